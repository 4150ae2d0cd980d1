"""The controller's tally and the run's headline numbers, with honest denominators.

Built from test reports only (a crashed worker sends nothing else) plus each task's ``pb-meta.json``, and written to
``<run dir>/summary.json`` as tasks finish (paced: at most once a second, and never more than 2% of the
time, see pacing.py) and at the end, so an interrupted run keeps what it had.
"""

from __future__ import annotations

import functools
import io
import json
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _pytest._code.code import TerminalRepr
from _pytest._io import TerminalWriter
from programbench.submission import FIXTURE_PREFIX, aggregate

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.core.task_key import TaskKey
from pytest_programbench.results.attempts import Attempt, mean_meta, mean_numbers, task_statistics
from pytest_programbench.results.attempts import headline as attempts_headline
from pytest_programbench.results.coverage import run_figure
from pytest_programbench.results.pacing import Pacer
from pytest_programbench.results.statistics import bounds_text, headline_statistics, method_text
from pytest_programbench.results.tally import Tally
from pytest_programbench.tasks.catalogue import packaged_instances
from pytest_programbench.text.printable import sanitise

if TYPE_CHECKING:
    from pytest_programbench.relay.spend import BudgetState, RunBudget

PASSED, FAILED, ERROR = "passed", "failed", "error"
RESOLVED, NEAR_RESOLVED = 1.0, 0.95  # programbench.submission.RESOLVED_THRESHOLD / NEAR_RESOLVED_THRESHOLD
TERMINAL_WIDTH = 99  # the summary's lines about the means fit a 100-column terminal
BASES = ("official", "corrected")  # --pb-score: the item's "score" property is the chosen one's
UPSTREAM_DEFECT = ("the official scorer counts tests twice where names differ by 'eval.': upstream ProgramBench issue "
                   "#56, PR #61")


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
    cost_usd: float | None = None
    key: str = ""  # the item's name: the instance id, or ``<id>[attempt-N]`` under --pb-attempts
    attempt: int = 1

    def __post_init__(self) -> None:
        self.key = self.key or self.instance_id

    @property
    def scored(self) -> bool:
        return self.outcome in (PASSED, FAILED) and self.score is not None

    @property
    def engine(self) -> str:
        """The engine the task's last attempt ran on (``--pb-docker-host``), "" when the run has one engine."""
        return str(self.meta.get("engine") or "")

    @property
    def tokens(self) -> dict[str, Any] | None:
        relay = self.meta.get("relay")
        return relay if isinstance(relay, dict) else None

    def basis_score(self, basis: str) -> float | None:
        """The official or the corrected score of a scored task (the item's properties say both; a task without a
        corrected score, or a record from before there was one, has its official score for both)."""
        if not self.scored:
            return None
        value = self.properties.get(f"score_{basis}")
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else self.score

    def as_dict(self) -> dict[str, Any]:
        meta = self.meta
        evaluation = meta.get("evaluation") or {}
        agent = meta.get("agent") or {}
        return {
            "outcome": self.outcome or "not_run", "score": self.score, "language": self.language,
            "score_basis": self.properties.get("score_basis") or "official",
            **{f"score_{basis}": self.basis_score(basis) for basis in BASES},
            "score_note": self.properties.get("score_note") or "",  # one line when the two differ: why
            "counted_twice": self.properties.get("counted_twice") or 0,
            "difficulty": self.difficulty, "overridden": self.overridden,
            "n_passed": self.properties.get("n_passed"), "n_tests": self.properties.get("n_tests"),
            "error_code": self.properties.get("error_code"), "reasons": self.reasons,
            "clock_fired": self.properties.get("clock_fired"), "agent_exit": agent.get("exit_code"),
            "clock_extended_s": agent.get("clock_extended_s"),  # seconds given back for held model requests
            "integrity_flags": evaluation.get("integrity_flags", []),
            "timings": {**meta.get("timings", {}), **(evaluation.get("timings") or {})},
            "image_id": (meta.get("image") or {}).get("id"),
            "blob_sha256": (meta.get("blobs") or {}).get("sha256"),
            "tokens": meta.get("relay"), "cost_usd": self.cost_usd, "duration": round(self.duration, 3),
            "engine": meta.get("engine"), "engines_tried": meta.get("engines_tried"),
            "coverage": meta.get("coverage"),  # the hidden tests' options the agent tried (results/coverage.py)
            **{name: self.properties[name] for name in ("gold_ceiling", "score_ignoring_gold_flaky")
               if name in self.properties},  # --pb-gold-ledger, --pb-ignore-flaky
        }


