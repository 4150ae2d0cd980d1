"""The model relay, host side (its in-sandbox bridge: tests/test_relay_bridge.py and tests/test_relay_tunnel.py).

Everything here is real: a scripted upstream HTTP server on 127.0.0.1 replays fixed bodies, the relay listens on a
Unix socket and on loopback TCP, clients are ``http.client`` and raw sockets.
"""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from pytest_programbench.relay.relay import (
    PLACEHOLDER_KEY,
    ModelRelay,
    RelayConfigError,
    RelayRecord,
    RelayStats,
    RetryPolicy,
    SSEDecoder,
    Upstream,
    relay_env,
    usage_from_mapping,
)

# -- the scripted upstream ------------------------------------------------------------------------------------


@dataclass
class Reply:
    """What the upstream answers: status, headers, and the body as pieces (sent one by one when ``chunked``)."""

    chunks: Sequence[bytes]
    status: int = 200
    content_type: str = "application/json"
    chunked: bool = False
    headers: Sequence[tuple[str, str]] = ()
    gate: threading.Event | None = None  # when set: wait for it after the first piece
    break_after: int | None = None  # close the connection after this many pieces, mid-body

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    header_items: list[tuple[str, str]]
    body: bytes


@dataclass
class ScriptedUpstream:
    tls: ssl.SSLContext | None = None
    routes: dict[tuple[str, str], Reply | list[Reply]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    connections: int = 0

    def __post_init__(self) -> None:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                upstream.connections += 1

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                upstream.received.append(Received(self.command, self.path,
                                                  {k.lower(): v for k, v in self.headers.items()},
                                                  list(self.headers.items()), body))
                reply = upstream.routes.get((self.command, self.path.split("?")[0]))
                if isinstance(reply, list):  # a script: one reply per request, in order
                    reply = reply.pop(0) if reply else None
                if reply is None:
                    reply = Reply([b'{"error": "no such route"}'], status=404)
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                for name, value in reply.headers:
                    self.send_header(name, value)
                if reply.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                if self.command == "HEAD" or reply.status in (204, 304):
                    return
                for index, piece in enumerate(reply.chunks):
                    if reply.break_after is not None and index == reply.break_after:
                        self.close_connection = True
                        self.wfile.flush()
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if reply.chunked:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    else:
                        self.wfile.write(piece)
                    self.wfile.flush()
                    if index == 0 and reply.gate is not None:
                        assert reply.gate.wait(20), "the client never saw the first piece"
                if reply.chunked:
                    self.wfile.write(b"0\r\n\r\n")

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def route(self, method: str, path: str, reply: Reply | list[Reply]) -> None:
        self.routes[(method, path)] = reply

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    yield server
    server.close()


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every address any socket of this process connects to during the test (on top of the network guard)."""
    seen: list[Any] = []
    original = socket.socket.connect  # already the guarded one

    def spy(self: socket.socket, address: Any) -> Any:
        seen.append(address)
        return original(self, address)

    monkeypatch.setattr(socket.socket, "connect", spy)
    return seen


def settled(relay: ModelRelay, count: int) -> list[RelayRecord]:
    """The records once ``count`` exist: a record is written just after the client got the last byte."""
    deadline = time.monotonic() + 10
    while len(records := relay.records()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(records) == count, records
    return records


def settled_stats(relay: ModelRelay, count: int) -> RelayStats:
    settled(relay, count)
    return relay.stats()


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float = 30) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def unix_client(relay: ModelRelay) -> UnixHTTPConnection:
    assert relay.socket_path is not None
    return UnixHTTPConnection(relay.socket_path)


def tcp_client(relay: ModelRelay) -> http.client.HTTPConnection:
    assert relay.tcp_address is not None
    return http.client.HTTPConnection(*relay.tcp_address, timeout=30)


def post_json(conn: http.client.HTTPConnection, path: str, payload: dict[str, Any],
              headers: dict[str, str] | None = None) -> tuple[int, bytes, http.client.HTTPResponse]:
    conn.request("POST", path, body=json.dumps(payload).encode(),
                 headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, response.read(), response


def raw_request(address: Any, request: bytes, family: int = socket.AF_INET) -> bytes:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(address)
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


# -- fixed bodies, as the real APIs send them -----------------------------------------------------------------


def sse(*events: tuple[str | None, Any]) -> list[bytes]:
    pieces = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        pieces.append((f"event: {name}\n" if name else "").encode() + f"data: {text}\n\n".encode())
    return pieces


CHAT_USAGE = {"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29,
              "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
              "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0}}
CHAT_BODY = json.dumps({
    "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT", "object": "chat.completion", "created": 1741569952,
    "model": "gpt-4.1-2025-04-14", "system_fingerprint": "fp_1", "service_tier": "default",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help?", "refusal": None,
                                         "annotations": []}, "logprobs": None, "finish_reason": "stop"}],
    "usage": CHAT_USAGE,
}, indent=2).encode()


def chat_chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None,
               choices: bool = True) -> dict[str, Any]:
    return {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1694268190,
            "model": "gpt-4o-mini", "system_fingerprint": "fp_44709d6fcb",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices else [],
            "usage": usage}


CHAT_STREAM_USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
CHAT_STREAM = sse(
    (None, chat_chunk({"role": "assistant", "content": ""})),
    (None, chat_chunk({"content": "Hel"})),
    (None, chat_chunk({"content": "lo"})),
    (None, chat_chunk({}, finish="stop")),
    (None, chat_chunk({}, usage=CHAT_STREAM_USAGE, choices=False)),
    (None, "[DONE]"),
)
CHAT_STREAM_NO_USAGE = sse(
    (None, chat_chunk({"role": "assistant", "content": ""})),
    (None, chat_chunk({"content": "Hello"})),
    (None, chat_chunk({}, finish="stop")),
    (None, "[DONE]"),
)

RESPONSES_USAGE = {"input_tokens": 36, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 87,
                   "output_tokens_details": {"reasoning_tokens": 20}, "total_tokens": 123}
RESPONSE_OBJECT = {
    "id": "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b", "object": "response", "created_at": 1741476542,
    "status": "completed", "error": None, "incomplete_details": None, "instructions": None,
    "model": "gpt-4.1-2025-04-14",
    "output": [{"type": "message", "id": "msg_67ccd2bf17f0819081ff3bb2cf6508e6", "status": "completed",
                "role": "assistant", "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]}],
    "parallel_tool_calls": True, "store": True, "temperature": 1.0, "tool_choice": "auto", "tools": [],
    "usage": RESPONSES_USAGE,
}
RESPONSES_BODY = json.dumps(RESPONSE_OBJECT).encode()
RESPONSES_STREAM = sse(
    ("response.created", {"type": "response.created", "sequence_number": 0,
                          "response": {**RESPONSE_OBJECT, "status": "in_progress", "output": [], "usage": None}}),
    ("response.in_progress", {"type": "response.in_progress", "sequence_number": 1,
                              "response": {**RESPONSE_OBJECT, "status": "in_progress", "output": [], "usage": None}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 2, "item_id": "msg_1",
                                    "output_index": 0, "content_index": 0, "delta": "Hi."}),
    ("response.completed", {"type": "response.completed", "sequence_number": 3, "response": RESPONSE_OBJECT}),
)

ANTHROPIC_USAGE = {"input_tokens": 2095, "output_tokens": 503}
ANTHROPIC_BODY = json.dumps({
    "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
    "content": [{"type": "text", "text": "Hi! My name is Claude."}], "stop_reason": "end_turn",
    "stop_sequence": None, "usage": ANTHROPIC_USAGE,
}).encode()
ANTHROPIC_STREAM = sse(
    ("message_start", {"type": "message_start", "message": {
        "id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "type": "message", "role": "assistant", "content": [],
        "model": "claude-sonnet-4-5", "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 472, "output_tokens": 2}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
    ("ping", {"type": "ping"}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "Hello"}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "!"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                       "usage": {"output_tokens": 15}}),
    ("message_stop", {"type": "message_stop"}),
)
NO_USAGE_BODY = json.dumps({"id": "chatcmpl-x", "object": "chat.completion", "model": "local",
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                         "finish_reason": "stop"}]}).encode()


@dataclass(frozen=True)
class Shape:
    name: str
    path: str
    request: dict[str, Any]
    reply: Reply
    usage: tuple[int | None, int | None, int | None] | None  # what the server sent: input, output, total
    raw: dict[str, Any] | None
    api: str


MESSAGES = [{"role": "user", "content": "Say hello"}]
SHAPES = [
    Shape("chat", "/v1/chat/completions", {"model": "gpt-4.1", "messages": MESSAGES},
          Reply([CHAT_BODY]), (19, 10, 29), CHAT_USAGE, "chat.completions"),
    Shape("chat-stream-include-usage", "/v1/chat/completions",
          {"model": "gpt-4o-mini", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}},
          Reply(CHAT_STREAM, content_type="text/event-stream", chunked=True), (12, 3, 15), CHAT_STREAM_USAGE,
          "chat.completions"),
    Shape("chat-stream-without-usage", "/v1/chat/completions",
          {"model": "gpt-4o-mini", "messages": MESSAGES, "stream": True},
          Reply(CHAT_STREAM_NO_USAGE, content_type="text/event-stream", chunked=True), None, None,
          "chat.completions"),
    Shape("chat-without-usage", "/v1/chat/completions", {"model": "local", "messages": MESSAGES},
          Reply([NO_USAGE_BODY]), None, None, "chat.completions"),
    Shape("responses", "/v1/responses", {"model": "gpt-4.1", "input": "Say hello"},
          Reply([RESPONSES_BODY]), (36, 87, 123), RESPONSES_USAGE, "responses"),
    Shape("responses-stream", "/v1/responses", {"model": "gpt-4.1", "input": "Say hello", "stream": True},
          Reply(RESPONSES_STREAM, content_type="text/event-stream", chunked=True), (36, 87, 123), RESPONSES_USAGE,
          "responses"),
    Shape("anthropic", "/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 1024, "messages": MESSAGES},
          Reply([ANTHROPIC_BODY]), (2095, 503, 2598), ANTHROPIC_USAGE, "anthropic.messages"),
    Shape("anthropic-stream", "/v1/messages",
          {"model": "claude-sonnet-4-5", "max_tokens": 1024, "messages": MESSAGES, "stream": True},
          Reply(ANTHROPIC_STREAM, content_type="text/event-stream", chunked=True), (472, 15, 487),
          {"input_tokens": 472, "output_tokens": 15}, "anthropic.messages"),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[shape.name for shape in SHAPES])
def test_api_shape_through_the_unix_socket(upstream: ScriptedUpstream, shape: Shape, tmp_path: Path) -> None:
    upstream.route("POST", shape.path, shape.reply)
    records = tmp_path / "task" / "model-requests.jsonl"
    with ModelRelay(upstream.url, records_path=records) as relay:
        status, body, response = post_json(unix_client(relay), shape.path, shape.request)
        assert status == 200
        assert body == shape.reply.body  # byte-identical, streamed or not
        if shape.reply.chunked:
            assert response.getheader("Transfer-Encoding") == "chunked"
            assert response.getheader("Content-Type") == "text/event-stream"
        [record] = settled(relay, 1)
        stats = relay.stats()
    assert upstream.received[0].body == json.dumps(shape.request).encode()
    assert record.status == 200
    assert record.error is None
    assert record.api == shape.api
    assert record.model == shape.request["model"]
    assert record.stream is shape.request.get("stream")
    assert record.listener == "unix"
    assert record.response_bytes == len(shape.reply.body)
    assert record.first_byte_s is not None
    assert 0 <= record.first_byte_s <= record.total_s
    if shape.usage is None:
        assert record.usage is None
        assert (stats.input_tokens, stats.output_tokens, stats.total_tokens) == (None, None, None)
    else:
        assert record.usage is not None
        assert (record.usage.input_tokens, record.usage.output_tokens, record.usage.total_tokens) == shape.usage
        assert dict(record.usage.raw) == shape.raw
        assert (stats.input_tokens, stats.output_tokens, stats.total_tokens) == shape.usage
    [line] = records.read_text().splitlines()
    written = json.loads(line)
    assert written == json.loads(json.dumps(record.as_dict()))
    assert written["usage"] is None if shape.usage is None else written["usage"]["input_tokens"] == shape.usage[0]
    assert stats.requests == 1
    assert stats.errors == 0


def test_stream_is_passed_on_before_it_ends(upstream: ScriptedUpstream) -> None:
    """The upstream holds back the rest of the stream until the client has seen the first event."""
    gate = threading.Event()
    reply = Reply(CHAT_STREAM, content_type="text/event-stream", chunked=True, gate=gate)
    upstream.route("POST", "/v1/chat/completions", reply)
    with ModelRelay(upstream.url, tcp=True) as relay:
        conn = tcp_client(relay)
        conn.request("POST", "/v1/chat/completions", body=b'{"model": "m", "stream": true}',
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        seen = b""
        while len(seen) < len(CHAT_STREAM[0]):
            seen += response.read1(65536)
        assert seen == CHAT_STREAM[0]
        gate.set()
        rest = response.read()
        assert seen + rest == reply.body
        [record] = settled(relay, 1)
    assert record.usage is not None
    assert record.usage.total_tokens == 15
    assert record.listener == "tcp"
    assert record.first_byte_s is not None
    assert record.first_byte_s < record.total_s


def test_keep_alive_client_and_pooled_upstream(upstream: ScriptedUpstream) -> None:
    upstream.route("POST", "/v1/chat/completions", Reply([CHAT_BODY]))
    upstream.route("POST", "/v1/messages", Reply(ANTHROPIC_STREAM, content_type="text/event-stream", chunked=True))
    with ModelRelay(upstream.url, tcp=True) as relay:
        conn = tcp_client(relay)
        for _ in range(3):
            assert post_json(conn, "/v1/chat/completions", {"model": "a"})[1] == CHAT_BODY
            assert post_json(conn, "/v1/messages", {"model": "b", "stream": True})[1] == b"".join(ANTHROPIC_STREAM)
        stats = settled_stats(relay, 6)
    assert stats.requests == 6
    assert stats.errors == 0
    assert stats.input_tokens == 3 * (19 + 472)
    assert stats.output_tokens == 3 * (10 + 15)
    assert stats.total_tokens == 3 * (29 + 487)
    assert stats.requests_with_usage == 6
    assert upstream.connections == 1  # one upstream connection, reused


def test_aggregate_counts_only_reported_usage(upstream: ScriptedUpstream) -> None:
    upstream.route("POST", "/v1/chat/completions", Reply([NO_USAGE_BODY]))
    upstream.route("POST", "/v1/responses", Reply([RESPONSES_BODY]))
    with ModelRelay(upstream.url, tcp=True) as relay:
        conn = tcp_client(relay)
        post_json(conn, "/v1/chat/completions", {"model": "a"})
        assert settled_stats(relay, 1).input_tokens is None
        post_json(conn, "/v1/responses", {"model": "a"})
        post_json(conn, "/v1/unknown", {"model": "a"})  # no model call: the relay's 403, counted an error
        stats = settled_stats(relay, 3)
    counts = stats.as_dict()
    assert {k: counts[k] for k in ("requests", "errors", "requests_with_usage", "input_tokens", "output_tokens",
                                   "total_tokens", "turns", "tool_calls")} == {
        "requests": 3, "errors": 1, "requests_with_usage": 1, "input_tokens": 36, "output_tokens": 87,
        "total_tokens": 123, "turns": 2, "tool_calls": 0}
    assert stats.latency_s > 0


# -- only the configured upstream -----------------------------------------------------------------------------


def test_key_from_the_host_environment(upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    secret = "sk-host-only-6f1d2a"
    monkeypatch.setenv("PB_TEST_MODEL_KEY", secret)
    upstream.route("POST", "/v1/chat/completions", Reply([CHAT_BODY]))
    upstream.route("POST", "/v1/messages", Reply([ANTHROPIC_BODY]))
    records = tmp_path / "records.jsonl"
    with ModelRelay(upstream.url, api_key_env="PB_TEST_MODEL_KEY", records_path=records, tcp=True) as relay:
        env = relay.agent_env()
        assert secret not in json.dumps(env)
        assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == PLACEHOLDER_KEY
        conn = tcp_client(relay)
        post_json(conn, "/v1/chat/completions", {"model": "a"}, {"Authorization": f"Bearer {PLACEHOLDER_KEY}"})
        post_json(conn, "/v1/messages", {"model": "b"},
                  {"x-api-key": PLACEHOLDER_KEY, "anthropic-version": "2023-06-01"})
        post_json(conn, "/v1/chat/completions", {"model": "a"})  # a client that sends no key at all
    openai, anthropic, keyless = upstream.received
    assert openai.headers["authorization"] == f"Bearer {secret}"
    assert "x-api-key" not in openai.headers
    assert anthropic.headers["x-api-key"] == secret
    assert "authorization" not in anthropic.headers
    assert anthropic.headers["anthropic-version"] == "2023-06-01"
    assert keyless.headers["authorization"] == f"Bearer {secret}"
    for received in upstream.received:
        assert PLACEHOLDER_KEY not in str(received.header_items)
        assert [name for name, _ in received.header_items].count("Host") == 1
    assert secret not in records.read_text()


def test_key_style_forced(upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PB_TEST_MODEL_KEY", "k1")
    upstream.route("POST", "/v1/messages", Reply([ANTHROPIC_BODY]))
    with ModelRelay(upstream.url, api_key_env="PB_TEST_MODEL_KEY", key_style="x-api-key", tcp=True) as relay:
        post_json(tcp_client(relay), "/v1/messages", {"model": "b"}, {"Authorization": "Bearer agent-made-up"})
    [received] = upstream.received
    assert received.headers["x-api-key"] == "k1"
    assert "authorization" not in received.headers


def test_missing_key_variable_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PB_TEST_MODEL_KEY", raising=False)
    relay = ModelRelay("https://api.example.invalid/v1", api_key_env="PB_TEST_MODEL_KEY", tcp=True)
    with pytest.raises(RelayConfigError, match=r"\$PB_TEST_MODEL_KEY"):
        relay.start()
    relay.close()


def test_client_keys_pass_through_without_injection(upstream: ScriptedUpstream) -> None:
    upstream.route("POST", "/v1/chat/completions", Reply([CHAT_BODY]))
    with ModelRelay(upstream.url, tcp=True) as relay:
        assert "OPENAI_API_KEY" not in relay.agent_env()
        post_json(tcp_client(relay), "/v1/chat/completions", {"model": "a"}, {"Authorization": "Bearer mine"})
    assert upstream.received[0].headers["authorization"] == "Bearer mine"


def test_default_headers_and_cookies_as_httpx_client_sent_them(upstream: ScriptedUpstream) -> None:
    """The relay sends through httpx's transport what ``httpx.Client`` used to add: its default headers under the
    agent's own, and the cookies the upstream set (a provider's load balancer) back, unless the agent sends its own."""
    upstream.route("POST", "/v1/chat/completions", [Reply([CHAT_BODY], headers=[("Set-Cookie", "lb=7; Path=/")]),
                                                    Reply([CHAT_BODY]), Reply([CHAT_BODY])])
    with ModelRelay(upstream.url, tcp=True) as relay:
        conn = tcp_client(relay)
        *_, first = post_json(conn, "/v1/chat/completions", {"model": "a"})
        assert first.getheader("Set-Cookie") == "lb=7; Path=/"  # passed on to the agent too
        post_json(conn, "/v1/chat/completions", {"model": "a"}, {"User-Agent": "codex/1", "Accept": "text/plain"})
        post_json(conn, "/v1/chat/completions", {"model": "a"}, {"Cookie": "mine=1"})
        conn.close()
    one, two, three = (received.headers for received in upstream.received)
    assert (one["user-agent"], one["accept"], one["connection"], one["accept-encoding"]) == (
        f"python-httpx/{httpx.__version__}", "*/*", "keep-alive", "identity")
    assert "cookie" not in one
    assert (two["user-agent"], two["accept"], two["cookie"]) == ("codex/1", "text/plain", "lb=7")
    assert three["cookie"] == "mine=1"


REFUSED = [
    ("absolute URI, other host", b"GET http://203.0.113.9/v1/models HTTP/1.1\r\nHost: 203.0.113.9\r\n\r\n", 403,
     "forwards only to"),
    ("absolute URI, upstream host other port", b"GET http://127.0.0.1:1/v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 403,
     "forwards only to"),
    ("absolute https URI", b"POST https://api.openai.com/v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"
     b"Content-Length: 2\r\n\r\n{}", 403, "api.openai.com"),
    ("CONNECT", b"CONNECT 203.0.113.9:443 HTTP/1.1\r\nHost: 203.0.113.9:443\r\n\r\n", 405, "CONNECT"),
    ("outside the prefix", b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n", 404, "outside the model endpoint"),
    ("dot segments", b"GET /api/v1/../../admin HTTP/1.1\r\nHost: x\r\n\r\n", 400, "dot segments"),
    ("encoded dot segments", b"GET /api/v1/%2e%2E/admin HTTP/1.1\r\nHost: x\r\n\r\n", 400, "dot segments"),
    ("encoded slash", b"GET /api/v1/..%2fadmin HTTP/1.1\r\nHost: x\r\n\r\n", 400, "dot segments"),
    ("asterisk", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed"),
    ("request body too large", b"POST /api/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n"
     b"\r\n", 413, "limit"),
]


@pytest.mark.parametrize(("request_bytes", "status", "message"), [case[1:] for case in REFUSED],
                         ids=[case[0] for case in REFUSED])
def test_refused_without_connecting_anywhere(upstream: ScriptedUpstream, connects: list[Any], request_bytes: bytes,
                                             status: int, message: str) -> None:
    with ModelRelay(f"{upstream.url}/api/v1", tcp=True) as relay:
        assert relay.tcp_address is not None
        raw = raw_request(relay.tcp_address, request_bytes)
        [record] = settled(relay, 1)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw
    error = json.loads(body)["error"]
    assert message in error["message"]
    assert error["type"] == "pb_relay_error"
    assert record.status == status
    assert record.error is not None
    assert message in record.error
    assert upstream.received == []
    assert upstream.connections == 0
    assert connects == [relay.tcp_address]  # the client's own connection, and nothing else


def test_host_header_and_absolute_uri_to_the_upstream(upstream: ScriptedUpstream) -> None:
    upstream.route("GET", "/api/v1/models", Reply([b'{"data": []}']))
    with ModelRelay(f"{upstream.url}/api/v1", tcp=True) as relay:
        assert relay.tcp_address is not None
        spoofed = raw_request(relay.tcp_address, b"GET /api/v1/models HTTP/1.1\r\nHost: evil.example\r\n"
                                                 b"Connection: close\r\n\r\n")
        absolute = raw_request(relay.tcp_address, f"GET {upstream.url}/api/v1/models?x=1 HTTP/1.1\r\n"
                                                  f"Host: whatever\r\nConnection: close\r\n\r\n".encode())
    assert spoofed.startswith(b"HTTP/1.1 200 ")
    assert absolute.startswith(b"HTTP/1.1 200 ")
    assert [r.headers["host"] for r in upstream.received] == [f"127.0.0.1:{upstream.port}"] * 2
    assert [r.path for r in upstream.received] == ["/api/v1/models", "/api/v1/models?x=1"]


def test_upstream_down_is_a_recorded_502(tmp_path: Path) -> None:
    """Refused connections are tried again within the retry budget; once it is spent, the agent gets a 502 and the
    relay says the model API was unavailable."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    records = tmp_path / "r.jsonl"
    with ModelRelay(f"http://127.0.0.1:{port}/v1", records_path=records, tcp=True,
                    retry=RetryPolicy(budget_s=1.5, base_s=0.05, max_backoff_s=0.2)) as relay:
        status, body, _ = post_json(tcp_client(relay), "/v1/chat/completions", {"model": "gpt", "stream": True})
        [record] = settled(relay, 1)
        stats = relay.stats()
        unavailable = relay.unavailable()
    assert status == 502
    assert "unreachable" in json.loads(body)["error"]["message"]
    assert record.gave_up
    assert len(record.retried) >= 2
    assert all(t["status"] is None and "unreachable" in t["error"] for t in record.retried)
    assert stats.retries == len(record.retried)
    assert stats.gave_up == 1
    assert unavailable is not None
    assert "1 request(s) given up" in unavailable
    assert "unreachable" in unavailable
    assert record.status == 502
    assert record.error is not None
    assert "unreachable" in record.error
    assert record.model == "gpt"
    assert record.usage is None
    assert stats.errors == 1
    assert stats.input_tokens is None
    assert json.loads(records.read_text())["status"] == 502


