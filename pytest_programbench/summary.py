"""The controller's tally and the run's headline numbers, with honest denominators.

Built from test reports only (a crashed worker sends nothing else) plus each task's ``pb-meta.json``, and written to
``<run dir>/summary.json`` every time a task finishes, so an interrupted run keeps what it had.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.artifacts import atomic_write_text

PASSED, FAILED, ERROR = "passed", "failed", "error"
RESOLVED, NEAR_RESOLVED = 1.0, 0.95  # programbench.submission.RESOLVED_THRESHOLD / NEAR_RESOLVED_THRESHOLD


@dataclass
class TaskRecord:
    instance_id: str
    language: str
    difficulty: str
    overridden: bool = False
    outcome: str = ""  # "" = not run (yet)
    score: float | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    duration: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def scored(self) -> bool:
        return self.outcome in (PASSED, FAILED) and self.score is not None

    def as_dict(self) -> dict[str, Any]:
        meta = self.meta
        evaluation = meta.get("evaluation") or {}
        agent = meta.get("agent") or {}
        return {
            "outcome": self.outcome or "not_run", "score": self.score, "language": self.language,
            "difficulty": self.difficulty, "overridden": self.overridden,
            "n_passed": self.properties.get("n_passed"), "n_tests": self.properties.get("n_tests"),
            "error_code": self.properties.get("error_code"), "reasons": self.reasons,
            "clock_fired": self.properties.get("clock_fired"), "agent_exit": agent.get("exit_code"),
            "integrity_flags": evaluation.get("integrity_flags", []),
            "timings": {**meta.get("timings", {}), **(evaluation.get("timings") or {})},
            "image_id": (meta.get("image") or {}).get("id"),
            "blob_sha256": (meta.get("blobs") or {}).get("sha256"),
            "tokens": meta.get("relay"), "duration": round(self.duration, 3),
        }


def _mean(values: list[float], denominator: int) -> float | None:
    return round(sum(values) / denominator, 6) if denominator else None


def figures(records: Iterable[TaskRecord]) -> dict[str, Any]:
    rows = list(records)
    scores = [r.score or 0.0 for r in rows if r.scored]
    return {
        "selected": len(rows),
        "scored": len(scores),
        "mean_over_scored": _mean(scores, len(scores)),
        "mean_over_selection": _mean(scores, len(rows)),  # errors and unattempted tasks count 0
        "resolved": sum(s >= RESOLVED for s in scores),
        "near_resolved": sum(s >= NEAR_RESOLVED for s in scores),
        "passed": sum(r.outcome == PASSED for r in rows),
        "failed": sum(r.outcome == FAILED for r in rows),
        "errors": sum(r.outcome == ERROR for r in rows),
        "not_run": sum(not r.outcome for r in rows),
    }


class RunSummary:
    def __init__(self, path: Path, header: dict[str, Any], records: Iterable[TaskRecord],
                 meta_loader: Callable[[str], dict[str, Any] | None] | None = None) -> None:
        self.path = path
        self.header = header
        self.records = {r.instance_id: r for r in records}
        self.meta_loader = meta_loader

    def record(self, report: pytest.TestReport) -> bool:
        """Fold one report in; True when it settled a task (then the file is rewritten)."""
        rec = self.records.get(report.nodeid.removeprefix("programbench::"))
        if rec is None or not report.nodeid.startswith("programbench::"):
            return False
        rec.duration += report.duration
        if report.outcome == "rerun":  # type: ignore[comparison-overlap]
            rec.reasons.append(_reason(report))
            self.write()
            return False
        props = dict(report.user_properties)
        if report.when == "setup" and report.failed:
            rec.outcome, rec.score = ERROR, None
            rec.reasons.append(_reason(report))
        elif report.when == "call":
            rec.properties.update(props)
            score = props.get("score")
            rec.score = float(score) if isinstance(score, int | float) else None
            rec.outcome = PASSED if report.passed else FAILED
            if not report.passed:
                rec.reasons.append(_reason(report))
        elif report.when == "teardown" and report.failed and rec.outcome != ERROR:
            rec.outcome = ERROR
            rec.reasons.append(_reason(report))
        else:
            return False
        if self.meta_loader is not None:
            rec.meta = self.meta_loader(rec.instance_id) or {}
        self.write()
        return True

    def headline(self) -> dict[str, Any]:
        return figures(self.records.values())

    def official_headline(self) -> dict[str, Any] | None:
        """programbench's own ``aggregate`` when the selection is the whole benchmark (no overridden task)."""
        from programbench.submission import aggregate, benchmark_instances

        benchmark = set(benchmark_instances())
        chosen = {iid for iid, r in self.records.items() if not r.overridden}
        if not benchmark <= chosen:
            return None
        scores = {iid: self.records[iid].score or 0.0 for iid in benchmark if self.records[iid].scored}
        if not scores:
            return None
        return aggregate(scores, len(benchmark)).as_dict()

    def breakdown(self, key: str) -> dict[str, dict[str, Any]]:
        groups: dict[str, list[TaskRecord]] = {}
        for rec in self.records.values():
            groups.setdefault(getattr(rec, key), []).append(rec)
        return {name: figures(rows) for name, rows in sorted(groups.items())}

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.header,
            "updated": time.time(),
            "headline": self.headline(),
            "official_headline": self.official_headline(),
            "by_language": self.breakdown("language"),
            "by_difficulty": self.breakdown("difficulty"),
            "tasks": {iid: rec.as_dict() for iid, rec in sorted(self.records.items())},
        }

    def write(self) -> None:
        atomic_write_text(self.path, json.dumps(self.as_dict(), indent=2, default=str))

    # -- terminal ---------------------------------------------------------------------------------------------

    def terminal_lines(self) -> list[str]:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        columns = ("selected", "scored", "mean", "resolved", "≥0.95", "failed", "errors")
        lines: list[str] = []
        for title, key in (("language", "language"), ("difficulty", "difficulty")):
            table = self.breakdown(key)
            width = max([len(title), *map(len, table)])
            lines.append(f"{title:<{width}}  " + "  ".join(f"{c:>8}" for c in columns))
            for name, fig in [*table.items(), ("all", self.headline())]:
                cells = (fig["selected"], fig["scored"], fmt(fig["mean_over_scored"]), fig["resolved"],
                         fig["near_resolved"], fig["failed"], fig["errors"])
                lines.append(f"{name:<{width}}  " + "  ".join(f"{c!s:>8}" for c in cells))
            lines.append("")
        head = self.headline()
        lines.append(f"mean over scored tasks: {fmt(head['mean_over_scored'])} ({head['scored']} scored)   "
                     f"mean over the selection (errors and unattempted count 0): {fmt(head['mean_over_selection'])} "
                     f"({head['selected']} selected)")
        official = self.official_headline()
        if official is not None:
            lines.append(f"official headline (all benchmark tasks): mean {official['mean_score']}, resolved "
                         f"{official['resolved_pct']}%, near-resolved {official['near_resolved_pct']}%")
        errors = [r for r in self.records.values() if r.outcome == ERROR]
        if errors:
            lines.append(f"errors ({len(errors)}, infrastructure, not scored):")
            lines.extend(f"  {r.instance_id}: {_first_line(r.reasons[-1]) if r.reasons else 'unknown'}"
                         for r in errors)
        return lines


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), text)


def _reason(report: pytest.TestReport) -> str:
    text = report.longreprtext.strip()
    return text[:4000] if text else report.outcome