@functools.cache
def benchmark_ids() -> frozenset[str]:
    """The 200 benchmark task ids (``programbench.submission.benchmark_instances``' keys), read once: the summary is
    rewritten after every task and every progress tick. From the packaged instances the catalogue read already:
    ``benchmark_instances`` also parses every task's tests.json (0.6 s at each session's start) for ids that do not
    depend on them."""
    ids = (str(i["instance_id"]) for i in packaged_instances())
    return frozenset(i for i in ids if not i.startswith(FIXTURE_PREFIX))


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
        # Errors because the model API rejected the key or stayed down past the retry budget (pb-meta.json).
        "model_unavailable": sum(r.outcome == ERROR and bool(r.meta.get("model_unavailable")) for r in rows),
        "not_run": sum(not r.outcome for r in rows),
    }


def task_cost(run_dir: Path, rec: TaskRecord, token_price: tuple[float, float] | None) -> float | None:
    """USD: the agent's own account (a mini-swe-agent trajectory's cost) if it has one, else the relay's tokens
    at ``--pb-token-price``, else unknown."""
    try:
        trajectory = json.loads((run_dir / rec.instance_id / f"{rec.instance_id}.traj.json").read_text())
        cost = trajectory["info"]["model_stats"]["instance_cost"]
        if isinstance(cost, int | float) and cost > 0:
            return round(float(cost), 6)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tokens = rec.tokens
    if token_price is None or tokens is None:
        return None
    inp, out = tokens.get("input_tokens"), tokens.get("output_tokens")
    if not isinstance(inp, int) and not isinstance(out, int):
        return None
    return round(((inp or 0) * token_price[0] + (out or 0) * token_price[1]) / 1e6, 6)


_METERED = ("cached_input_tokens", "turns", "tool_calls")  # the relay's counts summed besides the tokens
# The relay's retry meter and its waits for the run's limits (--pb-model-concurrency, -rpm, -tpm), summed over every
# task.
_RETRIES = ("retries", "retry_wait_s", "slot_wait_s", "rate_wait_s", "stream_breaks")


def token_totals(records: Iterable[TaskRecord]) -> dict[str, Any]:
    totals: dict[str, Any] = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "tasks_with_tokens": 0,
                              "cost_usd": None, "tasks_with_cost": 0, **dict.fromkeys(_METERED, 0),
                              **dict.fromkeys(_RETRIES, 0)}
    for rec in records:
        tokens = rec.tokens
        for key in _RETRIES:
            value = (tokens or {}).get(key)
            totals[key] = round(totals[key] + (value if isinstance(value, int | float) else 0), 3)
        if tokens is not None and any(isinstance(tokens.get(k), int) for k in ("input_tokens", "output_tokens")):
            totals["tasks_with_tokens"] += 1
            for key in ("input_tokens", "output_tokens", "total_tokens", *_METERED):
                totals[key] += tokens.get(key) or 0
        if rec.cost_usd is not None:
            totals["tasks_with_cost"] += 1
            totals["cost_usd"] = round((totals["cost_usd"] or 0.0) + rec.cost_usd, 6)
    return totals


