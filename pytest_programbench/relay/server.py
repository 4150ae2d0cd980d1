"""The agent-facing side of the relay: an HTTP/1.1 server on a Unix socket and/or loopback TCP, its wire work done
by h11 (parsing, body framing, chunked coding, keep-alive, ``Connection: close`` and HTTP/1.0 as h11 decides).

It is the sandbox's only way out, so it decides what it accepts before anything is forwarded: the request line
(``REQUEST_LINE_MAX``, 414 beyond) and the header fields (``HEADER_MAX``, 431 beyond) are parsed by h11 under one
cap of both (``max_incomplete_event_size``) and told apart by where the first line ends; the body is read through
h11's ``Data`` events under the relay's cap (413) and memory budget; a connection beyond ``max_connections`` gets a
503 unread; a refused request's answer is followed by a short linger so the client reads it instead of a reset.
Everything after the headers (which body to read, the forwarding) is the relay's (:class:`Host`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
from collections.abc import Callable
from typing import Protocol, cast

import h11

log = logging.getLogger(__name__)

#: Connections one relay serves at once; more get a 503. (The bridge in a sandbox opens at most half as many
#: channels, relay_bridge.MAX_CONNECTIONS: this bound is for host-loop agents, and slack for closes under way.)
MAX_CONNECTIONS = 256
#: Bytes of a request line (its CRLF excluded); more get a 414.
REQUEST_LINE_MAX = 64 << 10
#: Bytes of a request's header fields (the request line has its own ``REQUEST_LINE_MAX``); more get a 431.
HEADER_MAX = 64 << 10
#: Seconds of silence after which a refused client's remaining input is no longer read (see ``linger``).
LINGER_S = 1.0
_RECV = 65536


class Refusal(Exception):
    """An answer of the relay's own (status and message) instead of the upstream's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Host(Protocol):
    """What the server asks of the relay behind it."""

    client_idle_timeout: float
    max_connections: int

    def track(self, sock: socket.socket) -> bool: ...

    def untrack(self, sock: socket.socket) -> None: ...

    def refuse(self, handler: Handler, listener: str, status: int, message: str) -> None: ...

    def exchange(self, handler: Handler, listener: str) -> None: ...


class Headers:
    """A request's header fields as the client sent them (names in its case), looked up case-insensitively."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._items = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw]

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)

    def get_all(self, name: str) -> list[str]:
        lowered = name.lower()
        return [value for key, value in self._items if key.lower() == lowered]

    def get(self, name: str, default: str | None = None) -> str | None:
        found = self.get_all(name)
        return found[0] if found else default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(self.get_all(name))


def send_error(handler: Handler, status: int, message: str, linger_bytes: int) -> int:
    """Answer ``status`` with a JSON error body and close the connection; the bytes of body sent. The body reads as
    an error in both providers' shapes (OpenAI's ``error.message``, Anthropic's ``type: error`` with ``error.type``
    and ``error.message``), so whichever SDK the agent uses shows it the message."""
    handler.close_connection = True  # the request body may be unread
    body = json.dumps({"type": "error", "error": {"message": f"pb model relay: {message}", "type": "pb_relay_error",
                                                  "code": status}}).encode()
    sent = 0
    with contextlib.suppress(OSError, h11.LocalProtocolError):
        handler.start_response(status, [(b"Content-Type", b"application/json"),
                                        (b"Content-Length", b"%d" % len(body)), (b"Connection", b"close")])
        if handler.command != "HEAD":  # h11 sends no body after a HEAD it parsed; this covers one it could not
            handler.send_body(body)
            sent = len(body)
        handler.end_response()
        linger(handler, linger_bytes)
    return sent


def linger(handler: Handler, left: int) -> None:
    """Read and drop what the client still sends after an answer that closes the connection (a body refused
    unread, headers past the cap), up to ``left`` bytes and until it is silent for a second: closing a socket with
    unread input resets the connection, and the client would lose the answer it has not read yet. Memory stays at
    one read whatever it sends."""
    sock = handler.connection
    with contextlib.suppress(OSError, ValueError):
        sock.shutdown(socket.SHUT_WR)  # the answer is complete: the client sees its end now
        sock.settimeout(LINGER_S)
        while left > 0:
            data = sock.recv(min(left, _RECV))
            if not data:
                break
            left -= len(data)


# The refusals of a head past a cap (status, message): h11 can find either before the head is whole, the relay after.
LINE_TOO_LONG = (414, f"request line longer than {REQUEST_LINE_MAX} bytes")
HEADERS_TOO_LARGE = (431, f"request header fields larger than {HEADER_MAX} bytes")


def _head_refusal(exc: h11.RemoteProtocolError, head: bytes | bytearray) -> tuple[int, str]:
    """The status and message for a request head h11 could not parse: 414/431 for the caps, else h11's hint."""
    if "buffer too long" in str(exc):  # h11 saw more than both caps without a complete head
        end = head.find(b"\n")
        if end < 0 or end > REQUEST_LINE_MAX + 1:
            return LINE_TOO_LONG
        return HEADERS_TOO_LARGE
    return exc.error_status_hint, f"malformed request: {exc}"


