"""Which run a session is, from its options: a new run's identity or a resumed one's (``core/run_identity.py`` holds
the record itself: ``pb-run.json``, the settings it ran with and the fingerprint), the check that a resume matches,
and the command that resumes it.

``--pb-resume DIR`` alone starts from the recorded settings; an option the user gives (command line or ini) replaces
its recorded value, and the fingerprint check then refuses the ones that change what a result means. Workers get the
controller's recorded settings through ``workerinput``, so they collect the same selection. ``--pb-agent-env``
values are never recorded: names only."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.core.run_identity import RUN_MARKER, RunIdentity, fingerprint, read_record, recorded_settings
from pytest_programbench.core.settings import Settings
from pytest_programbench.pytest_layer import options


def new_identity(base: Path, *, output: str | None, resume: str | None) -> RunIdentity:
    """A new run's identity, or a resumed one's: its directory from ``--pb-output``/``--pb-resume`` or the default
    ``pb-runs/<UTC>-<run id>``; a directory that cannot be one is a usage error."""
    run_id = secrets.token_hex(4)
    now = time.time()
    if resume:
        run_dir = Path(resume).resolve()
        previous = run_dir / RUN_MARKER
        if not previous.is_file():
            raise pytest.UsageError(f"--pb-resume: {run_dir} holds no {RUN_MARKER}; it is not a run directory")
        resumed = True
    elif output:
        run_dir = Path(output).expanduser().resolve()
        if (run_dir / RUN_MARKER).exists():
            raise pytest.UsageError(
                f"--pb-output: {run_dir} already holds a run; pass --pb-resume {run_dir} to continue it, "
                "or choose a new directory"
            )
        resumed = False
    else:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        run_dir = (base / "pb-runs" / f"{stamp}-{run_id}").resolve()
        resumed = False
    return RunIdentity(run_id, str(run_dir), os.getpid(), socket.gethostname(), now, resumed)


def check_resumable(identity: RunIdentity, settings: Settings) -> None:
    """Refuse, saying what changed, to resume a run made with another configuration or other versions."""
    recorded = (read_record(identity.path) or {}).get("fingerprint")
    if recorded is None:
        raise pytest.UsageError(f"--pb-resume: {identity.path / RUN_MARKER} records no configuration to compare")
    current = fingerprint(settings)
    changed = [f"{key}: {recorded.get(key)!r} -> {current.get(key)!r} ({flag_of(key)})"
               for key in sorted(set(recorded) | set(current)) if recorded.get(key) != current.get(key)]
    if changed:
        raise pytest.UsageError("--pb-resume: refusing to resume " + str(identity.path)
                                + ", its configuration differs: " + "; ".join(changed)
                                + " (--pb-resume DIR alone reuses the recorded settings)")


# ------------------------------------------------------------------------------ resuming: settings and command

# What the controller hands every xdist worker in ``workerinput`` (plain data): the run's identity, and when the run is
# resumed the settings it ran with (so workers collect the same selection).
WORKERINPUT_IDENTITY = "pytest_programbench_run"
WORKERINPUT_RESUMED_SETTINGS = "pytest_programbench_resumed_settings"
# Where the run is, and whether this session only checks it: never taken from the record.
NOT_REUSED = frozenset({"resume", "output", "preflight"})


def given_fields(config: pytest.Config) -> set[str]:
    """The Settings fields the user set for this session (command line or ini)."""
    return {name for opt in options.OPTIONS if options.raw_value(config, opt) is not None
            for name in opt.settings_fields}


def reuse(settings: Settings, recorded: Mapping[str, Any], given: set[str]) -> Settings:
    """``settings`` with every field the user did not give taken from the record."""
    known = {f.name for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {name: tuple(value) if isinstance(value, list) else value
                              for name, value in recorded.items()
                              if name in known and name not in given and name not in NOT_REUSED}
    return dataclasses.replace(settings, **values)


def for_session(config: pytest.Config, settings: Settings) -> Settings:
    """The session's settings: when it resumes, the recorded ones under what the user gave (xdist workers get the
    controller's record through ``workerinput``)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        recorded = workerinput.get(WORKERINPUT_RESUMED_SETTINGS)
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
