"""The proxy's call log when its storage is full (issue 21 §3): a call may go unrecorded, never uncounted.

The daemon's own pieces, run here on real files: ``/dev/full`` answers every write with ``ENOSPC``, as a full
writable layer does. The same in a real sandbox an agent filled, through a session: tests/test_relay_hostile.py.
"""

from __future__ import annotations

from pathlib import Path

from pytest_programbench.sandbox.sandbox import CallLog
from tests.proxy_support import load_daemon

daemon = load_daemon("pb_proxy_daemon_calllog")


def test_a_record_the_full_disk_refuses_is_told_to_the_master(tmp_path: Path) -> None:
    told: list[int] = []
    log = daemon.CallLog("/dev/full", str(tmp_path / "calls.dropped"), lambda: told.append(1))
    log.append({"call": "1", "phase": "started", "argv": ["binary"]})
    assert told == []  # the call is recorded (or not) by its last line
    log.append({"call": "1", "phase": "ended", "argv": ["binary"], "exit": 0})
    assert told == [1]
    unopened = daemon.CallLog(str(tmp_path / "missing" / "calls.jsonl"), str(tmp_path / "calls.dropped"),
                              lambda: told.append(2))
    unopened.append({"call": "2", "phase": "ended"})
    assert told == [1, 2]  # a log that could not even be opened loses no count either


def test_the_master_count_is_overwritten_in_place(tmp_path: Path) -> None:
    path = tmp_path / "calls.count"
    count = daemon.CallCount(str(path))
    first = path.read_bytes()
    for state in (daemon.NOTE_BUSY, daemon.NOTE_IDLE, daemon.NOTE_BUSY, daemon.NOTE_UNRECORDED, daemon.NOTE_BUSY):
        count.note(state)
    count.save()
    text = path.read_text()
    assert len(text) == len(first)  # same size: no new blocks needed to update it
    assert text.split() == ["calls=000000000000003", "unrecorded=000000000000001"]


def test_the_harness_counts_and_says_what_went_unrecorded() -> None:
    calls = CallLog([{"call": "1", "argv": ["binary"]}], 0, None, made=6, unrecorded=5)
    assert calls.count == 6
    assert any(note.startswith("5 call(s) of the reference could not be recorded") for note in calls.notes())
    assert CallLog([{"call": "1"}], 2, None).count == 3  # an older daemon without a count: what the log says
