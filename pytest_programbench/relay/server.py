"""The agent-facing side of the relay: a small HTTP/1.1 server of our own on a Unix socket and/or loopback TCP.

It is the sandbox's only way out, so it decides byte by byte what it accepts: the request line (64 KiB, 414 beyond)
and the header fields (``HEADER_MAX``, 431 beyond) are read under caps before anything is forwarded; a connection
beyond ``max_connections`` gets a 503 unread; a refused request's answer is followed by a short linger so the client
reads it instead of a reset. Everything after the headers (the body, the forwarding) is the relay's
(:class:`Host`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import socketserver
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol, cast

log = logging.getLogger(__name__)

#: Connections one relay serves at once; more get a 503. (The bridge in a sandbox opens at most half as many
#: channels, relay_bridge.MAX_CONNECTIONS: this bound is for host-loop agents, and slack for closes under way.)
MAX_CONNECTIONS = 256
#: Bytes of a request's header fields (the request line has its own 64 KiB); more get a 431.
HEADER_MAX = 64 << 10
#: Seconds of silence after which a refused client's remaining input is no longer read (see ``linger``).
LINGER_S = 1.0


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


def send_error(handler: Handler, status: int, message: str, linger_bytes: int) -> int:
    """Answer ``status`` with a JSON error body and close the connection; the bytes of body sent."""
    handler.close_connection = True  # the request body may be unread
    body = json.dumps({"error": {"message": f"pb model relay: {message}", "type": "pb_relay_error",
                                 "code": status}}).encode()
    sent = 0
    with contextlib.suppress(OSError):
        handler.send_response_only(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)
            sent = len(body)
        linger(handler, linger_bytes)
    return sent


def linger(handler: Handler, left: int) -> None:
    """Read and drop what the client still sends after an answer that closes the connection (a body refused
    unread, headers past the cap), up to ``left`` bytes and until it is silent for a second: closing a socket with
    unread input resets the connection, and the client would lose the answer it has not read yet. Memory stays at
    one read whatever it sends."""
    with contextlib.suppress(OSError, ValueError):
        handler.connection.shutdown(socket.SHUT_WR)  # the answer is complete: the client sees its end now
        handler.connection.settimeout(LINGER_S)
        while left > 0:
            data = handler.rfile.read1(min(left, 65536))
            if not data:
                break
            left -= len(data)


class HeaderLimit:
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


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "pb-model-relay"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self._relay.client_idle_timeout)
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._admitted = self._relay.track(self.connection)

    def handle(self) -> None:
        if not self._admitted:  # one connection too many: refused before anything of it is read
            self.command, self.path, self.request_version = "-", "-", "HTTP/1.1"
            self._relay.refuse(self, cast(Server, self.server).listener, 503,
                                f"too many connections at once (at most {self._relay.max_connections})")
            return
        super().handle()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._relay.untrack(self.connection)

    @property
    def _relay(self) -> Host:
        return cast(Server, self.server).relay

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
            limited = HeaderLimit(rfile, HEADER_MAX)
            self.rfile = cast(Any, limited)
            try:
                parsed = self.parse_request()
            finally:
                self.rfile = rfile
            if not parsed:
                return
            listener = cast(Server, self.server).listener
            if limited.exceeded:
                self._relay.refuse(self, listener, 431, f"request header fields larger than {HEADER_MAX} bytes")
                return
            self._relay.exchange(self, listener)
        except OSError:  # timeouts, resets, broken pipes: this connection is done
            self.close_connection = True

    def address_string(self) -> str:
        return str(self.client_address[0]) if isinstance(self.client_address, tuple) else "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("relay %s: " + format, self.address_string(), *args)


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

