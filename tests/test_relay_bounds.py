"""The relay's bounds, host side (issue 21 §3): records, the records file, request bodies held, headers, connections.

Real relays on a Unix socket against the scripted upstream of tests/test_relay.py, real clients on raw sockets.
The hostile agent in a real sandbox, through a real session: tests/test_relay_hostile.py.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_programbench.pipeline.room import run_dir_need
from pytest_programbench.relay import records as records_module
from pytest_programbench.relay.budget import ByteBudget
from pytest_programbench.relay.records import (
    OMITTED_KEY,
    RECORD_MAX,
    BoundedJsonl,
    HeadTail,
    bounded_line,
    request_fields,
)
from pytest_programbench.relay.relay import HEADER_MAX, ModelRelay
from tests.test_relay import CHAT_BODY, Reply, ScriptedUpstream, settled


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    yield server
    server.close()


def raw_request(path: Path, data: bytes) -> bytes:
    """Send ``data`` on the relay's socket and read the answer to its end."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(str(path))
        with contextlib.suppress(OSError):  # refused before everything was sent: the answer is what counts
            sock.sendall(data)
        got = bytearray()
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    return bytes(got)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


# -- one record -------------------------------------------------------------------------------------------------


def test_a_record_is_bounded_whatever_it_holds() -> None:
    hostile = {"path": "/" + "a" * 65536, "model": "\x01" * 100000, "usage": {"raw": {str(k): [k] * 999 for k in
                                                                                         range(999)}},
               "error": "é" * 50000, "list": ["x" * 5000] * 5000, "status": 404}
    line = bounded_line(hostile)
    assert len(line.encode()) <= RECORD_MAX
    record = json.loads(line)
    assert record["status"] == 404  # scalars survive
    assert record["path"].startswith("/aaa")
    assert record["path"].endswith("[65537 chars]") or "clipped_bytes" in record


def test_requests_fields_are_read_without_parsing_the_body() -> None:
    assert request_fields(b'{"messages": [{"model": "inner", "stream": false}], "model": "gpt", "stream": true}') \
        == ("gpt", True)
    assert request_fields(b' {"stream": false, "x": {"model": "no"}, "model": "m\\"q"}') == ('m"q', False)
    assert request_fields(b'[{"model": "x"}]') == (None, None)
    assert request_fields(b'{"model": 3, "stream": "yes"}') == (None, None)
    model, _ = request_fields(b'{"model": "' + b"m" * 100000 + b'"}')
    assert model is not None
    assert len(model) < 2000
    assert model.endswith("bytes]")
    # A body that json.loads would blow up twentyfold is scanned in bounded time and memory: no fields.
    assert request_fields(b'{"pad": [' + b"[]," * 2_000_000 + b'[]], "model": "late"}') == (None, None)


# -- the records file and the memory ----------------------------------------------------------------------------


def test_the_records_file_keeps_head_and_tail_and_says_what_it_dropped(tmp_path: Path) -> None:
    path = tmp_path / "model-requests.jsonl"
    writer = BoundedJsonl(path, limit=20_000)
    for index in range(1000):
        writer.write({"index": index, "path": "/" + "p" * 3000})
    head = path.read_text().splitlines()
    assert head, "the head is written as it comes"
    writer.close()
    writer.write({"index": "after close"})
    data = path.read_bytes()
    assert len(data) <= 20_000 + 512  # the cap, plus the one line saying what was dropped
    lines = [json.loads(line) for line in data.splitlines()]
    [marker] = [line for line in lines if OMITTED_KEY in line]
    kept = [line["index"] for line in lines if "index" in line]
    assert kept[0] == 0
    assert kept[-1] == 999
    assert kept == sorted(kept)
    assert marker[OMITTED_KEY] == 1000 - len(kept)
    assert lines.index(marker) == len(head)  # between the head and the tail
    assert writer.omitted == marker[OMITTED_KEY]


def test_head_tail_in_memory() -> None:
    kept: HeadTail[int] = HeadTail(3, 2)
    for item in range(10):
        kept.add(item)
    assert kept.items() == [0, 1, 2, 8, 9]
    assert kept.omitted == 5


def test_the_disk_check_counts_the_records_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PB_DISK_RUN_DIR_NEED", raising=False)
    monkeypatch.setenv("PB_MODEL_REQUESTS_MAX", "1m")
    small = run_dir_need()
    monkeypatch.setenv("PB_MODEL_REQUESTS_MAX", "1g")
    assert run_dir_need() - small == (1 << 30) - (1 << 20)
    assert records_module.records_limit() == 1 << 30


