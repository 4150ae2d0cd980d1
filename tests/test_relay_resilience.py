"""The relay against a failing provider (the scripted model server's faults): transient failures absorbed before the
agent sees a byte, what could not be absorbed said plainly, a broken stream passed on and counted.

Each test speaks to the relay's TCP listener the way an SDK does (one streamed model request) and checks what the
agent got, what the server saw, and the record the relay kept (``model-requests.jsonl``).
"""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from pytest_programbench.pipeline.room import run_dir_need
from pytest_programbench.relay.rate import RunRateLimit
from pytest_programbench.relay.relay import ModelRelay, RetryPolicy
from pytest_programbench.relay.slots import SLOTS_DIR, ModelSlots
from pytest_programbench.relay.upstream import retry_hint
from tests.scripted_models import Faults, ScriptedModels, Step

STEPS = [Step("done", None, 10, 2)]
CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}],
        "stream_options": {"include_usage": True}}
FAST = RetryPolicy(budget_s=30, base_s=0.05, max_backoff_s=0.2)  # backoff without a hint: short


def ask(relay: ModelRelay, payload: dict[str, Any] = CHAT) -> tuple[int, bytes]:
    assert relay.tcp_address is not None
    conn = http.client.HTTPConnection(*relay.tcp_address, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        try:
            body = response.read()
        except http.client.IncompleteRead as exc:  # a stream the upstream cut
            body = exc.partial
        return response.status, body
    finally:
        conn.close()


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rate_limit_absorbed_honouring_retry_after(tmp_path: Path) -> None:
    """Three 429s with Retry-After: 1: the agent gets the 200, one request recorded with three retries waiting at
    least the second asked each, metered; the wait was told to the live view."""
    waits: list[float] = []
    with ScriptedModels(STEPS, faults=Faults(rate_limit_first=3, retry_after="1")) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, records_path=tmp_path / "r.jsonl",
                       retry=FAST, on_wait=waits.append) as relay:
        status, body = ask(relay)
        unavailable = relay.unavailable()
    stats = relay.stats()
    assert status == 200
    assert b"[DONE]" in body
    assert server.statuses == [429, 429, 429, 200]
    [record] = records(tmp_path / "r.jsonl")
    assert record["status"] == 200
    assert not record["gave_up"]
    assert [(t["attempt"], t["status"]) for t in record["retries"]] == [(1, 429), (2, 429), (3, 429)]
    assert all(1.0 <= t["wait_s"] <= 1.1 for t in record["retries"])  # Retry-After, plus at most 10% jitter
    assert record["retry_wait_s"] == pytest.approx(sum(t["wait_s"] for t in record["retries"]), abs=0.01)
    assert stats.retries == 3
    assert stats.retry_wait_s == pytest.approx(record["retry_wait_s"], abs=0.01)
    assert stats.turns == 1
    assert stats.input_tokens == server.sent.input_tokens == 11
    assert waits == [t["wait_s"] for t in record["retries"]]
    assert unavailable is None
    assert any("retried 3 transient failure(s)" in note for note in relay.notes())


def test_overload_absorbed_within_the_budget(tmp_path: Path) -> None:
    """503 for two seconds (no hint: exponential backoff with jitter): the agent never sees the 503."""
    with ScriptedModels(STEPS, faults=Faults(unavailable_for=2.0)) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, retry=FAST) as relay:
        status, _ = ask(relay)
    assert status == 200
    assert server.statuses[-1] == 200
    assert set(server.statuses[:-1]) == {503}
    assert relay.stats().retries == len(server.statuses) - 1 >= 2
    assert relay.unavailable() is None


def test_outage_longer_than_the_budget_is_given_up_and_named(tmp_path: Path) -> None:
    """529 for longer than the budget: the last answer goes to the agent as it came, the record says it gave up,
    and the relay names the outage (the task becomes an error of it)."""
    policy = RetryPolicy(budget_s=1.5, base_s=0.1, max_backoff_s=0.3)
    with ScriptedModels(STEPS, faults=Faults(unavailable_for=600, unavailable_status=529)) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, retry=policy,
                       records_path=tmp_path / "r.jsonl") as relay:
        first, _ = ask(relay)
        second, _ = ask(relay)
        unavailable = relay.unavailable()
    assert (first, second) == (529, 529)
    assert len(server.statuses) >= 4
    assert set(server.statuses) == {529}
    lines = records(tmp_path / "r.jsonl")
    assert [line["gave_up"] for line in lines] == [True, True]
    assert all(sum(t["wait_s"] for t in line["retries"]) <= 1.5 for line in lines)  # within the budget
    assert relay.stats().gave_up == 2
    assert unavailable == ("model API unavailable: 2 request(s) given up after the retry budget of 1.5 s "
                           "(2 answered 529)")


def test_rejected_key_is_not_retried_and_named(tmp_path: Path) -> None:
    with ScriptedModels(STEPS, faults=Faults(reject_key=True)) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, retry=FAST) as relay:
        status, body = ask(relay)
    assert status == 401
    assert b"authentication_error" in body
    assert server.statuses == [401]
    assert relay.stats().rejected == 1
    assert relay.stats().retries == 0
    assert relay.unavailable() == "model API rejected the key: 1 request(s) (1 answered 401)"


