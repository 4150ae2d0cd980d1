"""The model relay: the agent's only way out of its sandbox, and the meter of what it spent.

The sandbox has no network. A tiny bridge (``relay_bridge.py``, run as root inside the container) listens on the
container's loopback and carries every connection over one ``docker exec`` stream to the host (``relay_tunnel.py``),
which connects it to the Unix socket where a :class:`ModelRelay` accepts it. The relay forwards requests to exactly
one place, the configured ``--pb-model-endpoint`` URL (its path prefix included), optionally adding the API key from
the host's environment so the key never enters the sandbox. Anything else (``CONNECT``, absolute URIs naming another
host, paths outside the endpoint's prefix, dot segments) is refused with a 4xx before any connection is made.
Host-loop agents get the same relay on ``127.0.0.1:<ephemeral port>``.

Its parts, one module each:

* ``server.py``: the agent-facing HTTP/1.1 server, its wire work h11's (request line and header caps, connection
  cap, refusals);
* ``upstream.py``: the endpoint and the httpx client that reaches it;
* ``apis.py``, ``body_scan.py``: the cleanroom: the model calls it forwards (one table of method and path per API)
  and what their bodies may ask for; every other API, every provider-side tool and every model but the run's
  (``models``) is refused with a 4xx, recorded, and counted for the item's ``provider_tools_requested`` flag
  (``allow_server_tools``: forwarded as they come);
* ``metering.py``: token usage and tool calls read from responses as they stream by (every API shape);
* ``agent_loop.py``: the agent's loop read from its model calls: a CLI preset's loop that offers no shell tool is
  refused (``require_shell_tool``), the silence after a final answer is measured, a 400 refusing the client as
  outdated is noticed;
* ``recording.py``: one :class:`RelayRecord` per request, in ``model-requests.jsonl`` and summed in
  :class:`RelayStats`; no record ever contains a header value, so no key reaches the records;
* ``records.py``, ``budget.py``: the bounds on what the agent sends. Each record's line (4 KiB) and the records file
  (``PB_MODEL_REQUESTS_MAX``, head and tail kept), the records kept in memory (by count), a request's headers
  (64 KiB), its body (``PB_RELAY_REQUEST_MAX``), the bodies held at once (``PB_RELAY_INFLIGHT_MAX``: beyond it a
  request waits, then gets a 503) and the connections served at once (``MAX_CONNECTIONS``: beyond, a 503).

This module ties them together: a request's body is read, checked, forwarded, and the response streamed back as it
arrives (server-sent events included) through the metering tap.
"""

from __future__ import annotations

import collections
import contextlib
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
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType
from typing import Literal, cast
from urllib.parse import urlsplit

import httpx

from pytest_programbench.relay.agent_loop import ERROR_HEAD, LoopWatch, refuses_client
from pytest_programbench.relay.apis import (
    CleanroomRefusal,
    CleanroomTally,
    ModelPin,
    allowed_call,
    api_of,
    check_body,
    check_headers,
)
from pytest_programbench.relay.budget import ByteBudget, budget_wait, inflight_limit, request_limit
from pytest_programbench.relay.contract import (
    MODEL_REJECTED,
    PLACEHOLDER_KEY,
    REPLAY_FILE,
    SANDBOX_BRIDGE_PORT,
    RelayConfigError,
    Upstream,
    bad_path,
)
from pytest_programbench.relay.metering import (
    SSEDecoder,
    StreamUsage,
    Usage,
    UsageTap,
    tool_calls_in_body,
    usage_from_body,
    usage_from_mapping,
)
from pytest_programbench.relay.rate import RunRateLimit
from pytest_programbench.relay.recording import RECORDS_IN_MEMORY, Exchange, Recorder, RelayRecord, RelayStats
from pytest_programbench.relay.records import request_fields
from pytest_programbench.relay.replay import ReplayUpstream, ReplayWriter
from pytest_programbench.relay.server import (
    HEADER_MAX,
    LINGER_S,
    MAX_CONNECTIONS,
    Handler,
    Refusal,
    Server,
    TCPServer,
    UnixServer,
    send_error,
)
from pytest_programbench.relay.slots import ModelSlots
from pytest_programbench.relay.spend import HARD_FACTOR, SpendLedger
from pytest_programbench.relay.upstream import (
    DEFAULT_RETRY_BUDGET_S,
    KEY_HEADERS,
    REJECTED_STATUSES,
    REQUEST_DROP,
    RESPONSE_DROP,
    RetryPolicy,
    UpstreamClient,
    content_length,
)