def _mean_row(iid: str, recs: list[TaskRecord]) -> TaskRecord:
    """A task's row over its attempts (``RunSummary.task_rows``): the mean score over the scored ones, passed when
    every scored attempt passed (error when none scored but one errored), every other number its mean over the
    attempts that have it."""
    scored = [r for r in recs if r.scored]
    first = recs[0]
    costs = [r.cost_usd for r in recs if r.cost_usd is not None]
    ended = [r for r in recs if r.outcome]
    return TaskRecord(
        iid, first.language, first.difficulty, first.overridden, _mean_outcome(recs, scored),
        sum(r.score or 0.0 for r in scored) / len(scored) if scored else None,
        {**gold_properties(recs), **basis_properties(scored), **_mean_tests(scored)},
        reasons=[x for r in recs for x in r.reasons],
        duration=sum(r.duration for r in ended) / len(ended) if ended else 0.0,
        meta=mean_meta([r.meta for r in ended]),
        cost_usd=round(sum(costs) / len(costs), 6) if costs else None)


def _mean_outcome(recs: list[TaskRecord], scored: list[TaskRecord]) -> str:
    """Passed when every scored attempt passed, else failed; without one scored, error when one errored."""
    if scored:
        return PASSED if all(r.outcome == PASSED for r in scored) else FAILED
    return ERROR if any(r.outcome == ERROR for r in recs) else ""


def _mean_tests(scored: list[TaskRecord]) -> dict[str, float]:
    """The tests passed and scored, each its mean over the scored attempts that have it."""
    return mean_numbers([{k: r.properties[k] for k in ("n_passed", "n_tests") if k in r.properties}
                         for r in scored])