def test_stream_broken_after_bytes_went_out_is_passed_on_and_counted(tmp_path: Path) -> None:
    with ScriptedModels(STEPS, faults=Faults(break_stream=(1,))) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, retry=FAST,
                       records_path=tmp_path / "r.jsonl") as relay:
        status, body = ask(relay)
        again, _ = ask(relay)
    assert status == 200
    assert b"[DONE]" not in body
    assert again == 200
    assert server.statuses == [200, 200]  # never retried by the relay: bytes had gone out
    first = records(tmp_path / "r.jsonl")[0]
    assert first["stream_broken"]
    assert first["retries"] == []
    assert relay.stats().stream_breaks == 1
    assert relay.unavailable() is None


def test_retry_hints() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert retry_hint(httpx.Headers({"retry-after": "7"}), now) == 7
    assert retry_hint(httpx.Headers({"retry-after-ms": "250", "retry-after": "7"}), now) == 0.25
    date = format_datetime(now + timedelta(seconds=40), usegmt=True)
    assert retry_hint(httpx.Headers({"retry-after": date}), now) == 40
    openai = {"x-ratelimit-remaining-requests": "10", "x-ratelimit-reset-requests": "1s",
              "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0.5s"}
    assert retry_hint(httpx.Headers(openai), now) == 360.5  # the exhausted limit's reset
    anthropic = {"anthropic-ratelimit-requests-remaining": "0",
                 "anthropic-ratelimit-requests-reset": (now + timedelta(seconds=12)).isoformat().replace("+00:00",
                                                                                                        "Z")}
    assert retry_hint(httpx.Headers(anthropic), now) == 12
    assert retry_hint(httpx.Headers({"x-ratelimit-reset-requests": "20ms"}), now) == 0.02
    assert retry_hint(httpx.Headers({"retry-after": "soon"}), now) is None
    assert retry_hint(httpx.Headers({}), now) is None


def test_concurrency_slots_shared_by_relays_and_freed_by_a_dead_holder(tmp_path: Path) -> None:
    """Two relays (two tasks) on one run's slots, two slots: six requests at once, never more than two at the
    server; a process killed while it holds a slot frees it."""
    slots_dir = tmp_path / SLOTS_DIR
    told: list[str] = []
    with ScriptedModels(STEPS, faults=Faults(delay=0.3)) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, slots=ModelSlots(slots_dir, 2),
                       on_slot_wait=lambda: told.append("wait")) as one, \
            ModelRelay(server.base_url, tcp=True, unix=False, slots=ModelSlots(slots_dir, 2)) as two:
        with ThreadPoolExecutor(6) as pool:
            statuses = [status for status, _ in pool.map(ask, [one, two] * 3)]
        waited = one.stats().slot_wait_s + two.stats().slot_wait_s
    assert statuses == [200] * 6
    assert server.peak_in_flight == 2
    assert waited > 0
    assert told  # the live view heard of the wait

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, threading; from pathlib import Path; from pytest_programbench.relay.slots import ModelSlots; "
        f"ModelSlots(Path({str(tmp_path / 'one')!r}), 1).acquire(threading.Event()); print('held', flush=True); "
        "sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        fd = os.open(tmp_path / "one" / "slot-0", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.kill()
        holder.wait()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # freed with the dead process's descriptors
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def test_replay_answers_from_the_recording_and_names_the_first_mismatch(tmp_path: Path) -> None:
    """A conversation recorded through the relay is answered again with no server at all, byte for byte; a changed
    request is the first mismatch, answered 409 and described with a diff."""
    records_path = tmp_path / "run" / "r.jsonl"
    second = {**CHAT, "messages": [{"role": "user", "content": "and now?"}]}
    with ScriptedModels(STEPS) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, records_path=records_path) as relay:
        original = [ask(relay), ask(relay, second)]
    recording = records_path.with_name("model-replay.jsonl")
    assert len(recording.read_text().splitlines()) == 2
    dead = server.base_url  # the server is gone: any connection upstream would be refused
    with ModelRelay(dead, tcp=True, unix=False, replay_from=recording) as replay:
        again = [ask(replay), ask(replay, second)]
        assert replay.replay_mismatch() is None
        status, body = ask(replay, {**CHAT, "messages": [{"role": "user", "content": "hello"}]})
        mismatch = replay.replay_mismatch()
    assert [(s, b) for s, b in again] == [(s, b) for s, b in original]  # the same answers, offline
    assert status == 409
    assert b"replay" in body
    assert mismatch is not None
    assert mismatch.startswith("request 3 (POST /v1/chat/completions) goes past the 2 recorded")
    with ModelRelay(dead, tcp=True, unix=False, replay_from=recording) as replay:
        status, _ = ask(replay, {**CHAT, "messages": [{"role": "user", "content": "hello"}]})
        mismatch = replay.replay_mismatch()
    assert status == 409
    assert mismatch is not None
    assert "request 1 (POST /v1/chat/completions) matches no recorded request" in mismatch
    assert '-   "content": "hi",' in mismatch
    assert '+   "content": "hello",' in mismatch


