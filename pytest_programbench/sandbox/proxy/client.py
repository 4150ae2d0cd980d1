#!/usr/bin/python3 -IS
"""pb-proxy client, Python fallback of ``client.c`` (same protocol; used when no static C client can be built).

Installed as ``/workspace/binary`` with the container's own interpreter in the shebang. Python's start-up alone
costs ~20 ms per call, which is why the static C client is preferred; behaviour is otherwise the same: stdin,
stdout, stderr and the working directory travel as descriptors, signals are forwarded, and the exit status (or
the death by signal) of the reference is reproduced.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import sys

DEFAULT_SOCKET = "/run/pb-proxy/proxy.sock"
HEADER = struct.Struct("<4sIIIIIIIQQII")
REPLY = struct.Struct("<4siiI")
REPLY_SIGNAL = 1
NLIMITS = 16
RLIM_INFINITY_WIRE = (1 << 64) - 1
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH", "SIGTSTP", "SIGCONT")


def _fail(code: int, message: str) -> None:
    try:
        os.write(2, message.encode("utf-8", "replace"))
    finally:
        os._exit(code)


def _rlimits() -> bytes:
    try:
        import resource  # noqa: PLC0415 - lazy: each call's start-up is the client's overhead
    except ImportError:
        return struct.pack("<QQ", RLIM_INFINITY_WIRE, RLIM_INFINITY_WIRE) * NLIMITS
    out = []
    for number in range(NLIMITS):
        try:
            soft, hard = resource.getrlimit(number)
        except (OSError, ValueError):
            soft = hard = resource.RLIM_INFINITY
        out.append(struct.pack("<QQ", *(RLIM_INFINITY_WIRE if v == resource.RLIM_INFINITY else v
                                        for v in (soft, hard))))
    return b"".join(out)


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main() -> None:
    """Run the reference through the proxy as this process: request, forwarded signals, the same exit or death."""
    path = os.environ.get("PB_PROXY_SOCKET") or DEFAULT_SOCKET
    ignored = _ignored_signals()
    blocked = _blocked_signals()
    mask = os.umask(0o022)
    os.umask(mask)
    fds, fdmask, cwd = _passed_fds()
    # A script never sees the argv[0] it was called with (the kernel passes the path instead): use that path.
    argv = [os.fsencode(a) for a in sys.argv]
    env = [k + b"=" + v for k, v in os.environb.items()]
    strings = b"".join(s + b"\0" for s in [*argv, *env])
    header = HEADER.pack(b"PBX1", 1, fdmask, 0, len(argv), len(env), mask, NLIMITS, ignored, blocked, len(strings), 0)

    pending: list[int] = []
    _catch_forwarded(ignored, pending)
    sock = _connect(path)
    send_error = _send(sock, header, fds, strings)
    if cwd is not None:
        os.close(cwd)
    kind, value = _await_reply(sock, pending, send_error)
    if kind == REPLY_SIGNAL:
        _die_by(value)
    sys.stdout.flush()
    os._exit(value & 0xFF)


def _ignored_signals() -> int:
    """The mask of signals the caller ignores (bit ``n - 1`` for signal ``n``)."""
    ignored = 0
    for sig in range(1, 65):
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                ignored |= 1 << (sig - 1)
        except (OSError, ValueError):
            pass
    # Python itself ignores SIGPIPE and SIGXFSZ at start-up: what the caller had is unknown here, assume default.
    ignored &= ~((1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1)))
    return ignored


def _blocked_signals() -> int:
    blocked = 0
    for sig in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        blocked |= 1 << (int(sig) - 1)
    return blocked


def _passed_fds() -> tuple[list[int], int, int | None]:
    """The descriptors sent along (the open ones of 0, 1, 2 and the cwd), their mask, the cwd's descriptor."""
    fds: list[int] = []
    fdmask = 0
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            continue
        fds.append(fd)
        fdmask |= 1 << fd
    try:
        cwd: int | None = os.open(".", os.O_PATH | os.O_DIRECTORY)
    except OSError:
        cwd = None
    if cwd is not None:
        fds.append(cwd)
        fdmask |= 8
    return fds, fdmask, cwd


def _catch_forwarded(ignored: int, pending: list[int]) -> None:
    """Forwarded signals the caller does not ignore are caught into ``pending``."""
    for name in FORWARDED:
        number = getattr(signal, name)
        if ignored >> (number - 1) & 1:
            continue
        signal.signal(number, lambda sig, _frame: pending.append(sig))


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        _fail(126, f"binary: the reference proxy is not running ({path}: {exc.strerror})\n")
    return sock


def _send(sock: socket.socket, header: bytes, fds: list[int], strings: bytes) -> str:
    """Send the request (the header with the descriptors, then rlimits and strings); the error, if it failed."""
    send_error = ""
    try:
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
        sock.sendall(_rlimits() + strings)
    except OSError as exc:  # reported only if no reply explains it (a refused caller is answered at once)
        send_error = exc.strerror or str(exc)
    return send_error


def _await_reply(sock: socket.socket, pending: list[int], send_error: str) -> tuple[int, int]:
    """Forward signals until the reply comes; its kind and value (its message written to stderr)."""
    import select  # noqa: PLC0415 - lazy: each call's start-up is the client's overhead

    reply = b""
    while True:
        _forward_pending(sock, pending)
        try:
            readable, _, _ = select.select([sock], [], [], 0.5)
        except InterruptedError:
            continue
        if readable:
            got = _recv_exact(sock, REPLY.size)
            if got is None:
                break
            reply = got
            break
    if len(reply) != REPLY.size or reply[:4] != b"PBR1":
        if send_error:
            _fail(126, f"binary: cannot reach the reference proxy: {send_error}\n")
        _fail(125, "binary: the reference proxy closed the connection without a result\n")
    _magic, kind, value, length = REPLY.unpack(reply)
    if length:
        message = _recv_exact(sock, min(length, 4096))
        if message:
            os.write(2, message)
    return kind, value


def _forward_pending(sock: socket.socket, pending: list[int]) -> None:
    """Each caught signal as one byte; TSTP also stops the client itself, until it is continued."""
    while pending:
        sig = pending.pop(0)
        with contextlib.suppress(OSError):
            sock.sendall(bytes([sig]))
        if sig == signal.SIGTSTP:
            signal.signal(signal.SIGTSTP, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGSTOP)
            signal.signal(signal.SIGTSTP, lambda s, _f: pending.append(s))


def _die_by(value: int) -> None:
    """Die by the signal that killed the reference (without a core dump); never returns."""
    try:
        import resource  # noqa: PLC0415 - lazy: each call's start-up is the client's overhead

        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ImportError, OSError, ValueError):
        pass
    with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP cannot be set (nor caught)
        signal.signal(value, signal.SIG_DFL)
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [value])
    os.kill(os.getpid(), value)
    os._exit(128 + value)


if __name__ == "__main__":
    main()