class RunSummary:
    def __init__(self, path: Path, header: dict[str, Any], records: Iterable[TaskRecord], *,
                 meta_loader: Callable[[str], Mapping[str, Any] | None] | None = None,
                 token_price: tuple[float, float] | None = None,
                 before_write: Callable[[dict[str, Any]], None] | None = None, attempts: int = 1,
                 budget: RunBudget | None = None) -> None:
        self.path = path
        self.before_write = before_write  # the pytest_programbench_summary hook: may change what is written
        self.header = header
        self.records = {r.key: r for r in records}  # one per item: per attempt under --pb-attempts
        self.attempts = attempts
        self.meta_loader = meta_loader
        self.token_price = token_price
        self.budget = budget  # --pb-budget: spent and projected (relay/spend.py), and whether it stopped the run
        self.in_flight: dict[str, dict[str, Any]] = {}  # task -> phase, worker, clocks (the progress view's)
        # The progress view's thread writes too (in_flight); records change only on the main thread.
        self._lock = threading.RLock()
        self.tally = Tally(len(self.records))  # the progress view's counts, kept as tasks settle
        for rec in self.records.values():
            self.tally.count(rec)
        self.pacer = Pacer(self._write_now)  # summary.json: paced, not rewritten on every finish
        self._file_lock = threading.Lock()

    def set_in_flight(self, in_flight: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            self.in_flight = in_flight
            self.write()

    def record(self, report: pytest.TestReport) -> bool:
        """Fold one report in; True when it settled a task (then the file is rewritten)."""
        with self._lock:
            return self._record(report)

    def _record(self, report: pytest.TestReport) -> bool:
        key = TaskKey.of_nodeid(report.nodeid)
        rec = self.records.get(key.name) if key is not None else None
        if rec is None:
            return False
        self.tally.forget(rec)
        try:
            return self._fold(rec, report)
        finally:
            self.tally.count(rec)

    def _fold(self, rec: TaskRecord, report: pytest.TestReport) -> bool:
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
            rec.meta = dict(self.meta_loader(rec.key) or {})
        rec.cost_usd = task_cost(self.path.parent, rec, self.token_price)
        self.in_flight.pop(rec.key, None)
        self.write()
        return True

    def budget_state(self, running: int | None = None) -> BudgetState | None:
        """--pb-budget against the run: ``running`` tasks still spending (default: those in flight) projected at the
        finished tasks' mean cost; ``None`` without a budget."""
        if self.budget is None:
            return None
        with self._lock:  # the progress view's thread asks too
            costs = [rec.cost_usd for rec in self.records.values() if rec.outcome and rec.cost_usd is not None]
            return self.budget.state(costs, len(self.in_flight) if running is None else running)

    def by_task(self) -> dict[str, list[TaskRecord]]:
        """Each task's records, by attempt."""
        tasks: dict[str, list[TaskRecord]] = {}
        for rec in sorted(self.records.values(), key=lambda r: (r.instance_id, r.attempt)):
            tasks.setdefault(rec.instance_id, []).append(rec)
        return tasks

    def task_rows(self) -> list[TaskRecord]:
        """One row per task: the record itself with one attempt; with several, their mean over the scored ones
        (outcome: passed when every scored attempt passed, error when none scored but one errored). Every other
        number of the row (tests passed, phase times, tokens, cost, duration) is its mean over the attempts that
        have it, so a row reads as one attempt's does (results/attempts.py ``mean_meta``)."""
        if self.attempts == 1:
            return list(self.records.values())
        return [_mean_row(iid, recs) for iid, recs in self.by_task().items()]

    def attempt_results(self) -> dict[str, list[Any]]:
        """Per task its attempts' results, for results/attempts.py."""
        return {iid: [Attempt(r.score if r.scored else None, r.outcome == PASSED, ended=bool(r.outcome))
                      for r in recs] for iid, recs in self.by_task().items()}

    def headline(self) -> dict[str, Any]:
        head = figures(self.task_rows())
        if self.attempts > 1:  # over the selection: each task's attempts with errors counted 0, not run 0 too
            results = self.attempt_results()
            per_task = [sum(a.score or 0.0 for a in rows if a.ended) / max(1, sum(a.ended for a in rows))
                        for rows in results.values()]
            head["mean_over_selection"] = _mean(per_task, len(per_task))
            head["attempts"] = self.attempts
            head["attempts_ended"] = sum(r.outcome != "" for r in self.records.values())
        head["scores"] = self.by_basis()
        return head

    @property
    def basis(self) -> str:
        """``--pb-score``: which score the headline and the verdicts use."""
        return str((self.header.get("settings") or {}).get("score_basis") or "official")

    def by_basis(self) -> dict[str, Any]:
        """Both scores' headline numbers side by side (the headline's own are ``basis``'s), and the tasks whose two
        scores differ."""
        rows = self.task_rows()
        out: dict[str, Any] = {"basis": self.basis}
        for basis in BASES:
            scores = [r.basis_score(basis) or 0.0 for r in rows if r.scored]
            out[basis] = {"mean_over_scored": _mean(scores, len(scores)),
                          "mean_over_selection": _mean(scores, len(rows)),
                          "resolved": sum(v >= RESOLVED for v in scores),
                          "near_resolved": sum(v >= NEAR_RESOLVED for v in scores)}
        out["differing"] = sorted(r.instance_id for r in rows if r.scored
                                  and r.basis_score("official") != r.basis_score("corrected"))
        return out

    def intervals(self) -> dict[str, Any]:
        """95% bootstrap CIs of both headline means (results/statistics.py, scipy, over tasks); with several
        attempts per task a two-level bootstrap (results/attempts.py) and the attempts' numbers."""
        if self.attempts > 1:
            return attempts_headline(self.attempt_results(), attempts=self.attempts)
        scored = {iid: [r.score or 0.0] for iid, r in self.records.items() if r.scored}
        return headline_statistics(scored, list(self.records))

    def official_headline(self) -> dict[str, Any] | None:
        """programbench's own ``aggregate`` when the selection is the whole benchmark (no overridden task)."""
        benchmark = benchmark_ids()
        rows = {r.instance_id: r for r in self.task_rows()}
        chosen = {iid for iid, r in rows.items() if not r.overridden}
        if not benchmark <= chosen:
            return None
        scores = {iid: rows[iid].basis_score("official") or 0.0 for iid in benchmark if rows[iid].scored}
        if not scores:
            return None
        return aggregate(scores, len(benchmark)).as_dict()

    def breakdown(self, key: str) -> dict[str, dict[str, Any]]:
        groups: dict[str, list[TaskRecord]] = {}
        for rec in self.task_rows():
            groups.setdefault(getattr(rec, key), []).append(rec)
        return {name: figures(rows) for name, rows in sorted(groups.items())}

    def by_engine(self) -> dict[str, dict[str, Any]]:
        """Per engine (``--pb-docker-host``): its tasks' outcomes and time; empty for a one-engine run."""
        table: dict[str, dict[str, Any]] = {}
        for rec in self.records.values():
            if not rec.engine:
                continue
            row = table.setdefault(rec.engine, {"tasks": 0, "passed": 0, "failed": 0, "errors": 0, "seconds": 0.0})
            row["tasks"] += 1
            column = {PASSED: "passed", FAILED: "failed", ERROR: "errors"}.get(rec.outcome)
            if column is not None:
                row[column] += 1
            row["seconds"] = round(row["seconds"] + rec.duration, 3)
        return dict(sorted(table.items()))

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.header,
            "updated": time.time(),
            "headline": {**self.headline(), **self.intervals()},
            "official_headline": self.official_headline(),
            "by_language": self.breakdown("language"),
            "by_difficulty": self.breakdown("difficulty"),
            "by_engine": self.by_engine(),
            "tokens": token_totals(self.records.values()),
            "coverage": run_figure(row.meta.get("coverage") for row in self.task_rows()),
            "budget": None if (budget := self.budget_state()) is None else budget.as_dict(),
            "in_flight": dict(sorted(self.in_flight.items())),
            "tasks": self.tasks_dict(),
        }

    def tasks_dict(self) -> dict[str, Any]:
        """summary.json's ``tasks``, by instance id; with several attempts each task's aggregate, its numbers over
        the attempts and every attempt's own record (``attempts``, by attempt number)."""
        if self.attempts == 1:
            return {iid: {**rec.as_dict(), "phase": (self.in_flight.get(iid) or {}).get("phase")}
                    for iid, rec in sorted(self.records.items())}
        results = self.attempt_results()
        by_task = self.by_task()
        out: dict[str, Any] = {}
        for row in self.task_rows():
            out[row.instance_id] = {
                **row.as_dict(), **task_statistics(results[row.instance_id]),
                "attempts": {str(r.attempt): {**r.as_dict(), "phase": (self.in_flight.get(r.key) or {}).get("phase")}
                             for r in by_task[row.instance_id]},
            }
        return out

    def write(self) -> None:
        """summary.json rewritten now, or once when the gap after the last write ends (pacing.py)."""
        self.pacer.request()

    def flush(self) -> None:
        """A write still waiting for its gap, done now (the end of the session)."""
        self.pacer.flush()

    def _write_now(self) -> None:
        with self._file_lock:  # one write at a time, in order
            with self._lock:  # the records only while they are copied: the main thread folds reports meanwhile
                data = self.as_dict()
                if self.before_write is not None:
                    self.before_write(data)
                # sanitise (a copy): a string holding an undecodable file name's surrogates is written escaped
                data = sanitise(data)
            atomic_write_text(self.path, json.dumps(data, indent=2, default=str))

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
        if self.attempts > 1:  # beside pass@k, "0 resolved" and "15.5/16 tests" must say what they count
            lines.append(f"with {self.attempts} attempts per task, a task's score and tests are the means over its "
                         "attempts: resolved and ≥0.95 count tasks whose mean reached 1.0 and 0.95 (every attempt); "
                         "pass@k and resolved@k below count any of k")
        intervals = self.intervals()
        lines.extend(mean_lines(head, intervals))
        lines.extend(basis_lines(head["scores"]))
        if self.attempts > 1:
            lines.extend(attempts_lines(intervals))
        lines.extend(gold_lines(self.task_rows()))
        lines.append(tokens_line(token_totals(self.records.values())))
        budget = self.budget_state()
        if budget is not None:
            lines.append(budget.text() + ("; it stopped the run: the tasks not started are not run" if budget.stopped
                                          else ""))
        for engine, row in self.by_engine().items():
            lines.append(f"engine {engine}: {row['tasks']} tasks ({row['passed']} passed, {row['failed']} failed, "
                         f"{row['errors']} errors), {row['seconds']:.0f} s")
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