__all__ = [
    "DEFAULT_RETRY_BUDGET_S",
    "HEADER_MAX",
    "LINGER_S",
    "MAX_CONNECTIONS",
    "RECORDS_IN_MEMORY",
    "SOCKET_NAME",
    "ModelRelay",
    "RelayRecord",
    "RelayStats",
    "RetryPolicy",
    "SSEDecoder",
    "StreamUsage",
    "Usage",
    "UsageTap",
    "api_of",
    "relay_env",
    "tool_calls_in_body",
    "usage_from_body",
    "usage_from_mapping",
]

log = logging.getLogger(__name__)

KeyStyle = Literal["auto", "bearer", "x-api-key"]
#: What the relay's own probe of the key found: the key is accepted, rejected (401/403), or the probe got no answer.
KeyVerdict = Literal["accepted", "rejected", "unanswered"]

#: The name of the relay's socket inside its directory.
SOCKET_NAME = "relay.sock"
#: The ``anthropic-version`` the relay's own probe sends with an ``x-api-key`` (Anthropic's model list needs one).
PROBE_ANTHROPIC_VERSION = "2023-06-01"


def probe_path(upstream: Upstream) -> str:
    """What the relay's own probe of the key asks for: the model list below the endpoint (``/v1`` added when the
    prefix does not end in it), or OpenRouter's key endpoint (its model list needs no key)."""
    base = upstream.prefix if upstream.prefix.endswith("/v1") else f"{upstream.prefix}/v1"
    openrouter = upstream.host == "openrouter.ai" or upstream.host.endswith(".openrouter.ai")
    return f"{base}/key" if openrouter else f"{base}/models"


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



