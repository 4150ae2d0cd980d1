"""The run's identity: a run id and a run directory, made once by the controller and shipped to xdist workers."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

RUN_MARKER = "pb-run.json"


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
        history.append({"run_id": self.run_id, "started": self.started, "controller_pid": self.controller_pid})
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({**record, "history": history}, indent=2))
        tmp.replace(marker)