def mean_lines(head: Mapping[str, Any], intervals: Mapping[str, Any]) -> list[str]:
    """Each mean once, with its interval, then how the intervals were computed: every line under 100 columns."""
    lines = []
    unscored = head["selected"] - head["scored"]
    # Nothing scored (a Ctrl-C before the first verdict): a mean of zeros with a zero-width interval would read as
    # a measured 0.
    nothing = head["scored"] == 0
    if nothing:
        selection = f"nothing scored: {head['selected']} selected, none scored yet"
    elif unscored:
        selection = f"{head['selected']} selected; the {unscored} unscored count as 0"
    else:
        selection = f"{head['selected']} selected, all scored"
    for label, key, count in (("mean over scored tasks: ", "mean_over_scored", f"{head['scored']} scored"),
                              ("mean over the selection:", "mean_over_selection", selection)):
        ci = None if nothing else intervals.get(f"{key}_ci")
        value = "-" if head[key] is None or nothing else f"{head[key]:.3f}"
        lines.append(f"{label} {value}{', ' + bounds_text(ci) if ci else ''} ({count})")
    methods = dict.fromkeys(method_text(ci) for key in ("mean_over_scored_ci", "mean_over_selection_ci")
                            if (ci := intervals.get(key)))
    for method in methods:
        lines.extend(textwrap.wrap(method, width=TERMINAL_WIDTH, initial_indent="  ", subsequent_indent="    "))
    return lines


