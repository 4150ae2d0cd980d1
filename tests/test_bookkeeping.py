"""Bookkeeping per finished task is O(1): a finish folds its report into its own record and the run's counts;
summary.json is rewritten at a pace (results/pacing.py), not once per finish with every task's row.

Counted, not timed: the rows serialised (``TaskRecord.as_dict``) and the files written while 600 real test reports
are folded in, on a clock the test holds (the pacing's only input). The end of a real session writes the final
file whatever the pacing deferred: the session tests read it (test_scheduling.py, test_outcomes.py, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.results import summary as summary_module
from pytest_programbench.results.pacing import Pacer
from pytest_programbench.results.summary import RunSummary, TaskRecord

N = 600


def report(iid: str, when: Literal["setup", "call", "teardown"]) -> pytest.TestReport:
    props = [("score", 1.0), ("n_passed", 1), ("n_tests", 1)] if when == "call" else []
    return pytest.TestReport(f"programbench::{iid}", ("programbench", None, iid), {}, "passed", None, when,
                             user_properties=props, duration=1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_finishes_do_not_rewrite_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [f"pbbook__t{k}.0000000" for k in range(N)]
    summary = RunSummary(tmp_path / "summary.json", {"run_id": "x"}, [TaskRecord(i, "c", "easy") for i in ids])
    clock = Clock()
    summary.pacer = Pacer(summary._write_now, clock=clock)
    rows = {"n": 0}
    as_dict = TaskRecord.as_dict

    def counted(self: TaskRecord) -> dict[str, object]:
        rows["n"] += 1
        return as_dict(self)

    monkeypatch.setattr(TaskRecord, "as_dict", counted)
    written: list[str] = []

    def counting(path: Path, text: str) -> None:
        written.append(path.name)
        atomic_write_text(path, text)

    monkeypatch.setattr(summary_module, "atomic_write_text", counting)

    summary.write()  # the session's first write, at collection
    assert (len(written), rows["n"]) == (1, N)
    for k, iid in enumerate(ids):
        for when in ("setup", "call", "teardown"):
            summary.record(report(iid, when))
        summary.set_in_flight({ids[k + 1]: {"phase": "agent"}} if k + 1 < N else {})
        clock.now += 0.001  # 600 finishes within 0.6 s: one gap
    # 600 finishes, and not one more file write nor one more row: the pacing's gap had not ended.
    assert (len(written), rows["n"]) == (1, N)
    assert summary.tally.outcomes["passed"] == N
    assert len(summary.tally.durations) == N
    summary.flush()  # the end of the session
    assert (len(written), rows["n"]) == (2, 2 * N)
    assert written == ["summary.json", "summary.json"]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["headline"]["passed"] == N
    assert data["in_flight"] == {}

    # The progress view's changes spread over time (4 a second): one write per gap (1 s), not one per change.
    before = len(written)
    for iid in ids[:100]:
        summary.set_in_flight({iid: {"phase": "compile"}})
        clock.now += 0.25
    summary.flush()
    assert 100 * 0.25 / 1.0 - 2 <= len(written) - before <= 100 * 0.25 / 1.0 + 2, len(written) - before


def test_a_deferred_write_is_done_by_the_timer_without_another_request() -> None:
    """A finish inside the gap is not lost when nothing else happens: the pacer's timer writes it when the gap ends."""
    import threading

    clock = Clock()
    writes: list[float] = []
    second = threading.Event()

    def write() -> None:
        writes.append(clock.now)
        if len(writes) == 2:
            second.set()

    pacer = Pacer(write, min_gap=0.05, clock=clock)
    pacer.request()
    pacer.request()  # inside the gap: deferred
    assert writes == [clock.now]
    clock.now += 1.0  # the gap ends
    assert second.wait(60), "the deferred write never came"  # a backstop, not a timing
    assert len(writes) == 2
    pacer.flush()  # nothing waits any more: no third write
    assert len(writes) == 2
