"""The model relay: the agent's only way out of its sandbox, and the meter of what it spent.

The sandbox has no network. A tiny bridge (``relay_bridge.py``, run as root inside the container) listens on the
container's loopback and carries every connection over one ``docker exec`` stream to the host (``relay_tunnel.py``),
which connects it to the Unix socket where a :class:`ModelRelay` accepts it. The relay speaks HTTP/1.1 and forwards
requests to exactly one place, the configured ``--pb-model-endpoint`` URL (its path prefix included), optionally
adding the API key from the host's environment so the key never enters the sandbox. Anything else (``CONNECT``,
absolute URIs naming another host, paths outside the endpoint's prefix, dot segments) is refused with a 4xx before
any connection is made. Host-loop agents get the same relay on ``127.0.0.1:<ephemeral port>``. The agent-facing
side is a small HTTP/1.1 server of our own (it must decide, byte by byte, what it accepts); the upstream side is
httpx (keep-alive pool, TLS, streaming, timeouts), with no proxy taken from the environment and no redirects
followed.

Responses are streamed through as they arrive (server-sent events included); a tap parses them on the fly for token
usage in every API shape the agents use:

* OpenAI chat completions: the body's ``usage``; streamed, the ``usage`` of the final chunk
  (``stream_options.include_usage``);
* OpenAI responses: the body's ``usage``; streamed, ``response.usage`` of ``response.completed`` (or
  ``response.incomplete`` / ``response.failed``);
* Anthropic messages: the body's ``usage``; streamed, ``message_start``'s ``message.usage`` updated by every
  ``message_delta``'s cumulative ``usage``.

Usage is ``None`` when the upstream gave none, never 0. Every request becomes one :class:`RelayRecord`: a line of the
caller's JSON-lines file, and part of the in-memory :class:`RelayStats`. Neither ever contains a header value, so
no key reaches the records.

What the agent sends is bounded on the way (``records.py``, ``budget.py``): each record's line (4 KiB) and the
records file (``PB_MODEL_REQUESTS_MAX``, head and tail kept), the records kept in memory (by count), a request's
headers (64 KiB), its body (``PB_RELAY_REQUEST_MAX``), the bodies held at once (``PB_RELAY_INFLIGHT_MAX``: beyond it a
request waits, then gets a 503) and the connections served at once (``MAX_CONNECTIONS``: beyond, a 503).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import socket
import socketserver
import ssl
import stat
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, cast
from urllib.parse import unquote, urlsplit

import httpx

from pytest_programbench.relay.budget import ByteBudget, budget_wait, inflight_limit, request_limit
from pytest_programbench.relay.records import BoundedJsonl, HeadTail, clip_text, request_fields
from pytest_programbench.sandbox.layout import RELAY_PORT

log = logging.getLogger(__name__)

KeyStyle = Literal["auto", "bearer", "x-api-key"]

#: The bridge script, to be copied into the sandbox (stdlib only, Python 3.7+).
BRIDGE_SCRIPT = Path(__file__).with_name("relay_bridge.py")
#: The name of the relay's socket inside its directory.
SOCKET_NAME = "relay.sock"
#: The container-loopback port the bridge listens on (the sandbox layout's).
SANDBOX_BRIDGE_PORT = RELAY_PORT
#: What SDKs get as their API key when the relay adds the real one (they refuse to start without one).
PLACEHOLDER_KEY = "pb-relay-adds-the-key"

_MiB = 1 << 20
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the relay itself decides.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade"}
)
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "expect", "accept-encoding"}
_KEY_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length"}
_MAX_POOLED = 8
_POOL_IDLE_S = 60.0
#: Connections one relay serves at once; more get a 503. (The bridge in a sandbox opens at most half as many
#: channels, relay_bridge.MAX_CONNECTIONS: this bound is for host-loop agents, and slack for closes under way.)
MAX_CONNECTIONS = 256
#: Bytes of a request's header fields (the request line has its own 64 KiB); more get a 431.
HEADER_MAX = 64 << 10
#: Seconds of silence after which a refused client's remaining input is no longer read (see ``_linger``).
LINGER_S = 1.0
#: Records kept in memory (:meth:`ModelRelay.records`): the first and the last half of this many.
RECORDS_IN_MEMORY = 2000


class RelayConfigError(ValueError):
    """The relay cannot be set up as asked (bad endpoint URL, missing key variable): a usage error."""


# -- the upstream ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Upstream:
    """The one place the relay forwards to: scheme, host, port and path prefix (no trailing slash)."""

    scheme: Literal["http", "https"]
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise RelayConfigError(f"model endpoint {url!r}: the scheme must be http or https")
        if parts.username is not None or parts.password is not None:
            raise RelayConfigError(f"model endpoint {url!r}: credentials in the URL are not supported; "
                                   "name an environment variable holding the key instead")
        if parts.query or parts.fragment:
            raise RelayConfigError(f"model endpoint {url!r}: a query or fragment is not supported")
        if not parts.hostname:
            raise RelayConfigError(f"model endpoint {url!r}: no host")
        try:
            port = parts.port
        except ValueError as exc:
            raise RelayConfigError(f"model endpoint {url!r}: {exc}") from exc
        prefix = parts.path.rstrip("/")
        if _bad_path(prefix or "/"):
            raise RelayConfigError(f"model endpoint {url!r}: the path must not contain dot segments")
        return cls(cast(Literal["http", "https"], scheme), parts.hostname.lower(),
                   port or (443 if scheme == "https" else 80), prefix)

    @property
    def default_port(self) -> bool:
        return self.port == (443 if self.scheme == "https" else 80)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.default_port else f"{host}:{self.port}"

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host_header}"

    @property
    def url(self) -> str:
        return self.origin + self.prefix

    def contains(self, path: str) -> bool:
        """Whether an origin-form path (no query) lies under the endpoint's prefix."""
        return not self.prefix or path == self.prefix or path.startswith(self.prefix + "/")