def test_replay_recording_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """model-replay.jsonl keeps the head of the conversation within PB_MODEL_REPLAY_MAX, then says what it left out;
    the run directory's disk check counts the cap."""
    monkeypatch.setenv("PB_MODEL_REPLAY_MAX", "6k")
    monkeypatch.delenv("PB_DISK_RUN_DIR_NEED", raising=False)
    records_path = tmp_path / "r.jsonl"
    with ScriptedModels(STEPS) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, records_path=records_path) as relay:
        for _ in range(10):
            assert ask(relay)[0] == 200
    lines = records_path.with_name("model-replay.jsonl").read_bytes().splitlines(keepends=True)
    kept, note = lines[:-1], json.loads(lines[-1])
    assert 1 <= len(kept) < 10
    assert sum(map(len, kept)) <= 6 << 10
    assert note["omitted_exchanges"] == 10 - len(kept)
    small = run_dir_need()
    monkeypatch.setenv("PB_MODEL_REPLAY_MAX", "1g")
    assert run_dir_need() - small == (1 << 30) - (6 << 10)


def test_the_live_view_says_the_agent_is_rate_limited(tmp_path: Path) -> None:
    """TaskRun tells the publisher what the relay waited (a note beside the phase); the live line shows it, and the
    next phase clears it."""
    from pytest_programbench.results.progress import Publisher, TokenMeter, read_snapshot, task_line

    publisher = Publisher(tmp_path, "gw0")
    publisher.task_started("t1")
    publisher.phase("t1", "agent")
    publisher.note("t1", "rate-limited 40 s")
    [flight] = read_snapshot(tmp_path, TokenMeter(tmp_path)).in_flight
    assert "t1  agent (rate-limited 40 s) " in task_line(flight)
    publisher.phase("t1", "evaluation")
    [flight] = read_snapshot(tmp_path, TokenMeter(tmp_path)).in_flight
    assert "(rate-limited" not in task_line(flight)


def test_token_rate_holds_requests_back_once_answers_spent_it(tmp_path: Path) -> None:
    """--pb-model-tpm at 13 tokens a (shortened) minute of one second: each answer's 13 metered tokens (11 in, 2 out)
    are charged after it, so the second request still goes (the bucket is at zero, not below), the third waits a
    second for the refill; the wait is in its record, the relay's stats and the live view's callback, the charges in
    the state."""
    told: list[float] = []
    rate = RunRateLimit(tmp_path / SLOTS_DIR, rpm=None, tpm=13, window_s=1.0)
    with ScriptedModels(STEPS) as server, \
            ModelRelay(server.base_url, tcp=True, unix=False, records_path=tmp_path / "r.jsonl", rate=rate,
                       on_rate_wait=told.append) as relay:
        statuses = [ask(relay)[0] for _ in range(3)]
    stats = relay.stats()  # complete once the relay is closed
    assert statuses == [200] * 3
    waits = [r["rate_wait_s"] for r in records(tmp_path / "r.jsonl")]
    assert waits[:2] == [0.0, 0.0]
    assert 0.8 <= waits[2] <= 2.0, waits
    assert stats.rate_wait_s == pytest.approx(sum(waits))
    assert sum(told) >= 0.8
    state = rate.read()
    assert state is not None
    assert (state.sent, state.charged) == (3, 39)


TAKER = '''
import json, sys, threading, time
from pathlib import Path
from pytest_programbench.relay.rate import RunRateLimit
rate = RunRateLimit(Path(sys.argv[1]), rpm=int(sys.argv[2]), tpm=None, window_s=float(sys.argv[3]))
time.sleep(max(0.0, float(sys.argv[5]) - time.time()))  # both processes start together
stamps = []
for _ in range(int(sys.argv[4])):
    rate.acquire(threading.Event())
    stamps.append(time.time())
print(json.dumps(stamps))
'''


def test_request_rate_shared_by_processes(tmp_path: Path) -> None:
    """Two processes take request tokens from one run directory's bucket as fast as they can: a bucket of 20 refilled
    at 20 per (shortened) minute of half a second. Over any stretch of T seconds at most 20 + 40 T went, together:
    the burst of 20 is shared, not 20 each, and the rest came at the refill's pace."""
    directory = tmp_path / SLOTS_DIR
    start = time.time() + 1.0
    takers = [subprocess.Popen([sys.executable, "-c", TAKER, str(directory), "20", "0.5", "30", str(start)],
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    stamps = sorted(stamp for taker in takers for stamp in json.loads(taker.communicate(timeout=60)[0]))
    assert all(taker.returncode == 0 for taker in takers)
    assert len(stamps) == 60
    slack = 0.02  # a stamp is taken just after its token
    for i, first in enumerate(stamps):
        for j in range(i, len(stamps)):
            assert j - i + 1 <= 20 + 40 * (stamps[j] - first + slack), (i, j, stamps[j] - first)
    assert stamps[-1] - stamps[0] >= (60 - 20) / 40 - slack  # the 40 past the burst waited for the refill
