"""The relay tunnel: connections from inside a sandbox carried over one exec stream to a socket on the host.

A real sandbox, a host-side echo server standing in for the relay: bytes arrive unchanged both ways, half-closes
pass through, several connections at once stay apart, nothing is bind-mounted, and the agent user cannot stop it.
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.engine.docker_engine import Labels, sweep
from pytest_programbench.relay.contract import BRIDGE_SCRIPT
from pytest_programbench.relay.relay_bridge import connect_unix
from pytest_programbench.relay.relay_tunnel import RelayTunnel, TunnelError
from pytest_programbench.sandbox.layout import RELAY_PORT
from pytest_programbench.sandbox.sandbox import Sandbox
from tests.conftest import Testbed

pytestmark = pytest.mark.docker

IMAGE = "programbench/pbfix_1776_rpn.0b5e55e:task_cleanroom_v6"
PORT = RELAY_PORT

# Run as the agent user inside the sandbox: N clients at once, each sends SIZE bytes of its own pattern,
# half-closes, and must read back exactly what it sent (the echo server upper-cases nothing: bytes are bytes).
CLIENTS = f"PORT = {PORT}\n" + r"""
import socket, sys, threading
n, size = int(sys.argv[1]), int(sys.argv[2])
failures = []
def client(k):
    try:
        exchange(k)
    except Exception as exc:
        failures.append((k, repr(exc)))
def exchange(k):
    data = bytes((k * 7 + i) % 251 for i in range(size))
    s = socket.create_connection(("127.0.0.1", PORT), timeout=60)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    got = bytearray()
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    if bytes(got) != data:
        failures.append((k, len(got)))
threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
[t.start() for t in threads]
[t.join() for t in threads]
print("failures", failures)
sys.exit(1 if failures else 0)
"""


class EchoServer:
    """A Unix-socket server that echoes every connection until its EOF, then half-closes back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.connections = 0
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(64)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    @staticmethod
    def _handle(conn: socket.socket) -> None:
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()


class Refuser(EchoServer):
    """A relay refusing every request before its body is read: it answers after the first bytes and closes while
    the client is still sending (as the relay does when its linger after a refusal ends)."""

    ANSWER = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

    @staticmethod
    def _handle(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(Refuser.ANSWER)


# Run as root inside the sandbox: N clients at once, each sends SIZE bytes (a request body the relay refuses
# unread), then reads what came back; prints each client's first line.
SENDERS = f"PORT = {PORT}\n" + r"""
import json, socket, sys, threading
n, size = int(sys.argv[1]), int(sys.argv[2])
got = {}
def client(k):
    s = socket.create_connection(("127.0.0.1", PORT), timeout=120)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size)
    except OSError as exc:
        got.setdefault(k, "send: " + type(exc).__name__)
    answer = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    except OSError as exc:
        got.setdefault(k, "recv: " + type(exc).__name__)
    s.close()
    got[k] = answer.split(b"\r\n", 1)[0].decode() or got.get(k, "nothing")
threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(got, sort_keys=True))
"""


@pytest.fixture
def box(testbed: Testbed, engine: Any) -> Iterator[Sandbox]:
    labels = Labels(f"pbtest-tunnel-{uuid.uuid4().hex[:10]}", "controller", "pbfix__rpn.0b5e55e")
    sandbox = Sandbox(IMAGE, labels=labels, cpus=1, memory=512 << 20, lifetime=600, engine=engine).start()
    try:
        yield sandbox
    finally:
        sandbox.close()
        sweep(labels.run_id, engine=engine)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    with tempfile.TemporaryDirectory(prefix="pb-echo-") as directory:
        server = EchoServer(Path(directory) / "relay.sock")
        yield server
        server.close()


def _open(box: Sandbox, echo: EchoServer) -> RelayTunnel:
    return RelayTunnel(box.engine.api, box.id, lambda: connect_unix(str(echo.path))).open(
        PORT, script=BRIDGE_SCRIPT.read_bytes())


def test_connections_cross_the_tunnel_unchanged(box: Sandbox, echo: EchoServer, docker_client: Any) -> None:
    tunnel = _open(box, echo)
    try:
        box.put_file(CLIENTS.encode(), "/tmp/clients.py", mode=0o644, owner="root")
        result = box.exec(["python3", "/tmp/clients.py", "6", str(3 << 20)], timeout=300)
        assert result.exit_code == 0, result.text
        assert echo.connections == 6
        assert docker_client.api.inspect_container(box.id)["Mounts"] == [], "the tunnel needs no bind mount"
    finally:
        tunnel.close()


def test_the_agent_cannot_stop_the_bridge(box: Sandbox, echo: EchoServer) -> None:
    tunnel = _open(box, echo)
    try:
        attack = box.exec("pkill -KILL -f relay_bridge; kill -KILL -1; true", timeout=60)
        assert attack.exit_code is not None
        box.put_file(CLIENTS.encode(), "/tmp/clients.py", mode=0o644, owner="root")
        result = box.exec(["python3", "/tmp/clients.py", "1", "1000"], timeout=120)
        assert result.exit_code == 0, result.text
    finally:
        tunnel.close()


def test_a_bridge_that_cannot_listen_is_a_tunnel_error(box: Sandbox, echo: EchoServer) -> None:
    first = _open(box, echo)
    try:
        with pytest.raises(TunnelError, match="did not start"):
            _open(box, echo)  # the port is taken by the first bridge
    finally:
        first.close()


def test_closing_the_tunnel_ends_the_bridge(box: Sandbox, echo: EchoServer) -> None:
    _open(box, echo).close()
    gone = box.exec(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {PORT}), timeout=5)\"",
                    timeout=120)
    assert gone.exit_code != 0, "the bridge still listens after close()"


def test_an_answer_before_the_relay_closes_reaches_a_client_still_sending(box: Sandbox) -> None:
    """The relay answers a refused request and closes while the agent is still sending its body: the tunnel stops
    writing, keeps reading the relay's answer, and drops the agent's remaining bytes, so every client reads its
    answer instead of a reset (CI once saw a flooding client get nothing under load)."""
    with tempfile.TemporaryDirectory(prefix="pb-refuser-") as directory:
        refuser = Refuser(Path(directory) / "relay.sock")
        tunnel = _open(box, refuser)
        try:
            box.put_file(SENDERS.encode(), "/tmp/senders.py", mode=0o644, owner="root")
            result = box.exec(["python3", "/tmp/senders.py", "16", str(4 << 20)], timeout=300)
            assert result.exit_code == 0, result.text
            got = json.loads(result.text.strip().splitlines()[-1])
            assert got == {str(k): "HTTP/1.1 503 Service Unavailable" for k in range(16)}, got
        finally:
            tunnel.close()
            refuser.close()
