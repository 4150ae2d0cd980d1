"""``--pb-compare``: one run directory against an earlier one, from their files alone.

Per task the score delta and the hidden tests that flipped (pass -> fail, fail -> pass; only tests that count for the
official score: active branches, ignored tests left out), the paired difference of the means over the tasks both
runs scored with a 95% bootstrap CI and a permutation test's p-value (results/statistics.py), token, cost and time
deltas, and the tasks present in one run only. Written as ``compare.json`` and ``compare.html`` into the newer run's
directory; ``--pb-max-regression X`` turns the CI's lower bound into a gate.

Reads only finished files (``pb-run.json``, ``summary.json``, ``<id>/<id>.eval.json``): comparing two finished runs
needs no agent, engine or collection. Either side may also be a run that is not ours: a ``programbench eval`` output
directory or a leaderboard entry, read by results/foreign_runs.py (:func:`load_run` tells the kinds apart); what a side
does not hold is said ("not in this run") and the comparison uses what both have. Where a side is an entry, or
``--pb-registry-ignore`` is given, each side's leaderboard numbers are shown (over the benchmark's 200 tasks, the
registry's ignore map struck); with the ignore map, the paired scores and the flips are the leaderboard's (its struck
tests left out on both sides).

Under ``--pb-attempts`` (either run) every attempt counts: a task's score is its mean over its scored attempts (as
summary.json has it), the delta the difference of those means, and a hidden test's outcome in a run its pass rate over
the attempts with a result (3/4): it flipped when its majority outcome (passed in more than half) changed. The paired
bootstrap still resamples tasks. ``method`` in compare.json says which.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import jinja2
from programbench.utils.load_data import get_active_branches, get_ignored_tests

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.core.run_identity import RUN_MARKER
from pytest_programbench.core.task_key import TaskKey
from pytest_programbench.results import coverage, foreign_files, foreign_runs, registry
from pytest_programbench.results.report import TaskScope
from pytest_programbench.results.statistics import (
    interval_text,
    paired_difference,
    paired_permutation_test,
)
from pytest_programbench.tasks.catalogue import Catalogue, CatalogueError
from pytest_programbench.text.printable import html_text, printable

COMPARE_JSON = "compare.json"
COMPARE_HTML = "compare.html"
PASSED = "passed"


class CompareError(Exception):
    """A directory that is not a finished run (a usage error where it comes from an option); its message printable
    (it quotes the runs' names)."""

    def __init__(self, message: str) -> None:
        super().__init__(printable(message))


class ComparedRun(Protocol):
    """What a comparison reads of a side: our run (:class:`FinishedRun`) or a foreign one
    (``foreign_runs.ForeignRun``)."""

    @property
    def path(self) -> Path: ...
    @property
    def kind(self) -> str: ...  # foreign_runs.OURS / OFFICIAL / ENTRY's name
    @property
    def lacks(self) -> tuple[str, ...]: ...  # what the run does not record ("not in this run")
    @property
    def notes(self) -> tuple[str, ...]: ...
    @property
    def tasks(self) -> dict[str, dict[str, Any]]: ...  # summary.json's rows, as far as the run has them
    @property
    def basis(self) -> str: ...
    @property
    def attempts(self) -> int: ...
    def scores(self, basis: str | None = None) -> dict[str, float]: ...
    def test_runs(self, instance_id: str) -> list[dict[str, str]]: ...  # per attempt with a result: test -> status
    def test_map(self, instance_id: str) -> dict[str, bool] | None: ...  # what the leaderboard reads of the task
    def scoped(self, instance_id: str) -> bool: ...  # its tests are the official score's (active, not ignored)
    def describe(self) -> dict[str, Any]: ...


class FlakyTests(Protocol):
    """What a gold ledger (``--pb-gold-ledger``) tells a comparison: whether a hidden test is flaky on the
    reference itself, so its flip says nothing about the agent."""

    def is_flaky(self, instance_id: str, test: str) -> bool: ...


@dataclass(frozen=True)
class FinishedRun:
    """A run directory as its files say: the record, the summary, each task's official result."""

    path: Path
    record: dict[str, Any]
    summary: dict[str, Any]
    scopes: dict[str, TaskScope | None] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()  # summary.json's ids that are no task id (a path, a scheme): listed, not read

    @classmethod
    def load(cls, path: Path) -> FinishedRun:
        """A run directory of ours, which may still be anyone's: read as results/foreign_files.py reads (inside it,
        capped), an id that is no task id's shape left out and listed."""
        path = path.expanduser().resolve()
        try:
            record = foreign_files.read_json(path / RUN_MARKER, root=path, limit=foreign_files.RECORD_MAX)
            summary = foreign_files.read_json(path / "summary.json", root=path)
        except foreign_files.ForeignFileError as exc:
            raise CompareError(f"{path} is not a finished run directory (its {RUN_MARKER} and summary.json "
                               f"cannot be read: {exc})") from None
        if not isinstance(record, dict) or not isinstance(summary, dict) or not isinstance(summary.get("tasks"), dict):
            raise CompareError(f"{path / 'summary.json'} lists no tasks")
        if not isinstance(record.get("settings"), dict):
            record = {**record, "settings": {}}
        unknown = tuple(sorted(iid for iid in summary["tasks"] if not foreign_files.is_task_id(iid)))
        summary = {**summary, "tasks": {iid: row for iid, row in summary["tasks"].items()
                                        if iid not in unknown and isinstance(row, dict)}}
        return cls(path, record, summary, _scopes(record, summary["tasks"]), unknown)

    @property
    def tasks(self) -> dict[str, dict[str, Any]]:
        tasks: dict[str, dict[str, Any]] = self.summary["tasks"]
        return tasks

    @property
    def kind(self) -> str:
        return foreign_runs.OURS.name

    @property
    def lacks(self) -> tuple[str, ...]:
        return ()

    @property
    def notes(self) -> tuple[str, ...]:
        return (printable(foreign_runs.unknown_note(self.unknown)),) if self.unknown else ()

    def test_runs(self, instance_id: str) -> list[dict[str, str]]:
        return self.outcomes(instance_id).runs

    def test_map(self, instance_id: str) -> dict[str, bool] | None:
        """Attempt 1's per-test map (the one ``<id>/<id>.eval.json`` a package holds) of a task the run scored."""
        statuses = self.statuses(instance_id) if instance_id in self.scores() else None
        return None if statuses is None else {t: s == PASSED for t, s in statuses.items()}

    def scoped(self, instance_id: str) -> bool:
        return self.scopes.get(instance_id) is not None

    def scores(self, basis: str | None = None) -> dict[str, float]:
        """Scores of the tasks this run scored (passed or failed; errors and unattempted are not scores): the run's
        own (its ``--pb-score``), or ``basis``'s (``official``, ``corrected``; a run from before the corrected score
        has its own for both)."""
        out: dict[str, float] = {}
        for iid, row in self.tasks.items():
            value = row.get(f"score_{basis}") if basis else None
            value = value if isinstance(value, int | float) else row.get("score")
            if row.get("outcome") in ("passed", "failed") and isinstance(value, int | float):
                out[iid] = float(value)
        return out

    @property
    def basis(self) -> str:
        """Which score decided this run (``--pb-score``)."""
        return str((self.record.get("settings") or {}).get("score_basis") or "official")

    @property
    def attempts(self) -> int:
        """Attempts per task (``--pb-attempts``; the headline says it only when above 1)."""
        value = (self.summary.get("headline") or {}).get("attempts")
        return value if isinstance(value, int) and value > 1 else 1

    def attempt_numbers(self, instance_id: str) -> list[int]:
        """The task's attempts as summary.json lists them (``[1]`` with one attempt per task)."""
        listed = (self.tasks.get(instance_id) or {}).get("attempts")
        if self.attempts == 1 or not isinstance(listed, dict):
            return [1]
        return sorted(int(n) for n in listed if str(n).isdigit())

    def outcomes(self, instance_id: str) -> AttemptStatuses:
        """Every attempt's statuses of the tests that count (attempts without a readable result left out)."""
        runs = [self.statuses(instance_id, n) for n in self.attempt_numbers(instance_id)]
        return AttemptStatuses([r for r in runs if r is not None])

    def statuses(self, instance_id: str, attempt: int = 1) -> dict[str, str] | None:
        """``branch/test`` -> status of the tests that count for the score in one attempt's result (attempt 1's
        in ``<id>/``, attempt N's in ``attempts/<N>/<id>/``); ``None`` without a readable result."""
        task_dir = TaskKey(instance_id, n=attempt, single=attempt == 1).task_dir(self.path)
        eval_json = task_dir / f"{instance_id}.eval.json"
        if not eval_json.is_file():
            return None
        try:
            data = foreign_files.read_json(eval_json, root=self.path, limit=foreign_files.EVAL_JSON_MAX)
        except foreign_files.ForeignFileError as exc:
            raise CompareError(str(exc)) from None
        if not isinstance(data, dict):
            return None
        scope = self.scopes.get(instance_id)
        out: dict[str, str] = {}
        for test in data.get("test_results") or []:
            if not isinstance(test, dict):
                continue
            branch, name = str(test.get("branch", "")), str(test.get("name", ""))
            full = f"{branch}/{name}"
            if scope is not None and (branch not in scope.active_branches or full in scope.ignored_tests):
                continue
            out[full] = str(test.get("status", ""))
        return out

    def per_attempt_tokens(self) -> dict[str, Any]:
        """Under --pb-attempts the run's tokens and cost per attempt: the sum over tasks of each task's mean over its
        attempts (summary.json's rows), as its times are, so a K-attempt run compares with a one-attempt run."""
        out: dict[str, Any] = {}
        for key in ("input_tokens", "output_tokens", "total_tokens"):
            values = [v for row in self.tasks.values() if isinstance(v := (row.get("tokens") or {}).get(key),
                                                                         int | float)]
            out[key] = round(sum(values), 1) if values else None
        costs = [c for row in self.tasks.values() if isinstance(c := row.get("cost_usd"), int | float)]
        out["cost_usd"] = round(sum(costs), 6) if costs else None
        return out

    def describe(self) -> dict[str, Any]:
        settings = self.record.get("settings") or {}
        return {
            "run_dir": str(self.path), "run_id": self.record.get("run_id"),
            "agent": settings.get("agent"), "model": settings.get("model"),
            "submissions": settings.get("submissions"),
            "plugin_version": self.record.get("plugin_version"),
            "programbench_version": self.record.get("programbench_version"),
            "headline": {k: v for k, v in (self.summary.get("headline") or {}).items() if not k.endswith("_ci")},
            "tokens": self.summary.get("tokens") or {} if self.attempts == 1 else self.per_attempt_tokens(),
            **{f"{phase}_seconds": round(sum(_seconds(r, phase) or 0.0 for r in self.tasks.values()), 3)
               for phase in PHASES},
        }


def _scopes(record: Mapping[str, Any], tasks: Mapping[str, Any]) -> dict[str, TaskScope | None]:
    """Active branches and ignored tests of each task, from the catalogue the run used (its recorded tasks dirs);
    a task no longer found keeps every test of its result (said in compare.json as ``scope: all``)."""
    settings = record.get("settings") or {}
    dirs = [d for d in settings.get("tasks_dirs") or () if Path(d).is_dir()]
    try:
        by_id = {t.instance_id: t for t in Catalogue.load(dirs, include_fixtures=bool(
            settings.get("include_fixtures")))}
    except CatalogueError:
        by_id = {}
    scopes: dict[str, TaskScope | None] = {}
    for iid in tasks:
        task = by_id.get(iid)
        try:
            instance = task.load_instance() if task is not None else None
        except CatalogueError:
            instance = None
        scopes[iid] = None if instance is None else TaskScope(tuple(get_active_branches(instance)),
                                                               frozenset(get_ignored_tests(instance)))
    return scopes


# A total's name in a run kind's ``lacks`` (foreign_runs.NEVER_RECORDED, and "cost").
LACKING = MappingProxyType({"input_tokens": "tokens", "output_tokens": "tokens", "total_tokens": "tokens",
                            "cost_usd": "cost", "agent_seconds": "agent time", "evaluation_seconds": "evaluation time"})

# Time per task from pb-meta.json's timings (summary.json's "timings"): the agent's window and the evaluation. Not
# pytest's duration, which for a task a resumed session reused is only the reuse.
PHASES = ("agent", "evaluation")


def _seconds(row: Mapping[str, Any], phase: str) -> float | None:
    value = (row.get("timings") or {}).get(phase)
    return float(value) if isinstance(value, int | float) else None


def _tokens(row: Mapping[str, Any]) -> float | None:
    tokens = row.get("tokens") or {}
    if not isinstance(tokens, dict):
        return None
    total = tokens.get("total_tokens")
    if isinstance(total, int | float):  # a float: the mean over a task's attempts
        return total
    parts = [p for k in ("input_tokens", "output_tokens") if isinstance(p := tokens.get(k), int | float)]
    return sum(parts) if parts else None


def _delta(base: Any, new: Any, digits: int = 6) -> float | None:
    if isinstance(base, int | float) and isinstance(new, int | float):
        return round(float(new) - float(base), digits)
    return None


@dataclass(frozen=True)
class AttemptStatuses:
    """A task's hidden tests over a run's attempts: each attempt's ``branch/test`` -> status."""

    runs: list[dict[str, str]]

    def passes(self, test: str) -> int:
        return sum(run.get(test) == PASSED for run in self.runs)

    def mostly_passed(self, test: str) -> bool:
        """The majority outcome: passed in more than half the attempts with a result (a tie is not passed)."""
        return 2 * self.passes(test) > len(self.runs)

    def shown(self, test: str) -> str:
        """The status with one attempt (``failure``; ``absent``: not in the result), the pass rate with several."""
        if len(self.runs) == 1:
            return self.runs[0].get(test, "absent")
        return f"{self.passes(test)}/{len(self.runs)} passed"


def flips(base: AttemptStatuses, new: AttemptStatuses, instance_id: str,
          ledger: FlakyTests | None) -> dict[str, list[dict[str, Any]]]:
    """The tests whose majority outcome over the attempts changed between the runs (with one attempt each: whose
    pass/fail changed); a test missing from a result did not pass there."""
    out: dict[str, list[dict[str, Any]]] = {"pass_to_fail": [], "fail_to_pass": []}
    if not base.runs or not new.runs:
        return out
    for test in sorted({t for run in (*base.runs, *new.runs) for t in run}):
        was, now = base.mostly_passed(test), new.mostly_passed(test)
        if was == now:
            continue
        row = {"test": test, "base": base.shown(test), "new": new.shown(test),
               "base_passes": base.passes(test), "base_attempts": len(base.runs),
               "new_passes": new.passes(test), "new_attempts": len(new.runs),
               "flaky": None if ledger is None else ledger.is_flaky(instance_id, test)}
        out["pass_to_fail" if was else "fail_to_pass"].append(row)
    return out


ONE_ATTEMPT = ("each task's score; a flip: a hidden test's pass/fail changed between the two results; the paired "
               "bootstrap resamples tasks")
OVER_ATTEMPTS = ("per task the mean of its scored attempts' scores, the delta the difference of those means; per "
                 "hidden test its pass rate over the attempts with a result in each run, a flip a change of its "
                 "majority outcome (passed in more than half); the paired bootstrap resamples tasks (attempts not "
                 "resampled); tokens, cost and times per task are its means over its attempts, their totals the sums "
                 "of those means (per attempt)")


def method(base: ComparedRun, new: ComparedRun) -> dict[str, Any]:
    """How the runs' attempts were compared, as compare.json and compare.html say it."""
    several = max(base.attempts, new.attempts) > 1
    return {"attempts": {"base": base.attempts, "new": new.attempts},
            "text": OVER_ATTEMPTS if several else ONE_ATTEMPT}


@dataclass(frozen=True)
class Gate:
    """``--pb-max-regression X``: fails when the paired CI's lower bound is below -X (or there is no interval)."""

    max_regression: float
    failed: bool
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"max_regression": self.max_regression, "failed": self.failed, "message": self.message}