def basis_properties(scored: list[TaskRecord]) -> dict[str, Any]:
    """A task's official and corrected scores over its scored attempts: each the mean, as the task's score is."""
    out: dict[str, Any] = {"score_basis": scored[0].properties.get("score_basis")} if scored else {}
    for basis in BASES:
        values = [v for r in scored if (v := r.basis_score(basis)) is not None]
        if values:
            out[f"score_{basis}"] = round(sum(values) / len(values), 6)
    return out


def basis_lines(scores: Mapping[str, Any]) -> list[str]:
    """Where a task's official and corrected scores differ: both means, and why, in one line."""
    differing = scores.get("differing") or []
    if not differing:
        return []
    official, corrected = scores["official"], scores["corrected"]

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    return [f"official and corrected scores differ on {len(differing)} task(s) ({UPSTREAM_DEFECT}): mean over the "
            f"selection official {fmt(official['mean_over_selection'])}, corrected "
            f"{fmt(corrected['mean_over_selection'])}; resolved official {official['resolved']}, corrected "
            f"{corrected['resolved']}; the {scores['basis']} score decides (--pb-score)"]


def gold_properties(recs: list[TaskRecord]) -> dict[str, Any]:
    """A task's --pb-gold-ledger numbers over its attempts: the ceiling (the task's, the same in every attempt) and
    --pb-ignore-flaky's score as the mean over the attempts that have one, as the task's score is."""
    ceilings = [r.properties["gold_ceiling"] for r in recs if isinstance(r.properties.get("gold_ceiling"), int | float)]
    ignoring = [v for r in recs if r.scored and isinstance(v := r.properties.get("score_ignoring_gold_flaky"),
                                                               int | float)]
    out: dict[str, Any] = {"gold_ceiling": ceilings[0]} if ceilings else {}
    if ignoring:
        out["score_ignoring_gold_flaky"] = round(sum(ignoring) / len(ignoring), 6)
    return out


