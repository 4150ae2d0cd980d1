"""The proxy's wire protocol and pure helpers, without Docker.

Both clients (the static C one, built on the host, and the Python fallback) talk to an in-process fake daemon
that uses the real daemon's request parser; malformed requests are fed to the parser directly.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.sandbox.proxy_build import PYTHON_CLIENT, build_client
from tests.proxy_support import load_daemon

daemon = load_daemon("pb_proxy_daemon")


# ---------------------------------------------------------------------------------------------- pure helpers
def test_clean_env_strips_loader_and_runtime_hooks() -> None:
    env, removed = daemon.clean_env([
        "PATH=/bin", "LD_PRELOAD=/x.so", "LD_AUDIT=/a.so", "LD_LIBRARY_PATH=/l", "LD_ANYTHING=1", "GCONV_PATH=/g",
        "GLIBC_TUNABLES=x", "JAVA_TOOL_OPTIONS=-javaagent:x", "NODE_OPTIONS=--require x", "KEEP=a=b", "EMPTY=",
        "NOEQUALS", "=novalue", "MY_LD_PRELOAD=fine"])
    assert env == {"PATH": "/bin", "KEEP": "a=b", "EMPTY": "", "MY_LD_PRELOAD": "fine"}
    assert set(removed) == {"LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "LD_ANYTHING", "GCONV_PATH", "GLIBC_TUNABLES",
                            "JAVA_TOOL_OPTIONS", "NODE_OPTIONS"}


def test_audit_flags(tmp_path: Path) -> None:
    (tmp_path / "m").symlink_to("/proc/self/mem")
    assert daemon.audit_flags(["b", "/proc/self/mem"], None) == ["proc-mem"]
    assert daemon.audit_flags(["b", "--in=/proc/123/task/5/mem"], None) == ["proc-mem"]
    assert daemon.audit_flags(["b", "m"], str(tmp_path)) == ["proc-mem"]
    assert daemon.audit_flags(["b", "/proc/self/exe", "/proc/thread-self/fd/3"], None) == ["proc-self"]
    assert daemon.audit_flags(["/proc/self/mem", "input.txt", "memory"], str(tmp_path)) == []  # argv[0] is not data


def test_wait_status_to_reply() -> None:
    assert daemon.wait_status_to_reply(3 << 8) == (daemon.REPLY_EXIT, 3, False)
    assert daemon.wait_status_to_reply(signal.SIGKILL) == (daemon.REPLY_SIGNAL, 9, False)
    assert daemon.wait_status_to_reply(signal.SIGSEGV | 0x80) == (daemon.REPLY_SIGNAL, 11, True)


def test_reference_kind(tmp_path: Path) -> None:
    (tmp_path / "script").write_bytes(b"#!/bin/bash\necho hi\n")
    (tmp_path / "elf").write_bytes(b"\x7fELF" + bytes(60))
    (tmp_path / "other").write_bytes(b"MZ")
    assert daemon.reference_kind(str(tmp_path / "script")) == "script"
    assert daemon.script_interpreter(str(tmp_path / "script")) == "/bin/bash"
    assert daemon.reference_kind(str(tmp_path / "elf")) == "elf"
    assert daemon.reference_kind(str(tmp_path / "other")) == "other"
    assert daemon.reference_kind(str(tmp_path / "missing")) == "unreadable"


def test_raw_mode_matches_cfmakeraw() -> None:
    import termios

    attrs = [termios.ICRNL | termios.IXON, termios.OPOST, termios.CS7 | termios.PARENB,
             termios.ECHO | termios.ICANON | termios.ISIG, 38400, 38400, [b"\x00"] * 32]
    iflag, oflag, cflag, lflag, _i, _o, cc = daemon.raw_mode(attrs)
    assert iflag & (termios.ICRNL | termios.IXON) == 0
    assert oflag & termios.OPOST == 0
    assert lflag & (termios.ECHO | termios.ICANON | termios.ISIG) == 0
    assert cflag & termios.CSIZE == termios.CS8
    assert not cflag & termios.PARENB
    assert cc[termios.VMIN] == 1
    assert cc[termios.VTIME] == 0


# ---------------------------------------------------------------------------------------------- request parser
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _parse(payload: bytes, fds: list[int] | None = None) -> Any:
    left, right = socket.socketpair()
    try:
        if fds:
            left.sendmsg([payload[: daemon.HEADER.size]],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
            left.sendall(payload[daemon.HEADER.size:])
        else:
            left.sendall(payload)
        left.shutdown(socket.SHUT_WR)
        return daemon.read_request(right)
    finally:
        left.close()
        right.close()


def _header(**fields: int) -> bytes:
    values = {"version": 1, "fdmask": 0, "flags": 0, "argc": 1, "envc": 0, "umask": 0o22, "nrlim": 0,
              "ign": 0, "blk": 0, "strlen": 2, "pad": 0}
    values.update(fields)
    return daemon.HEADER.pack(fields.get("magic", b"PBX1"), values["version"], values["fdmask"], values["flags"],
                              values["argc"], values["envc"], values["umask"], values["nrlim"], values["ign"],
                              values["blk"], values["strlen"], values["pad"])


def test_parser_accepts_a_well_formed_request() -> None:
    read, write = os.pipe()
    try:
        body = daemon.RLIMIT.pack(1, 2) + b"prog\0arg one\0A=1\0"
        request = _parse(_header(fdmask=0b0011, argc=2, envc=1, nrlim=1, strlen=17, umask=0o77, ign=5, blk=8)
                         + body, [read, write])
        try:
            assert request.argv == ["prog", "arg one"]
            assert request.env_entries == ["A=1"]
            assert request.rlimits == [(1, 2)]
            assert (request.umask, request.sig_ignored, request.sig_blocked) == (0o77, 5, 8)
            assert set(request.fds) == {daemon.FD_STDIN, daemon.FD_STDOUT}
            assert os.fstat(request.fds[daemon.FD_STDIN]).st_ino == os.fstat(read).st_ino
        finally:
            request.close()
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize(("payload", "fd_count"), [
    (b"GARBAGE" * 10, 0),
    (_header(magic=b"XXXX") + b"x\0", 0),
    (_header(version=2) + b"x\0", 0),
    (_header(fdmask=0b1111) + b"x\0", 2),  # mask says 4, 2 sent
    (_header(fdmask=0b10000) + b"x\0", 1),
    (_header(strlen=1 << 30), 0),
    (_header(nrlim=10_000), 0),
    (_header(argc=3, strlen=2) + b"x\0", 0),
    (_header(strlen=3) + b"abc", 0),
    (_header(argc=1, strlen=4) + b"a\0b\0", 0),  # one string announced, two sent
    (_header(strlen=10) + b"short\0", 0),  # connection closes mid-request
    (b"PBX1\x01", 0),
])
def test_parser_refuses_malformed_requests_and_closes_their_descriptors(payload: bytes, fd_count: int) -> None:
    read, write = os.pipe()
    fds = [read, write, read, write][:fd_count]
    before = _open_fds()
    try:
        with pytest.raises(daemon.ProtocolError):
            _parse(payload, fds)
        assert _open_fds() == before  # every received descriptor was closed again
    finally:
        os.close(read)
        os.close(write)


def test_parser_refuses_descriptors_after_the_header() -> None:
    read, write = os.pipe()
    left, right = socket.socketpair()
    before = _open_fds()
    try:
        left.sendmsg([_header(fdmask=1, strlen=2)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", read))])
        left.sendmsg([b"x\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", write))])
        with pytest.raises(daemon.ProtocolError, match="unexpected descriptors"):
            daemon.read_request(right)
        assert _open_fds() == before
    finally:
        for closable in (left, right):
            closable.close()
        os.close(read)
        os.close(write)


# ---------------------------------------------------------------------------------------------- real clients
@pytest.fixture(scope="module")
def static_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = build_client(cache_dir=tmp_path_factory.mktemp("proxy-cache"), allow_fallback=False)
    assert built.kind == "static-c"
    return built.path


@pytest.fixture(params=["static-c", "python"])
def client_command(request: pytest.FixtureRequest, static_client: Path) -> list[str]:
    if request.param == "static-c":
        return [str(static_client)]
    return [sys.executable, "-I", "-S", str(PYTHON_CLIENT)]


class FakeDaemon:
    """Accepts one call, parses it with the daemon's parser, then lets the test decide the answer."""

    def __init__(self, path: Path, answer: Callable[[socket.socket, Any], None]) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.request: Any = None
        self.cwd: str | None = None
        self.stdin_data = b""
        self.fd_bits: set[int] = set()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, args=(answer,), daemon=True)
        self.thread.start()

    def _serve(self, answer: Callable[[socket.socket, Any], None]) -> None:
        import select

        try:
            conn, _ = self.listener.accept()
            with conn:
                self.request = daemon.read_request(conn)
                self.cwd = os.readlink(f"/proc/self/fd/{self.request.fds[daemon.FD_CWD]}")
                stdin = self.request.fds.get(daemon.FD_STDIN)
                if stdin is not None and select.select([stdin], [], [], 2)[0]:
                    self.stdin_data = os.read(stdin, 100)
                self.fd_bits = set(self.request.fds)
                self.request.close()  # like the worker: the caller's pipes must not stay open here
                answer(conn, self.request)
        except BaseException as exc:
            self.error = exc
        finally:
            self.listener.close()

    def close(self) -> None:
        self.thread.join(10)