def _content_length(headers: httpx.Headers) -> int | None:
    """The upstream body's declared length; ``None`` when chunked or until the connection closes."""
    if "transfer-encoding" in headers:
        return None
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


def _socket_of(response: httpx.Response) -> socket.socket | None:
    """The upstream socket under a streaming response (to cut it from another thread at close)."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    return sock if isinstance(sock, socket.socket) else None


def _bad_path(path: str) -> bool:
    """Dot segments, encoded slashes or backslashes: anything an upstream might normalise out of the prefix."""
    if not path.startswith("/") or "\\" in path:
        return True
    for segment in path.split("/"):
        decoded = unquote(segment)
        if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
            return True
    return False


# -- usage ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Token usage of one response, normalised across API shapes; each field ``None`` when not reported.

    ``input_tokens`` counts every prompt token: for Anthropic it adds ``cache_creation_input_tokens`` and
    ``cache_read_input_tokens`` to ``input_tokens`` (which excludes them), so it means the same as OpenAI's
    ``prompt_tokens``. ``raw`` is the usage object exactly as the upstream sent it (merged, for Anthropic streams).
    """

    input_tokens: int | None
    output_tokens: int | None
    total_tokens: int | None
    cached_input_tokens: int | None = None
    reasoning_tokens: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.total_tokens, "cached_input_tokens": self.cached_input_tokens,
                "reasoning_tokens": self.reasoning_tokens, "raw": dict(self.raw)}


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _dig(mapping: Mapping[str, Any], *keys: str) -> Any:
    value: Any = mapping
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _sum(*values: int | None) -> int | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


def usage_from_mapping(usage: Mapping[str, Any]) -> Usage | None:
    """Normalise a ``usage`` object of any supported API shape; ``None`` when it holds no token counts."""
    if "prompt_tokens" in usage or "completion_tokens" in usage:  # chat completions, legacy completions
        inp, out = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
        total = _count(usage.get("total_tokens"))
        cached = _count(_dig(usage, "prompt_tokens_details", "cached_tokens"))
        reasoning = _count(_dig(usage, "completion_tokens_details", "reasoning_tokens"))
    elif "input_tokens" in usage or "output_tokens" in usage:  # responses API, Anthropic messages
        out = _count(usage.get("output_tokens"))
        total = _count(usage.get("total_tokens"))
        reasoning = _count(_dig(usage, "output_tokens_details", "reasoning_tokens"))
        cache_read = _count(usage.get("cache_read_input_tokens"))
        cache_write = _count(usage.get("cache_creation_input_tokens"))
        if cache_read is not None or cache_write is not None:  # Anthropic: input_tokens excludes the cache
            inp = _count(usage.get("input_tokens"))
            inp = None if inp is None else inp + (cache_read or 0) + (cache_write or 0)
            cached = cache_read
        else:
            inp = _count(usage.get("input_tokens"))
            cached = _count(_dig(usage, "input_tokens_details", "cached_tokens"))
    else:
        return None
    if inp is None and out is None and total is None:
        return None
    if total is None and inp is not None and out is not None:
        total = inp + out
    return Usage(inp, out, total, cached, reasoning, dict(usage))


_TOOL_ITEM_TYPES = ("function_call", "local_shell_call", "custom_tool_call", "shell_call", "apply_patch_call")


def tool_calls_in_body(body: Any) -> int:
    """Tool calls in a complete (non-streamed) response of any supported API shape."""
    if not isinstance(body, Mapping):
        return 0
    count = 0
    for choice in body.get("choices") or []:  # chat completions
        calls = _dig(choice, "message", "tool_calls") if isinstance(choice, Mapping) else None
        count += len(calls) if isinstance(calls, list) else 0
    content = body.get("content")  # Anthropic messages
    if isinstance(content, list):
        count += sum(1 for block in content if isinstance(block, Mapping) and block.get("type") == "tool_use")
    output = body.get("output")  # responses
    if isinstance(output, list):
        count += sum(1 for item in output if isinstance(item, Mapping) and item.get("type") in _TOOL_ITEM_TYPES)
    return count


def usage_from_body(body: Any) -> Usage | None:
    """Usage of a complete (non-streamed) JSON response body."""
    if not isinstance(body, Mapping):
        return None
    usage = body.get("usage")
    if isinstance(usage, Mapping):
        return usage_from_mapping(usage)
    response = body.get("response")  # an event or wrapper carrying a responses-API object
    if isinstance(response, Mapping) and isinstance(response.get("usage"), Mapping):
        return usage_from_mapping(response["usage"])
    return None


class StreamUsage:
    """Usage of a streamed response, fed one decoded server-sent event payload at a time."""

    def __init__(self) -> None:
        self._raw: dict[str, Any] | None = None
        self.tool_calls = 0
        self._chat_calls: set[tuple[Any, Any]] = set()

    def feed(self, event: Any) -> None:
        if not isinstance(event, Mapping):
            return
        kind = event.get("type")
        self._count_tool_calls(kind, event)
        if kind == "message_start":  # Anthropic: the prompt's usage, output so far
            usage = _dig(event, "message", "usage")
            if isinstance(usage, Mapping):
                self._merge(usage, replace=True)
        elif kind == "message_delta":  # Anthropic: cumulative counts
            usage = event.get("usage")
            if isinstance(usage, Mapping):
                self._merge(usage, replace=False)
        elif isinstance(kind, str) and kind.startswith("response."):  # responses API
            usage = _dig(event, "response", "usage")
            if isinstance(usage, Mapping):
                self._merge(usage, replace=True)
        elif isinstance(event.get("usage"), Mapping):  # chat completions chunk with include_usage
            self._merge(event["usage"], replace=True)

    def _count_tool_calls(self, kind: Any, event: Mapping[str, Any]) -> None:
        """Tool calls the model made: one per Responses output item, Anthropic tool_use block or chat call index."""
        if kind == "response.output_item.done":
            self.tool_calls += _dig(event, "item", "type") in _TOOL_ITEM_TYPES
        elif kind == "content_block_start":
            self.tool_calls += _dig(event, "content_block", "type") in ("tool_use", "server_tool_use")
        elif kind is None and isinstance(event.get("choices"), list):
            for choice in event["choices"]:
                calls = _dig(choice, "delta", "tool_calls") if isinstance(choice, Mapping) else None
                for call in calls if isinstance(calls, list) else []:
                    if isinstance(call, Mapping):
                        self._chat_calls.add((choice.get("index"), call.get("index", call.get("id"))))
            self.tool_calls = len(self._chat_calls)

    def _merge(self, usage: Mapping[str, Any], *, replace: bool) -> None:
        if replace or self._raw is None:
            self._raw = {}
        self._raw.update({key: value for key, value in usage.items() if value is not None})

    @property
    def usage(self) -> Usage | None:
        return None if self._raw is None else usage_from_mapping(self._raw)