def test_upstream_breaking_off_a_stream(upstream: ScriptedUpstream) -> None:
    reply = Reply(ANTHROPIC_STREAM, content_type="text/event-stream", chunked=True, break_after=3)
    upstream.route("POST", "/v1/messages", reply)
    with ModelRelay(upstream.url, tcp=True) as relay:
        conn = tcp_client(relay)
        conn.request("POST", "/v1/messages", body=b"{}")
        response = conn.getresponse()
        with pytest.raises(http.client.IncompleteRead) as caught:
            response.read()
        assert caught.value.partial == b"".join(ANTHROPIC_STREAM[:3])
        [record] = settled(relay, 1)
    assert record.status == 200
    assert record.error is not None
    assert "broke off" in record.error
    assert record.failed
    assert record.usage is not None  # what was seen before the break: message_start's counts
    assert record.usage.input_tokens == 472


def test_chunked_request_body_and_gzip_response(upstream: ScriptedUpstream) -> None:
    compressed = gzip.compress(CHAT_BODY)
    upstream.route("POST", "/v1/chat/completions",
                   Reply([compressed[:10], compressed[10:]], chunked=True, headers=[("Content-Encoding", "gzip")]))
    payload = json.dumps({"model": "gpt-4.1", "messages": MESSAGES}).encode()
    with ModelRelay(upstream.url, tcp=True) as relay:
        conn = tcp_client(relay)
        conn.request("POST", "/v1/chat/completions", body=iter([payload[:7], payload[7:]]),
                     headers={"Content-Type": "application/json", "Accept-Encoding": "gzip, br"},
                     encode_chunked=True)
        response = conn.getresponse()
        assert response.read() == compressed
        assert response.getheader("Content-Encoding") == "gzip"
        [record] = settled(relay, 1)
    [received] = upstream.received
    assert received.body == payload
    assert received.headers["content-length"] == str(len(payload))
    assert received.headers["accept-encoding"] == "identity"
    assert record.model == "gpt-4.1"
    assert record.usage is not None
    assert record.usage.total_tokens == 29