class Handler(socketserver.BaseRequestHandler):
    """One client connection: requests parsed and answers framed by one ``h11.Connection``, served one by one."""

    request: socket.socket

    def setup(self) -> None:
        self.connection = self.request
        self.connection.settimeout(self._relay.client_idle_timeout)
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=REQUEST_LINE_MAX + 2 + HEADER_MAX)
        self.command, self.path, self.request_version = "-", "-", "HTTP/1.1"
        self.headers = Headers([])
        self.close_connection = False
        self._admitted = self._relay.track(self.connection)

    def handle(self) -> None:
        listener = cast(Server, self.server).listener
        if not self._admitted:  # one connection too many: refused before anything of it is read
            self._relay.refuse(self, listener, 503,
                               f"too many connections at once (at most {self._relay.max_connections})")
            return
        try:
            while self._one_request(listener):
                pass
        except OSError:  # timeouts, resets, broken pipes: this connection is done
            pass

    def finish(self) -> None:
        self._relay.untrack(self.connection)

    @property
    def _relay(self) -> Host:
        return cast(Server, self.server).relay

    def _recv(self) -> bytes:
        data = self.connection.recv(_RECV)
        self._h11.receive_data(data)  # b"": the client closed its side
        return data

    def _one_request(self, listener: str) -> bool:
        """Serve one request; whether the connection stays open for another."""
        conn = self._h11
        head = bytearray()  # this request's bytes as received (to tell an over-long request line from headers)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._relay.refuse(self, listener, *_head_refusal(exc, head))
                return False
            if event is h11.NEED_DATA:
                if len(head) > REQUEST_LINE_MAX + 1 and b"\n" not in head:  # no need to wait for both caps
                    self._relay.refuse(self, listener, *LINE_TOO_LONG)
                    return False
                data = self._recv()
                if len(head) <= REQUEST_LINE_MAX + 2 + HEADER_MAX:
                    head += data
                continue
            if isinstance(event, h11.Request):
                break
            return False  # ConnectionClosed, or PAUSED (a protocol switch the relay does not do)
        self.command = event.method.decode("ascii")
        self.path = event.target.decode("latin-1")
        self.request_version = "HTTP/" + event.http_version.decode("ascii")
        raw = event.headers.raw_items()
        self.headers = Headers(raw)
        # One cap of both in h11: each its own here, for a head under the sum.
        if len(event.method) + len(event.target) + 10 > REQUEST_LINE_MAX:
            self._relay.refuse(self, listener, *LINE_TOO_LONG)
            return False
        if sum(len(name) + len(value) + 4 for name, value in raw) + 2 > HEADER_MAX:
            self._relay.refuse(self, listener, *HEADERS_TOO_LARGE)
            return False
        self._relay.exchange(self, listener)
        if self.close_connection or conn.our_state is not h11.DONE:
            return False
        if conn.their_state is h11.SEND_BODY:  # a request answered without reading its body: done if it had none
            with contextlib.suppress(h11.RemoteProtocolError):
                conn.next_event()
        if conn.their_state is not h11.DONE:
            return False
        conn.start_next_cycle()
        return True

    # -- what the relay reads and writes

    def read_body(self, limit: int, hold: Callable[[int], None]) -> bytes:
        """The request body (Content-Length or chunked, h11 decoding), at most ``limit`` bytes (a 413 beyond);
        ``hold(n)`` is called before ``n`` more bytes are kept (it refuses when there is no room)."""
        conn = self._h11
        length: int | None = None
        declared = self.headers.get("Content-Length")
        if declared is not None and "Transfer-Encoding" not in self.headers:  # h11 validated it
            length = int(declared)
            if length > limit:
                raise Refusal(413, f"request body of {length} bytes exceeds the relay's limit")
            hold(length)
        if conn.they_are_waiting_for_100_continue:
            self._send(h11.InformationalResponse(status_code=100, headers=[]))
        chunks: list[bytes] = []
        got = 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise Refusal(exc.error_status_hint, f"malformed request body: {exc}") from exc
            if event is h11.NEED_DATA:
                if not self._recv():
                    raise ConnectionResetError("the client closed before sending the whole body")
                continue
            if isinstance(event, h11.Data):
                got += len(event.data)
                if got > limit:
                    raise Refusal(413, "request body exceeds the relay's limit")
                if length is None:
                    hold(len(event.data))
                chunks.append(bytes(event.data))
                continue
            if isinstance(event, h11.EndOfMessage):
                break
            raise ConnectionResetError("the client closed before sending the whole body")
        if length is None and len(chunks) > 1:
            hold(got)  # the joined copy exists next to the chunks for a moment
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _send(self, event: h11.Event) -> None:
        data = self._h11.send(event)
        if data:
            self.connection.sendall(data)

    def start_response(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes = b"") -> None:
        """The status line and header fields; h11 adds the framing (chunked for HTTP/1.1 without a length,
        close for HTTP/1.0) and ``Connection: close`` when either side asked for it."""
        self._send(h11.Response(status_code=status, headers=headers, reason=reason))

    def send_body(self, data: bytes) -> None:
        self._send(h11.Data(data=data))

    def end_response(self) -> None:
        self._send(h11.EndOfMessage())
        if self._h11.our_state is h11.MUST_CLOSE:
            self.close_connection = True


class Server(socketserver.ThreadingMixIn, socketserver.BaseServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # socketserver's 5 makes a Unix connect fail with EAGAIN under a burst
    relay: Host
    listener: str


class UnixServer(Server, socketserver.UnixStreamServer):
    pass


class TCPServer(Server, socketserver.TCPServer):
    allow_reuse_address = True