class SSEDecoder:
    """Incremental ``text/event-stream`` decoder: bytes in, each event's ``data`` out (bounded memory)."""

    def __init__(self, max_event_bytes: int = 16 * _MiB) -> None:
        self._pending = b""
        self._data: list[bytes] = []
        self._size = 0
        self._max = max_event_bytes
        self._overflow = False

    def feed(self, chunk: bytes) -> Iterator[str]:
        buffer = self._pending + chunk
        lines = buffer.splitlines(keepends=True)
        self._pending = b""
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            self._pending = lines.pop()
        elif lines and lines[-1].endswith(b"\r"):
            # "\r" may be the first half of "\r\n": keep it until the next byte tells.
            self._pending = lines.pop()
        if len(self._pending) > self._max:
            self._pending, self._overflow = b"", True
        for raw in lines:
            yield from self._line(raw.rstrip(b"\r\n"))

    def close(self) -> Iterator[str]:
        pending, self._pending = self._pending, b""
        if pending:
            yield from self._line(pending.rstrip(b"\r\n"))
        yield from self._line(b"")

    def _line(self, line: bytes) -> Iterator[str]:
        if not line:
            if self._data and not self._overflow:
                yield b"\n".join(self._data).decode("utf-8", "replace")
            self._data, self._size, self._overflow = [], 0, False
            return
        name, _, value = line.partition(b":")
        if name != b"data":
            return
        value = value.removeprefix(b" ")
        self._size += len(value)
        if self._size > self._max:
            self._data, self._overflow = [], True
        elif not self._overflow:
            self._data.append(value)


class UsageTap:
    """Watches a response body go by and extracts usage, streamed or not, without holding a stream."""

    def __init__(self, content_type: str, content_encoding: str, max_json_bytes: int = 32 * _MiB) -> None:
        self.streamed = "text/event-stream" in content_type.lower()
        encoding = content_encoding.strip().lower()
        self._inflate: Any = None
        self._unreadable = False
        if encoding in ("gzip", "x-gzip", "deflate"):
            self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, auto-detected
        elif encoding not in ("", "identity"):
            self._unreadable = True
        self._sse = SSEDecoder()
        self._stream = StreamUsage()
        self._body = io.BytesIO()
        self._max_json = max_json_bytes
        self.tool_calls: int | None = None  # after finish(): how many tool calls the response made

    def feed(self, chunk: bytes) -> None:
        if self._unreadable:
            return
        if self._inflate is not None:
            try:
                chunk = self._inflate.decompress(chunk)
            except zlib.error:
                self._unreadable = True
                return
        if self.streamed:
            for data in self._sse.feed(chunk):
                self._event(data)
        elif self._body.tell() + len(chunk) <= self._max_json:
            self._body.write(chunk)
        else:
            self._unreadable = True

    def _event(self, data: str) -> None:
        if data.strip() == "[DONE]":
            return
        with contextlib.suppress(ValueError):
            self._stream.feed(json.loads(data))

    def finish(self) -> Usage | None:
        if self._unreadable:
            return None
        if self.streamed:
            for data in self._sse.close():
                self._event(data)
            self.tool_calls = self._stream.tool_calls
            return self._stream.usage
        try:
            body = json.loads(self._body.getvalue())
        except ValueError:
            return None
        self.tool_calls = tool_calls_in_body(body)
        return usage_from_body(body)