def test_head_and_no_content(upstream: ScriptedUpstream) -> None:
    upstream.route("HEAD", "/v1/models", Reply([b"0123456789"]))
    upstream.route("DELETE", "/v1/files/1", Reply([b""], status=204))
    # A DELETE of a file is no model call: only forwarded when server tools are allowed (the cleanroom refuses it).
    with ModelRelay(upstream.url, tcp=True, allow_server_tools=True) as relay:
        conn = tcp_client(relay)
        conn.request("HEAD", "/v1/models")
        head = conn.getresponse()
        assert head.status == 200
        assert head.getheader("Content-Length") == "10"
        assert head.read() == b""
        conn.request("DELETE", "/v1/files/1")
        deleted = conn.getresponse()
        assert (deleted.status, deleted.read()) == (204, b"")
        conn.request("HEAD", "/v1/models")
        assert conn.getresponse().status == 200
        assert settled_stats(relay, 3).errors == 0


def test_client_going_away_mid_stream(upstream: ScriptedUpstream) -> None:
    gate = threading.Event()
    upstream.route("POST", "/v1/messages",
                   Reply(ANTHROPIC_STREAM * 200, content_type="text/event-stream", chunked=True, gate=gate))
    with ModelRelay(upstream.url, tcp=True) as relay:
        conn = tcp_client(relay)
        conn.request("POST", "/v1/messages", body=b"{}")
        response = conn.getresponse()
        assert response.read1(16)
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()
        gate.set()
        deadline = time.monotonic() + 10
        while not relay.records() and time.monotonic() < deadline:
            time.sleep(0.05)
        [record] = relay.records()
    assert record.error is not None
    assert "client" in record.error


