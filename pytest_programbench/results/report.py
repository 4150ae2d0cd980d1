"""``report.html``: one self-contained page per run (inline CSS and JS, no network), written at session end.

Built from the same dictionary as ``summary.json`` (so the headline numbers are the same numbers) plus each task's
``<id>.eval.json`` for the failing tests by branch. Links to a task's files are relative: the page works wherever the
run directory is copied. A foreign run's page (``--pb-report``) reads its eval.json files through
results/foreign_files.py (inside the run, capped) and none of our own per-task records (pb-meta.json, timelines),
which such a run does not have; its links, as every page's, are quoted relative paths to regular files inside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.core.task_key import TaskKey
from pytest_programbench.results import coverage, foreign_files, task_meta, timeline
from pytest_programbench.results.verdict import EVAL_JSON_MAX, PANEL_POINTER, FailingTest, failing_tests, read_failing
from pytest_programbench.text.printable import html_text

REPORT_NAME = "report.html"


@dataclass(frozen=True)
class TaskScope:
    """What counts for a task's score: its active branches and its ignored ``branch/test`` names."""

    active_branches: tuple[str, ...]
    ignored_tests: frozenset[str]


def failing_by_branch(eval_json: Path, scope: TaskScope | None, *,
                      foreign: Path | None = None) -> dict[str, list[FailingTest]]:
    """Tests of the active branches that did not pass (ignored ones left out), as the official result lists them,
    each with its message (the item's message shows the first few). ``foreign``: the foreign run's directory, read
    as results/foreign_files.py reads it (nothing when a file is refused)."""
    def counted(branch: str, name: str) -> bool:
        return scope is None or (branch in scope.active_branches and f"{branch}/{name}" not in scope.ignored_tests)

    if foreign is None:
        return read_failing(eval_json, counted)
    if not eval_json.is_file():
        return {}
    try:
        return failing_tests(foreign_files.read_json(eval_json, root=foreign, limit=EVAL_JSON_MAX), counted)
    except foreign_files.ForeignFileError:
        return {}


