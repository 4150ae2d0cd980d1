"""A run's identity (its id, directory, controller and start, made once by the controller and shipped to xdist workers),
its marker file ``pb-run.json`` and the fingerprint of the settings that change what a result means (a resume must
match it). Pure data and files: the pytest layer decides, from the options, which run a session is
(``pytest_layer/run_record.py``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pytest_programbench.core.settings import Settings

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


def fingerprint(settings: Settings) -> dict[str, Any]:
    """The settings that change what a result means, with the versions: a resume must find the same."""
    values = {name: getattr(settings, name) for name in RESULT_SETTINGS}
    values["agent_env"] = sorted(spec.partition("=")[0] for spec in settings.agent_env)  # names, never values
    if settings.score_basis != "official":  # --pb-score corrected changes verdicts; a run without it stays resumable
        values["score_basis"] = settings.score_basis
    if settings.runtime:  # --pb-runtime: another kernel under the same tasks; a default run stays resumable
        values["runtime"] = settings.runtime
    if not settings.audit_hidden_tests:  # no reads_hidden_tests flag can fail an item; a default run stays resumable
        values["audit_hidden_tests"] = "off"
    values["plugin_version"] = version("pytest-programbench")
    values["programbench_version"] = version("programbench")
    plain: dict[str, Any] = json.loads(json.dumps(values, default=str))
    return plain


def public_settings(settings: Settings) -> dict[str, Any]:
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
