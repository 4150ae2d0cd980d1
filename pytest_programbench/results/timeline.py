"""A task attempt's timeline for report.html: its phases, each model request and each call of the reference, in order.

Read from what the run already wrote into the attempt's directory: ``pb-meta.json`` (``phases``: each pipeline phase's
start and seconds; ``evaluation.phases``: compile.sh, each branch's tests, the audit), ``model-requests.jsonl`` (the
relay's records) and ``binary-calls.jsonl`` (the proxy's). A run written before ``phases`` existed falls back on the
run's ``progress.jsonl`` (phase changes, when the live view was on) and otherwise shows no phase bar.

A six-hour agent makes thousands of requests and tens of thousands of calls, so the page holds a bounded part: the
events are grouped into at most ``GROUPS_MAX`` windows of a round width (10 s .. 1 h), each group says what it holds
in full (requests, tokens, retries, seconds held, calls, failed calls) and embeds its first events up to its share of
the attempt's budget (``events_max``, which report.py sets from the page's); what is left out is counted and the file
named. Every text comes from the sandbox: the template prints it, Jinja's finalize escapes it.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.results import task_meta

log = logging.getLogger(__name__)

MODEL_REQUESTS = "model-requests.jsonl"
BINARY_CALLS = "binary-calls.jsonl"
SAVED = "timeline.json"  # an attempt's timeline, built once when it ended (the report trims it to its share)
VERSION = 1
# The report's budget: at most PAGE_EVENTS rows in all, shared by every attempt's timeline, each between
# ATTEMPT_EVENTS_MIN and ATTEMPT_EVENTS_MAX (bench/bench_report.py measures the page this gives).
PAGE_EVENTS, ATTEMPT_EVENTS_MIN, ATTEMPT_EVENTS_MAX = 12_000, 40, 1_500
LINES_MAX = 500_000  # lines read from one file (the relay's and the proxy's logs are capped well below)
GROUPS_MAX = 24  # windows per attempt
WIDTHS = (10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)  # a window's seconds: the smallest giving <= GROUPS_MAX
ARGV_SHOWN = 300  # characters of one call's command line embedded


def clock(seconds: float) -> str:
    """``H:MM:SS`` of a non-negative number of seconds."""
    value = max(0, int(seconds))
    return f"{value // 3600}:{value // 60 % 60:02d}:{value % 60:02d}"


def duration(seconds: float | None) -> str:
    """A short duration: ``0.012 s``, ``3.4 s``, ``1:02:03``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds:.3f} s"
    return f"{seconds:.1f} s" if seconds < 60 else clock(seconds)


def _epoch(stamp: Any) -> float | None:
    """An ISO 8601 time (the relay's ``started_at``, the proxy's ``time``) as epoch seconds."""
    if not isinstance(stamp, str):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Event:
    """One row: a model request or a call of the reference. ``record`` is kept to say the row's text only for the
    rows embedded (tens of thousands are counted, a few hundred shown)."""

    at: float
    kind: str  # "request" | "call"
    seconds: float | None
    failed: bool
    record: Mapping[str, Any]
    tokens: float = 0
    retries: int = 0
    held: float = 0.0

    def row(self, start: float) -> dict[str, Any]:
        text, status = (request_text if self.kind == "request" else call_text)(self.record)
        return {"offset": clock(self.at - start), "kind": self.kind, "text": text, "status": status,
                "failed": self.failed, "duration": duration(self.seconds), "tokens": int(self.tokens),
                "retries": self.retries, "held": round(self.held, 1)}


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    """Each JSON object line of ``path`` (others skipped), at most ``LINES_MAX``; nothing when it cannot be read."""
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle):
                if number >= LINES_MAX:
                    return
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    yield record
    except OSError:
        return


def request_event(record: Mapping[str, Any]) -> Event | None:
    """A relay record (``RelayRecord.as_dict``) as a row: start, duration, tokens, retries and seconds held back."""
    at = _epoch(record.get("started_at"))
    if at is None:
        return None
    usage = _mapping(record.get("usage"))
    tokens = _number(usage.get("total_tokens"))
    if tokens is None:
        tokens = sum((v for k in ("input_tokens", "output_tokens") if (v := _number(usage.get(k))) is not None), 0.0)
    retries = record.get("retries")
    held = sum(_number(record.get(k)) or 0.0 for k in ("retry_wait_s", "slot_wait_s", "rate_wait_s"))
    status = record.get("status")
    failed = bool(record.get("error") or record.get("cleanroom_refused")) or not isinstance(status, int) \
        or status >= 400
    return Event(at, "request", _number(record.get("total_s")), failed, record, tokens,
                 len(retries) if isinstance(retries, list) else 0, held)


