"""The relay's agent-facing HTTP/1.1 (h11 in relay/server.py): the head caps on each side of h11's one buffer cap,
keep-alive with both request body framings, HTTP/1.0 clients, and each streamed chunk reaching the agent before the
metering tap reads it.

Real relays on loopback TCP against the scripted upstream of tests/test_relay.py, real clients on raw sockets.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_programbench.relay import relay as relay_module
from pytest_programbench.relay.metering import UsageTap
from pytest_programbench.relay.relay import HEADER_MAX, ModelRelay
from tests.test_relay import CHAT_BODY, CHAT_STREAM, Reply, ScriptedUpstream, raw_request, settled


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    yield server
    server.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else 0


@pytest.mark.parametrize(("line", "headers", "status"), [
    ((64 << 10) + 1, 0, 414),  # a line past its cap, headers small: under h11's one buffer for both, still 414
    (64 << 10, 0, 404),  # a line at its cap: served (the path is outside the endpoint)
    (200 << 10, 0, 414),  # a line past both caps: refused before the rest is read
    (100, HEADER_MAX + 4096, 431),  # headers past their cap, under the sum of both
    (60 << 10, 60 << 10, 404),  # each under its own cap: served (the path is outside the endpoint)
])
def test_request_line_and_header_caps(upstream: ScriptedUpstream, line: int, headers: int, status: int) -> None:
    """``line``: bytes of the request line, its CRLF excluded; ``headers``: bytes of the padding field, its CRLF
    included."""
    with ModelRelay(f"{upstream.url}/v1", tcp=True) as relay:
        assert relay.tcp_address is not None
        target = b"/" + b"a" * (line - len(b"GET / HTTP/1.1"))
        fields = b"X-Pad: " + b"h" * max(headers - 9, 0) + b"\r\n" if headers else b""
        answer = raw_request(relay.tcp_address, b"GET " + target + b" HTTP/1.1\r\nHost: h\r\n" + fields + b"\r\n")
        [record] = settled(relay, 1)
    assert status_of(answer) == status, answer[:200]
    assert record.status == status
    assert upstream.received == []


def _read_response(sock: socket.socket, buffered: bytearray) -> tuple[bytes, bytes]:
    """One response (Content-Length framed) off a keep-alive connection: its head and body."""
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, bytes(buffered)
        buffered += chunk
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    body = bytearray(rest)
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    buffered[:] = body[length:]
    return head, bytes(body[:length])


def test_keep_alive_with_chunked_and_sized_bodies_then_close(upstream: ScriptedUpstream) -> None:
    upstream.route("POST", "/v1/chat/completions", Reply([CHAT_BODY]))
    payload = json.dumps({"model": "m", "messages": []}).encode()
    chunked = b"%x\r\n%s\r\n%x;ext=1\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (10, payload[:10], len(payload) - 10,
                                                                           payload[10:])
    with ModelRelay(f"{upstream.url}/v1", tcp=True) as relay:
        assert relay.tcp_address is not None
        with socket.create_connection(relay.tcp_address, timeout=10) as sock:
            buffered = bytearray()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + chunked)
            first = _read_response(sock, buffered)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(payload), payload))
            second = _read_response(sock, buffered)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            third = _read_response(sock, buffered)
            assert sock.recv(1) == b""  # closed after the answer it asked to be the last
        settled(relay, 3)
    for head, body in (first, second, third):
        assert head.startswith(b"HTTP/1.1 200 ")
        assert body == CHAT_BODY
    assert b"connection: close" in third[0].lower()
    assert b"connection: close" not in first[0].lower() + second[0].lower()
    assert [r.body for r in upstream.received] == [payload] * 3


def test_http_1_0_client_gets_a_close_delimited_stream(upstream: ScriptedUpstream) -> None:
    upstream.route("POST", "/v1/chat/completions", Reply(CHAT_STREAM, content_type="text/event-stream",
                                                         chunked=True))
    payload = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    with ModelRelay(f"{upstream.url}/v1", tcp=True) as relay:
        assert relay.tcp_address is not None
        answer = raw_request(relay.tcp_address, b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(payload), payload))
        [record] = settled(relay, 1)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == b"".join(CHAT_STREAM)
    assert record.usage is not None


def test_each_chunk_reaches_the_agent_before_the_tap_reads_it(upstream: ScriptedUpstream,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The tap's first read waits until the agent has the first chunk: written after the tap, it never would."""
    seen = threading.Event()
    waited: list[bool] = []

    class WaitingTap(UsageTap):
        def feed(self, chunk: bytes) -> None:
            if not waited:
                waited.append(seen.wait(5))
            super().feed(chunk)

    monkeypatch.setattr(relay_module, "UsageTap", WaitingTap)
    upstream.route("POST", "/v1/chat/completions", Reply(CHAT_STREAM, content_type="text/event-stream",
                                                         chunked=True))
    payload = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    first = CHAT_STREAM[0]
    with ModelRelay(f"{upstream.url}/v1", tcp=True) as relay:
        assert relay.tcp_address is not None
        with socket.create_connection(relay.tcp_address, timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            got = bytearray()
            while first not in got:
                chunk = sock.recv(65536)
                assert chunk, bytes(got)
                got += chunk
            seen.set()
            rest: Any = sock.recv(65536)
            while rest:
                rest = sock.recv(65536)
        settled(relay, 1)
    assert waited == [True]