def _response_headers(response: httpx.Response, *, bodyless: bool, close: bool) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers as the agent gets them: hop-by-hop ones (and those its Connection names)
    dropped, except a bodyless answer's Content-Length; the body's length when known; ``Connection: close`` when
    the handler closes."""
    raw = response.headers.raw
    named = {token.strip().lower() for name, value in raw if name.lower() == b"connection"
             for token in value.decode("latin-1").split(",")}
    headers: list[tuple[bytes, bytes]] = []
    for name, value in raw:
        lowered = name.decode("latin-1").lower()
        dropped = lowered in RESPONSE_DROP or lowered in named
        if dropped and not (bodyless and lowered == "content-length"):  # HEAD keeps its length
            continue
        headers.append((name, value))
    length = content_length(response.headers)
    if not bodyless and length is not None:
        headers.append((b"Content-Length", b"%d" % length))
    if close:
        headers.append((b"Connection", b"close"))
    return headers


class ModelRelay:
    """Forwards HTTP requests to one upstream URL only, streaming, metering tokens. See the module doc.

    ``endpoint``: the upstream URL (``--pb-model-endpoint``). ``records_path``: a JSON-lines file that gets one
    line per request (appended; parent directories created). ``unix``: listen on a Unix socket (``socket_path``,
    else ``relay.sock`` in a fresh private temporary directory, removed on close) for the sandbox's bridge.
    ``tcp``: also listen on ``127.0.0.1:tcp_port`` (0: ephemeral) for host-loop agents. ``api_key_env``: the name of
    a host environment variable whose value the relay sends upstream in place of whatever key the client sent:
    ``Authorization: Bearer`` or Anthropic's ``x-api-key``, as ``key_style`` says (the plugin passes
    :func:`configured_key_style`); ``"auto"`` picks per call from the relay's own table (``x-api-key`` for Anthropic's
    endpoint and Anthropic's API, ``Bearer`` otherwise), never from the request's headers. An upstream 401/403 is
    passed to the agent as it came; whether it means the key does not work is decided by the relay's own probe
    (:meth:`key_verdict`: a request of its own, with its own headers, to :func:`probe_path`), never by what the
    agent sent. ``models``: the run's configured model names (:class:`apis.ModelPin`): a model call naming any other
    model is refused by the cleanroom; empty or ``None``: no model configured, none pinned. ``socket_mode``: the
    socket file's permissions.
    ``max_request_bytes``, ``max_inflight_bytes``, ``inflight_wait_s``, ``records_limit``: the bounds of the module
    doc (``None``: from ``PB_RELAY_REQUEST_MAX``, ``PB_RELAY_INFLIGHT_MAX``, ``PB_RELAY_BUDGET_WAIT``,
    ``PB_MODEL_REQUESTS_MAX``); ``max_connections``: connections served at once.

    The model API as a shared, failing resource: ``retry`` (``upstream.RetryPolicy``: the per-request budget of
    retries before the first byte; ``on_wait(seconds)`` told of each wait), ``slots`` (``slots.ModelSlots``: the run's
    ``--pb-model-concurrency``; ``on_slot_wait()`` told when a request must wait), ``rate`` (``rate.RunRateLimit``:
    ``--pb-model-rpm`` / ``--pb-model-tpm``, each answer's tokens charged to it; ``on_rate_wait(seconds)`` told of
    each wait), ``spend`` (``spend.SpendLedger``:
    ``--pb-budget``, requests refused with a 402 past it x1.1), ``replay_from`` (a ``model-replay.jsonl`` answered
    from instead of the endpoint, ``replay.py``). After :meth:`close`, :meth:`unavailable`, :meth:`over_budget` and
    :meth:`replay_mismatch` say why the task must be an error, if it must.

    ``allow_server_tools`` (``--pb-model-allow-server-tools``): forward every request inside the endpoint, provider-side
    tools and other APIs included; without it the relay is a cleanroom (``apis.py``) and :meth:`cleanroom` tells what
    it refused.

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
        models: Collection[str] | None = None,
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
        retry: RetryPolicy | None = None,
        on_wait: Callable[[float], None] | None = None,
        slots: ModelSlots | None = None,
        on_slot_wait: Callable[[], None] | None = None,
        replay_from: str | os.PathLike[str] | None = None,
        spend: SpendLedger | None = None,
        rate: RunRateLimit | None = None,
        on_rate_wait: Callable[[float], None] | None = None,
        allow_server_tools: bool = False,
        require_shell_tool: bool = False,
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
        self.pin = ModelPin.of(models or ())
        self.connect_timeout = connect_timeout
        self.upstream_timeout = upstream_timeout
        self.retry = retry or RetryPolicy()
        self._on_wait = on_wait
        self._slots = slots
        self._on_slot_wait = on_slot_wait
        self.replay_from = None if replay_from is None else Path(replay_from)
        self._spend = spend
        self._rate = rate
        self._on_rate_wait = on_rate_wait
        self.allow_server_tools = allow_server_tools
        self._cleanroom = CleanroomTally(allowed=allow_server_tools)
        self.loop = LoopWatch(require_shell=require_shell_tool)  # the agent's loop, read from its model calls
        self._budget_refused = 0
        self._metering = threading.Condition()  # answers whose cost is not yet in the ledger
        self._unmetered = 0
        self._replay_writer: ReplayWriter | None = None  # model-replay.jsonl beside the records
        self._outages: collections.Counter[str] = collections.Counter()  # what gave up, by answer
        self._rejections: collections.Counter[str] = collections.Counter()  # agents' requests answered 401/403
        self._verdict: KeyVerdict | None = None  # the relay's own probe of the key, once one was answered 401/403
        self._probe_lock = threading.Lock()
        self.client_idle_timeout = client_idle_timeout
        self.max_request_bytes = request_limit() if max_request_bytes is None else max_request_bytes
        inflight = inflight_limit() if max_inflight_bytes is None else max_inflight_bytes
        # Bodies held at once (one relay per task): never less than one largest body read in chunks (the chunks and
        # their joined copy), or that body could never pass.
        self.budget = ByteBudget(max(inflight, 2 * self.max_request_bytes),
                                 budget_wait() if inflight_wait_s is None else inflight_wait_s)
        self.max_connections = max_connections
        self._ssl_context = ssl_context
        self._key: str | None = None
        self._temp_dir: Path | None = None
        self._servers: list[Server] = []
        self._threads: dict[Server, threading.Thread] = {}
        self._lock = threading.Lock()
        self._clients: set[socket.socket] = set()
        self._handlers: set[threading.Thread] = set()
        self._upstream: UpstreamClient | ReplayUpstream | None = None  # pooled, streaming, TLS (created by start)
        self._recorder = Recorder(self.records_path, records_limit)
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
            if self.replay_from is not None:  # answered from a recording: nothing goes upstream
                self._upstream = ReplayUpstream(self.replay_from)
            else:
                self._upstream = UpstreamClient(self.upstream, connect_timeout=self.connect_timeout,
                                                read_timeout=self.upstream_timeout, ssl_context=self._ssl_context,
                                                policy=self.retry, on_wait=self._on_wait, slots=self._slots,
                                                on_slot_wait=self._on_slot_wait, rate=self._rate,
                                                on_rate_wait=self._on_rate_wait)
            self._recorder.open()
            if self.records_path is not None:
                self._replay_writer = ReplayWriter(self.records_path.with_name(REPLAY_FILE))
            if self._want_unix:
                self._servers.append(self._listen_unix())
            if self._want_tcp:
                self._servers.append(self._adopt(TCPServer(("127.0.0.1", self._tcp_port), Handler), "tcp"))
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

    def _listen_unix(self) -> Server:
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
        server = UnixServer(str(path), Handler, bind_and_activate=False)
        try:
            server.server_bind()
            os.chmod(path, self._socket_mode)
            server.server_activate()
        except BaseException:
            server.server_close()
            raise
        return self._adopt(server, "unix")

    def _adopt(self, server: socketserver.BaseServer, listener: str) -> Server:
        adopted = cast(Server, server)
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
        if self._upstream is not None:
            self._upstream.cut()
        with self._lock:
            live = list(self._clients)
            handlers = list(self._handlers)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5
        for thread in handlers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._upstream is not None:
            self._upstream.close()
        self.key_verdict()  # an answer of 401/403 asks the relay's own probe whether the key works
        self._recorder.close()  # the tail and what was dropped; later writes are ignored
        if self._replay_writer is not None:
            self._replay_writer.close()
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
        return self._recorder.records()

    def record_bounds(self) -> dict[str, int]:
        """What the bounds held back (for pb-meta.json): records dropped from the file, refusals for lack of room."""
        omitted, in_memory = self._recorder.omitted()
        return {"records_omitted": omitted, "records_omitted_in_memory": in_memory,
                "inflight_refused": self.budget.refused, "inflight_peak_bytes": self.budget.peak}

    def notes(self) -> list[str]:
        """Sentences for the item's notes (after :meth:`close`): what the bounds held back, if anything."""
        bounds = self.record_bounds()
        out = []
        if bounds["records_omitted"] and self.records_path is not None:
            out.append(f"{self.records_path.name} reached its cap: {bounds['records_omitted']} model request "
                       "record(s) dropped (counted in pb-meta.json's relay stats; the first and the last kept)")
        stats = self.stats()
        if stats.retries:
            out.append(f"the model relay retried {stats.retries} transient failure(s) upstream, waiting "
                       f"{stats.retry_wait_s:.0f} s in all")
        if stats.stream_breaks:
            out.append(f"the upstream broke off {stats.stream_breaks} response(s) after bytes reached the agent")
        rejected = self._rejected_by_agent()
        if rejected:
            out.append(f"the upstream answered {rejected} of the agent's request(s) with 401/403, and the relay's own "
                       "probe found the key accepted: the agent's answers, scored")
        if bounds["inflight_refused"]:
            out.append(f"the model relay refused {bounds['inflight_refused']} request(s) with a 503: the request "
                       f"bodies in flight reached {self.budget.limit} bytes")
        return out

    def _note_outage(self, answer: str) -> None:
        with self._lock:
            self._outages[answer] += 1

    def key_verdict(self) -> KeyVerdict | None:
        """Whether the key works, as the relay's own probe found it; asked once, the first time this is called
        after an agent's request was answered 401/403 (``None`` before, or when replaying: no key is in play).

        The probe is the relay's own request (``GET`` :func:`probe_path`, the key in the configured style, no header
        of the agent's) on a client of its own, so neither the agent nor closing the relay decides its answer: 401 or
        403 is ``rejected``; any other answer ``accepted`` (the agent's 401/403 then came from what it sent); none
        within the retry budget ``unanswered``."""
        with self._probe_lock:
            with self._lock:
                pending = sum(self._rejections.values())
            if self._verdict is None and pending and not isinstance(self._upstream, ReplayUpstream):
                self._verdict = self._probe_key()
            return self._verdict

    def _probe_key(self) -> KeyVerdict:
        client = UpstreamClient(self.upstream, connect_timeout=self.connect_timeout,
                                read_timeout=self.connect_timeout, ssl_context=self._ssl_context, policy=self.retry)
        path = probe_path(self.upstream)
        style = self._style(path)
        headers = [("Host", self.upstream.host_header), ("Accept-Encoding", "identity")]
        if style == "x-api-key":
            headers.append(("anthropic-version", PROBE_ANTHROPIC_VERSION))
        if self._key is not None:
            headers.append(self._key_header(style))
        try:
            response = client.send("GET", path, headers, b"")
        except Refusal as refusal:
            log.warning("model relay: the key probe got no answer: %s", refusal.message)
            return "unanswered"
        else:
            client.done(response)
            return "rejected" if response.status_code in REJECTED_STATUSES else "accepted"
        finally:
            client.close()

    def _rejected_by_agent(self) -> int:
        """Requests answered 401/403 that the probe found the key not at fault for (the agent's doing)."""
        if self._verdict in ("rejected", "unanswered"):
            return 0
        with self._lock:
            return sum(self._rejections.values())

    def unavailable(self) -> str | None:
        """Why the model API could not be used in this window, ``None`` when it could: the key rejected by the
        relay's own probe (after an agent's request was answered 401/403), or requests given up after the whole
        retry budget. The caller makes the task an error of it."""
        verdict = self.key_verdict()
        with self._lock:
            outages = collections.Counter(self._outages)
            if verdict == "unanswered":  # the probe itself could not reach the API: an outage
                outages["no answer (unreachable)"] += sum(self._rejections.values())
            rejected = dict(self._rejections) if verdict == "rejected" else {}
        if not outages and not rejected:
            return None
        if rejected:
            what = ", ".join(f"{n} answered {answer}" for answer, n in sorted(rejected.items()))
            return f"{MODEL_REJECTED}: {sum(rejected.values())} request(s) ({what})"
        what = ", ".join(f"{n} answered {answer}" if answer[:1].isdigit() else f"{n} {answer}"
                         for answer, n in sorted(outages.items()))
        return (f"model API unavailable: {sum(outages.values())} request(s) given up after the retry budget of "
                f"{self.retry.budget_s:g} s ({what})")

    def stats(self) -> RelayStats:
        return self._recorder.stats()

    def held_seconds(self) -> float:
        """Seconds the harness held this task's model requests back so far (slots, rate limits, retry pauses;
        concurrent holds counted once): what the agent's clock gives back (``relay/held.py``)."""
        upstream = self._upstream
        return upstream.held.seconds() if isinstance(upstream, UpstreamClient) else 0.0

    def describe(self) -> str:
        where = [str(self.socket_path)] if self.socket_path is not None else []
        if self.tcp_url is not None:
            where.append(self.tcp_url)
        return " and ".join(where) or "(not listening)"

    # -- internals: connection tracking

    def track(self, sock: socket.socket) -> bool:
        """Tracked (to be cut at close); whether it may be served (a connection beyond ``max_connections`` not)."""
        with self._lock:
            admitted = len(self._clients) < self.max_connections
            self._clients.add(sock)
            self._handlers.add(threading.current_thread())
            return admitted

    def untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._clients.discard(sock)
            self._handlers.discard(threading.current_thread())

    def _record(self, exchange: Exchange) -> None:
        self._recorder.add(exchange)

    # -- internals: one exchange

    def exchange(self, handler: Handler, listener: str) -> None:
        exchange = Exchange(listener, handler.command, handler.path)
        try:
            if handler.command == "HEAD" and handler.path == "/" and not self.upstream.contains("/"):
                # claude-code's connectivity probe at start: the relay itself is what it can reach, so it answers.
                exchange.status = 200
                handler.start_response(200, [(b"Content-Length", b"0")])
                handler.end_response()
                exchange.mark_first_byte()
                return
            self._forward(handler, exchange)
        except Refusal as refusal:
            exchange.error = refusal.message
            exchange.status = refusal.status
            if isinstance(refusal, CleanroomRefusal):
                exchange.cleanroom = refusal.what
                with self._lock:
                    self._cleanroom.add(refusal)
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

    def refuse(self, handler: Handler, listener: str, status: int, message: str) -> None:
        """Answer ``status`` before anything more of the request is read, and record it."""
        exchange = Exchange(listener, handler.command or "-", handler.path or "-")
        exchange.status, exchange.error = status, message
        self._send_error(handler, exchange, status, message)
        self._record(exchange)

    def _send_error(self, handler: Handler, exchange: Exchange, status: int, message: str) -> None:
        exchange.response_bytes = send_error(handler, status, message, self.max_request_bytes)
        exchange.mark_first_byte()

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
                raise Refusal(400, f"malformed request target {target[:200]!r}") from exc
            scheme = parts.scheme.lower()
            same = (scheme == upstream.scheme and (parts.hostname or "").lower() == upstream.host
                    and (port or (443 if scheme == "https" else 80)) == upstream.port)
            if not same:
                where = f"{parts.scheme}://{parts.netloc}"[:200]
                raise Refusal(403, f"the relay forwards only to {upstream.url}; refusing a request for {where}")
            path, query = parts.path or "/", parts.query
        else:
            raise Refusal(400, f"malformed request target {target[:200]!r}")
        if bad_path(path):
            raise Refusal(400, f"refusing path {path[:200]!r}: dot segments, encoded slashes or backslashes")
        if not upstream.contains(path):
            raise Refusal(404, f"path {path[:200]!r} is outside the model endpoint {upstream.url}; "
                                f"use base URL <relay>{upstream.prefix}")
        return path + (f"?{query}" if query else "")

    def _hold(self, exchange: Exchange, size: int) -> None:
        """Take ``size`` more bytes of the budget for this request's body, or refuse it (503) when there is none."""
        if not self.budget.take(size):
            raise Refusal(503, f"the relay holds {self.budget.limit} bytes of request bodies at once and had no "
                                f"room for {exchange.held + size} more within {self.budget.wait_s:g} s; retry later")
        exchange.held += size

    def _read_body(self, handler: Handler, exchange: Exchange) -> bytes:
        # h11 decodes the framing (Content-Length or chunked; other codings it refuses with the head); the caps are
        # ours: the relay's request limit and its budget of bodies held at once.
        return handler.read_body(self.max_request_bytes, lambda size: self._hold(exchange, size))

    def _anthropic_endpoint(self) -> bool:
        return self.upstream.host == "anthropic.com" or self.upstream.host.endswith(".anthropic.com")

    def _style(self, path: str) -> str:
        """The header the key goes in for a request to ``path``: the configured style, or under ``"auto"`` the
        relay's own table of the call (Anthropic's endpoint or API: ``x-api-key``), never the agent's headers."""
        if self.key_style != "auto":
            return self.key_style
        anthropic = self._anthropic_endpoint() or (api_of(path) or "").startswith("anthropic.")
        return "x-api-key" if anthropic else "bearer"

    def _key_header(self, style: str) -> tuple[str, str]:
        key = self._key or ""
        return ("x-api-key", key) if style == "x-api-key" else ("Authorization", f"Bearer {key}")

    def _headers(self, handler: Handler, body: bytes, path: str) -> list[tuple[str, str]]:
        incoming = handler.headers
        named = {token.strip().lower() for value in incoming.get_all("Connection") or [] for token in value.split(",")}
        drop = REQUEST_DROP | named | (KEY_HEADERS if self._key is not None else frozenset())
        headers = [(name, value) for name, value in incoming.items() if name.lower() not in drop]
        headers.append(("Host", self.upstream.host_header))
        if body or handler.command in ("POST", "PUT", "PATCH"):
            headers.append(("Content-Length", str(len(body))))
        headers.append(("Accept-Encoding", "identity"))  # so the usage tap can read the body
        if self._key is not None:
            headers.append(self._key_header(self._style(path)))
        return headers

    def _forward(self, handler: Handler, exchange: Exchange) -> None:
        path, body = self._admit(handler, exchange)
        offered = self.loop.admit(api_of(path) if handler.command == "POST" else None, body)
        try:
            self._forward_admitted(handler, exchange, path, body)
        finally:
            self.loop.ended(offered_tools=offered, status=exchange.status, tool_calls=exchange.tool_calls)

    def _forward_admitted(self, handler: Handler, exchange: Exchange, path: str, body: bytes) -> None:
        refusal = self.loop.refusal
        if refusal is not None:  # the agent's loop cannot run a command: nothing of it goes upstream
            raise Refusal(400, refusal.message())
        upstream = self._upstream
        if upstream is None or self._closed:
            raise Refusal(503, "the relay is closing")
        spend = self._spend
        rate = self._rate if isinstance(upstream, UpstreamClient) else None  # a replayed answer costs nothing
        metered = spend is not None or rate is not None
        if metered:
            # An answer's cost is known after its last byte went out, when the agent may already have sent its next
            # request: this task's answers still being metered are waited for (briefly) before the check (and before
            # the next takes a --pb-model-tpm token).
            with self._metering:
                self._metering.wait_for(lambda: self._unmetered == 0, timeout=2.0)
        self._check_budget(spend)
        try:
            response = upstream.send(handler.command, path, self._headers(handler, body, path), body,
                                     exchange.attempts)
        except Refusal:
            if exchange.attempts.gave_up:  # no answer within the whole budget
                self._note_outage("no answer (unreachable)")
            raise
        writer = self._replay_writer
        exchange.captured = bytearray() if writer is not None and writer.room > 0 else None
        self._respond_metered(handler, exchange, response, upstream, rate=rate, spend=spend)
        if writer is not None:
            captured = exchange.captured
            writer.add(handler.command, path, body, exchange.status, response.headers,
                       response=None if captured is None or exchange.stream_broken else bytes(captured))

    def _admit(self, handler: Handler, exchange: Exchange) -> tuple[str, bytes]:
        """The request's upstream path and body, read once the cleanroom let its path and headers through, and
        then its body (refused with a :class:`Refusal` otherwise)."""
        if handler.command == "CONNECT":
            raise Refusal(405, f"CONNECT is not supported: the relay forwards only to {self.upstream.url}")
        path = self._target(handler.path)
        exchange.path = path
        # The cleanroom: a model call or nothing, refused before its body is read when the path or headers say so.
        call = None if self.allow_server_tools else allowed_call(handler.command, path, self.upstream.prefix)
        if call is not None:
            check_headers(call, handler.headers)
        body = self._read_body(handler, exchange)
        exchange.request_bytes = len(body)
        exchange.t0 = time.monotonic()
        exchange.model, exchange.stream = request_fields(body)  # scanned, not parsed: bounded memory
        if call is not None:
            check_body(call, body, self.pin)
        return path, body

    def _check_budget(self, spend: SpendLedger | None) -> None:
        """Refuses the request (402) once the run's model budget is spent."""
        if spend is not None and spend.exhausted():
            with self._lock:
                self._budget_refused += 1
            raise Refusal(402, f"the run's model budget is spent: ${spend.total():.4f} of --pb-budget "
                               f"${spend.budget:g} (no request is forwarded past x{HARD_FACTOR:g})")

    def _respond_metered(self, handler: Handler, exchange: Exchange, response: httpx.Response,
                         upstream: UpstreamClient | ReplayUpstream, *, rate: RunRateLimit | None,
                         spend: SpendLedger | None) -> None:
        """:meth:`_respond`, then the answer's usage charged to the rate limit and the spend ledger, counted as
        unmetered until it is."""
        metered = spend is not None or rate is not None
        if metered:
            with self._metering:
                self._unmetered += 1
        try:
            self._respond(handler, exchange, response)
        finally:
            upstream.done(response)
            if rate is not None:
                rate.charge(exchange.usage)
            if spend is not None:
                spend.add(exchange.usage)
            if metered:
                with self._metering:
                    self._unmetered -= 1
                    self._metering.notify_all()

    def over_budget(self) -> str | None:
        """Why requests were refused for the run's budget (the task is an error of it), ``None`` when none was."""
        with self._lock:
            refused = self._budget_refused
        if not refused or self._spend is None:
            return None
        return (f"model budget spent: {refused} request(s) refused once the run had spent ${self._spend.total():.4f} "
                f"of --pb-budget ${self._spend.budget:g} (x{HARD_FACTOR:g})")

    def cleanroom(self) -> CleanroomTally:
        """What the cleanroom refused so far (complete after :meth:`close`): its ``flag()`` and ``as_dict()``."""
        with self._lock:
            return CleanroomTally(self._cleanroom.allowed, dict(self._cleanroom.attempts),
                                  self._cleanroom.other_attempts, self._cleanroom.unreadable)

    def loop_refused(self) -> str | None:
        """Why the agent's loop was refused (it offered the model no shell tool), ``None`` when it was not."""
        refusal = self.loop.refusal
        return None if refusal is None else refusal.message()

    def outdated_client(self) -> str | None:
        """The provider's refusal of the agent's client as outdated (a 400 naming its version), if one came."""
        if self.loop.outdated is None:
            return None
        return (f"the provider refused the agent's client ({self.loop.outdated_client or 'no User-Agent'}) as "
                f"outdated: {self.loop.outdated!r}")

    def answered_idle(self) -> float | None:
        """Seconds the agent has made no model request since its final answer (``LoopWatch.answered_idle``)."""
        return self.loop.answered_idle()

    def replay_mismatch(self) -> str | None:
        """Under ``replay_from``: the first request that matched no recorded one (the task is an error of it)."""
        upstream = self._upstream
        return upstream.mismatch if isinstance(upstream, ReplayUpstream) else None

    def _respond(self, handler: Handler, exchange: Exchange, response: httpx.Response) -> None:
        status = response.status_code
        exchange.status = status
        if status in REJECTED_STATUSES:  # passed on as it came; the relay's own probe decides what it means
            exchange.rejected = True
            with self._lock:
                self._rejections[f"{status}"] += 1
        elif exchange.attempts.gave_up:
            self._note_outage(f"{status}")
        bodyless = handler.command == "HEAD" or status in (204, 304)
        headers = _response_headers(response, bodyless=bodyless, close=handler.close_connection)
        # h11 frames the body: the length when known, else chunked to HTTP/1.1 and close-delimited to HTTP/1.0.
        handler.start_response(status, headers, response.reason_phrase.encode("latin-1"))
        if bodyless:
            handler.end_response()
            exchange.mark_first_byte()
            response.read()  # nothing, but lets the connection be reused
            return
        tap = UsageTap(response.headers.get("Content-Type") or "", response.headers.get("Content-Encoding") or "")
        exchange.head = bytearray() if status == 400 else None  # read for a refusal of the client as outdated
        self._stream_body(handler, exchange, response, tap)
        if exchange.head is not None:
            user_agent = handler.headers.get("User-Agent") or ""
            outdated = refuses_client(status, bytes(exchange.head), user_agent)
            if outdated is not None:
                self.loop.outdated_refusal(outdated, user_agent)
        if exchange.first_byte_s is None:
            exchange.mark_first_byte()
        exchange.usage = tap.finish()
        exchange.tool_calls = tap.tool_calls

    def _stream_body(self, handler: Handler, exchange: Exchange, response: httpx.Response, tap: UsageTap) -> None:
        """The answer's raw bytes to the agent as they arrive (no decompression: the client gets the upstream's
        encoding, the tap inflates), each then read by the usage tap and kept for model-replay.jsonl while it fits;
        a cut stream or a client gone ends it."""
        write = handler.send_body
        chunks = response.iter_raw()
        while True:
            try:
                chunk = next(chunks, b"")
            except (httpx.HTTPError, OSError) as exc:  # a cut stream, or a body short of its Content-Length
                exchange.error = f"upstream broke off the response: {exc!r}"
                exchange.stream_broken = True
                handler.close_connection = True  # no terminating chunk: the client sees a truncated body
                break
            if not chunk:
                handler.end_response()
                break
            exchange.mark_first_byte()
            try:  # to the agent before the tap reads it: metering never delays a chunk
                write(chunk)
                gone = False
            except OSError as exc:
                exchange.error = f"client went away mid-response: {exc!r}"
                handler.close_connection = True
                gone = True
            tap.feed(chunk)
            head = exchange.head
            if head is not None and len(head) < ERROR_HEAD:
                head += chunk[:ERROR_HEAD - len(head)]
            exchange.response_bytes += len(chunk)
            self._capture(exchange, chunk)
            if gone:
                break

    def _capture(self, exchange: Exchange, chunk: bytes) -> None:
        """A chunk kept for model-replay.jsonl while the answer fits the writer's room (then none of it is)."""
        captured = exchange.captured
        if captured is not None:
            room = self._replay_writer.room if self._replay_writer is not None else 0
            if len(captured) + len(chunk) <= room:
                captured += chunk
            else:
                exchange.captured = None