def request_text(record: Mapping[str, Any]) -> tuple[str, str]:
    """A request's method and path, and its status (with the relay's error when there was one)."""
    error = record.get("error") or record.get("cleanroom_refused")
    return (f"{record.get('method') or '?'} {record.get('path') or '?'}",
            f"{record.get('status')}{f' ({error})' if error else ''}")


def call_event(record: Mapping[str, Any]) -> Event | None:
    """A proxy record as a row: its argv (``binary`` for argv[0]), exit status or signal, duration."""
    at = _number(record.get("at"))  # to the millisecond; "time" alone (older runs) is to the second
    if at is None:
        at = _epoch(record.get("time"))
    if at is None:
        return None
    failed = bool(record.get("error")) or record.get("signal") is not None or record.get("exit") is None
    return Event(at, "call", _number(record.get("duration_s")), failed, record)


def call_text(record: Mapping[str, Any]) -> tuple[str, str]:
    """A call's command line (cut at ``ARGV_SHOWN`` characters) and its exit status, signal or error."""
    argv = record.get("argv")
    line = shlex.join([str(w) for w in argv] if isinstance(argv, list) else ["binary"])
    if len(line) > ARGV_SHOWN:
        line = f"{line[:ARGV_SHOWN]}... [{len(line)} chars]"
    signal, code, error = record.get("signal"), record.get("exit"), record.get("error")
    if signal is not None:
        status = f"signal {signal}"
    elif code is not None:
        status = f"exit {code}"
    else:
        status = "did not end" if record.get("phase") == "started" or record.get("interrupted") else "no status"
    return line, f"{status} ({error})" if error else status