def gate(difference: Mapping[str, Any] | None, max_regression: float) -> Gate:
    if difference is None:
        return Gate(max_regression, True, f"programbench: --pb-max-regression {max_regression:g}: fewer than 2 tasks "
                    "were scored by both runs, so there is no interval to check")
    low = float(difference["low"])
    if low < -max_regression:
        return Gate(max_regression, True, (
            f"programbench: regression: the 95% CI of the mean score difference reaches {low:.4f}, below "
            f"--pb-max-regression -{max_regression:g} (difference {difference['estimate']:.4f}, CI "
            f"[{low:.4f}, {float(difference['high']):.4f}] over {difference['n']} tasks)"))
    return Gate(max_regression, False, f"programbench: --pb-max-regression {max_regression:g}: the CI's lower bound "
                f"{low:.4f} is within it")


BASES = ("official", "corrected")


def both_scores(row: Mapping[str, Any]) -> dict[str, Any]:
    """A task's official and corrected scores and the line that says why they differ (summary.json's)."""
    return {"score_official": row.get("score_official", row.get("score")),
            "score_corrected": row.get("score_corrected", row.get("score")),
            "score_note": row.get("score_note") or ""}


def by_basis(base: ComparedRun, new: ComparedRun) -> dict[str, Any]:
    """The means over the tasks both runs scored, by the official and by the corrected score, and which decided
    each run (the comparison's own numbers are each run's deciding score)."""
    out: dict[str, Any] = {"basis": {"base": base.basis, "new": new.basis}}
    for basis in BASES:
        b, n = base.scores(basis), new.scores(basis)
        paired = sorted(set(b) & set(n))
        out[basis] = {"tasks": len(paired),
                      "mean_base": round(sum(b[t] for t in paired) / len(paired), 6) if paired else None,
                      "mean_new": round(sum(n[t] for t in paired) / len(paired), 6) if paired else None}
    return out