def api_of(path: str) -> str | None:
    """The API shape a request path names."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, api in (("/chat/completions", "chat.completions"), ("/responses", "responses"),
                        ("/messages", "anthropic.messages"), ("/completions", "completions"),
                        ("/embeddings", "embeddings")):
        if path.endswith(suffix):
            return api
    return None


# -- records --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RelayRecord:
    """One request through the relay. ``status`` is what the client got (the relay's own 4xx/5xx included);
    latencies run from the moment the request was read in full; ``first_byte_s`` is the first response body byte
    (the headers when there is no body); ``error`` says why the exchange went wrong, ``None`` when it did not."""

    started_at: str
    listener: str
    method: str
    path: str
    status: int
    model: str | None
    stream: bool | None
    api: str | None
    first_byte_s: float | None
    total_s: float
    request_bytes: int
    response_bytes: int
    usage: Usage | None
    error: str | None
    tool_calls: int | None = None  # in the response, when it was a readable model API response

    @property
    def failed(self) -> bool:
        return self.error is not None or self.status >= 400

    def as_dict(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "listener": self.listener, "method": self.method, "path": self.path,
                "status": self.status, "model": self.model, "stream": self.stream, "api": self.api,
                "first_byte_s": self.first_byte_s, "total_s": self.total_s, "request_bytes": self.request_bytes,
                "response_bytes": self.response_bytes, "usage": None if self.usage is None else self.usage.as_dict(),
                "error": self.error, "tool_calls": self.tool_calls}


_MODEL_APIS = frozenset({"chat.completions", "responses", "anthropic.messages", "completions"})


@dataclass
class RelayStats:
    """The aggregate of a relay's records. Token sums are ``None`` when no request reported them."""

    requests: int = 0
    errors: int = 0
    requests_with_usage: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    latency_s: float = 0.0
    turns: int = 0  # answered model API requests (chat, responses, messages, completions)
    tool_calls: int = 0  # tool calls in the model's responses
    cached_input_tokens: int | None = None
    model_latency_s: float = 0.0  # time in answered model API requests, first byte to last

    def add(self, record: RelayRecord) -> None:
        self.requests += 1
        self.errors += record.failed
        self.latency_s += record.total_s
        if record.api in _MODEL_APIS and not record.failed:
            self.turns += 1
            self.model_latency_s += record.total_s
            self.tool_calls += record.tool_calls or 0
        if record.usage is not None:
            self.requests_with_usage += 1
            self.input_tokens = _sum(self.input_tokens, record.usage.input_tokens)
            self.output_tokens = _sum(self.output_tokens, record.usage.output_tokens)
            self.total_tokens = _sum(self.total_tokens, record.usage.total_tokens)
            self.cached_input_tokens = _sum(self.cached_input_tokens, record.usage.cached_input_tokens)

    def as_dict(self) -> dict[str, int | float | None]:
        """Plain builtins only: safe for ``user_properties`` across xdist and for pb-meta.json."""
        return {"requests": self.requests, "errors": self.errors, "requests_with_usage": self.requests_with_usage,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.total_tokens, "latency_s": round(self.latency_s, 6), "turns": self.turns,
                "tool_calls": self.tool_calls, "cached_input_tokens": self.cached_input_tokens,
                "model_latency_s": round(self.model_latency_s, 6)}


# -- env for agents -------------------------------------------------------------------------------------------


def relay_env(base_url: str, prefix: str = "", *, injects_key: bool = False) -> dict[str, str]:
    """Env vars that point OpenAI- and Anthropic-style SDKs at a relay reachable at ``base_url``.

    The relay mirrors the upstream's paths, so the SDK base URLs carry the endpoint's prefix: OpenAI SDKs append
    ``/chat/completions`` to a base that ends in the version (``/v1`` when the endpoint has no prefix), Anthropic
    SDKs append ``/v1/messages`` to a base without it.
    """
    base = base_url.rstrip("/")
    openai = base + (prefix or "/v1")
    anthropic = base + prefix.removesuffix("/v1")
    env = {"OPENAI_BASE_URL": openai, "OPENAI_API_BASE": openai, "ANTHROPIC_BASE_URL": anthropic,
           "PB_MODEL_RELAY_URL": base + prefix}
    if injects_key:
        env |= {"OPENAI_API_KEY": PLACEHOLDER_KEY, "ANTHROPIC_API_KEY": PLACEHOLDER_KEY}
    loopback = "127.0.0.1,localhost,::1"
    for name in ("NO_PROXY", "no_proxy"):
        current = os.environ.get(name, "")
        env[name] = f"{current},{loopback}" if current else loopback
    return env


# -- the relay ------------------------------------------------------------------------------------------------


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Exchange:
    """Book-keeping of one request on its way through."""

    def __init__(self, listener: str, method: str, target: str) -> None:
        self.t0 = time.monotonic()
        self.started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        self.listener = listener
        self.method = method
        self.path = target if target.startswith("/") else target[:200]
        self.status = 0
        self.model: str | None = None
        self.stream: bool | None = None
        self.first_byte_s: float | None = None
        self.request_bytes = 0
        self.response_bytes = 0
        self.usage: Usage | None = None
        self.error: str | None = None
        self.tool_calls: int | None = None
        self.held = 0  # bytes of the relay's budget this request holds (its body), given back when it ends

    def mark_first_byte(self) -> None:
        if self.first_byte_s is None:
            self.first_byte_s = round(time.monotonic() - self.t0, 6)

    def record(self) -> RelayRecord:
        # The agent chose the path, the method and the model: clipped, so that no record is larger than a few KiB.
        return RelayRecord(self.started_at, self.listener, clip_text(self.method, 64), clip_text(self.path),
                           self.status, None if self.model is None else clip_text(self.model, 256), self.stream,
                           api_of(self.path), self.first_byte_s, round(time.monotonic() - self.t0, 6),
                           self.request_bytes, self.response_bytes, self.usage,
                           None if self.error is None else clip_text(self.error), self.tool_calls)


class _HeaderLimit:
    """The handler's input while header fields are read: at most ``left`` bytes, then end of input."""

    def __init__(self, rfile: io.BufferedIOBase, left: int) -> None:
        self._rfile = rfile
        self.left = left
        self.exceeded = False

    def readline(self, size: int = -1) -> bytes:
        if self.left <= 0:
            self.exceeded = True
            return b""
        line = self._rfile.readline(self.left if size < 0 else min(size, self.left))
        self.left -= len(line)
        return line


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "pb-model-relay"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self._relay.client_idle_timeout)
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._admitted = self._relay._track(self.connection)

    def handle(self) -> None:
        if not self._admitted:  # one connection too many: refused before anything of it is read
            self.command, self.path, self.request_version = "-", "-", "HTTP/1.1"
            self._relay._refuse(self, cast(_Server, self.server).listener, 503,
                                f"too many connections at once (at most {self._relay.max_connections})")
            return
        super().handle()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._relay._untrack(self.connection)

    @property
    def _relay(self) -> ModelRelay:
        return cast(_Server, self.server).relay

    def handle_one_request(self) -> None:
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(414)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            rfile = self.rfile
            limited = _HeaderLimit(rfile, HEADER_MAX)
            self.rfile = cast(Any, limited)
            try:
                parsed = self.parse_request()
            finally:
                self.rfile = rfile
            if not parsed:
                return
            listener = cast(_Server, self.server).listener
            if limited.exceeded:
                self._relay._refuse(self, listener, 431, f"request header fields larger than {HEADER_MAX} bytes")
                return
            self._relay._exchange(self, listener)
        except OSError:  # timeouts, resets, broken pipes: this connection is done
            self.close_connection = True

    def address_string(self) -> str:
        return str(self.client_address[0]) if isinstance(self.client_address, tuple) else "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("relay %s: " + format, self.address_string(), *args)


