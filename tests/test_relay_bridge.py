"""The in-sandbox relay bridge (``relay_bridge.py --stdio``) run as a host process, the test speaking the host's end.

The test plays ``relay_tunnel.py``'s part on the bridge's stdin/stdout with the real frame protocol (``frame`` and
``FrameReader``) and echoes what each channel sends, so every property of the bridge is seen from a client's socket:
bursts beyond the channel limit, full duplex and half-close, a refused channel, bad ``--listen`` values. The same
bridge runs in a real sandbox in tests/test_relay_tunnel.py; here it is seconds, not a container.
"""

from __future__ import annotations

import ast
import errno
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from pytest_programbench.relay.contract import BRIDGE_SCRIPT
from pytest_programbench.relay.relay_bridge import (
    ACK,
    ACK_PAYLOAD,
    BUFFER,
    CLOSE,
    DATA,
    EOF,
    MAX_CONNECTIONS,
    OPEN,
    READY,
    WINDOW,
    FrameReader,
    frame,
)

BURST = 300  # more than the bridge's channel limit (128): the rest wait in the accept backlog, none may be dropped
DUPLEX_BYTES = 8 << 20  # far more than both pipes' and sockets' buffers: both directions must flow at once


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Host:
    """The host's end of the tunnel: echoes every DATA frame back at once and, after a channel's EOF, sends
    ``end:<bytes received>`` and its own EOF. ``refuse``: answer every OPEN with CLOSE (no relay behind)."""

    def __init__(self, *, refuse: bool = False, ack: bool = True) -> None:
        self.port = free_port()
        self.refuse = refuse
        self.ack = ack  # acknowledge what arrived (the tunnel does once the relay took it)
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(BRIDGE_SCRIPT), "--listen",
                                      f"127.0.0.1:{self.port}", "--stdio"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.ready = threading.Event()
        self.opened: set[int] = set()
        self.closed: set[int] = set()
        self.received: dict[int, int] = {}
        # The reader never writes: a bridge blocked on a full stdout while we block on its full stdin would hang.
        self.outbox: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()
        assert self.ready.wait(10), self.proc.stderr.read() if self.proc.stderr else ""

    def _read(self) -> None:
        assert self.proc.stdout is not None
        reader = FrameReader()
        while data := os.read(self.proc.stdout.fileno(), 65536):
            for channel, kind, payload in reader.feed(data):
                self._frame(channel, kind, payload)

    def _frame(self, channel: int, kind: int, payload: bytes) -> None:
        if kind == READY:
            self.ready.set()
        elif kind == OPEN:
            self.opened.add(channel)
            self.received[channel] = 0
            if self.refuse:
                self.outbox.put(frame(channel, CLOSE))
        elif self.refuse:
            return  # a refused channel is gone on the host: nothing more is sent on it
        elif kind == DATA:
            self.received[channel] += len(payload)
            self.outbox.put(frame(channel, DATA, payload))
            if self.ack:
                self.outbox.put(frame(channel, ACK, ACK_PAYLOAD.pack(len(payload))))
        elif kind == EOF:
            self.outbox.put(frame(channel, DATA, b"end:%d" % self.received[channel]) + frame(channel, EOF))
        elif kind == CLOSE:
            self.closed.add(channel)

    def _write(self) -> None:
        assert self.proc.stdin is not None
        while (data := self.outbox.get()) is not None:
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except OSError:
                return

    def close(self) -> int:
        self.outbox.put(None)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture
def host() -> Iterator[Host]:
    bridge = Host()
    yield bridge
    if bridge.proc.poll() is None:
        bridge.close()


def exchange(port: int, payload: bytes, *, timeout: float = 60) -> bytes:
    """Send, half-close, read to EOF. A connection the other side closed with the request unread is reset (RST):
    its end, as for a closed one (the half-close or a read then fails with ENOTCONN or ECONNRESET)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        got = bytearray()
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                got += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise
    return bytes(got)


def test_a_burst_beyond_the_channel_limit_loses_no_connection(host: Host) -> None:
    start = threading.Barrier(BURST)
    answers: dict[int, bytes | str] = {}

    def client(k: int) -> None:
        payload = b"%d:" % k + bytes((k + i) % 251 for i in range(2000))
        start.wait()
        try:
            answer = exchange(host.port, payload)
        except OSError as exc:
            answers[k] = repr(exc)
            return
        answers[k] = "ok" if answer == payload + b"end:%d" % len(payload) else answer[:80]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert {k: v for k, v in answers.items() if v != "ok"} == {}
    assert len(answers) == BURST
    assert len(host.opened) == BURST


def test_full_duplex_and_half_close(host: Host) -> None:
    """The echo comes back while the client is still sending; the client's half-close reaches the host after its
    last byte (``end:<all of it>``), and the host's half-close reaches the client as EOF."""
    payload = os.urandom(DUPLEX_BYTES)
    got = bytearray()
    with socket.create_connection(("127.0.0.1", host.port), timeout=60) as sock:
        def send() -> None:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        while chunk := sock.recv(1 << 16):
            got += chunk
        sender.join(60)
    assert len(got) == DUPLEX_BYTES + len(b"end:%d" % DUPLEX_BYTES)
    assert bytes(got) == payload + b"end:%d" % DUPLEX_BYTES