def test_close_cuts_in_flight_streams(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    gate = threading.Event()
    upstream.route("POST", "/v1/messages", Reply(ANTHROPIC_STREAM, content_type="text/event-stream", chunked=True,
                                                 gate=gate))
    relay = ModelRelay(upstream.url, tcp=True, records_path=tmp_path / "r.jsonl").start()
    socket_path = relay.socket_path
    assert socket_path is not None
    assert socket_path.is_socket()
    conn = tcp_client(relay)
    conn.request("POST", "/v1/messages", body=b"{}")
    assert conn.getresponse().read1(16)
    started = time.monotonic()
    relay.close()
    gate.set()
    assert time.monotonic() - started < 8
    assert not socket_path.exists()
    assert not socket_path.parent.exists()  # the private temporary directory is gone too
    relay.close()  # idempotent


def test_socket_path_and_mode(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    path = tmp_path / "s" / "relay.sock"
    path.parent.mkdir()
    path.write_text("not a socket")
    with pytest.raises(RelayConfigError, match="not a socket"):
        ModelRelay(upstream.url, socket_path=path).start()
    path.unlink()
    with ModelRelay(upstream.url, socket_path=path, socket_mode=0o660) as relay:
        assert relay.socket_path == path
        assert path.stat().st_mode & 0o777 == 0o660
    assert not path.exists()
    assert path.parent.exists()  # the caller's directory stays
    with pytest.raises(RelayConfigError, match="longer"):
        ModelRelay(upstream.url, socket_path=tmp_path / ("x" * 120)).start()


def test_https_upstream(tmp_path: Path) -> None:
    """TLS to the upstream, certificate verified: against a CA it trusts, and refused against one it does not."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=120)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    upstream = ScriptedUpstream(tls=server_context)
    upstream.route("POST", "/v1/messages", Reply(ANTHROPIC_STREAM, content_type="text/event-stream", chunked=True))
    try:
        trusting = ssl.create_default_context(cafile=str(cert))
        with ModelRelay(f"{upstream.url}/v1", tcp=True, ssl_context=trusting) as relay:
            status, body, _ = post_json(tcp_client(relay), "/v1/messages", {"model": "c", "stream": True})
            assert (status, body) == (200, b"".join(ANTHROPIC_STREAM))
            [record] = settled(relay, 1)
            assert record.usage is not None
            assert record.usage.total_tokens == 487
        with ModelRelay(f"{upstream.url}/v1", tcp=True) as relay:  # the system's CAs: verification fails
            status, body, _ = post_json(tcp_client(relay), "/v1/messages", {"model": "c"})
            assert status == 502
            assert "CERTIFICATE_VERIFY_FAILED" in json.loads(body)["error"]["message"]
    finally:
        upstream.close()
    assert len(upstream.received) == 1


# -- configuration and env ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "expected"), [
    ("https://api.openai.com/v1", Upstream("https", "api.openai.com", 443, "/v1")),
    ("https://api.anthropic.com", Upstream("https", "api.anthropic.com", 443, "")),
    ("http://127.0.0.1:4000/", Upstream("http", "127.0.0.1", 4000, "")),
    ("HTTPS://OpenRouter.ai/api/v1/", Upstream("https", "openrouter.ai", 443, "/api/v1")),
    ("http://[::1]:8080/v1", Upstream("http", "::1", 8080, "/v1")),
])
def test_upstream_parsing(url: str, expected: Upstream) -> None:
    assert Upstream.parse(url) == expected


def test_upstream_host_header() -> None:
    assert Upstream.parse("http://[::1]:8080/v1").host_header == "[::1]:8080"
    assert Upstream.parse("https://api.openai.com:443/v1").host_header == "api.openai.com"
    assert Upstream.parse("https://api.openai.com/v1").url == "https://api.openai.com/v1"


@pytest.mark.parametrize("url", ["ftp://x/v1", "https://user:pw@api.openai.com/v1", "https://x/v1?key=1",
                                 "https:///v1", "http://x:99999/", "https://x/v1/../admin", "api.openai.com/v1"])
def test_bad_endpoints(url: str) -> None:
    with pytest.raises(RelayConfigError):
        ModelRelay(url)


def test_needs_a_listener() -> None:
    with pytest.raises(RelayConfigError):
        ModelRelay("http://127.0.0.1:1", unix=False, tcp=False)


@pytest.mark.parametrize(("prefix", "openai", "anthropic"), [
    ("", "http://127.0.0.1:9/v1", "http://127.0.0.1:9"),
    ("/v1", "http://127.0.0.1:9/v1", "http://127.0.0.1:9"),
    ("/api/v1", "http://127.0.0.1:9/api/v1", "http://127.0.0.1:9/api"),
    ("/openai", "http://127.0.0.1:9/openai", "http://127.0.0.1:9/openai"),
])
def test_relay_env(prefix: str, openai: str, anthropic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_PROXY", "corp.example")
    monkeypatch.delenv("no_proxy", raising=False)
    env = relay_env("http://127.0.0.1:9/", prefix)
    assert env["OPENAI_BASE_URL"] == env["OPENAI_API_BASE"] == openai
    assert env["ANTHROPIC_BASE_URL"] == anthropic
    assert env["PB_MODEL_RELAY_URL"] == "http://127.0.0.1:9" + prefix
    assert env["NO_PROXY"] == "corp.example,127.0.0.1,localhost,::1"
    assert env["no_proxy"] == "127.0.0.1,localhost,::1"
    assert "OPENAI_API_KEY" not in env


def test_sandbox_env(upstream: ScriptedUpstream) -> None:
    relay = ModelRelay(f"{upstream.url}/v1")
    assert relay.sandbox_env()["OPENAI_BASE_URL"] == "http://127.0.0.1:47801/v1"
    with pytest.raises(RelayConfigError):
        relay.agent_env()  # no TCP listener: the caller must say where the agent reaches the relay


def test_openai_sdk_paths_meet_the_prefix(upstream: ScriptedUpstream) -> None:
    """What an SDK builds from the env (base + its own suffix) is exactly what the upstream gets."""
    upstream.route("POST", "/api/v1/chat/completions", Reply([CHAT_BODY]))
    upstream.route("POST", "/api/v1/messages", Reply([ANTHROPIC_BODY]))
    with ModelRelay(f"{upstream.url}/api/v1", tcp=True) as relay:
        env = relay.agent_env()
        for url, payload in ((env["OPENAI_BASE_URL"] + "/chat/completions", {"model": "a"}),
                             (env["ANTHROPIC_BASE_URL"] + "/v1/messages", {"model": "b"})):
            path = "/" + url.split("/", 3)[3]
            assert post_json(tcp_client(relay), path, payload)[0] == 200
    assert [r.path for r in upstream.received] == ["/api/v1/chat/completions", "/api/v1/messages"]


# -- usage parsing, unit level --------------------------------------------------------------------------------


def test_usage_normalisation() -> None:
    anthropic = usage_from_mapping({"input_tokens": 10, "cache_creation_input_tokens": 5,
                                    "cache_read_input_tokens": 100, "output_tokens": 7})
    assert anthropic is not None
    assert (anthropic.input_tokens, anthropic.output_tokens, anthropic.total_tokens) == (115, 7, 122)
    assert anthropic.cached_input_tokens == 100
    chat = usage_from_mapping(CHAT_USAGE)
    assert chat is not None
    assert (chat.cached_input_tokens, chat.reasoning_tokens) == (0, 0)
    responses = usage_from_mapping(RESPONSES_USAGE)
    assert responses is not None
    assert (responses.cached_input_tokens, responses.reasoning_tokens) == (4, 20)
    partial = usage_from_mapping({"output_tokens": 3})
    assert partial is not None
    assert (partial.input_tokens, partial.output_tokens, partial.total_tokens) == (None, 3, None)
    assert usage_from_mapping({}) is None
    assert usage_from_mapping({"prompt_tokens": None, "completion_tokens": "x"}) is None


def test_sse_decoder_any_split_and_line_ending() -> None:
    stream = b"".join(ANTHROPIC_STREAM)
    for ending in (b"\n", b"\r\n", b"\r"):
        data = stream.replace(b"\n", ending)
        for size in (1, 2, 3, 7, 64, len(data)):
            decoder = SSEDecoder()
            events = [event for start in range(0, len(data), size) for event in decoder.feed(data[start:start + size])]
            events += list(decoder.close())
            assert [json.loads(event)["type"] for event in events] == [
                "message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
                "content_block_stop", "message_delta", "message_stop"], (ending, size)


def test_sse_decoder_multiline_data_and_oversized_events() -> None:
    decoder = SSEDecoder(max_event_bytes=10)
    events = list(decoder.feed(b"data: a\ndata: b\n: comment\nid: 1\n\ndata: " + b"x" * 50 + b"\n\ndata: ok\n\n"))
    assert events == ["a\nb", "ok"]