class _Server(socketserver.ThreadingMixIn, socketserver.BaseServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # socketserver's 5 makes a Unix connect fail with EAGAIN under a burst
    relay: ModelRelay
    listener: str


class _UnixServer(_Server, socketserver.UnixStreamServer):
    pass


class _TCPServer(_Server, socketserver.TCPServer):
    allow_reuse_address = True


class ModelRelay:
    """Forwards HTTP requests to one upstream URL only, streaming, metering tokens. See the module doc.

    ``endpoint``: the upstream URL (``--pb-model-endpoint``). ``records_path``: a JSON-lines file that gets one
    line per request (appended; parent directories created). ``unix``: listen on a Unix socket (``socket_path``,
    else ``relay.sock`` in a fresh private temporary directory, removed on close) for the sandbox's bridge.
    ``tcp``: also listen on ``127.0.0.1:tcp_port`` (0: ephemeral) for host-loop agents. ``api_key_env``: the name of
    a host environment variable whose value the relay sends upstream in place of whatever key the client sent:
    ``Authorization: Bearer`` or Anthropic's ``x-api-key`` (``key_style="auto"`` picks ``x-api-key`` when the
    request carries ``anthropic-version`` or ``x-api-key``). ``socket_mode``: the socket file's permissions.
    ``max_request_bytes``, ``max_inflight_bytes``, ``inflight_wait_s``, ``records_limit``: the bounds of the module
    doc (``None``: from ``PB_RELAY_REQUEST_MAX``, ``PB_RELAY_INFLIGHT_MAX``, ``PB_RELAY_BUDGET_WAIT``,
    ``PB_MODEL_REQUESTS_MAX``); ``max_connections``: connections served at once.

    A request is recorded just after its last byte went to the client, so :meth:`records` and :meth:`stats` are
    complete once :meth:`close` has returned (it waits for in-flight exchanges, cutting them after a few seconds).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        records_path: str | os.PathLike[str] | None = None,
        unix: bool = True,
        socket_path: str | os.PathLike[str] | None = None,
        socket_mode: int = 0o600,
        tcp: bool = False,
        tcp_port: int = 0,
        api_key_env: str | None = None,
        key_style: KeyStyle = "auto",
        connect_timeout: float = 30.0,
        # A reasoning model may be silent for long before its first byte (the CLIs wait through it): an hour.
        upstream_timeout: float = 3600.0,
        client_idle_timeout: float = 3600.0,
        max_request_bytes: int | None = None,
        max_inflight_bytes: int | None = None,
        inflight_wait_s: float | None = None,
        max_connections: int = MAX_CONNECTIONS,
        records_limit: int | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not unix and not tcp:
            raise RelayConfigError("the relay needs a Unix socket, a TCP listener, or both")
        if key_style not in ("auto", "bearer", "x-api-key"):
            raise RelayConfigError(f"unknown key style {key_style!r}")
        self.upstream = Upstream.parse(endpoint)
        self.records_path = None if records_path is None else Path(records_path)
        self._want_unix = unix
        self._socket_path = None if socket_path is None else Path(socket_path)
        self._socket_mode = socket_mode
        self._want_tcp = tcp
        self._tcp_port = tcp_port
        self.api_key_env = api_key_env
        self.key_style: KeyStyle = key_style
        self.connect_timeout = connect_timeout
        self.upstream_timeout = upstream_timeout
        self.client_idle_timeout = client_idle_timeout
        self.max_request_bytes = request_limit() if max_request_bytes is None else max_request_bytes
        inflight = inflight_limit() if max_inflight_bytes is None else max_inflight_bytes
        # Bodies held at once (one relay per task): never less than one largest body read in chunks (the chunks and
        # their joined copy), or that body could never pass.
        self.budget = ByteBudget(max(inflight, 2 * self.max_request_bytes),
                                 budget_wait() if inflight_wait_s is None else inflight_wait_s)
        self.max_connections = max_connections
        self._records_limit = records_limit
        self._ssl_context = ssl_context
        self._key: str | None = None
        self._temp_dir: Path | None = None
        self._servers: list[_Server] = []
        self._threads: dict[_Server, threading.Thread] = {}
        self._lock = threading.Lock()
        self._clients: set[socket.socket] = set()
        self._handlers: set[threading.Thread] = set()
        self._client: httpx.Client | None = None  # the upstream side: pooled, streaming, TLS (created by start)
        self._inflight: set[httpx.Response] = set()
        self._records: HeadTail[RelayRecord] = HeadTail(RECORDS_IN_MEMORY // 2, RECORDS_IN_MEMORY // 2)
        self._stats = RelayStats()
        self._records_file: BoundedJsonl | None = None
        self._started = False
        self._closed = False

    # -- life cycle

    def start(self) -> ModelRelay:
        if self._started:
            raise RuntimeError("the relay was already started")
        self._started = True
        if self.api_key_env is not None:
            key = os.environ.get(self.api_key_env, "")
            if not key:
                raise RelayConfigError(f"the model relay adds the key from ${self.api_key_env}, which is not set")
            self._key = key
        try:
            self._client = self._upstream_client()
            if self.records_path is not None:
                self._records_file = BoundedJsonl(self.records_path, limit=self._records_limit)
            if self._want_unix:
                self._servers.append(self._listen_unix())
            if self._want_tcp:
                self._servers.append(self._adopt(_TCPServer(("127.0.0.1", self._tcp_port), _Handler), "tcp"))
            for server in self._servers:
                thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                          name=f"pb-relay-{server.listener}", daemon=True)
                thread.start()
                self._threads[server] = thread
        except BaseException:
            self.close()
            raise
        log.debug("model relay up: %s -> %s", self.describe(), self.upstream.url)
        return self

    def _listen_unix(self) -> _Server:
        if self._socket_path is None:
            self._temp_dir = Path(tempfile.mkdtemp(prefix="pb-relay-"))
            self._socket_path = self._temp_dir / SOCKET_NAME
        path = self._socket_path
        if len(os.fsencode(path)) > 107:
            raise RelayConfigError(f"relay socket path {path} is longer than a Unix socket allows (107 bytes)")
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise RelayConfigError(f"relay socket path {path} exists and is not a socket")
            path.unlink()  # a stale socket of an earlier run
        path.parent.mkdir(parents=True, exist_ok=True)
        server = _UnixServer(str(path), _Handler, bind_and_activate=False)
        try:
            server.server_bind()
            os.chmod(path, self._socket_mode)
            server.server_activate()
        except BaseException:
            server.server_close()
            raise
        return self._adopt(server, "unix")

    def _adopt(self, server: socketserver.BaseServer, listener: str) -> _Server:
        adopted = cast(_Server, server)
        adopted.relay = self
        adopted.listener = listener
        return adopted

    def close(self) -> None:
        """Stop listening, cut in-flight exchanges, close the records file and remove the socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.budget.close()  # requests waiting for room give up now
        for server in self._servers:
            thread = self._threads.get(server)
            if thread is not None and thread.is_alive():
                server.shutdown()  # returns once serve_forever has left its loop
            server.server_close()
        with self._lock:
            live: list[Any] = [*self._clients, *filter(None, map(_socket_of, self._inflight))]
            handlers = list(self._handlers)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5
        for thread in handlers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._client is not None:
            self._client.close()
        with self._lock:
            if self._records_file is not None:
                self._records_file.close()  # the tail and what was dropped; later writes are ignored
        if self._want_unix and self._socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(self._socket_path.lstat().st_mode):
                    self._socket_path.unlink()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> ModelRelay:
        return self.start() if not self._started else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- what callers need

    @property
    def socket_path(self) -> Path | None:
        """The Unix socket (after start)."""
        return self._socket_path if self._want_unix else None

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for server in self._servers:
            if server.listener == "tcp":
                host, port = cast(tuple[str, int], cast(socketserver.TCPServer, server).server_address)[:2]
                return host, port
        return None

    @property
    def tcp_url(self) -> str | None:
        """``http://127.0.0.1:<port>`` of the host listener (after start), ``None`` without one."""
        address = self.tcp_address
        return None if address is None else f"http://{address[0]}:{address[1]}"

    @property
    def injects_key(self) -> bool:
        return self.api_key_env is not None

    def agent_env(self, base_url: str | None = None) -> dict[str, str]:
        """Env vars pointing SDKs at this relay as reachable at ``base_url`` (default: the host TCP listener)."""
        base = base_url if base_url is not None else self.tcp_url
        if base is None:
            raise RelayConfigError("the relay has no TCP listener: pass the base URL the agent reaches it at")
        return relay_env(base, self.upstream.prefix, injects_key=self.injects_key)

    def sandbox_env(self, port: int = SANDBOX_BRIDGE_PORT) -> dict[str, str]:
        """Env vars for an agent in the sandbox, reaching the relay through the bridge on ``127.0.0.1:port``."""
        return self.agent_env(f"http://127.0.0.1:{port}")

    def records(self) -> list[RelayRecord]:
        """The records kept in memory: all of them up to ``RECORDS_IN_MEMORY``, else the first and the last half."""
        with self._lock:
            return self._records.items()

    def record_bounds(self) -> dict[str, int]:
        """What the bounds held back (for pb-meta.json): records dropped from the file, refusals for lack of room."""
        with self._lock:
            omitted = 0 if self._records_file is None else self._records_file.omitted
            return {"records_omitted": omitted, "records_omitted_in_memory": self._records.omitted,
                    "inflight_refused": self.budget.refused, "inflight_peak_bytes": self.budget.peak}

    def notes(self) -> list[str]:
        """Sentences for the item's notes (after :meth:`close`): what the bounds held back, if anything."""
        bounds = self.record_bounds()
        out = []
        if bounds["records_omitted"] and self.records_path is not None:
            out.append(f"{self.records_path.name} reached its cap: {bounds['records_omitted']} model request "
                       "record(s) dropped (counted in pb-meta.json's relay stats; the first and the last kept)")
        if bounds["inflight_refused"]:
            out.append(f"the model relay refused {bounds['inflight_refused']} request(s) with a 503: the request "
                       f"bodies in flight reached {self.budget.limit} bytes")
        return out

    def stats(self) -> RelayStats:
        with self._lock:
            return RelayStats(**vars(self._stats))

    def describe(self) -> str:
        where = [str(self.socket_path)] if self.socket_path is not None else []
        if self.tcp_url is not None:
            where.append(self.tcp_url)
        return " and ".join(where) or "(not listening)"

    # -- internals: connection tracking

    def _track(self, sock: socket.socket) -> bool:
        """Tracked (to be cut at close); whether it may be served (a connection beyond ``max_connections`` not)."""
        with self._lock:
            admitted = len(self._clients) < self.max_connections
            self._clients.add(sock)
            self._handlers.add(threading.current_thread())
            return admitted

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._clients.discard(sock)
            self._handlers.discard(threading.current_thread())

    def _record(self, exchange: _Exchange) -> None:
        record = exchange.record()
        with self._lock:
            self._records.add(record)
            self._stats.add(record)
            if self._records_file is not None:
                self._records_file.write(record.as_dict())  # bounded line, head and tail kept
        log.debug("relay %s %s -> %s (%s)", record.method, record.path, record.status, record.error or "ok")

    # -- internals: one exchange

    def _exchange(self, handler: _Handler, listener: str) -> None:
        exchange = _Exchange(listener, handler.command, handler.path)
        try:
            if handler.command == "HEAD" and handler.path == "/" and not self.upstream.contains("/"):
                # claude-code's connectivity probe at start: the relay itself is what it can reach, so it answers.
                exchange.status = 200
                handler.send_response(200)
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                exchange.mark_first_byte()
                return
            self._forward(handler, exchange)
        except _Refusal as refusal:
            exchange.error = refusal.message
            exchange.status = refusal.status
            self._send_error(handler, exchange, refusal.status, refusal.message)
        except OSError as exc:  # the client went away or stalled
            handler.close_connection = True
            exchange.error = exchange.error or f"client connection: {exc!r}"
        except Exception as exc:  # a bug of ours: answer, record, keep serving
            log.exception("model relay: internal error")
            exchange.error = f"relay internal error: {exc!r}"
            if exchange.status == 0:
                exchange.status = 500
                self._send_error(handler, exchange, 500, "internal error")
            handler.close_connection = True
        finally:
            self.budget.give(exchange.held)
            self._record(exchange)

    def _refuse(self, handler: _Handler, listener: str, status: int, message: str) -> None:
        """Answer ``status`` before anything more of the request is read, and record it."""
        exchange = _Exchange(listener, handler.command or "-", handler.path or "-")
        exchange.status, exchange.error = status, message
        self._send_error(handler, exchange, status, message)
        self._record(exchange)

    def _send_error(self, handler: _Handler, exchange: _Exchange, status: int, message: str) -> None:
        handler.close_connection = True  # the request body may be unread
        body = json.dumps({"error": {"message": f"pb model relay: {message}", "type": "pb_relay_error",
                                     "code": status}}).encode()
        with contextlib.suppress(OSError):
            handler.send_response_only(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.send_header("Connection", "close")
            handler.end_headers()
            if handler.command != "HEAD":
                handler.wfile.write(body)
                exchange.response_bytes = len(body)
            exchange.mark_first_byte()
            self._linger(handler)

    def _linger(self, handler: _Handler) -> None:
        """Read and drop what the client still sends after an answer that closes the connection (a body refused
        unread, headers past the cap), up to ``max_request_bytes`` and until it is silent for a second: closing a
        socket with unread input resets the connection, and the client would lose the answer it has not read yet.
        Memory stays at one read whatever it sends."""
        left = self.max_request_bytes
        with contextlib.suppress(OSError, ValueError):
            handler.connection.shutdown(socket.SHUT_WR)  # the answer is complete: the client sees its end now
            handler.connection.settimeout(LINGER_S)
            while left > 0:
                data = handler.rfile.read1(min(left, 65536))
                if not data:
                    break
                left -= len(data)

    def _target(self, target: str) -> str:
        upstream = self.upstream
        if target.startswith("/"):
            parts = urlsplit(target)
            path, query = parts.path, parts.query
        elif "://" in target:
            parts = urlsplit(target)
            try:
                port = parts.port
            except ValueError as exc:
                raise _Refusal(400, f"malformed request target {target[:200]!r}") from exc
            scheme = parts.scheme.lower()
            same = (scheme == upstream.scheme and (parts.hostname or "").lower() == upstream.host
                    and (port or (443 if scheme == "https" else 80)) == upstream.port)
            if not same:
                where = f"{parts.scheme}://{parts.netloc}"[:200]
                raise _Refusal(403, f"the relay forwards only to {upstream.url}; refusing a request for {where}")
            path, query = parts.path or "/", parts.query
        else:
            raise _Refusal(400, f"malformed request target {target[:200]!r}")
        if _bad_path(path):
            raise _Refusal(400, f"refusing path {path[:200]!r}: dot segments, encoded slashes or backslashes")
        if not upstream.contains(path):
            raise _Refusal(404, f"path {path[:200]!r} is outside the model endpoint {upstream.url}; "
                                f"use base URL <relay>{upstream.prefix}")
        return path + (f"?{query}" if query else "")

    def _hold(self, exchange: _Exchange, size: int) -> None:
        """Take ``size`` more bytes of the budget for this request's body, or refuse it (503) when there is none."""
        if not self.budget.take(size):
            raise _Refusal(503, f"the relay holds {self.budget.limit} bytes of request bodies at once and had no "
                                f"room for {exchange.held + size} more within {self.budget.wait_s:g} s; retry later")
        exchange.held += size

    def _read_body(self, handler: _Handler, exchange: _Exchange) -> bytes:
        headers = handler.headers
        encodings = [part.strip().lower() for part in ",".join(headers.get_all("Transfer-Encoding") or []).split(",")
                     if part.strip()]
        if encodings:
            if encodings != ["chunked"]:
                raise _Refusal(501, f"unsupported request transfer coding {','.join(encodings)!r}")
            return self._read_chunked(handler, exchange)
        lengths = headers.get_all("Content-Length") or []
        if not lengths:
            return b""
        if len(set(lengths)) != 1 or not lengths[0].strip().isdigit():
            raise _Refusal(400, "invalid Content-Length")
        length = int(lengths[0])
        if length > self.max_request_bytes:
            raise _Refusal(413, f"request body of {length} bytes exceeds the relay's limit")
        self._hold(exchange, length)
        body = handler.rfile.read(length)
        if len(body) != length:
            raise ConnectionResetError("the client closed before sending the whole body")
        return body

    def _read_chunked(self, handler: _Handler, exchange: _Exchange) -> bytes:
        body = bytearray()
        rfile = handler.rfile
        while True:
            line = rfile.readline(1026)
            if not line.endswith(b"\n"):
                raise _Refusal(400, "malformed chunked request body")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise _Refusal(400, "malformed chunk size in request body") from exc
            if size == 0:
                while rfile.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers, discarded
                    pass
                self._hold(exchange, len(body))  # the copy below exists next to the chunks for a moment
                return bytes(body)
            if len(body) + size > self.max_request_bytes:
                raise _Refusal(413, "request body exceeds the relay's limit")
            self._hold(exchange, size)
            data = rfile.read(size)
            if len(data) != size:
                raise ConnectionResetError("the client closed inside a chunk")
            body += data
            rfile.readline(3)

    def _headers(self, handler: _Handler, body: bytes) -> list[tuple[str, str]]:
        incoming = handler.headers
        named = {token.strip().lower() for value in incoming.get_all("Connection") or [] for token in value.split(",")}
        drop = _REQUEST_DROP | named | (_KEY_HEADERS if self._key is not None else frozenset())
        headers = [(name, value) for name, value in incoming.items() if name.lower() not in drop]
        headers.append(("Host", self.upstream.host_header))
        if body or handler.command in ("POST", "PUT", "PATCH"):
            headers.append(("Content-Length", str(len(body))))
        headers.append(("Accept-Encoding", "identity"))  # so the usage tap can read the body
        if self._key is not None:
            style = self.key_style
            if style == "auto":
                anthropic = "anthropic-version" in incoming or "x-api-key" in incoming
                style = "x-api-key" if anthropic else "bearer"
            headers.append(("x-api-key", self._key) if style == "x-api-key" else
                           ("Authorization", f"Bearer {self._key}"))
        return headers

    def _upstream_client(self) -> httpx.Client:
        """httpx for the upstream side: a keep-alive pool, streaming, TLS, and a read timeout long enough for a
        model that thinks for an hour before its first byte. No proxy from the environment, no redirects: the
        relay goes to the configured endpoint and nowhere else."""
        timeout = httpx.Timeout(connect=self.connect_timeout, read=self.upstream_timeout, write=self.upstream_timeout,
                                pool=self.connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=_MAX_POOLED,
                              keepalive_expiry=_POOL_IDLE_S)
        verify: ssl.SSLContext | bool = self._ssl_context if self._ssl_context is not None else True
        return httpx.Client(timeout=timeout, limits=limits, verify=verify, trust_env=False, follow_redirects=False)

    def _send_upstream(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> httpx.Response:
        client = self._client
        if client is None or self._closed:
            raise _Refusal(503, "the relay is closing")
        # The path was checked against the endpoint's prefix as sent: the URL is built from its raw bytes, so
        # nothing is re-encoded or normalised on the way.
        url = httpx.URL(scheme=self.upstream.scheme, host=self.upstream.host, port=self.upstream.port,
                        raw_path=path.encode("ascii", "surrogateescape"))
        request = client.build_request(method, url, headers=headers, content=body if body else None)
        try:
            response = client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise _Refusal(504, f"upstream {self.upstream.origin} timed out: {exc!r}") from exc
        except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
            raise _Refusal(502, f"upstream {self.upstream.origin} unreachable: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise _Refusal(502, f"upstream {self.upstream.origin} sent no valid response: {exc!r}") from exc
        with self._lock:
            self._inflight.add(response)
        return response

    def _forward(self, handler: _Handler, exchange: _Exchange) -> None:
        if handler.command == "CONNECT":
            raise _Refusal(405, f"CONNECT is not supported: the relay forwards only to {self.upstream.url}")
        path = self._target(handler.path)
        exchange.path = path
        body = self._read_body(handler, exchange)
        exchange.request_bytes = len(body)
        exchange.t0 = time.monotonic()
        exchange.model, exchange.stream = request_fields(body)  # scanned, not parsed: bounded memory
        response = self._send_upstream(handler.command, path, self._headers(handler, body), body)
        try:
            self._respond(handler, exchange, response)
        finally:
            with self._lock:
                self._inflight.discard(response)
            response.close()  # a body read to its end returns the connection to the pool

    def _respond(self, handler: _Handler, exchange: _Exchange, response: httpx.Response) -> None:
        status = response.status_code
        exchange.status = status
        bodyless = handler.command == "HEAD" or status in (204, 304) or 100 <= status < 200
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in response.headers.raw]
        named = {token.strip().lower() for name, value in headers if name.lower() == "connection"
                 for token in value.split(",")}
        handler.send_response_only(status, response.reason_phrase)
        for name, value in headers:
            lowered = name.lower()
            dropped = lowered in _RESPONSE_DROP or lowered in named
            if dropped and not (bodyless and lowered == "content-length"):  # HEAD keeps its length
                continue
            handler.send_header(name, value)
        chunked = False
        length = _content_length(response.headers)
        if bodyless:
            pass
        elif length is not None:
            handler.send_header("Content-Length", str(length))
        elif handler.request_version == "HTTP/1.1":
            handler.send_header("Transfer-Encoding", "chunked")
            chunked = True
        else:
            handler.close_connection = True
        if handler.close_connection:
            handler.send_header("Connection", "close")
        handler.end_headers()
        if bodyless:
            exchange.mark_first_byte()
            response.read()  # nothing, but lets the connection be reused
            return
        tap = UsageTap(response.headers.get("Content-Type") or "", response.headers.get("Content-Encoding") or "")
        write = handler.wfile.write
        # Raw bytes as they arrive (no decompression: the client gets the upstream's encoding, the tap inflates).
        chunks = response.iter_raw()
        while True:
            try:
                chunk = next(chunks, b"")
            except (httpx.HTTPError, OSError) as exc:  # a cut stream, or a body short of its Content-Length
                exchange.error = f"upstream broke off the response: {exc!r}"
                handler.close_connection = True  # no terminating chunk: the client sees a truncated body
                break
            if not chunk:
                if chunked:
                    write(b"0\r\n\r\n")
                break
            exchange.mark_first_byte()
            tap.feed(chunk)
            exchange.response_bytes += len(chunk)
            try:
                write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            except OSError as exc:
                exchange.error = f"client went away mid-response: {exc!r}"
                handler.close_connection = True
                break
        if exchange.first_byte_s is None:
            exchange.mark_first_byte()
        exchange.usage = tap.finish()
        exchange.tool_calls = tap.tool_calls