def test_a_refused_channel_closes_the_client() -> None:
    """No relay behind the tunnel (the host answers OPEN with CLOSE): the agent's connection is closed, not left
    hanging, and the bridge goes on serving the next one."""
    host = Host(refuse=True)
    try:
        for expected in ({1}, {1, 2}):
            assert exchange_or_empty(host.port) == b""
            assert host.opened == expected
    finally:
        assert host.close() == 0


def exchange_or_empty(port: int) -> bytes:
    try:
        return exchange(port, b"GET / HTTP/1.1\r\n\r\n", timeout=10)
    except (ConnectionResetError, BrokenPipeError):  # closed with the request unread (a timeout is a failure)
        return b""


@pytest.mark.parametrize(("listen", "message"), [
    ("0.0.0.0:4000", "non-loopback"),
    ("10.1.2.3:4000", "non-loopback"),
    ("[::2]:4000", "non-loopback"),
    ("127.0.0.1", "HOST:PORT"),
    ("127.0.0.1:http", "HOST:PORT"),
    ("127.0.0.1:70000", "out of range"),
    ("not-an-address:4000", "cannot listen"),
])
def test_bad_listen_values_are_refused(listen: str, message: str) -> None:
    result = subprocess.run([sys.executable, "-I", "-S", str(BRIDGE_SCRIPT), "--listen", listen, "--stdio"],
                            stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr.decode()
    assert result.stdout == b"", "no READY frame: nothing listens"


def test_only_the_stdio_mode_is_left() -> None:
    result = subprocess.run([sys.executable, "-I", "-S", str(BRIDGE_SCRIPT), "--listen", "127.0.0.1:4000",
                             "--unix", "/tmp/relay.sock"], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    assert result.returncode == 2
    assert b"--stdio" in result.stderr


def test_the_bridge_ends_with_its_stdin(host: Host) -> None:
    assert exchange(host.port, b"hello") == b"hello" + b"end:5"
    assert host.close() == 0


def test_the_bridge_runs_on_python_3_7() -> None:
    """Task images run the bridge with whatever python3 they ship: its syntax and the stdlib it uses must exist in
    3.7. ``ast`` checks the grammar (walrus, positional-only parameters...), vermin the stdlib modules, functions
    and arguments it can see (``socket.create_server``, ``math.prod``...; not methods of values it cannot type)."""
    source = BRIDGE_SCRIPT.read_text()
    ast.parse(source, filename=str(BRIDGE_SCRIPT), feature_version=(3, 7))
    result = subprocess.run([sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())",
                             "-t=3.7-", "--violations", "--no-tips", str(BRIDGE_SCRIPT)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_channel_holds_at_most_its_window_until_acknowledged() -> None:
    """Flow control: however fast the client sends, the host gets at most ``WINDOW`` (plus one read) of a channel's
    bytes it has not acknowledged; the rest waits in the client's socket. Acknowledged, it flows again, whole."""
    host = Host(ack=False)
    payload = os.urandom(4 << 20)
    try:
        with socket.create_connection(("127.0.0.1", host.port), timeout=60) as sock:
            sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
            sender.start()
            deadline = time.monotonic() + 30
            while sum(host.received.values()) < WINDOW and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)  # more time only lets more through: the bound must still hold
            [channel] = host.received
            assert WINDOW <= host.received[channel] <= WINDOW + BUFFER
            host.ack = True
            host.outbox.put(frame(channel, ACK, ACK_PAYLOAD.pack(host.received[channel])))
            echoed = bytearray()
            while len(echoed) < len(payload):
                chunk = sock.recv(1 << 16)
                assert chunk, "the channel closed before everything came back"
                echoed += chunk
            sender.join(30)
        assert bytes(echoed) == payload
    finally:
        assert host.close() == 0


def test_clients_beyond_the_channel_limit_wait_in_the_backlog(host: Host) -> None:
    """``MAX_CONNECTIONS`` channels at once: the next client is not accepted (nor dropped) until one ends."""
    held = [socket.create_connection(("127.0.0.1", host.port), timeout=30) for _ in range(MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 30
        while len(host.opened) < MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)
        waiting = socket.create_connection(("127.0.0.1", host.port), timeout=30)  # in the listen backlog
        waiting.sendall(b"late")
        waiting.shutdown(socket.SHUT_WR)
        time.sleep(0.5)  # time only lets a wrongly accepted channel show
        assert len(host.opened) == MAX_CONNECTIONS
        held.pop().close()
        got = bytearray()
        while chunk := waiting.recv(65536):
            got += chunk
        waiting.close()
        assert bytes(got) == b"late" + b"end:4"
        assert len(host.opened) == MAX_CONNECTIONS + 1
    finally:
        for sock in held:
            sock.close()
