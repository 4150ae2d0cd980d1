#!/usr/bin/env python3
"""Bridge TCP connections on a loopback address to a Unix socket: the model relay's door into a sandbox.

Runs inside the network-less sandbox as root, with the container's own python3, so it is one stdlib-only file
that works on Python 3.7 and later. Every connection accepted on ``--listen`` gets its own connection to the Unix
socket ``--unix`` (the host's model relay, bind-mounted into the container); bytes flow both ways unchanged, a
half-close on one side is passed on to the other (``shutdown(SHUT_WR)``), and a reset tears down both.

    python3 -I -S relay_bridge.py --listen 127.0.0.1:47801 --unix /run/pb-relay/relay.sock [--daemon]

With ``--daemon`` the command returns (exit 0) only once the bridge listens, and keeps it running in the
background, detached from the caller's terminal and output (so ``docker exec`` returns); any startup error is
reported on stderr with a non-zero exit status instead.

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
import stat
import sys
import threading
import time
from collections.abc import Sequence

BUFFER = 65536
MAX_CONNECTIONS = 512
CONNECT_TIMEOUT = 10.0


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
    server.listen(128)
    server.setblocking(False)
    return server


def _shutdown(sock: socket.socket, how: int) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(how)


def _pump(source: socket.socket, sink: socket.socket, broken: threading.Event) -> None:
    """Copy until EOF, then pass the half-close on; on an error cut both connections."""
    try:
        while True:
            data = source.recv(BUFFER)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        broken.set()
        _shutdown(source, socket.SHUT_RDWR)
        _shutdown(sink, socket.SHUT_RDWR)
        return
    _shutdown(sink, socket.SHUT_WR)


def connect_unix(path: str) -> socket.socket:
    """Connect, waiting while the relay's accept backlog is full (EAGAIN on a Unix socket), up to a limit."""
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


class Bridge:
    def __init__(self, listeners: Sequence[socket.socket], unix_path: str) -> None:
        self.listeners = list(listeners)
        self.unix_path = unix_path
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.stopping = threading.Event()

    def serve(self) -> None:
        selector = selectors.DefaultSelector()
        for listener in self.listeners:
            selector.register(listener, selectors.EVENT_READ, listener)
        while not self.stopping.is_set():
            for key, _ in selector.select(timeout=0.5):
                server: socket.socket = key.data
                try:
                    client, _address = server.accept()
                except OSError:  # e.g. the client already reset; EMFILE: retry on the next round
                    continue
                if not self.slots.acquire(blocking=False):
                    client.close()
                    continue
                thread = threading.Thread(target=self._connection, args=(client,))
                thread.daemon = True
                thread.start()
        selector.close()

    def _connection(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            client.setblocking(True)
            if client.family in (socket.AF_INET, socket.AF_INET6):
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream = connect_unix(self.unix_path)
            broken = threading.Event()
            inbound = threading.Thread(target=_pump, args=(client, upstream, broken))
            inbound.daemon = True
            inbound.start()
            _pump(upstream, client, broken)
            inbound.join()
        except OSError as exc:
            log(f"connection failed: {exc!r}")
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    sock.close()
            self.slots.release()


def log(message: str) -> None:
    try:
        sys.stderr.write(f"relay_bridge: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def daemonize(log_path: str | None, pidfile: str | None) -> None:
    """Detach. The calling process exits 0 once the serving grandchild has written its pidfile (the sockets
    already listen, so connections queue from now on); the grandchild returns from here and serves."""
    ready_read, ready_write = os.pipe()
    if os.fork() > 0:
        os.close(ready_write)
        with os.fdopen(ready_read, "rb") as ready:
            os._exit(0 if ready.read() == b"ok" else 1)
    os.close(ready_read)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")
    os.umask(0o022)
    devnull = os.open(os.devnull, os.O_RDWR)
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if log_path else devnull
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in {devnull, out}:
        if fd > 2:
            os.close(fd)
    write_pidfile(pidfile)
    os.write(ready_write, b"ok")
    os.close(ready_write)


def write_pidfile(pidfile: str | None) -> None:
    if pidfile:
        with open(pidfile, "w") as handle:
            handle.write(f"{os.getpid()}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Bridge loopback TCP connections to a Unix socket.")
    parser.add_argument("--listen", action="append", required=True, metavar="HOST:PORT",
                        help="loopback address to listen on (repeatable; [::1]:PORT for IPv6)")
    parser.add_argument("--unix", required=True, metavar="PATH", help="the Unix socket to connect each client to")
    parser.add_argument("--daemon", action="store_true", help="return once listening; keep serving in background")
    parser.add_argument("--log", metavar="FILE", help="with --daemon: append diagnostics here")
    parser.add_argument("--pidfile", metavar="FILE", help="write the serving process's pid here once listening")
    args = parser.parse_args(argv)
    try:
        mode = os.stat(args.unix).st_mode
    except OSError as exc:
        log(f"cannot reach the relay socket {args.unix}: {exc}")
        return 2
    if not stat.S_ISSOCK(mode):
        log(f"{args.unix} is not a socket")
        return 2
    try:
        listeners = [listen(text) for text in args.listen]
    except (OSError, ValueError) as exc:
        log(f"cannot listen: {exc}")
        return 2
    if args.daemon:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        daemonize(args.log, args.pidfile)
    else:
        write_pidfile(args.pidfile)
        sys.stdout.write("listening\n")
        sys.stdout.flush()
    bridge = Bridge(listeners, args.unix)

    def stop(signum: int, frame: object) -> None:
        bridge.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    bridge.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
