"""``--pb-resume DIR`` alone: the run's recorded settings, what the user gave on top, and the command that resumes.

pb-run.json (``run_record.py``) records the run's settings (``--pb-agent-env`` values never: names only). A resumed
session starts from them; an option the user gives (command line or ini) replaces its recorded value, and the
fingerprint check then refuses the ones that change what a result means. Workers get the controller's recorded
settings through ``workerinput``, so they collect the same selection.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench import options
from pytest_programbench.run_record import recorded_settings

WORKERINPUT_KEY = "pytest_programbench_resumed_settings"
# Where the run is, and whether this session only checks it: never taken from the record.
NOT_REUSED = frozenset({"resume", "output", "preflight"})


def given_fields(config: pytest.Config) -> set[str]:
    """The Settings fields the user set for this session (command line or ini)."""
    return {name for opt in options.OPTIONS if options.raw_value(config, opt) is not None
            for name in opt.settings_fields}


def reuse(settings: options.Settings, recorded: Mapping[str, Any], given: set[str]) -> options.Settings:
    """``settings`` with every field the user did not give taken from the record."""
    known = {f.name for f in dataclasses.fields(options.Settings)}
    values: dict[str, Any] = {name: tuple(value) if isinstance(value, list) else value
                              for name, value in recorded.items()
                              if name in known and name not in given and name not in NOT_REUSED}
    return dataclasses.replace(settings, **values)


def for_session(config: pytest.Config, settings: options.Settings) -> options.Settings:
    """The session's settings: when it resumes, the recorded ones under what the user gave (xdist workers get the
    controller's record through ``workerinput``)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        recorded = workerinput.get(WORKERINPUT_KEY)
    elif settings.resume:
        recorded = recorded_settings(Path(settings.resume))
    else:
        recorded = None
    return settings if recorded is None else reuse(settings, recorded, given_fields(config))


def flag_of(field_name: str) -> str:
    """The option that sets a Settings field (the field's name when no option does)."""
    return next((o.flag for o in options.OPTIONS if field_name in o.settings_fields), field_name)


# ---------------------------------------------------------------------------------------------- the command


def _takes_value(arg: str) -> bool:
    opt = next((o for o in options.OPTIONS if o.flag == arg), None)
    return opt is not None and opt.kind != "bool"


def command(args: Sequence[str], run_dir: Path) -> str:
    """The command that resumes the run: what is not recorded (``-n``, paths, pytest's own options) kept, every
    ``--pb-*`` option dropped (the record has it), ``--pb-resume DIR`` added. An ``--pb-agent-env NAME=VALUE``'s
    value is not recorded and not printed: it stays as ``NAME=...`` to fill in."""
    kept: list[str] = []
    words = list(args)
    i = 0
    while i < len(words):
        word = words[i]
        flag, eq, value = word.partition("=")
        if not flag.startswith("--pb-"):
            kept.append(word)
            i += 1
            continue
        if not eq and _takes_value(flag):
            value = words[i + 1] if i + 1 < len(words) else ""
            i += 1
        i += 1
        if flag == "--pb-agent-env" and "=" in value:
            kept += [flag, value.partition("=")[0] + "=..."]
    return shlex.join(["pytest", "--pb-resume", str(run_dir), *kept])
