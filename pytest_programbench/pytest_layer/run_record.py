"""The run's record, ``pb-run.json``, in one place: its identity (a run id and a run directory, made once by the
controller and shipped to xdist workers), the settings it ran with (what ``--pb-resume DIR`` alone reuses) and the
fingerprint of those that change what a result means (a resume must match it), plus the command and selection.

``--pb-resume DIR`` alone starts from the recorded settings; an option the user gives (command line or ini) replaces
its recorded value, and the fingerprint check then refuses the ones that change what a result means. Workers get the
controller's recorded settings through ``workerinput``, so they collect the same selection. ``--pb-agent-env``
values are never recorded: names only."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.pytest_layer import options

RUN_MARKER = "pb-run.json"
RECORDED_KEY = "settings"  # in pb-run.json: the run's settings, what --pb-resume DIR alone reuses

# Settings that change what a task's result means; a resumed run must match them (selection may differ).
RESULT_SETTINGS = (
    "agent", "agent_setup", "agent_on_host", "agent_timeout", "prompt_template", "model", "model_endpoint",
    "submissions", "image_tag", "cpus", "memory", "branch_workers", "branch_retries", "compile_timeout",
    "test_timeout", "strict", "sandbox_cpus", "sandbox_memory", "model_failures_scored", "agent_replay",
    "model_allow_server_tools",
)


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    run_dir: str
    controller_pid: int
    hostname: str
    started: float
    resumed: bool = False

    @property
    def path(self) -> Path:
        return Path(self.run_dir)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunIdentity:
        return cls(**data)

    @classmethod
    def create(cls, base: Path, *, output: str | None, resume: str | None) -> RunIdentity:
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
        return cls(run_id, str(run_dir), os.getpid(), socket.gethostname(), now, resumed)

    def materialise(self, extra: dict[str, Any]) -> None:
        """Create the directory and write its marker (the reaper reads the controller pid from it)."""
        self.path.mkdir(parents=True, exist_ok=True)
        marker = self.path / RUN_MARKER
        history: list[dict[str, Any]] = []
        if marker.exists():
            try:
                history = json.loads(marker.read_text()).get("history", [])
            except ValueError:
                history = []
        record = {**self.as_dict(), **extra}
        # Each session's own start and command (--pb-package names the first, the run's, beside the packaging one).
        history.append({"run_id": self.run_id, "started": self.started, "controller_pid": self.controller_pid,
                        "command": extra.get("command")})
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({**record, "history": history}, indent=2))
        tmp.replace(marker)


def fingerprint(settings: options.Settings) -> dict[str, Any]:
    """The settings that change what a result means, with the versions: a resume must find the same."""
    from importlib.metadata import version

    values = {name: getattr(settings, name) for name in RESULT_SETTINGS}
    values["agent_env"] = sorted(spec.partition("=")[0] for spec in settings.agent_env)  # names, never values
    if settings.score_basis != "official":  # --pb-score corrected changes verdicts; a run without it stays resumable
        values["score_basis"] = settings.score_basis
    if not settings.audit_hidden_tests:  # no reads_hidden_tests flag can fail an item; a default run stays resumable
        values["audit_hidden_tests"] = "off"
    values["plugin_version"] = version("pytest-programbench")
    values["programbench_version"] = version("programbench")
    plain: dict[str, Any] = json.loads(json.dumps(values, default=str))
    return plain


def public_settings(settings: options.Settings) -> dict[str, Any]:
    """The settings as written to files: ``--pb-agent-env`` values never leave the process."""
    values = dataclasses.asdict(settings)
    values["agent_env"] = [spec.partition("=")[0] for spec in settings.agent_env]
    return values


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """pb-run.json as a dict (None: none, unreadable, or not an object)."""
    try:
        data = json.loads((run_dir / RUN_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recorded_settings(run_dir: Path) -> dict[str, Any] | None:
    """The settings pb-run.json records (None: no readable record; a run from before they were recorded)."""
    data = read_record(run_dir)
    recorded = data.get(RECORDED_KEY) if data is not None else None
    return recorded if isinstance(recorded, dict) else None


def check_resumable(identity: RunIdentity, settings: options.Settings) -> None:
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
