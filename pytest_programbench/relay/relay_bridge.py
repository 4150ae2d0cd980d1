#!/usr/bin/env python3
"""The model relay's door into a sandbox: loopback TCP connections carried as channels over stdin/stdout.

Runs inside the network-less sandbox as root, with the container's own python3, so it is one stdlib-only file
that works on Python 3.7 and later (tests/test_relay_bridge.py checks it). Every connection accepted on
``--listen`` becomes a numbered channel multiplexed over the bridge's own stdin and stdout, which the host holds as
one ``docker exec`` stream (``relay_tunnel.py``, which connects each channel to the relay). That needs no bind
mount, so it works on any engine, local or remote. A frame is ``>IBI`` (channel, kind, payload length) then the
payload; kinds: OPEN, DATA, EOF (half-close), CLOSE (reset), READY (the bridge listens), ACK (the host delivered
that many bytes of the channel). The bridge exits when its stdin ends (the host went away).

Flow control: a channel may have at most ``WINDOW`` bytes sent to the host and not yet acknowledged; past that the
bridge stops reading the client, whose bytes then wait in the sandbox's own socket buffers. So the host holds at
most ``MAX_CONNECTIONS * WINDOW`` bytes of the agent's requests however fast the agent sends and however slowly
the relay reads (a relay waiting for room in its byte budget does not read at all).

    python3 -I -S relay_bridge.py --listen 127.0.0.1:47801 --stdio

Annotations are never evaluated (``from __future__ import annotations``), so their modern syntax is fine on 3.7;
the code itself avoids anything newer than 3.7 (walrus, ``removeprefix``, ``socket.create_server``...).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence

BUFFER = 65536
MAX_CONNECTIONS = 128  # channels at once; more clients wait in the listen backlog until one ends
# Connections the kernel completes and queues for accept (capped by net.core.somaxconn, 4096 by default). Past it a
# client's handshake waits on SYN retries, which a loaded host can let run out: that client is reset with no answer.
BACKLOG = 1024
WINDOW = 256 << 10  # bytes of one channel sent to the host and not yet acknowledged
CONNECT_TIMEOUT = 10.0

# The --stdio tunnel's frames (relay_tunnel.py speaks the other end).
FRAME = struct.Struct(">IBI")
OPEN, DATA, EOF, CLOSE, READY, ACK = range(6)
ACK_PAYLOAD = struct.Struct(">I")
MAX_FRAME = 1 << 20
MAX_PENDING = 64 << 20  # bytes waiting for a client that does not read: then its channel is dropped


def parse_address(text: str) -> tuple[int, str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` to (family, host, port); only loopback hosts are accepted."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    port = int(port_text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in ("localhost", ""):
        host = "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    packed = socket.inet_pton(family, host)
    loopback = packed[0] == 127 if family == socket.AF_INET else packed == b"\0" * 15 + b"\1"
    if not loopback:
        raise ValueError(f"refusing to listen on non-loopback address {text!r}")
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {text!r}")
    return family, host, port


def listen(text: str) -> socket.socket:
    family, host, port = parse_address(text)
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    server.bind((host, port))
    server.listen(BACKLOG)
    server.setblocking(False)
    return server


def connect_unix(path: str) -> socket.socket:
    """Connect, waiting while the relay's accept backlog is full (EAGAIN on a Unix socket), up to a limit.

    Used on the host (the tunnel's connection to the relay's socket); here because it needs only the stdlib."""
    deadline = time.monotonic() + CONNECT_TIMEOUT
    delay = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
            continue
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)
        return sock


class FrameReader:
    """Reassembles frames from a byte stream that arrives in arbitrary pieces."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        self.buffer += data
        frames = []
        while len(self.buffer) >= FRAME.size:
            channel, kind, length = FRAME.unpack_from(self.buffer)
            if length > MAX_FRAME:
                raise ValueError(f"frame of {length} bytes")
            if len(self.buffer) < FRAME.size + length:
                break
            frames.append((channel, kind, bytes(self.buffer[FRAME.size:FRAME.size + length])))
            del self.buffer[:FRAME.size + length]
        return frames


