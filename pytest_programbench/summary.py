"""The controller's running tally: built from test reports only (a crashed worker sends nothing else), written to
``<run dir>/summary.json`` each time a task finishes so an interrupted run keeps what it had."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.artifacts import atomic_write_text

PASSED, FAILED, ERROR = "passed", "failed", "error"


@dataclass
class TaskRecord:
    instance_id: str
    language: str
    difficulty: str
    outcome: str = ""
    score: float | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    duration: float = 0.0


class RunSummary:
    def __init__(self, path: Path, header: dict[str, Any], tasks: dict[str, tuple[str, str]]) -> None:
        self.path = path
        self.header = header
        self.records = {iid: TaskRecord(iid, lang, level) for iid, (lang, level) in tasks.items()}

    def record(self, report: pytest.TestReport) -> bool:
        """Fold one report in; True when it finished a task (then the file is rewritten)."""
        iid = report.nodeid.removeprefix("programbench::")
        rec = self.records.get(iid)
        if rec is None or report.nodeid == iid:
            return False
        rec.duration += report.duration
        props = dict(report.user_properties)
        if report.when == "setup" and report.failed:
            rec.outcome, rec.score, rec.reason = ERROR, None, _reason(report)
        elif report.when == "call":
            rec.properties.update(props)
            score = props.get("score")
            rec.score = float(score) if isinstance(score, int | float) else None
            rec.outcome = PASSED if report.passed else FAILED
            rec.reason = "" if report.passed else _reason(report)
        elif report.when == "teardown" and report.failed and rec.outcome != ERROR:
            rec.outcome, rec.reason = ERROR, _reason(report)
        else:
            return False
        self.write()
        return True

    def headline(self) -> dict[str, Any]:
        scored = [r for r in self.records.values() if r.outcome in (PASSED, FAILED) and r.score is not None]
        selected = len(self.records)
        total = sum(r.score or 0.0 for r in scored)
        return {
            "selected": selected,
            "scored": len(scored),
            "passed": sum(r.outcome == PASSED for r in self.records.values()),
            "failed": sum(r.outcome == FAILED for r in self.records.values()),
            "errors": sum(r.outcome == ERROR for r in self.records.values()),
            "not_run": sum(not r.outcome for r in self.records.values()),
            "mean_over_scored": round(total / len(scored), 6) if scored else None,
            "mean_over_selection": round(total / selected, 6) if selected else None,
        }

    def write(self) -> None:
        data = {
            **self.header,
            "updated": time.time(),
            "headline": self.headline(),
            "tasks": {iid: rec.__dict__ for iid, rec in sorted(self.records.items())},
        }
        atomic_write_text(self.path, json.dumps(data, indent=2, default=str))


def _reason(report: pytest.TestReport) -> str:
    text = report.longreprtext.strip()
    return text.splitlines()[-1][:500] if text else report.outcome