def _statuses(run: ComparedRun, instance_id: str, struck: set[str]) -> AttemptStatuses:
    return AttemptStatuses([{t: s for t, s in r.items() if t not in struck} for r in run.test_runs(instance_id)])


def leaderboard_scores(run: ComparedRun, ignore: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """Each task the run scored as the leaderboard scores it: its per-test map with the ignore map's tests struck
    (compile_leaderboard's ``_instance_score``)."""
    out: dict[str, float] = {}
    for iid in run.scores():
        tests = run.test_map(iid)
        if tests is not None:
            out[iid] = registry.instance_score(tests, set(ignore.get(iid, ())))
    return out


def leaderboard(base: ComparedRun, new: ComparedRun, ignore: Mapping[str, Sequence[str]] | None,
                ignore_file: str | None) -> dict[str, Any]:
    """Each side's row as the leaderboard computes it from per-test maps: percentages over its 200 tasks."""
    out: dict[str, Any] = {"ignore_file": ignore_file, "total": registry.LEADERBOARD_TOTAL}
    for side, run in (("base", base), ("new", new)):
        maps = {iid: tests for iid in run.scores() if (tests := run.test_map(iid)) is not None}
        board = registry.compute(maps, {k: list(v) for k, v in (ignore or {}).items()}, ignore_file=ignore_file or "")
        out[side] = {"mean_score": board.mean_score, "resolved": board.resolved, "near_resolved": board.near_resolved,
                     "tasks": board.tasks, "struck": board.struck}
    return out


def kind_text(name: str) -> str:
    return next(k.text for k in foreign_runs.KINDS if k.name == name)


def side_info(run: ComparedRun) -> dict[str, Any]:
    return {**run.describe(), "kind": run.kind, "kind_text": kind_text(run.kind), "lacks": list(run.lacks),
            "notes": list(run.notes)}


def _few(names: Iterable[str], shown: int = 5) -> str:
    listed = sorted(names)
    return ", ".join(listed[:shown]) + (f" and {len(listed) - shown} more" if len(listed) > shown else "") or "none"


def compare(base: ComparedRun, new: ComparedRun, *, ledger: FlakyTests | None = None,
            max_regression: float | None = None, ignore: Mapping[str, Sequence[str]] | None = None,
            ignore_file: str | None = None) -> dict[str, Any]:
    """The comparison of ``new`` against ``base`` as compare.json holds it. With ``ignore`` (the registry's ignore
    map) the paired scores are the leaderboard's and its struck tests flip on neither side."""
    if not set(base.tasks) & set(new.tasks):
        raise CompareError(f"{base.path} and {new.path} have no task in common (base: {_few(base.tasks)}; new: "
                           f"{_few(new.tasks)})")
    if ignore is None:
        base_scores, new_scores = base.scores(), new.scores()
    else:
        base_scores, new_scores = leaderboard_scores(base, ignore), leaderboard_scores(new, ignore)
    how = method(base, new)
    tasks = {iid: _task_row(base, new, iid, base_scores, new_scores, ignore=ignore, ledger=ledger)
             for iid in sorted(set(base.tasks) & set(new.tasks))}
    base_info, new_info = side_info(base), side_info(new)
    entry = foreign_runs.ENTRY.name in (base.kind, new.kind)
    result: dict[str, Any] = {
        "base": base_info, "new": new_info, "method": how,
        # which score each side is compared by: its own (its --pb-score; a foreign run's official), or the
        # leaderboard's (--pb-registry-ignore: per-test maps with the registry's struck tests left out)
        "compared_by": "leaderboard" if ignore is not None else "own",
        "paired": _paired_means(base_scores, new_scores, how),
        "tasks": tasks,
        "only_in_base": sorted(set(base.tasks) - set(new.tasks)),
        "only_in_new": sorted(set(new.tasks) - set(base.tasks)),
        "not_paired": sorted(iid for iid, row in tasks.items() if not row["paired"]),
        "flips": {
            "pass_to_fail": sum(len(r["pass_to_fail"]) for r in tasks.values()),
            "fail_to_pass": sum(len(r["fail_to_pass"]) for r in tasks.values()),
        },
        "totals": _totals(base, new, base_info, new_info),
        "scores": by_basis(base, new),
        "coverage": coverage.compare_runs({iid: row["coverage"] for iid, row in tasks.items()},
                                          (row.get("coverage") for row in base.tasks.values()),
                                          (row.get("coverage") for row in new.tasks.values())),
        "leaderboard": leaderboard(base, new, ignore, ignore_file) if entry or ignore is not None else None,
        "gold_ledger": None if ledger is None else str(getattr(ledger, "path", "given")),
        "gate": None,
    }
    if max_regression is not None:
        result["gate"] = gate(result["paired"]["difference"], max_regression).as_dict()
    return result


def _paired_means(base_scores: Mapping[str, float], new_scores: Mapping[str, float],
                  how: Mapping[str, Any]) -> dict[str, Any]:
    """compare.json's ``paired``: the tasks both runs scored, both means, the difference and the permutation test."""
    paired = sorted(set(base_scores) & set(new_scores))
    over = None if how["text"] == ONE_ATTEMPT else "tasks both runs scored (each task's mean over its attempts)"
    difference = paired_difference(base_scores, new_scores, over=over)
    permutation = paired_permutation_test(base_scores, new_scores)
    return {
        "tasks": len(paired),
        "mean_base": round(sum(base_scores[t] for t in paired) / len(paired), 6) if paired else None,
        "mean_new": round(sum(new_scores[t] for t in paired) / len(paired), 6) if paired else None,
        "difference": difference.as_dict() if difference else None,
        "permutation_test": permutation.as_dict() if permutation else None,
    }


def _task_row(base: ComparedRun, new: ComparedRun, iid: str, base_scores: Mapping[str, float],
              new_scores: Mapping[str, float], *, ignore: Mapping[str, Sequence[str]] | None,
              ledger: FlakyTests | None) -> dict[str, Any]:
    """One task's row of compare.json: each side's scores, the delta, the flipped tests and the deltas of use."""
    b, n = base.tasks[iid], new.tasks[iid]
    struck = set((ignore or {}).get(iid, ()))
    changed = flips(_statuses(base, iid, struck), _statuses(new, iid, struck), iid, ledger)
    return {
        "base": {"outcome": b.get("outcome"), "score": b.get("score"), "compared": base_scores.get(iid),
                 **both_scores(b)},
        "new": {"outcome": n.get("outcome"), "score": n.get("score"), "compared": new_scores.get(iid),
                **both_scores(n)},
        "paired": iid in base_scores and iid in new_scores,
        "delta": _delta(base_scores.get(iid), new_scores.get(iid)),
        "scope": "official" if base.scoped(iid) and new.scoped(iid) else "all",
        **changed,
        "tokens_delta": _delta(_tokens(b), _tokens(n), 0),
        "cost_delta": _delta(b.get("cost_usd"), n.get("cost_usd")),
        **{f"{phase}_seconds_delta": _delta(_seconds(b, phase), _seconds(n, phase), 3) for phase in PHASES},
        "coverage": coverage.compare_task(b.get("coverage"), n.get("coverage")),  # did it explore more?
    }


def _totals(base: ComparedRun, new: ComparedRun, base_info: Mapping[str, Any],
            new_info: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """compare.json's ``totals``: tokens, cost and each phase's seconds on both sides, with the sides lacking them."""
    def missing(key: str) -> list[str]:
        return [side for side, run in (("base", base), ("new", new)) if LACKING[key] in run.lacks]

    totals = {
        key: {"base": base_info["tokens"].get(key), "new": new_info["tokens"].get(key),
              "delta": _delta(base_info["tokens"].get(key), new_info["tokens"].get(key)),
              "missing": missing(key)}
        for key in ("input_tokens", "output_tokens", "total_tokens", "cost_usd")
    }
    for phase in PHASES:
        key = f"{phase}_seconds"
        totals[key] = {"base": base_info[key], "new": new_info[key], "delta": _delta(base_info[key], new_info[key], 3),
                       "missing": missing(key)}
    return totals


def terminal_lines(result: Mapping[str, Any]) -> list[str]:
    lines = [f"new  {result['new']['run_dir']}", f"base {result['base']['run_dir']}", *side_lines(result)]
    lines.extend(_paired_lines(result))
    lines.extend(_task_lines(result))
    lines.extend(leaderboard_lines(result.get("leaderboard")))
    lines.append(_totals_line(result["totals"]))
    explored = coverage.compare_line(result["coverage"]) if result.get("coverage") else None
    if explored is not None:
        lines.append(explored)
    return lines


def _paired_lines(result: Mapping[str, Any]) -> list[str]:
    """The method, the paired means with the difference's interval, both scores' means and the permutation test."""
    paired, how = result["paired"], result["method"]
    lines = []
    if how["text"] == OVER_ATTEMPTS:
        lines.append(f"attempts per task: base {how['attempts']['base']}, new {how['attempts']['new']}: {how['text']}")
    if paired["difference"] is not None:
        lines.append(f"mean over the {paired['tasks']} tasks both scored: {paired['mean_base']:.3f} -> "
                     f"{paired['mean_new']:.3f}; difference {interval_text(paired['difference'])}")
    else:
        lines.append(f"{paired['tasks']} task(s) scored by both runs: too few for an interval")
    lines.extend(basis_lines(result.get("scores")))
    test = paired["permutation_test"]
    if test is not None:
        resampled = (f"exact over {test['resamples']} sign patterns" if test["exact"]
                     else f"{test['resamples']} resamples")
        lines.append(f"permutation test: p = {test['p_value']:.4f} (two-sided, paired, {resampled})")
    return lines


def _task_lines(result: Mapping[str, Any]) -> list[str]:
    """Better and worse tasks and flipped tests counted, a line per changed or unpaired task, the one-sided ones."""
    tasks = result["tasks"]
    worse = sum(1 for r in tasks.values() if (r["delta"] or 0) < 0)
    better = sum(1 for r in tasks.values() if (r["delta"] or 0) > 0)
    lines = [f"tasks: {better} better, {worse} worse, {len(tasks) - better - worse} unchanged or unpaired; "
             f"tests: {result['flips']['pass_to_fail']} pass->fail, {result['flips']['fail_to_pass']} fail->pass"]
    for iid, row in tasks.items():
        if row["delta"] or row["pass_to_fail"] or row["fail_to_pass"] or not row["paired"]:
            score = (f"{row['base']['compared']:.4f} -> {row['new']['compared']:.4f}" if row["paired"] else
                     f"{row['base']['outcome']} -> {row['new']['outcome']} (not paired)")
            delta = f" ({row['delta']:+.4f})" if row["delta"] is not None else ""
            lines.append(f"  {iid}: {score}{delta}, {len(row['pass_to_fail'])} pass->fail, "
                         f"{len(row['fail_to_pass'])} fail->pass")
    for side in ("only_in_base", "only_in_new"):
        if result[side]:
            lines.append(f"{side.replace('_', ' ')}: {', '.join(result[side])}")
    return lines


def _totals_line(totals: Mapping[str, Any]) -> str:
    """Tokens, cost and each phase's time, base -> new."""
    tokens, cost = shown(totals["total_tokens"], "{}"), totals["cost_usd"]
    times = "; ".join(f"{phase} {shown(totals[phase + '_seconds'], '{:.1f} s')['base']} -> "
                      f"{shown(totals[phase + '_seconds'], '{:.1f} s')['new']}" for phase in PHASES)
    missing = cost.get("missing") or ()  # a side whose kind records no cost (an entry without _stats/cost.json)
    cost_text = ("unknown (no --pb-token-price)" if cost["base"] is None and cost["new"] is None and not missing
                 else " -> ".join(foreign_runs.NOT_IN_RUN if side in missing else "unknown" if cost[side] is None
                                  else f"${cost[side]:,.4f}" for side in ("base", "new")))
    return f"tokens {tokens['base']} -> {tokens['new']}; cost {cost_text}; {times}"


def shown(total: Mapping[str, Any], form: str) -> dict[str, str]:
    """A total's two sides as text: "not in this run" for a side whose kind does not record it."""
    return {side: foreign_runs.NOT_IN_RUN if side in total.get("missing", ()) else
            ("-" if total[side] is None else form.format(total[side])) for side in ("base", "new")}


def side_lines(result: Mapping[str, Any]) -> list[str]:
    """Which kind each side is (one line), what a side does not record, and what was not scored there."""
    base, new = result["base"], result["new"]
    lines = [f"base is {base.get('kind_text', kind_text(foreign_runs.OURS.name))}; new is "
             f"{new.get('kind_text', kind_text(foreign_runs.OURS.name))}"]
    for label, side in (("base", base), ("new", new)):
        if side.get("lacks"):
            lines.append(f"{label}: {', '.join(side['lacks'])}: {foreign_runs.NOT_IN_RUN}")
        lines.extend(f"{label}: {note}" for note in side.get("notes") or ())
    if result.get("compared_by") == "leaderboard":
        lines.append(f"compared by the leaderboard's scores: each task's per-test map with the tests "
                     f"{Path(str((result.get('leaderboard') or {}).get('ignore_file'))).name} strikes left out, on "
                     "both sides")
    return lines


def leaderboard_lines(board: Mapping[str, Any] | None) -> list[str]:
    """Each side's leaderboard row (where a side is an entry, or with --pb-registry-ignore)."""
    if not board:
        return []
    ignore = f", {Path(board['ignore_file']).name} struck" if board.get("ignore_file") else ""
    return [f"leaderboard numbers (over {board['total']} tasks, resolved at 1.0, near-resolved at 0.95{ignore}): "
            + "; ".join(f"{side} mean {row['mean_score']}%, resolved {row['resolved']}%, near-resolved "
                        f"{row['near_resolved']}% ({row['tasks']} task(s), {row['struck']} test(s) struck)"
                        for side, row in ((s, board[s]) for s in ("base", "new")))]


def basis_lines(scores: Mapping[str, Any] | None) -> list[str]:
    """Both scores' paired means, when they or the runs' deciding scores differ."""
    if not scores:
        return []
    official, corrected, basis = scores["official"], scores["corrected"], scores["basis"]
    if (official["mean_base"], official["mean_new"]) == (corrected["mean_base"], corrected["mean_new"]) \
            and basis["base"] == basis["new"]:
        return []

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    # A side that has no corrected score (an entry without eval.json files) is said, and a mean over fewer tasks too.
    by_corrected = (f"{fmt(corrected['mean_base'])} -> {fmt(corrected['mean_new'])}"
                    + (f" (over the {corrected['tasks']} task(s) both have it)"
                       if corrected["tasks"] != official["tasks"] else "") if corrected["tasks"]
                    else "not in both runs")
    return [f"by the official score {fmt(official['mean_base'])} -> {fmt(official['mean_new'])}, by the corrected "
            f"score {by_corrected} (upstream ProgramBench issue #56); "
            f"the {basis['base']} score decided the base run, the {basis['new']} score the new one"]


# compare.json's totals as a reader names them (the keys stay the file's).
TOTAL_LABELS = MappingProxyType({"input_tokens": "input tokens", "output_tokens": "output tokens",
                                 "total_tokens": "total tokens", "cost_usd": "cost (USD)",
                                 "agent_seconds": "agent time (s)", "evaluation_seconds": "evaluation time (s)"})


def total_label(key: str) -> str:
    return TOTAL_LABELS.get(key, key.replace("_", " "))


def render_html(result: Mapping[str, Any], reports: Mapping[str, str] | None = None) -> str:
    """``reports``: side -> a relative link to that run's report.html, for the sides that have one."""
    template = files("pytest_programbench.results").joinpath("templates", "compare.html.j2").read_text()
    # finalize: every printed value made printable (control bytes escaped) before autoescape (markup escaped)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             finalize=html_text)
    env.filters["score"] = score_text
    env.filters["num"] = number_text
    env.filters["total_label"] = total_label
    return env.from_string(template).render(result=result, interval_text=interval_text, reports=reports or {})


_PAIR_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def pair_name(base: Path) -> str:
    """A file-name stem for the comparison with ``base``, one per base: readable from its directory name, kept
    apart from any other base of the same name by a hash of its full path (--pb-compare keeps every pair)."""
    readable = _PAIR_UNSAFE.sub("-", base.name)[:60].strip("-.") or "run"
    return f"compare-{readable}-{hashlib.sha256(str(base).encode()).hexdigest()[:8]}"


def report_links(base: ComparedRun, new: ComparedRun) -> dict[str, str]:
    """Links from a comparison in ``new`` to each side's report.html, relative, for the sides that are run
    directories of ours and have one (a foreign directory's report.html is whatever its author put there)."""
    links = {}
    for side, run in (("base", base), ("new", new)):
        if run.kind == foreign_runs.OURS.name and (run.path / "report.html").is_file():
            links[side] = Path(os.path.relpath(run.path / "report.html", new.path)).as_posix()
    return links


def score_text(value: Any) -> str:
    """A score as the report prints it: four decimals ("-" for none)."""
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


def number_text(value: Any, *, signed: bool = False) -> str:
    """A total or a delta: a whole number with thousands separators, else at most four decimals ("-" for none)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    sign = "+" if signed else ""
    if float(value).is_integer():
        return f"{value:{sign},.0f}"
    return f"{value:{sign},.4f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class Written:
    result: dict[str, Any]
    json_path: Path
    html_path: Path
    pair_html: Path | None = None  # this pair's own page, kept when another base is compared

    @property
    def gate_failure(self) -> str:
        gate_row = self.result.get("gate") or {}
        return str(gate_row.get("message", "")) if gate_row.get("failed") else ""

    def lines(self) -> list[str]:
        """The terminal's lines, printable: ids, notes and paths come from the runs' files."""
        out = terminal_lines(self.result)
        gate_row = self.result.get("gate")
        if gate_row is not None and not gate_row["failed"]:
            out.append(gate_row["message"])
        out.append(f"comparison: {self.json_path}, {self.html_path}")
        if self.pair_html is not None:
            out.append(f"this pair's own, kept when another base is compared: {self.pair_html}")
        return [printable(line) for line in out]


def detect(path: Path) -> foreign_runs.Kind:
    """The kind of directory ``path`` is (ours, a ``programbench eval`` output, an entry); CompareError if none."""
    try:
        return foreign_runs.detect(path.expanduser().resolve())
    except foreign_runs.ForeignRunError as exc:
        raise CompareError(str(exc)) from None


def check_run(path: Path) -> foreign_runs.Kind:
    """Before a session spends agent time on it: ``path`` is a side a comparison can read (its kind found, our run's
    files or an entry's per-test map readable)."""
    kind = detect(path)
    try:
        if kind == foreign_runs.OURS:
            FinishedRun.load(path)
        elif kind == foreign_runs.ENTRY:
            foreign_runs.read_score_map(path.expanduser().resolve())
    except foreign_runs.ForeignRunError as exc:
        raise CompareError(str(exc)) from None
    return kind


def load_runs(paths: Sequence[Path], *, tasks_dirs: Sequence[str] = ()) -> list[ComparedRun]:
    """Each side as its kind reads: ours as :class:`FinishedRun`, the others by results/foreign_runs.py with the
    catalogue of ``tasks_dirs`` and of the tasks directories our sides' runs used."""
    kinds = [detect(p) for p in paths]
    ours = {i: FinishedRun.load(p) for i, (p, kind) in enumerate(zip(paths, kinds, strict=True))
            if kind == foreign_runs.OURS}
    dirs = [*tasks_dirs, *(str(d) for run in ours.values()
                           for d in (run.record.get("settings") or {}).get("tasks_dirs") or ())]
    runs: list[ComparedRun] = []
    for i, (path, kind) in enumerate(zip(paths, kinds, strict=True)):
        try:
            runs.append(ours[i] if i in ours else foreign_runs.read(path, kind, tasks_dirs=dirs))
        except foreign_runs.ForeignRunError as exc:
            raise CompareError(str(exc)) from None
    return runs


def write(base_dir: Path, new_dir: Path, *, ledger: FlakyTests | None = None, max_regression: float | None = None,
          tasks_dirs: Sequence[str] = (), registry_ignore: str | None = None) -> Written:
    """Compare ``new_dir`` against ``base_dir`` (each any kind :func:`detect` knows); compare.json and compare.html go
    into ``new_dir``. ``registry_ignore``: the registry's ignored_tests.json (``--pb-registry-ignore``)."""
    base, new = load_runs([base_dir, new_dir], tasks_dirs=tasks_dirs)
    if base.path == new.path:
        raise CompareError(f"--pb-compare: {base.path} is compared with itself")
    try:
        ignore = registry.read_ignore_map(Path(registry_ignore)) if registry_ignore else None
    except foreign_files.ForeignFileError as exc:
        raise CompareError(str(exc)) from None
    result = compare(base, new, ledger=ledger, max_regression=max_regression, ignore=ignore,
                     ignore_file=registry_ignore)
    # compare.json/html: the latest comparison (where scripts look); the pair's own files keep every earlier one.
    page = render_html(result, report_links(base, new))
    text = json.dumps(result, indent=2)
    stem = pair_name(base.path)
    for name, content in ((f"{stem}.json", text), (f"{stem}.html", page), (COMPARE_JSON, text),
                          (COMPARE_HTML, page)):
        atomic_write_text(new.path / name, content)
    return Written(result, new.path / COMPARE_JSON, new.path / COMPARE_HTML, new.path / f"{stem}.html")