def frame(channel: int, kind: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(channel, kind, len(payload)) + payload


class StdioBridge:
    """Accepted connections as channels over stdin/stdout, in one thread with non-blocking sockets: a client that
    does not read its answer holds up only its own channel (its bytes wait in its buffer, up to a bound)."""

    def __init__(self, listeners: Sequence[socket.socket], stdin_fd: int = 0, stdout_fd: int = 1) -> None:
        self.listeners = list(listeners)
        self.stdin_fd = stdin_fd
        self.stdout_fd = stdout_fd
        self.channels: dict[int, socket.socket] = {}
        self.pending: dict[int, bytearray] = {}  # host -> client bytes not yet taken by the client
        self.half: dict[int, set[str]] = {}  # ended directions: "in" (from the client), "out" (to it)
        self.eof_pending: set[int] = set()  # the host half-closed; pass it on once pending is flushed
        self.unacked: dict[int, int] = {}  # client -> host bytes the host has not acknowledged yet
        self.next_channel = 1
        self.selector = selectors.DefaultSelector()
        self.accepting = True

    def emit(self, channel: int, kind: int, payload: bytes = b"") -> None:
        data = frame(channel, kind, payload)
        while data:
            written = os.write(self.stdout_fd, data)
            data = data[written:]

    def serve(self) -> None:
        for listener in self.listeners:
            self.selector.register(listener, selectors.EVENT_READ, "listener")
        self.selector.register(self.stdin_fd, selectors.EVENT_READ, "stdin")
        self.emit(0, READY)
        reader = FrameReader()
        while True:
            for key, events in self.selector.select():
                if key.data == "listener":
                    self._accept(key.fileobj)  # type: ignore[arg-type]
                elif key.data == "stdin":
                    data = os.read(self.stdin_fd, BUFFER)
                    if not data:
                        return  # the host went away
                    for channel, kind, payload in reader.feed(data):
                        self._from_host(channel, kind, payload)
                else:
                    channel = int(key.data)
                    if events & selectors.EVENT_WRITE:
                        self._flush(channel)
                    if events & selectors.EVENT_READ and channel in self.channels:
                        self._from_client(channel)

    def _events(self, channel: int) -> int:
        reading = "in" not in self.half[channel] and self.unacked[channel] < WINDOW
        events = selectors.EVENT_READ if reading else 0
        return events | (selectors.EVENT_WRITE if self.pending[channel] else 0)

    def _update(self, channel: int) -> None:
        client = self.channels[channel]
        events = self._events(channel)
        try:
            if events:
                self.selector.modify(client, events, str(channel))
            else:
                self.selector.unregister(client)
        except KeyError:
            if events:
                self.selector.register(client, events, str(channel))

    def _accept(self, server: socket.socket) -> None:
        try:
            client, _address = server.accept()
        except OSError:
            return
        client.setblocking(False)
        if client.family in (socket.AF_INET, socket.AF_INET6):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = self.next_channel
        self.next_channel += 1
        self.channels[channel] = client
        self.pending[channel] = bytearray()
        self.half[channel] = set()
        self.unacked[channel] = 0
        self.selector.register(client, selectors.EVENT_READ, str(channel))
        self.emit(channel, OPEN)
        if len(self.channels) >= MAX_CONNECTIONS:  # at the limit: the next clients wait in the backlog
            self._accept_more(False)

    def _accept_more(self, accept: bool) -> None:
        if accept == self.accepting:
            return
        self.accepting = accept
        for listener in self.listeners:
            if accept:
                self.selector.register(listener, selectors.EVENT_READ, "listener")
            else:
                self.selector.unregister(listener)

    def _from_client(self, channel: int) -> None:
        try:
            data = self.channels[channel].recv(BUFFER)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(channel, tell_host=True)
            return
        if data:
            self.emit(channel, DATA, data)
            self.unacked[channel] += len(data)
            if self.unacked[channel] >= WINDOW:
                self._update(channel)  # not read again until the host acknowledges
            return
        self.emit(channel, EOF)
        self._ended(channel, "in")

    def _from_host(self, channel: int, kind: int, payload: bytes) -> None:
        if channel not in self.channels:
            return  # already dropped here; the host learned it from our CLOSE
        if kind == DATA:
            self.pending[channel] += payload
            if len(self.pending[channel]) > MAX_PENDING:
                self._drop(channel, tell_host=True)  # a client that never reads its answer
                return
            self._flush(channel)
        elif kind == EOF:
            self.eof_pending.add(channel)
            self._flush(channel)
        elif kind == CLOSE:
            self._drop(channel, tell_host=False)
        elif kind == ACK and len(payload) == ACK_PAYLOAD.size:
            self.unacked[channel] = max(0, self.unacked[channel] - ACK_PAYLOAD.unpack(payload)[0])
            self._update(channel)

    def _flush(self, channel: int) -> None:
        client = self.channels[channel]
        pending = self.pending[channel]
        try:
            while pending:
                sent = client.send(pending[:BUFFER])
                del pending[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(channel, tell_host=True)
            return
        if not pending and channel in self.eof_pending:
            self.eof_pending.discard(channel)
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)
            self._ended(channel, "out")
            return
        self._update(channel)

    def _ended(self, channel: int, direction: str) -> None:
        self.half[channel].add(direction)
        if self.half[channel] == {"in", "out"}:
            self._drop(channel, tell_host=False)
        else:
            self._update(channel)

    def _drop(self, channel: int, *, tell_host: bool) -> None:
        client = self.channels.pop(channel, None)
        self.pending.pop(channel, None)
        self.half.pop(channel, None)
        self.unacked.pop(channel, None)
        self.eof_pending.discard(channel)
        if client is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(client)
        client.close()
        self._accept_more(len(self.channels) < MAX_CONNECTIONS)
        if tell_host:
            self.emit(channel, CLOSE)


def log(message: str) -> None:
    try:
        sys.stderr.write(f"relay_bridge: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Carry loopback TCP connections over stdin/stdout.")
    parser.add_argument("--listen", action="append", required=True, metavar="HOST:PORT",
                        help="loopback address to listen on (repeatable; [::1]:PORT for IPv6)")
    parser.add_argument("--stdio", action="store_true", required=True,
                        help="carry every connection over stdin/stdout (a tunnel)")
    args = parser.parse_args(argv)
    try:
        listeners = [listen(text) for text in args.listen]
    except (OSError, ValueError) as exc:
        log(f"cannot listen: {exc}")
        return 2
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # the host went away: end quietly
    StdioBridge(listeners).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