def phases_of(meta: Mapping[str, Any], progress: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The attempt's phases, by start: the pipeline's (level 0) and the evaluation's (level 1, compile, each branch,
    the audit); from ``progress`` (this task's progress.jsonl lines) when pb-meta.json has none."""
    out: list[dict[str, Any]] = []
    for entry in meta.get("phases") or []:
        at, seconds = _number(entry.get("at")), _number(entry.get("seconds"))
        if at is not None and seconds is not None:
            out.append({"name": str(entry.get("phase")), "at": at, "seconds": seconds, "level": 0})
    evaluation = _mapping(meta.get("evaluation"))
    for entry in evaluation.get("phases") or []:
        at, seconds = _number(entry.get("at")), _number(entry.get("seconds"))
        if at is None or seconds is None:
            continue
        name = str(entry.get("phase"))
        if name == "branch":
            name = f"branch {entry.get('branch')}{' (serial retry)' if entry.get('serial') else ''}"
        out.append({"name": name, "at": at, "seconds": seconds, "level": 1})
    if not out:
        out = _from_progress(progress)
    return sorted(out, key=lambda p: (p["at"], p["level"]))


def _from_progress(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Phases from the live view's history: each phase lasts until the next line of the same task."""
    stamped = [(at, str(line.get("phase"))) for line in lines if (at := _number(line.get("at"))) is not None]
    out = []
    for (at, name), (after, _) in itertools.pairwise(stamped):
        if name in ("starting", "finished", "verdict"):
            continue
        level = 1 if name == "compile" or name.startswith(("branch ", "audit ")) else 0
        out.append({"name": name, "at": at, "seconds": round(after - at, 3), "level": level})
    return out


def progress_lines(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The run's progress.jsonl by item name (``<id>`` or ``<id>[attempt-N]``)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in _lines(run_dir / "progress.jsonl"):
        task = line.get("task")
        if isinstance(task, str):
            out.setdefault(task, []).append(line)
    return out


def window(span: float) -> int:
    """The groups' width in seconds: the smallest round width giving at most ``GROUPS_MAX`` windows."""
    for width in WIDTHS:
        if span / width < GROUPS_MAX:
            return width
    return int(span / GROUPS_MAX) + 1


def shares(counts: Sequence[int], budget: int) -> list[int]:
    """``budget`` rows shared by groups of ``counts`` rows: small groups show all, the rest split what is left."""
    out = [0] * len(counts)
    remaining = budget
    order = sorted(range(len(counts)), key=lambda i: counts[i])
    for position, index in enumerate(order):
        share = remaining // (len(order) - position)
        out[index] = min(counts[index], share)
        remaining -= out[index]
    return out


def build(task_dir: Path, *, events_max: int, progress: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any] | None:
    """The attempt's timeline as report.html's template reads it; None when there is nothing to show."""
    meta = task_meta.read(task_dir) or {}
    phases = phases_of(meta, progress)
    events = [e for record in _lines(task_dir / MODEL_REQUESTS) if (e := request_event(record)) is not None]
    n_requests = len(events)
    events += [e for record in _lines(task_dir / BINARY_CALLS) if (e := call_event(record)) is not None]
    if not phases and not events:
        return None
    events.sort(key=lambda e: e.at)  # stable: a call's second-resolution time keeps the file's order within it
    start, span = _extent(phases, events)
    width = window(max((e.at for e in events), default=start) - start + 1)
    groups, shown = _groups(events, start=start, width=width, events_max=events_max)
    requests = [e for e in events if e.kind == "request"]
    calls = [e for e in events if e.kind == "call"]
    return {
        "span": clock(span), "width": clock(width),
        "phases": [{**p, "offset": clock(p["at"] - start), "duration": duration(p["seconds"]),
                    "left": round(100 * (p["at"] - start) / span, 2),
                    "width": round(max(0.2, 100 * p["seconds"] / span), 2)} for p in phases],
        "groups": groups,
        "requests": n_requests, "calls": len(calls), **_sums(requests, calls),
        "shown": shown, "left_out": len(events) - shown, "events_max": events_max,
    }


def _extent(phases: Sequence[Mapping[str, Any]], events: Sequence[Event]) -> tuple[float, float]:
    """Where the timeline starts (its first phase or event) and how long it spans (at least a millisecond)."""
    starts = [p["at"] for p in phases] + [e.at for e in events[:1]]
    start = min(starts)
    end = max([p["at"] + p["seconds"] for p in phases] + [e.at + (e.seconds or 0.0) for e in events[-1:]])
    return start, max(end - start, 1e-3)


def _groups(events: Sequence[Event], *, start: float, width: int,
            events_max: int) -> tuple[list[dict[str, Any]], int]:
    """The events in windows of ``width`` seconds, ``events_max`` rows shared among them; the rows shown."""
    buckets: dict[int, list[Event]] = {}
    for event in events:
        buckets.setdefault(int((event.at - start) // width), []).append(event)
    keys = sorted(buckets)
    shown = shares([len(buckets[k]) for k in keys], max(0, events_max))
    return [_group(k, width, buckets[k], n, start) for k, n in zip(keys, shown, strict=True)], sum(shown)


def _sums(requests: Sequence[Event], calls: Sequence[Event]) -> dict[str, Any]:
    """Tokens, retries, held seconds and failures of some requests and calls."""
    return {"tokens": int(sum(e.tokens for e in requests)), "retries": sum(e.retries for e in requests),
            "held": round(sum(e.held for e in requests), 1),
            "failed_requests": sum(e.failed for e in requests), "failed_calls": sum(e.failed for e in calls)}


def _group(key: int, width: int, events: list[Event], shown: int, start: float) -> dict[str, Any]:
    requests = [e for e in events if e.kind == "request"]
    calls = [e for e in events if e.kind == "call"]
    return {
        "label": f"{clock(key * width)} to {clock((key + 1) * width)}",
        "requests": len(requests), "calls": len(calls), **_sums(requests, calls),
        "rows": [e.row(start) for e in events[:shown]],
        "more_requests": sum(e.kind == "request" for e in events[shown:]),
        "more_calls": sum(e.kind == "call" for e in events[shown:]),
    }


def save(task_dir: Path) -> None:
    """Build the attempt's timeline once, when it ended, into ``timeline.json``: the session's end then reads a small
    file per attempt instead of every request and call. A view: a failure here changes nothing for the task, and the
    report builds the timeline itself."""
    try:
        built = build(task_dir, events_max=ATTEMPT_EVENTS_MAX)
        if built is not None:
            atomic_write_text(task_dir / SAVED, json.dumps({"version": VERSION, **built}, separators=(",", ":")))
    except Exception as exc:  # never the task's concern
        log.debug("timeline of %s not saved: %s", task_dir, exc)


def load(task_dir: Path, *, events_max: int, progress: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any] | None:
    """The attempt's timeline for a page, ``events_max`` rows at most: ``timeline.json`` trimmed, else built."""
    try:
        saved = json.loads((task_dir / SAVED).read_text())
    except (OSError, ValueError):
        saved = None
    if isinstance(saved, dict) and saved.get("version") == VERSION and events_max <= saved.get("events_max", 0):
        return trim(saved, events_max)
    return build(task_dir, events_max=events_max, progress=progress)


def trim(built: Mapping[str, Any], events_max: int) -> dict[str, Any]:
    """A timeline with at most ``events_max`` rows: each window keeps the first rows of its new share (shares only
    shrink with the budget, so this equals building it with ``events_max``)."""
    groups = [dict(g) for g in built["groups"]]
    totals = [g["requests"] + g["calls"] for g in groups]
    for group, share in zip(groups, shares(totals, max(0, events_max)), strict=True):
        dropped = group["rows"][share:]
        group["rows"] = group["rows"][:share]
        group["more_requests"] += sum(r["kind"] == "request" for r in dropped)
        group["more_calls"] += sum(r["kind"] == "call" for r in dropped)
    shown = sum(len(g["rows"]) for g in groups)
    return {**built, "groups": groups, "shown": shown, "left_out": sum(totals) - shown, "events_max": events_max}