@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[Path]:
    return tmp_path / "proxy.sock"


def _reply(kind: int, value: int, message: bytes = b"") -> Callable[[socket.socket, Any], None]:
    def answer(conn: socket.socket, _request: Any) -> None:
        conn.sendall(daemon.REPLY.pack(b"PBR1", kind, value, len(message)) + message)

    return answer


def _run(command: list[str], sock: Path, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    env = {"PB_PROXY_SOCKET": str(sock), "PATH": os.environ.get("PATH", "/bin"), "LD_PRELOAD": "", "X": "y z"}
    return subprocess.run([*command, *args], env=env, capture_output=True, timeout=30, **kwargs)


def test_client_sends_argv_env_fds_cwd_and_state(client_command: list[str], sock_path: Path, tmp_path: Path) -> None:
    fake = FakeDaemon(sock_path, _reply(daemon.REPLY_EXIT, 0))
    done = _run(client_command, sock_path, "one", "two words", "", cwd=tmp_path, input=b"data")
    fake.close()
    assert fake.error is None, fake.error
    request = fake.request
    assert request.argv[1:] == ["one", "two words", ""]
    assert "X=y z" in request.env_entries
    assert "LD_PRELOAD=" in request.env_entries
    assert fake.fd_bits == {daemon.FD_STDIN, daemon.FD_STDOUT, daemon.FD_STDERR, daemon.FD_CWD}
    assert fake.cwd == str(tmp_path)
    assert fake.stdin_data == b"data"  # read from the caller's own stdin pipe
    assert request.umask == 0o022 or request.umask == os.umask(os.umask(0))
    assert len(request.rlimits) == 16
    assert done.returncode == 0


def test_static_client_sends_argv0_as_typed(static_client: Path, sock_path: Path) -> None:
    fake = FakeDaemon(sock_path, _reply(daemon.REPLY_EXIT, 0))
    subprocess.run(["./typed-name", "x"], executable=str(static_client), env={"PB_PROXY_SOCKET": str(sock_path)},
                   timeout=30, check=True)
    fake.close()
    assert fake.request.argv == ["./typed-name", "x"]


@pytest.mark.parametrize(("kind", "value", "expected"), [(0, 0, 0), (0, 3, 3), (0, 255, 255), (1, 15, -15),
                                                         (1, 9, -9), (1, 11, -11), (3, 126, 126)])
def test_client_reproduces_the_outcome(client_command: list[str], sock_path: Path, kind: int, value: int,
                                       expected: int) -> None:
    fake = FakeDaemon(sock_path, _reply(kind, value, b"note\n" if kind == 3 else b""))
    done = _run(client_command, sock_path)
    fake.close()
    assert done.returncode == expected
    if kind == 3:
        assert done.stderr == b"note\n"


def test_client_prints_a_refusal(client_command: list[str], sock_path: Path) -> None:
    fake = FakeDaemon(sock_path, _reply(daemon.REPLY_REFUSED, 126, b"binary: permission denied: uid 0\n"))
    done = _run(client_command, sock_path)
    fake.close()
    assert (done.returncode, done.stderr) == (126, b"binary: permission denied: uid 0\n")


def test_client_without_a_daemon(client_command: list[str], tmp_path: Path) -> None:
    done = _run(client_command, tmp_path / "nothing.sock")
    assert done.returncode == 126
    assert b"the reference proxy is not running" in done.stderr


def test_client_when_the_daemon_hangs_up(client_command: list[str], sock_path: Path) -> None:
    fake = FakeDaemon(sock_path, lambda conn, _r: None)
    done = _run(client_command, sock_path)
    fake.close()
    assert done.returncode == 125
    assert b"closed the connection without a result" in done.stderr


def _default_signal_actions() -> None:
    for sig in (signal.SIGINT, signal.SIGWINCH, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def test_client_forwards_signals(client_command: list[str], sock_path: Path) -> None:
    received: list[int] = []

    def answer(conn: socket.socket, _request: Any) -> None:
        conn.settimeout(20)
        while len(received) < 3:
            data = conn.recv(16)
            if not data:
                return
            received.extend(data)
        conn.sendall(daemon.REPLY.pack(b"PBR1", daemon.REPLY_SIGNAL, signal.SIGTERM, 0))

    fake = FakeDaemon(sock_path, answer)
    # The signals' default actions whatever this suite inherited: a suite started in the background of a shell has
    # SIGINT ignored, and a client rightly never forwards what its caller ignores (the reference would ignore it too).
    process = subprocess.Popen([*client_command], env={"PB_PROXY_SOCKET": str(sock_path),
                                                       "PATH": os.environ.get("PATH", "/bin")},
                               preexec_fn=_default_signal_actions)  # noqa: PLW1509
    deadline = time.monotonic() + 10
    while fake.request is None and time.monotonic() < deadline:
        time.sleep(0.02)
    for count, sig in enumerate((signal.SIGINT, signal.SIGWINCH, signal.SIGHUP), 1):
        # Sent again until forwarded (the client may not have its handlers yet), then the next: order by condition.
        deadline = time.monotonic() + 20
        while len(received) < count and time.monotonic() < deadline:
            process.send_signal(sig)
            wait_until = time.monotonic() + 1
            while len(received) < count and time.monotonic() < wait_until:
                time.sleep(0.01)
    assert process.wait(20) == -signal.SIGTERM
    fake.close()
    assert received == [signal.SIGINT, signal.SIGWINCH, signal.SIGHUP]