def test_refused_long_paths_flood_a_bounded_file(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """The finding: a refused request kept its whole 64 KiB path, and records had no limit in number."""
    path = tmp_path / "model-requests.jsonl"
    with ModelRelay(f"{upstream.url}/v1", records_path=path, records_limit=64 << 10) as relay:
        assert relay.socket_path is not None
        for _ in range(200):
            answer = raw_request(relay.socket_path, b"GET /" + b"x" * 65000 + b" HTTP/1.1\r\nHost: h\r\n\r\n")
            assert status_of(answer) == 404
    data = path.read_bytes()
    assert len(data) <= (64 << 10) + 512
    lines = data.splitlines()
    assert all(len(line) <= RECORD_MAX for line in lines)
    marker = json.loads(next(line for line in lines if OMITTED_KEY.encode() in line))
    assert marker[OMITTED_KEY] + len(lines) - 1 == 200
    assert relay.stats().requests == 200  # counted, every one
    assert relay.record_bounds()["records_omitted"] == marker[OMITTED_KEY]
    assert any("reached its cap" in note for note in relay.notes())
    assert all(len(r.path) < 1100 for r in relay.records())


# -- bytes in flight, headers, connections ----------------------------------------------------------------------


def test_the_byte_budget_waits_then_refuses() -> None:
    budget = ByteBudget(100, wait_s=0.2)
    assert budget.take(60)
    assert not budget.take(50)  # no room within the wait
    assert not budget.take(101)  # never room
    freed = threading.Timer(0.05, budget.give, args=(60,))
    freed.start()
    budget.wait_s = 30
    assert budget.take(90)  # room made while it waited
    assert (budget.taken, budget.peak, budget.refused) == (90, 90, 2)
    budget.close()
    assert not budget.take(20)  # closing: no more waiting


def test_bodies_beyond_the_budget_are_refused_and_recorded(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """Three bodies fit the budget and stay held while the upstream answers slowly (after its first byte); the
    others wait, then get a 503 the agent sees, recorded; once the upstream answers, the budget is free again."""
    gate = threading.Event()
    upstream.route("POST", "/v1/chat/completions", Reply([CHAT_BODY[:1], CHAT_BODY[1:]], gate=gate))
    body = b'{"model": "m", "pad": "' + b"x" * (1 << 20) + b'"}'  # three fit in 4 MiB, four do not
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with ModelRelay(f"{upstream.url}/v1", records_path=tmp_path / "r.jsonl", max_request_bytes=2 << 20,
                    max_inflight_bytes=4 << 20, inflight_wait_s=0.3) as relay:
        assert relay.socket_path is not None
        socket_path = relay.socket_path
        answers: list[bytes] = []
        clients = [threading.Thread(target=lambda: answers.append(raw_request(socket_path, request)))
                   for _ in range(6)]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 30
        while relay.budget.refused < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for client in clients:
            client.join(60)
        assert sorted(status_of(answer) for answer in answers) == [200, 200, 200, 503, 503, 503]
        assert relay.budget.peak == 3 * len(body)
        records = settled(relay, 6)
    refused = [r for r in records if r.status == 503]
    assert len(refused) == 3
    assert all("bytes of request bodies at once" in (r.error or "") for r in refused)
    assert all(r.model == "m" for r in records if r.status == 200)
    assert relay.budget.taken == 0
    assert any("refused 3 request(s)" in note for note in relay.notes())


def test_headers_beyond_the_cap_are_refused(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    with ModelRelay(f"{upstream.url}/v1", records_path=tmp_path / "r.jsonl") as relay:
        assert relay.socket_path is not None
        headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"h" * 60000) for i in range(50))
        answer = raw_request(relay.socket_path, b"GET /v1/models HTTP/1.1\r\n" + headers + b"\r\n")
        assert status_of(answer) == 431
        [record] = settled(relay, 1)
    assert str(HEADER_MAX) in (record.error or "")


def test_connections_beyond_the_cap_get_a_503(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    with ModelRelay(f"{upstream.url}/v1", records_path=tmp_path / "r.jsonl", max_connections=3) as relay:
        assert relay.socket_path is not None
        idle = []
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(relay.socket_path))
            idle.append(sock)
        try:
            deadline = time.monotonic() + 30
            while len(relay.records()) == 0 and len(relay._clients) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            answer = raw_request(relay.socket_path, b"GET /v1/models HTTP/1.1\r\nHost: h\r\n\r\n")
            assert status_of(answer) == 503
            assert b"too many connections" in answer
        finally:
            for sock in idle:
                sock.close()
        [record] = settled(relay, 1)
    assert record.status == 503