def gold_lines(rows: Iterable[TaskRecord]) -> list[str]:
    """--pb-gold-ledger: each task's score beside its ceiling (what a perfect clone reaches here)."""
    lines = []
    for rec in sorted(rows, key=lambda r: r.instance_id):
        ceiling = rec.properties.get("gold_ceiling")
        if not isinstance(ceiling, int | float):
            continue
        score = "-" if rec.score is None else f"{rec.score:.3f}"
        ignoring = rec.properties.get("score_ignoring_gold_flaky")
        extra = (f", {ignoring:.3f} ignoring the ledger's impossible and flaky tests"
                 if isinstance(ignoring, int | float) else "")
        lines.append(f"  {rec.instance_id}: score {score} of gold ceiling {ceiling:.3f}{extra}")
    return ["score against the gold ceiling (--pb-gold-ledger):", *lines] if lines else []


def attempts_lines(numbers: dict[str, Any]) -> list[str]:
    """--pb-attempts: the spread across attempts and the mean over tasks of pass@k, resolved@k, near-resolved@k."""
    std = numbers.get("std_across_attempts")
    means = ", ".join(f"{m:.3f}" for m in numbers.get("attempt_means") or [])
    lines = [f"attempts per task: {numbers['attempts']}; each complete attempt's mean over the selection: "
             f"{means or '-'}; standard deviation across attempts: {'-' if std is None else f'{std:.3f}'}"]
    for name, label in (("pass_at_k", "pass@k"), ("resolved_at_k", "resolved@k"),
                        ("near_resolved_at_k", "near-resolved@k")):
        values = numbers.get(name) or {}
        if values:
            lines.append(f"{label} (unbiased, mean over tasks): "
                         + ", ".join(f"k={k} {v:.3f}" for k, v in values.items()))
    return lines


def tokens_line(totals: dict[str, Any]) -> str:
    if not totals["tasks_with_tokens"]:
        tokens = "tokens: none metered (no --pb-model-endpoint relay)"
    else:
        tokens = (f"tokens: {totals['input_tokens']:,} in, {totals['output_tokens']:,} out, "
                  f"{totals['total_tokens']:,} total ({totals['tasks_with_tokens']} tasks metered)")
    if totals["cost_usd"] is None:
        cost = "cost: unknown (--pb-token-price IN,OUT prices metered tokens)"
    else:
        cost = f"cost: ${totals['cost_usd']:,.4f} ({totals['tasks_with_cost']} tasks)"
    retries = (f"   model API retries: {totals['retries']} ({totals['retry_wait_s']:.0f} s waited)"
               if totals.get("retries") else "")
    limits = (totals.get("slot_wait_s") or 0) + (totals.get("rate_wait_s") or 0)
    if limits:
        retries += f"   waited for the run's model limits: {limits:.0f} s"
    return f"{tokens}   {cost}{retries}"


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), text)


def _reason(report: pytest.TestReport) -> str:
    """The failure's own text: its longrepr rendered (the report's ``longreprtext`` starts with xdist's
    ``[gw0] linux -- Python ...`` line), a traceback led by its exception's line (the errors list shows the first)."""
    longrepr = report.longrepr
    if longrepr is None:
        return report.outcome
    if not isinstance(longrepr, TerminalRepr):
        text = str(longrepr)
    else:
        out = io.StringIO()
        writer = TerminalWriter(out)
        writer.hasmarkup = False
        longrepr.toterminal(writer)
        text = out.getvalue().strip()
        crash = str(getattr(getattr(longrepr, "reprcrash", None), "message", "") or "").strip()
        first = crash.splitlines()[0] if crash else ""
        if first and first.split(": ", 1)[-1] not in _first_line(text):
            text = f"{first}\n{text}"
    text = text.strip()
    return text[:4000] if text else report.outcome