def _fmt(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _seconds(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    value = int(value)
    return f"{value // 3600}:{value // 60 % 60:02d}:{value % 60:02d}"


OUTCOMES = ("passed", "failed", "other")  # a bin's bar is stacked by outcome: only passed tasks' part is green


def distribution(tasks: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Scored tasks in ten bins of 0.1 plus exactly 1.0 (resolved); errors and unattempted apart. Each bin counts
    its tasks by outcome (with --pb-min-score below 1 a bin may hold both)."""
    labels = [f"{i / 10:.1f}-{(i + 1) / 10:.1f}" for i in range(10)] + ["1.0 (resolved)", "error / not run"]
    counts = [dict.fromkeys(OUTCOMES, 0) for _ in labels]
    for row in tasks.values():
        score = row.get("score")
        if row.get("outcome") not in ("passed", "failed") or score is None:
            counts[11]["other"] += 1
        else:
            counts[10 if score >= 1.0 else min(9, int(score * 10))][row["outcome"]] += 1
    peak = max(sum(c.values()) for c in counts) or 1
    return [{"label": label, "count": sum(c.values()),
             "parts": [{"outcome": o, "count": c[o], "height": round(100 * c[o] / peak, 1)} for o in OUTCOMES if c[o]]}
            for label, c in zip(labels, counts, strict=True)]


def _count(value: Any) -> str:
    """A count, or a mean of counts over attempts (one decimal when it is not whole)."""
    if not isinstance(value, int | float):
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def numbers(row: Mapping[str, Any]) -> dict[str, Any]:
    """The columns a task's row and each of its attempts show: tests, times, tokens, cost, retries, coverage."""
    tokens = row.get("tokens") or {}
    total = tokens.get("total_tokens")
    if not isinstance(total, int | float):
        parts = [v for k in ("input_tokens", "output_tokens") if isinstance(v := tokens.get(k), int | float)]
        total = sum(parts) if parts else None
    timings = row.get("timings") or {}
    evaluation = timings.get("evaluation")
    return {
        "total_tokens": total, "tokens_text": _count(total),
        "agent_seconds": timings.get("agent"), "agent_time": _seconds(timings.get("agent")),
        "eval_seconds": evaluation, "eval_time": _seconds(evaluation),
        "score_text": _fmt(row.get("score")),
        "tests_text": (f"{_count(row.get('n_passed'))}/{_count(row['n_tests'])}"
                       if row.get("n_tests") is not None else "-"),
        "cost_text": "-" if row.get("cost_usd") is None else f"${row['cost_usd']:.4f}",
        **model_meter(tokens), **coverage_columns(row.get("coverage")),
    }


def coverage_columns(row: Any) -> dict[str, Any]:
    """A task's exploration coverage (results/coverage.py): "1/2" and its fraction, the options never tried."""
    if not isinstance(row, Mapping) or not isinstance(row.get("total"), int):
        return {"coverage": None, "coverage_text": "-", "coverage_sort": -1}
    value = coverage.fraction(row)
    covered = row.get("covered")
    text = (f"{_count(covered)}/{row['total']}" if isinstance(covered, int | float)
            else f"-/{row['total']} (no calls recorded)")
    return {"coverage": row, "coverage_text": text, "coverage_sort": -1 if value is None else round(value, 6)}


def task_rows(run_dir: Path, data: dict[str, Any], scope: Callable[[str], TaskScope | None], *,
              events_max: int = 0, progress: Mapping[str, list[dict[str, Any]]] | None = None,
              foreign: bool = False) -> list[dict[str, Any]]:
    """Each task's row and panel. ``foreign``: a run that is not ours, whose eval.json files are read inside it with
    caps and whose per-task records of ours (pb-meta.json, timelines) are not read at all."""
    rows = []
    progress = progress or {}
    for iid, row in data.get("tasks", {}).items():
        task_dir = run_dir / iid
        links = {label: href for label, name in (
            ("transcript", "transcript.html"), ("agent.log", "agent.log"), ("trajectory", f"{iid}.traj.json"),
            ("eval.json", f"{iid}.eval.json"),
            ("pb-meta.json", "pb-meta.json")) if (href := foreign_files.link(run_dir, f"{iid}/{name}")) is not None}
        flags = list(row.get("integrity_flags") or [])
        attempts = attempt_rows(run_dir, iid, row, scope(iid), events_max=events_max, progress=progress)
        # under --pb-attempts each attempt lists its own
        failing = {} if attempts else failing_by_branch(task_dir / f"{iid}.eval.json", scope(iid),
                                                        foreign=run_dir if foreign else None)
        bounded = _bounded(failing)
        shown = {b: t for a in attempts for b, t in (a.get("failing") or {}).items()} if attempts else bounded
        rows.append({
            **row, "id": iid, "links": links, "flags": flags, **numbers(row), "failing": bounded,
            "search": search_text(iid, shown),
            "spread": attempt_spread(row), **gold_columns(row), **score_columns(row, None if foreign else task_dir),
            "reason": _reason(row), "attempt_rows": attempts,
            "timeline": None if attempts or foreign else timeline.load(task_dir, events_max=events_max,
                                                                       progress=progress.get(iid, ())),
        })
    return rows


def attempt_rows(run_dir: Path, iid: str, row: Mapping[str, Any], scope: TaskScope | None, *, events_max: int,
                 progress: Mapping[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """--pb-attempts: each attempt's own numbers, failing tests and timeline, for the task's panel (empty with one
    attempt); the panel's budget for failing tests' messages is shared by the attempts."""
    listed = row.get("attempts")
    if not isinstance(listed, Mapping):
        return []
    out = []
    for number, attempt in sorted(listed.items(), key=lambda kv: int(kv[0])):
        key = TaskKey(iid, n=int(number), single=False)
        task_dir = key.task_dir(run_dir)
        failing = failing_by_branch(task_dir / f"{iid}.eval.json", scope)
        out.append({**attempt, "n": int(number), **numbers(attempt),
                    "dir": str(task_dir.relative_to(run_dir)),
                    "failing": _bounded(failing, PANEL_DETAIL_MAX // len(listed)),
                    "timeline": timeline.load(task_dir, events_max=events_max, progress=progress.get(key.name, ()))})
    return out


SEARCH_TEXT_MAX = 4096  # characters of a task's searchable text (its id, failing tests and their first lines)


def search_text(iid: str, failing: Mapping[str, list[dict[str, str]]]) -> str:
    """What the page's search box matches a task on, lowercased and bounded: its id, each failing test's branch,
    name and the first line of its message."""
    parts = [iid]
    for branch, tests in failing.items():
        for test in tests:
            first = (test.get("detail") or "").strip().splitlines()[:1]
            parts.append(" ".join([branch, str(test.get("name", "")), *first]))
    return " ".join(parts).lower()[:SEARCH_TEXT_MAX]


def facets(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The values each filter of the page offers: every language, difficulty, outcome and flag the rows hold."""
    def values(key: str) -> list[str]:
        return sorted({str(r.get(key)) for r in rows if r.get(key) not in (None, "")})
    return {"language": values("language"), "difficulty": values("difficulty"), "outcome": values("outcome"),
            "flag": sorted({str(f) for r in rows for f in r.get("flags") or []})}


def _reason(row: Mapping[str, Any]) -> str:
    """The item's last failure text as the panel shows it: without the line pointing at this very panel."""
    reasons = row.get("reasons") or []
    if not reasons:
        return ""
    return "\n".join(line for line in str(reasons[-1]).splitlines() if line.strip() != PANEL_POINTER)


# The error bars' scale: a score of 0..1 across WIDTH pixels of inline SVG, PAD pixels of margin either side.
BAR_WIDTH, BAR_PAD = 280, 10
SPREAD_WIDTH, SPREAD_PAD = 96, 2


def _x(value: Any, width: int, pad: int) -> float:
    return round(pad + width * min(1.0, max(0.0, float(value))), 2)


def error_bar(ci: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A headline mean's 95% interval (``Interval.as_dict``) placed on the 0..1 score axis, for its SVG."""
    if not ci:
        return None
    return {**ci, **{f"x_{end}": _x(ci[end], BAR_WIDTH, BAR_PAD) for end in ("low", "high", "estimate")}}


def attempt_spread(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """--pb-attempts: a task's mean over its scored attempts, their range (worst..best) and pass@k, resolved@k at
    the largest k, placed on the 0..1 axis of its row's bar; ``None`` with one attempt or none scored."""
    pass_at = row.get("pass_at_k") or {}
    if (row.get("n_attempts") or 0) < 2 or not pass_at or row.get("mean") is None:
        return None
    k = max(pass_at, key=int)
    return {"mean": row["mean"], "worst": row["worst"], "best": row["best"], "k": k, "pass_at_k": pass_at[k],
            "resolved_at_k": (row.get("resolved_at_k") or {}).get(k), "ended": row.get("ended"),
            "n": row["n_attempts"], "scored": row.get("scored"),
            **{f"x_{name}": _x(row[name], SPREAD_WIDTH, SPREAD_PAD) for name in ("worst", "best", "mean")}}


COUNTED_SHOWN = 200  # tests the official counted twice, listed in a task's panel (the rest counted)


def score_columns(row: Mapping[str, Any], task_dir: Path | None) -> dict[str, Any]:
    """Both scores of a task (official, corrected), the line that says why they differ, and the tests the official
    counted twice (from its pb-meta.json, read only where the two differ; ``task_dir`` None: a foreign run's)."""
    note = str(row.get("score_note") or "")
    recorded = (task_meta.read(task_dir) or {}).get("outcome") if note and task_dir is not None else None
    twice = [str(t) for t in recorded.get("counted_twice") or []] if isinstance(recorded, dict) else []
    return {"official_text": _fmt(row.get("score_official")), "corrected_text": _fmt(row.get("score_corrected")),
            "score_note": note, "counted_twice_names": twice[:COUNTED_SHOWN],
            "counted_twice_more": max(0, len(twice) - COUNTED_SHOWN)}


def gold_columns(row: Mapping[str, Any]) -> dict[str, Any]:
    """--pb-gold-ledger: the task's ceiling (its mean gold score) beside its score; --pb-ignore-flaky's score."""
    ceiling, ignoring = row.get("gold_ceiling"), row.get("score_ignoring_gold_flaky")
    ceiling = ceiling if isinstance(ceiling, int | float) else None
    return {"ceiling": ceiling, "ceiling_text": _fmt(ceiling),
            "ignoring_flaky_text": _fmt(ignoring) if isinstance(ignoring, int | float) else ""}


def model_meter(relay: dict[str, Any]) -> dict[str, Any]:
    """A task's model API retries and seconds waited (its relay's meter in summary.json), for its row: "3 (12 s
    waited)", "-" without a relay; the waits for the run's limits (--pb-model-concurrency, -rpm, -tpm) beside."""
    retries = relay.get("retries")
    if not isinstance(retries, int | float):  # a float: the mean over a task's attempts
        return {"retries": None, "retries_text": "-", "limits_text": ""}
    waited = relay.get("retry_wait_s") or 0
    limits = (relay.get("slot_wait_s") or 0) + (relay.get("rate_wait_s") or 0)
    return {"retries": retries, "retries_text": f"{_count(retries)} ({waited:.0f} s waited)" if retries else "0",
            "limits_text": f"{limits:.0f} s for the run's limits" if limits else ""}


PANEL_DETAIL_MAX = 256 << 10  # characters of failing tests' messages per task panel; the rest are in eval.json


def _bounded(failing: dict[str, list[FailingTest]], budget: int = PANEL_DETAIL_MAX) -> dict[str, list[dict[str, str]]]:
    """Every failing test, each with its message while the panel's budget lasts (a task can fail thousands)."""
    out: dict[str, list[dict[str, str]]] = {}
    for branch, tests in failing.items():
        rows = out.setdefault(branch, [])
        for test in tests:
            detail = test.detail if len(test.detail) <= budget else ""
            budget -= len(detail)
            rows.append({"name": test.name, "status": test.status, "detail": detail,
                         "cut": "" if detail or not test.detail else "message in eval.json"})
    return out


def _when(started: Any, updated: Any) -> dict[str, str]:
    """The run's start (UTC) and how long it has run, from summary.json's clocks."""
    if not isinstance(started, int | float):
        return {"started": "-", "duration": "-"}
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
    ended = updated if isinstance(updated, int | float) else started
    return {"started": stamp, "duration": _seconds(max(0.0, ended - started))}


def events_budget(tasks: Mapping[str, Any]) -> int:
    """Rows one attempt's timeline may embed: the page's budget over every attempt of every task."""
    timelines = sum(len(row.get("attempts") or {}) or 1 for row in tasks.values() if isinstance(row, Mapping))
    return max(timeline.ATTEMPT_EVENTS_MIN,
               min(timeline.ATTEMPT_EVENTS_MAX, timeline.PAGE_EVENTS // max(1, timelines)))


def render(run_dir: Path, data: dict[str, Any], scope: Callable[[str], TaskScope | None], *,
           foreign: bool = False) -> str:
    template = files("pytest_programbench.results").joinpath("templates", "report.html.j2").read_text()
    # finalize: every printed value made printable (control bytes escaped) before autoescape (markup escaped)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             finalize=html_text)
    env.filters["fmt"] = _fmt
    env.filters["num"] = _count
    head = data["headline"]
    rows = task_rows(run_dir, data, scope, events_max=events_budget(data.get("tasks", {})),
                     progress={} if foreign else timeline.progress_lines(run_dir), foreign=foreign)
    return env.from_string(template).render(
        data=data, head=head, rows=rows, facets=facets(rows), bins=distribution(data.get("tasks", {})),
        groups=[("language", data.get("by_language", {})), ("difficulty", data.get("by_difficulty", {}))],
        tokens=data.get("tokens") or {}, settings=data.get("settings") or {},
        when=_when(data.get("started"), data.get("updated")),
        bars={name: error_bar(head.get(f"{name}_ci")) for name in ("mean_over_scored", "mean_over_selection")},
        bar_box=(BAR_PAD, BAR_PAD + BAR_WIDTH), spread_box=(SPREAD_PAD, SPREAD_PAD + SPREAD_WIDTH), foreign=foreign,
    )


def write_report(run_dir: Path, data: dict[str, Any], scope: Callable[[str], TaskScope | None], *,
                 foreign: bool = False) -> Path:
    path = run_dir / REPORT_NAME
    atomic_write_text(path, render(run_dir, data, scope, foreign=foreign))
    return path
