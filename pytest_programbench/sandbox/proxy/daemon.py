"""The reference-binary proxy daemon of a pytest-programbench sandbox (runs as root inside the container).

Shipped into the container as a single file and run with the container's own ``python3`` (standard library only,
Python >= 3.8). Two sub-commands:

``setup``  lays the sandbox out (agent user, reference moved to a root-only directory, docs read-only, empty
           ``/workspace/src``, the client at ``/workspace/binary``), starts ``serve`` in the background and prints one
           JSON line describing the result.
``serve``  the daemon proper: a master process that keeps a small pool of pre-forked workers blocked in
           ``accept()`` on a Unix socket. Each worker handles exactly one call and exits, so a malformed or hostile
           request can only ever kill its own worker.

One call, a ``Call`` whose steps 1 to 5 are its methods admit, read, spawn, supervise, finish (``client.c`` is the
other side):

1. The client connects; the worker reads the caller's credentials with ``SO_PEERCRED`` and refuses every uid that
   is not allowed (the agent's).
2. The client sends a fixed header with its stdin/stdout/stderr and cwd as descriptors (``SCM_RIGHTS``), then its
   rlimits, argv (argv[0] as typed) and environment.
3. The worker forks the child: new session, the caller's fds on 0/1/2 (a fresh pseudo-terminal stands in for a
   terminal, relayed by the worker, so the child has a controlling terminal), rlimits, umask, ignored signals and
   signal mask as the caller had them, ``LD_PRELOAD`` and kin stripped, groups/gid/uid dropped to the agent's,
   ``fchdir`` to the caller's cwd, then ``execve`` of the reference through a close-on-exec ``O_PATH`` descriptor.
   The reference is mode 111 and lives in a 0700 root directory: the kernel marks a process that executes a file
   it cannot read as not dumpable, so the agent (same uid) can neither ptrace it nor open its
   ``/proc/<pid>/{mem,maps,exe,fd}``; its files belong to the agent because it runs as the agent.

   Under gVisor (``--pb-runtime runsc``) the loader needs READ permission to execute a file (google/gvisor PR 14687,
   open) and never marks such a task non-dumpable (google/gvisor issue 160, open). ``setup`` finds this out by
   trying (``exec_needs_read``: exec of an execute-only junk file answers ENOEXEC on Linux, EACCES there) and the
   daemon then runs in *capability* mode: each worker keeps ``CAP_DAC_OVERRIDE`` in its permitted set only and
   raises it into the effective set for the ``execve`` alone, after the caller's cwd is entered with the agent's
   rights. The capability is what lets the loader read the file; ``execve`` drops it (a non-root uid, no ambient or
   file capabilities), so the running reference is the agent's uid with no capability: it cannot open its own
   file (mode 111) by any path, ``/proc/self/exe`` included, and its files are the agent's. What keeps the agent
   out of the dumpable child is Yama's ``ptrace_scope`` >= 1 (gVisor's default is 1): ptrace and
   ``/proc/<pid>/mem`` are refused to a non-ancestor, and the child descends from the daemon, never from the
   agent. ``setup`` refuses to serve without it. gVisor writes no core files.
4. Signals the client catches (INT, TERM, HUP, QUIT, USR1, USR2, WINCH, TSTP, CONT) arrive as single bytes and are
   delivered to the child's process group; if the client disappears the group is killed.
5. The worker replies with the exit status or the signal that killed the child. The call log gets a ``started``
   line before the reference runs and an ``ended`` line after (argv, cwd, exit, duration, flags such as ``proc-mem``
   for arguments naming ``/proc/*/mem``), both with the call's id: a worker killed mid-call leaves its ``started``
   line. Every line is bounded (``RECORD_MAX``: long values clipped, long lists cut, with counts).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import grp
import hashlib
import json
import os
import pwd
import re
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

resource: ModuleType | None
try:
    import resource
except ImportError:  # pragma: no cover - every CPython on Linux has it
    resource = None

# ---------------------------------------------------------------------------------------------- layout constants
PROXY_DIR = "/var/lib/pb-proxy"  # 0700 root: the reference, this file, the logs
REFERENCE = PROXY_DIR + "/executable"
CALL_LOG = PROXY_DIR + "/calls.jsonl"
DAEMON_LOG = PROXY_DIR + "/daemon.log"
SOCKET_DIR = "/run/pb-proxy"
SOCKET_PATH = SOCKET_DIR + "/proxy.sock"
WORKSPACE = "/workspace"
DOCS_DIR = WORKSPACE + "/docs"
SRC_DIR = WORKSPACE + "/src"
CLIENT_PATH = WORKSPACE + "/binary"
STAGED_CLIENT = PROXY_DIR + "/client"
AGENT_NAME = "pbagent"
AGENT_UID = 1777
SUID_DUMPABLE = "/proc/sys/fs/suid_dumpable"  # 1 would make execute-only programs dumpable: refuse to serve
YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"  # capability mode: >= 1, or the agent could trace the child
EXEC_PROBE = PROXY_DIR + "/exec-probe"  # execute-only junk: does this kernel's exec need read permission?
CAP_DAC_OVERRIDE = 1
PR_SET_KEEPCAPS = 8
_CAPABILITY_VERSION_3 = 0x20080522

# ---------------------------------------------------------------------------------------------- wire protocol
MAGIC_REQUEST = b"PBX1"
MAGIC_REPLY = b"PBR1"
PROTOCOL_VERSION = 1
# magic, version, fdmask, flags, argc, envc, umask, nrlimits, ignored-signal mask, blocked-signal mask,
# length of the NUL-terminated strings, padding
HEADER = struct.Struct("<4sIIIIIIIQQII")
RLIMIT = struct.Struct("<QQ")
REPLY = struct.Struct("<4siiI")  # magic, kind, value, message length
REPLY_EXIT, REPLY_SIGNAL, REPLY_REFUSED, REPLY_ERROR = 0, 1, 2, 3
FD_STDIN, FD_STDOUT, FD_STDERR, FD_CWD = 1, 2, 4, 8
MAX_STRINGS = 64 << 20  # argv + env; execve itself stops far below
MAX_RLIMITS = 64
MAX_FDS = 4
REQUEST_DEADLINE = 30.0  # seconds a worker waits for a complete request
RLIM_INFINITY_WIRE = (1 << 64) - 1

# Variables that make a program load code (or parse attacker files) before main(): never passed to the reference.
# glibc strips most of them itself for set-uid programs (its "unsecure envvars"); the reference is not set-uid,
# so we do it. Any ``LD_*`` is stripped, plus runtime hooks of languages a reference may embed.
STRIP_ENV_EXACT = frozenset({
    # glibc's own list of unsecure variables (sysdeps/generic/unsecvars.h), LD_* aside
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE",
    "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR",
    # runtimes a reference may embed: code or module paths read at start-up
    "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "NODE_OPTIONS", "PYTHONPATH", "PYTHONHOME",
    "PYTHONSTARTUP", "PYTHONUSERBASE", "PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB",
    # OpenSSL loads engines and providers (shared objects) named by its configuration
    "OPENSSL_CONF", "OPENSSL_ENGINES", "OPENSSL_MODULES",
})
# Any LD_*; Lua's LUA_INIT, LUA_PATH, LUA_CPATH and their _5_x versioned forms.
STRIP_ENV_PREFIXES = ("LD_", "LUA_INIT", "LUA_PATH", "LUA_CPATH")
# Set for the reference whatever the caller had: an embedded Python never reads the user site under $HOME (which
# the agent writes), where a .pth file or usercustomize would run code.
FORCED_ENV = {"PYTHONNOUSERSITE": "1"}

# Signals the client forwards; TSTP/CONT also stop and continue the child.
FORWARDABLE = frozenset(range(1, 65))
_PROC_MEM = re.compile(r"/proc/[^/\s]+/(?:task/[^/\s]+/)?mem\b")
_PROC_SELF = re.compile(r"/proc/(?:self|thread-self|\d+)/(?:task/\d+/)?(?:exe|fd|map_files|root|cwd)\b")
LOG_ARG_LIMIT = 1024  # characters of one logged value (argv entry, cwd, variable name)
LOG_LIST_LIMIT = 64  # entries of a logged list (argv, stripped variables); the full count is recorded
RECORD_MAX = 16 << 10  # bytes of one call-log line, whatever the caller sent
LOG_MAX_BYTES = 64 << 20  # past this, calls are counted (``DROPPED_LOG``), not recorded
DROPPED_LOG = PROXY_DIR + "/calls.dropped"  # one byte per call not recorded; its size is the count
# The master's count of calls and of calls whose record could not be written (the sandbox's storage full): one
# fixed-width line written at start and then overwritten in place, so updating it needs no new disk space.
COUNT_LOG = PROXY_DIR + "/calls.count"
COUNT_LINE = "calls={:015d} unrecorded={:015d}\n"
AUDIT_PATH_MAX = 4096  # longer arguments cannot be opened as paths (PATH_MAX), so they are matched as text only


def stripped_env_name(name: str) -> bool:
    return name in STRIP_ENV_EXACT or name.startswith(STRIP_ENV_PREFIXES)


def clean_env(entries: list[str]) -> tuple[dict[str, str], list[str]]:
    """The environment for the reference and the names that were removed from it."""
    env: dict[str, str] = {}
    removed: list[str] = []
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not sep or not name:
            continue
        if stripped_env_name(name):
            removed.append(name)
            continue
        env[name] = value
    return env, removed


def audit(argv: list[str], cwd: str | None) -> tuple[list[str], dict[str, str]]:
    """Flags for the call log and what the check saw: ``{argument: resolved path}`` for each flagged argument.

    Every argument is matched as text and, resolved against the caller's cwd (symlinks followed), as a path; an
    ``--opt=VALUE`` argument's value too. Advisory: the agent can swap a symlink between this check and the
    reference's own open (docs/security.md), so the record says what the check saw, not what the reference read.
    """
    flags: list[str] = []
    seen: dict[str, str] = {}
    for arg in argv[1:]:
        texts = [arg]
        candidates = [arg]
        if arg.startswith("-") and "=" in arg:
            candidates.append(arg.partition("=")[2])
        if cwd:
            for candidate in candidates:
                if candidate and len(candidate) < AUDIT_PATH_MAX and "\0" not in candidate:
                    with contextlib.suppress(OSError, ValueError):
                        texts.append(os.path.realpath(os.path.join(cwd, candidate)))
        for text in texts:
            flag = "proc-mem" if _PROC_MEM.search(text) else "proc-self" if _PROC_SELF.search(text) else None
            if flag:
                if flag not in flags:
                    flags.append(flag)
                if len(seen) < LOG_LIST_LIMIT:
                    seen.setdefault(_clip_text(arg), _clip_text(text))
    return flags, seen


def audit_flags(argv: list[str], cwd: str | None) -> list[str]:
    """Flags for the call log: arguments that name (or resolve to) ``/proc/*/mem`` and the other self-views."""
    return audit(argv, cwd)[0]


def wait_status_to_reply(status: int) -> tuple[int, int, bool]:
    """(kind, value, core dumped) of a wait status."""
    if os.WIFSIGNALED(status):
        return REPLY_SIGNAL, os.WTERMSIG(status), bool(os.WCOREDUMP(status))
    return REPLY_EXIT, os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255, False


def reference_kind(path: str) -> str:
    """``elf``, ``script`` (a ``#!`` file: cannot run from an execute-only file) or ``other``. Read as root."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError:
        return "unreadable"
    if head == b"\x7fELF":
        return "elf"
    if head[:2] == b"#!":
        return "script"
    return "other"


def script_interpreter(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            line = handle.readline(256)
    except OSError:
        return "?"
    return line[2:].strip().decode("utf-8", "replace") or "?"


_error_fd = 2  # the daemon log; a worker moves it to a close-on-exec descriptor


def _log_error(message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(_error_fd, f"pb-proxy[{os.getpid()}]: {message}\n".encode("utf-8", "replace"))


def _set_subreaper() -> None:
    """Adopt orphaned descendants so that they are reaped (best effort; needs ctypes)."""
    try:
        import ctypes  # noqa: PLC0415 - lazy: a minimal image may lack it; then no subreaper, best effort

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:  # noqa: S110 - optional
        pass


class Request:
    """A parsed call request; owns the received descriptors until ``close``."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}  # FD_* bit -> received descriptor
        self.argv: list[str] = []
        self.env_entries: list[str] = []
        self.umask = 0o022
        self.rlimits: list[tuple[int, int]] = []
        self.sig_ignored = 0
        self.sig_blocked = 0

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


class ProtocolError(Exception):
    pass


def _recv_exact(conn: socket.socket, size: int, deadline: float, fds_out: list[int] | None) -> bytes:
    """Read exactly ``size`` bytes; descriptors are accepted only when ``fds_out`` is given."""
    chunks: list[bytes] = []
    have = 0
    cmsg_space = socket.CMSG_SPACE(MAX_FDS * 4)
    while have < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProtocolError(f"request incomplete after {REQUEST_DEADLINE:.0f} s")
        conn.settimeout(remaining)
        try:
            data, ancdata, msg_flags, _addr = conn.recvmsg(min(size - have, 1 << 20), cmsg_space,
                                                           socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:  # socket.timeout included (not a TimeoutError before Python 3.10)
            raise ProtocolError(f"receive failed ({exc or 'timeout'})") from None
        received: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                received.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
        if received:
            if fds_out is None or fds_out:
                for fd in received:
                    os.close(fd)
                raise ProtocolError("unexpected descriptors")
            fds_out.extend(received)
        if msg_flags & socket.MSG_CTRUNC:
            raise ProtocolError("too many descriptors")
        if not data:
            raise ProtocolError("connection closed mid-request")
        chunks.append(data)
        have += len(data)
    return b"".join(chunks)


def read_request(conn: socket.socket) -> Request:
    deadline = time.monotonic() + REQUEST_DEADLINE
    request = Request()
    received: list[int] = []
    try:
        raw = _recv_exact(conn, HEADER.size, deadline, received)
        (magic, version, fdmask, _flags, argc, envc, umask, nrlim, sig_ign, sig_blk, strlen,
         _pad) = HEADER.unpack(raw)
        if magic != MAGIC_REQUEST or version != PROTOCOL_VERSION:
            raise ProtocolError("bad magic or version")
        if fdmask & ~0xF or bin(fdmask).count("1") != len(received):
            raise ProtocolError(f"descriptor mask {fdmask:#x} does not match {len(received)} descriptors")
        if nrlim > MAX_RLIMITS or strlen > MAX_STRINGS or argc + envc > strlen:
            raise ProtocolError("request too large")
        bits = [b for b in (FD_STDIN, FD_STDOUT, FD_STDERR, FD_CWD) if fdmask & b]
        for index, bit in enumerate(bits):  # (no zip(strict=...): the container's Python may be older)
            request.fds[bit] = received[index]
        received = []
        body = _recv_exact(conn, nrlim * RLIMIT.size + strlen, deadline, None)
        request.rlimits = [RLIMIT.unpack_from(body, i * RLIMIT.size) for i in range(nrlim)]
        strings = body[nrlim * RLIMIT.size:]
        if strlen and not strings.endswith(b"\0"):
            raise ProtocolError("strings not NUL-terminated")
        parts = strings[:-1].split(b"\0") if strlen else []
        if len(parts) != argc + envc:
            raise ProtocolError(f"expected {argc + envc} strings, got {len(parts)}")
        decoded = [os.fsdecode(p) for p in parts]
        request.argv = decoded[:argc]
        request.env_entries = decoded[argc:]
        request.umask = umask & 0o777
        request.sig_ignored = sig_ign
        request.sig_blocked = sig_blk
        return request
    except BaseException:
        for fd in received:
            os.close(fd)
        request.close()
        raise


def send_reply(conn: socket.socket, kind: int, value: int, message: str = "") -> None:
    data = message.encode("utf-8", "replace")[:4096]
    try:
        conn.settimeout(5)
        conn.sendall(REPLY.pack(MAGIC_REPLY, kind, value, len(data)) + data)
    except OSError:
        pass


class Config:
    def __init__(self, args: argparse.Namespace) -> None:
        self.socket_path: str = args.socket
        self.reference: str = args.reference
        self.call_log: str = args.call_log
        self.dropped_log: str = args.dropped_log
        self.count_log: str = args.count_log
        self.agent_uid: int = args.agent_uid
        self.agent_gid: int = args.agent_gid
        self.groups: list[int] = [int(g) for g in args.groups.split(",") if g] if args.groups else []
        self.allow_uids: set[int] = set(args.allow_uid or [args.agent_uid])
        self.pool: int = args.pool
        self.max_workers: int = args.max_workers
        self.rlimits: list[tuple[int, int]] = []
        self.interpreter = "?"
        # Capability mode (gVisor): the exec alone has CAP_DAC_OVERRIDE, so the loader may read the reference.
        self.exec_capability: ExecCapability | None = (ExecCapability() if getattr(args, "exec_capability", False)
                                                       else None)


class ExecCapability:
    """``CAP_DAC_OVERRIDE`` kept in a worker's permitted set across its drop to the agent's uid, in its effective set
    only for an ``execve`` (which drops it: a non-root uid with no ambient or file capabilities keeps none)."""

    def __init__(self) -> None:
        import ctypes  # noqa: PLC0415 - lazy: only capability mode needs it, and a minimal image may lack it

        self._ctypes = ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._bit = 1 << CAP_DAC_OVERRIDE

    def keep_across_setuid(self, keep: bool) -> None:
        if self._libc.prctl(PR_SET_KEEPCAPS, int(keep), 0, 0, 0) != 0:
            raise OSError(self._ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS)")

    def set(self, *, effective: bool) -> None:
        """Permitted: the capability alone; effective: it or nothing; inheritable: nothing."""
        ctypes = self._ctypes
        header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
        data = (ctypes.c_uint32 * 6)(self._bit if effective else 0, self._bit, 0, 0, 0, 0)
        if self._libc.capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset")


# ---------------------------------------------------------------------------------------------- the child
def _exec_child(ref_fd: int, request: Request, argv: list[str], env: dict[str, str],  # noqa: PLR0917
                slave: int | None, tty_bits: int, errpipe: int, capability: ExecCapability | None) -> None:
    """The general spawn path, in a forked child (already running as the agent); never returns.

    Used for calls the fast path (``_spawn_fast``) cannot reproduce: a terminal (the child needs it as its
    controlling terminal), a closed standard descriptor, ignored or blocked signals, different rlimits.
    """
    code = 127
    try:
        os.setsid()
        if slave is not None:
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        # Park every source above the standard range first so that dup2 cannot clobber one of them.
        parked: dict[int, int] = {}
        for target, bit in ((0, FD_STDIN), (1, FD_STDOUT), (2, FD_STDERR)):
            if slave is not None and tty_bits & bit:
                parked[target] = _dupfd_high(slave)
            elif bit in request.fds:
                parked[target] = _dupfd_high(request.fds[bit])
        for target in (0, 1, 2):
            if target in parked:
                os.dup2(parked[target], target, inheritable=True)
            else:
                with contextlib.suppress(OSError):
                    os.close(target)
        # Signals: default everywhere, ignored where the caller had them ignored.
        for sig in range(1, signal.NSIG):
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                wanted = signal.SIG_IGN if request.sig_ignored >> (sig - 1) & 1 else signal.SIG_DFL
                signal.signal(sig, wanted)
            except (OSError, ValueError, RuntimeError):
                pass
        os.umask(request.umask)
        if FD_CWD in request.fds:
            try:
                os.fchdir(request.fds[FD_CWD])
            except OSError as exc:
                code = 126
                os.write(errpipe, b"cwd %d" % (exc.errno or 0))
                _child_message(f"binary: cannot enter the working directory: {os.strerror(exc.errno or 0)}\n")
                os._exit(code)
        blocked = _signal_set(request.sig_blocked)
        # Last: the caller's limits and signal mask (a tight limit must not break our own set-up).
        _apply_rlimits(request.rlimits)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if capability is not None:  # after the cwd was entered with the agent's rights; execve drops it
            capability.set(effective=True)
        os.execve(ref_fd, argv, env)  # noqa: S606 - fexecve of the reference with the caller's argv
    except OSError as exc:
        number = exc.errno or 0
        code = 127 if number == errno.ENOENT else 126
        with contextlib.suppress(OSError):
            os.write(errpipe, b"exec %d" % number)
        _child_message(f"binary: cannot run the reference program: {os.strerror(number)}\n")
    except BaseException:  # noqa: S110 - the child must never return into the worker's code
        pass
    os._exit(code)


def _dupfd_high(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)


def _child_message(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


def _current_rlimits() -> list[tuple[int, int]]:
    if resource is None:
        return []
    out = []
    for number in range(16):
        try:
            soft, hard = resource.getrlimit(number)
        except (OSError, ValueError):
            soft = hard = resource.RLIM_INFINITY
        out.append((RLIM_INFINITY_WIRE if soft == resource.RLIM_INFINITY else soft,
                    RLIM_INFINITY_WIRE if hard == resource.RLIM_INFINITY else hard))
    return out


def _from_wire(value: int) -> int:
    return resource.RLIM_INFINITY if resource is not None and value == RLIM_INFINITY_WIRE else value


def _to_wire(value: int) -> int:
    return RLIM_INFINITY_WIRE if resource is not None and value == resource.RLIM_INFINITY else value


def _apply_rlimits(limits: list[tuple[int, int]]) -> None:
    if resource is None:
        return
    for number, (soft, hard) in enumerate(limits):
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(number, (_from_wire(soft), _from_wire(hard)))


def _adopt_rlimits(limits: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Take on the caller's limits; returns the previous soft limits (wire values) to restore."""
    previous: list[tuple[int, int]] = []
    if resource is None:
        return previous
    for number, soft, hard in limits:
        previous.append((number, _to_wire(resource.getrlimit(number)[0])))
        resource.setrlimit(number, (_from_wire(soft), _from_wire(hard)))
    return previous


def _restore_soft_rlimits(previous: list[tuple[int, int]]) -> None:
    """Back to the worker's soft limits, as far as a lowered hard limit allows (the worker then retires)."""
    if resource is None:
        return
    for number, soft in previous:
        hard = _to_wire(resource.getrlimit(number)[1])
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(number, (_from_wire(min(soft, hard)), _from_wire(hard)))


# glibc's internal signals (SIGCANCEL, SIGSETXID): no program may rely on them, Python cannot set them, and a
# caller started by glibc's posix_spawn has them ignored. They are left out of every comparison.
_LIBC_INTERNAL = frozenset({32, 33})


def _signal_set(mask: int) -> list[int]:
    return [sig for sig in range(1, 65) if mask >> (sig - 1) & 1 and sig not in _LIBC_INTERNAL]


# Limits the worker may take on for the moment of a spawn without endangering itself; a caller with any other
# limit changed (CPU, DATA, AS, NPROC, RTTIME, a tiny stack or descriptor table) takes the general path.
_RLIMIT_CPU, _RLIMIT_FSIZE, _RLIMIT_DATA, _RLIMIT_STACK, _RLIMIT_NPROC, _RLIMIT_NOFILE = 0, 1, 2, 3, 6, 7
_RLIMIT_AS, _RLIMIT_RTTIME = 9, 15
_UNSAFE_RLIMITS = frozenset({_RLIMIT_CPU, _RLIMIT_DATA, _RLIMIT_NPROC, _RLIMIT_AS, _RLIMIT_RTTIME})
_RLIMIT_FLOORS = {_RLIMIT_NOFILE: 64, _RLIMIT_STACK: 1 << 20}


def rlimit_changes(request: Request, own: list[tuple[int, int]]) -> list[tuple[int, int, int]] | None:
    """(resource, soft, hard) of the caller's limits that differ from the worker's (wire values), or None when
    the worker cannot safely adopt them for a moment."""
    changes = []
    for number, (soft, hard) in enumerate(request.rlimits[: len(own)]):
        have_soft, have_hard = own[number]
        if (soft, hard) == (have_soft, have_hard):
            continue
        if number in _UNSAFE_RLIMITS or soft > hard or hard > have_hard:
            return None
        if soft < _RLIMIT_FLOORS.get(number, 0) or (number == _RLIMIT_FSIZE and hard != have_hard):
            return None
        changes.append((number, soft, hard))
    return changes


def fast_path_possible(request: Request, own_rlimits: list[tuple[int, int]]) -> bool:
    """Whether ``subprocess`` (vfork) reproduces the caller's process state exactly.

    Ignored and blocked signals and most rlimits are taken on by the worker for the moment of the spawn, except
    an ignored SIGCHLD (the worker would lose its child's status): that, a closed standard descriptor, a terminal
    or a limit the worker cannot adopt (see ``rlimit_changes``) take the general path.
    """
    return (
        sys.version_info >= (3, 9)
        and resource is not None
        and all(bit in request.fds for bit in (FD_STDIN, FD_STDOUT, FD_STDERR))
        and signal.SIGCHLD not in _signal_set(request.sig_ignored)
        and rlimit_changes(request, own_rlimits) is not None
    )


class SpawnError(Exception):
    def __init__(self, code: int, message: str, detail: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


def _spawn_fast(ref_fd: int, request: Request, argv: list[str], env: dict[str, str],  # noqa: PLR0917
                limits: list[tuple[int, int, int]], capability: ExecCapability | None) -> subprocess.Popen[bytes]:
    """Start the reference with vfork+exec (through ``/proc/self/fd/N`` of the close-on-exec O_PATH descriptor).

    The kernel opens the file before it closes close-on-exec descriptors, so the path works for a compiled
    program while the descriptor never reaches it. The caller must keep the returned object alive until it has
    reaped the child itself: ``Popen.__del__`` would otherwise reap a child that already exited.

    In capability mode the worker enters the caller's cwd itself, with the agent's rights, before it raises the
    capability for the spawn: the capability must never let the child into a directory the agent cannot search.
    """
    cwd_fd = request.fds.get(FD_CWD)
    if capability is not None and cwd_fd is not None:
        try:
            os.fchdir(cwd_fd)
        except OSError as exc:
            raise SpawnError(126, f"binary: cannot enter the working directory: {os.strerror(exc.errno or 0)}\n",
                             "cwd: " + os.strerror(exc.errno or 0)) from None
        cwd_fd = None
    # The child inherits the worker's ignored signals and mask at the moment of the vfork (handlers are reset):
    # make them the caller's for that moment. SIGPIPE and SIGXFSZ, which Python ignores, included.
    ignored = set(_signal_set(request.sig_ignored)) - {signal.SIGKILL, signal.SIGSTOP}
    saved: dict[int, Any] = {}
    for sig in ignored | {signal.SIGPIPE, signal.SIGXFSZ}:
        with contextlib.suppress(OSError, ValueError):
            saved[sig] = signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    old_limits = _adopt_rlimits(limits)
    old_mask = signal.pthread_sigmask(signal.SIG_SETMASK, _signal_set(request.sig_blocked))
    try:
        if capability is not None:
            capability.set(effective=True)
        child = subprocess.Popen(
            argv, executable=f"/proc/self/fd/{ref_fd}", stdin=request.fds[FD_STDIN],
            stdout=request.fds[FD_STDOUT], stderr=request.fds[FD_STDERR],
            cwd=None if cwd_fd is None else f"/proc/self/fd/{cwd_fd}", env=env, close_fds=False,
            start_new_session=True, umask=request.umask, restore_signals=False)
    except OSError as exc:
        number = exc.errno or 0
        if cwd_fd is not None and exc.filename == f"/proc/self/fd/{cwd_fd}":
            raise SpawnError(126, f"binary: cannot enter the working directory: {os.strerror(number)}\n",
                             "cwd: " + os.strerror(number)) from None
        raise SpawnError(127 if number == errno.ENOENT else 126,
                         f"binary: cannot run the reference program: {os.strerror(number)}\n",
                         "exec: " + os.strerror(number)) from None
    finally:
        if capability is not None:
            capability.set(effective=False)
            os.chdir("/")
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _restore_soft_rlimits(old_limits)
        for sig, handler in saved.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, handler)
    return child


# ---------------------------------------------------------------------------------------------- terminal relay
def raw_mode(attrs: list[Any]) -> list[Any]:
    """``cfmakeraw`` of a ``tcgetattr`` list (what ``tty.setraw`` does, without importing ``tty``)."""
    iflag, oflag, cflag, lflag, ispeed, ospeed, cc = attrs
    iflag &= ~(termios.IGNBRK | termios.BRKINT | termios.PARMRK | termios.ISTRIP | termios.INLCR | termios.IGNCR
               | termios.ICRNL | termios.IXON)
    oflag &= ~termios.OPOST
    lflag &= ~(termios.ECHO | termios.ECHONL | termios.ICANON | termios.ISIG | termios.IEXTEN)
    cflag = (cflag & ~(termios.CSIZE | termios.PARENB)) | termios.CS8
    cc = list(cc)
    cc[termios.VMIN] = 1
    cc[termios.VTIME] = 0
    return [iflag, oflag, cflag, lflag, ispeed, ospeed, cc]


class Relay:
    """A fresh pseudo-terminal for the child, relayed to the caller's terminal (which is put in raw mode)."""

    def __init__(self, request: Request) -> None:
        self.outer = -1
        self.master = -1
        self.slave = -1
        self.saved: list[Any] | None = None
        self.bits = 0
        self.to_outer = bytearray()
        self.to_master = bytearray()
        self.master_open = True
        self.outer_open = True
        first: int | None = None
        device: int | None = None
        for bit in (FD_STDIN, FD_STDOUT, FD_STDERR):
            fd = request.fds.get(bit)
            if fd is None or not os.isatty(fd):
                continue
            rdev = os.fstat(fd).st_rdev
            if device is None:
                device, first = rdev, fd
            if rdev == device:
                self.bits |= bit
        if first is None:
            raise ValueError("no terminal")
        # A private open file description of the caller's terminal (opened with the agent's rights, as the
        # worker already is the agent): non-blocking without touching the flags the caller's shell sees.
        self.outer = os.open(f"/proc/self/fd/{first}", os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.master, self.slave = os.openpty()
            attrs = termios.tcgetattr(self.outer)
            self.saved = [a[:] if isinstance(a, list) else a for a in attrs]
            termios.tcsetattr(self.slave, termios.TCSANOW, attrs)
            self.copy_winsize()
            flags = fcntl.fcntl(self.master, fcntl.F_GETFL)
            fcntl.fcntl(self.master, fcntl.F_SETFL, flags | os.O_NONBLOCK)
            termios.tcsetattr(self.outer, termios.TCSANOW, raw_mode(attrs))
        except BaseException:
            self.close()
            raise

    def copy_winsize(self) -> None:
        try:
            size = fcntl.ioctl(self.outer, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, size)
        except OSError:
            pass

    def foreground_group(self, fallback: int) -> int:
        try:
            group = os.tcgetpgrp(self.master)
            return group if group > 0 else fallback
        except OSError:
            return fallback

    def close_slave(self) -> None:
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1

    def poll_events(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        if self.outer_open:
            mask = select.POLLIN if len(self.to_master) < (1 << 20) else 0
            if self.to_outer:
                mask |= select.POLLOUT
            if mask:
                out.append((self.outer, mask))
        if self.master_open:
            mask = select.POLLIN if len(self.to_outer) < (1 << 20) else 0
            if self.to_master:
                mask |= select.POLLOUT
            if mask:
                out.append((self.master, mask))
        return out

    def on_event(self, fd: int, events: int) -> None:
        if fd == self.outer:
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                data = self._read(self.outer)
                if data is None:
                    self.outer_open = False
                else:
                    self.to_master += data
            if events & select.POLLOUT:
                self._flush(self.outer, self.to_outer)
            self._flush(self.master, self.to_master)
        elif fd == self.master:
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                data = self._read(self.master)
                if data is None:
                    self.master_open = False
                else:
                    self.to_outer += data
            if events & select.POLLOUT:
                self._flush(self.master, self.to_master)
            self._flush(self.outer, self.to_outer)

    @staticmethod
    def _read(fd: int) -> bytes | None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return b""
        except OSError:  # EIO: no process holds the slave any more
            return None
        return data if data else None

    @staticmethod
    def _flush(fd: int, buffer: bytearray) -> None:
        while buffer:
            try:
                written = os.write(fd, bytes(buffer[:65536]))
            except BlockingIOError:
                return
            except OSError:
                buffer.clear()
                return
            del buffer[:written]

    def finish(self, budget: float = 2.0) -> None:
        """After the child exited: drain what it wrote, deliver it, restore the caller's terminal."""
        deadline = time.monotonic() + budget
        while self.master_open and time.monotonic() < deadline and len(self.to_outer) < (8 << 20):
            data = self._read(self.master)
            if not data:
                break
            self.to_outer += data
        while self.to_outer and time.monotonic() < deadline:
            self._flush(self.outer, self.to_outer)
            if self.to_outer:
                select.select([], [self.outer], [], max(0.0, deadline - time.monotonic()))
        self.close()

    def close(self) -> None:
        if self.saved is not None and self.outer >= 0:
            with contextlib.suppress(OSError, termios.error):  # the terminal may be gone
                termios.tcsetattr(self.outer, termios.TCSANOW, self.saved)
            self.saved = None
        for name in ("outer", "master", "slave"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)


# ---------------------------------------------------------------------------------------------- one call
def _fd_path(fd: int | None) -> str | None:
    if fd is None:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _open_log(path: str) -> int:
    """The call log, opened while still root (it is root-only); -1 when it cannot be opened."""
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        _log_error(f"cannot open the call log: {exc}")
        return -1


class CallLog:
    """The worker's two root-only files, opened before it drops to the agent's uid: the call log and the count of
    calls that found it full (one byte each, so its size is the count). A call whose record cannot be written at
    all (the sandbox's storage is full: the agent shares it) is told to the master (``notify``), which counts it in
    memory and in ``COUNT_LOG``: a call may go unrecorded, never uncounted."""

    def __init__(self, path: str, dropped_path: str, notify: Callable[[], None] | None = None) -> None:
        self.fd = _open_log(path)
        self.dropped_fd = _open_log(dropped_path)
        self.notify = notify
        self.torn = False  # a short write left a line without its end: the next one starts on a line of its own

    def append(self, record: dict[str, Any], *, started_logged: bool = False) -> bool:
        """One bounded JSON line, written with a single ``write`` on an ``O_APPEND`` descriptor; whether it was.

        Past ``LOG_MAX_BYTES`` the call is counted instead, unless its ``started`` line is in the log
        (``started_logged``): its end is then written anyway, as counting it too would count the call twice. Each
        worker may so add one line after the check and one call's end: the log never exceeds
        ``LOG_MAX_BYTES + 2 * max_workers * RECORD_MAX`` (the host reads that much).
        """
        final = record.get("phase") != "started"  # a call is recorded by its last line
        try:
            if self.fd < 0:
                raise OSError(errno.EBADF, "the call log could not be opened")
            if os.fstat(self.fd).st_size >= LOG_MAX_BYTES and not started_logged:
                if final:
                    if self.dropped_fd < 0:
                        raise OSError(errno.EBADF, "the count of dropped calls could not be opened")
                    if os.write(self.dropped_fd, b".") != 1:
                        raise OSError(errno.ENOSPC, "short write")
                return False
            line = (b"\n" if self.torn else b"") + bounded_line(record)
            written = os.write(self.fd, line)
            self.torn = 0 < written < len(line)
            if written < len(line):
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(line)} bytes)")
            return True
        except OSError as exc:
            _log_error(f"cannot write the call log: {exc}")
            if final and self.notify is not None:
                self.notify()
            return False


def _clip_text(text: str) -> str:
    return text if len(text) <= LOG_ARG_LIMIT else text[:LOG_ARG_LIMIT] + f"...[{len(text)} chars]"


def _clip(values: list[str], limit: int = LOG_LIST_LIMIT) -> list[str]:
    return [_clip_text(v) for v in values[:limit]]


def _encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8", "replace")


def bounded_line(record: dict[str, Any]) -> bytes:
    """``record`` as one JSON line of at most ``RECORD_MAX`` bytes.

    Lists are cut to ``LOG_LIST_LIMIT`` entries and strings clipped to ``LOG_ARG_LIMIT`` characters, with the full
    counts kept (``argv_count``, ``stripped_env_count``). JSON escaping can still multiply a value sixfold (control
    characters become ``\\u00XX``), so lists are then cut further; a record that still does not fit keeps only
    its scalar fields and says how long it was.
    """
    out = _clipped(record)
    line = _encode(out)
    keep = LOG_LIST_LIMIT
    while len(line) > RECORD_MAX and keep > 1:
        keep //= 4
        _cut(record, out, keep)
        line = _encode(out)
    if len(line) > RECORD_MAX:
        line = _encode(_slim(out, len(line)))
    return line


def _clipped(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its lists and dicts cut to ``LOG_LIST_LIMIT`` entries (a cut list's full count beside it)
    and its strings clipped to ``LOG_ARG_LIMIT`` characters."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) > LOG_LIST_LIMIT:
                out[f"{key}_count"] = len(value)
            out[key] = _clip(value)
        elif isinstance(value, dict):
            out[key] = {_clip_text(str(k)): _clip_text(str(v)) for k, v in list(value.items())[:LOG_LIST_LIMIT]}
        elif isinstance(value, str):
            out[key] = _clip_text(value)
        else:
            out[key] = value
    return out


def _cut(record: dict[str, Any], out: dict[str, Any], keep: int) -> None:
    """Cut ``out``'s lists and dicts (those of ``record``) to ``keep`` entries of at most 64 characters."""
    for key, value in record.items():
        if isinstance(value, list) and key in out:
            out[f"{key}_count"] = len(value)
            out[key] = [v[:64] if isinstance(v, str) else v for v in out[key][:keep]]
        elif isinstance(value, dict) and key in out:
            out[key] = {k[:64]: v[:64] for k, v in list(out[key].items())[:keep]}


def _slim(out: dict[str, Any], length: int) -> dict[str, Any]:
    """Only the scalar fields (strings cut to 256 characters), and the length of the line that did not fit."""
    slim = {k: v[:256] if isinstance(v, str) else v for k, v in out.items()
            if v is None or isinstance(v, (str, int, float, bool))}
    slim["clipped_bytes"] = length
    return slim


def drop_privileges(cfg: Config) -> None:
    """The worker becomes the agent: every later step runs with the agent's rights only.

    The credential change also makes the worker non-dumpable, so the agent cannot inspect or ptrace it.
    """
    if os.geteuid() != 0:
        return
    capability = cfg.exec_capability
    if capability is not None:
        capability.keep_across_setuid(True)
    os.setgroups(cfg.groups)
    os.setresgid(cfg.agent_gid, cfg.agent_gid, cfg.agent_gid)
    os.setresuid(cfg.agent_uid, cfg.agent_uid, cfg.agent_uid)
    if capability is not None:
        capability.set(effective=False)  # permitted: CAP_DAC_OVERRIDE alone
        capability.keep_across_setuid(False)


def handle_call(cfg: Config, ref_fd: int, kind: str, conn: socket.socket, *, log: CallLog, wake_r: int) -> bool:
    """Serve one connection in a worker (already running as the agent); True when the worker must retire."""
    call = Call(cfg, ref_fd, kind, conn, log=log, wake_r=wake_r)
    if call.admit() and call.read() and call.spawn():
        call.finish(call.supervise())
    return call.retire


class Call:
    """One call, served in its steps: ``admit`` the caller, ``read`` its request, ``spawn`` the reference,
    ``supervise`` it until it exits, ``finish`` with the reply and the ``ended`` line.

    A step that refuses or fails answers the client and writes the call's line itself, and returns False: the call
    then ends there. While the child runs, each ready descriptor is an event handled by the method named after its
    source (``on_client``, ``on_wake``, ``on_terminal``).
    """

    def __init__(self, cfg: Config, ref_fd: int, kind: str, conn: socket.socket, *, log: CallLog,
                 wake_r: int) -> None:
        self.cfg = cfg
        self.ref_fd = ref_fd
        self.ref_kind = kind  # of the reference program: "elf", "script"...
        self.conn = conn
        self.log = log
        self.wake_r = wake_r
        started = time.time()
        self.clock = time.monotonic()
        # The id joins a call's "started" and "ended" lines (worker pid + a clock: unique in the container).
        # "at": the start to the millisecond, so a call and a model request in the same second keep their order
        self.record: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                                       "at": round(started, 3), "call": f"{os.getpid()}.{time.monotonic_ns()}",
                                       "phase": "ended"}
        self.request = Request()  # empty until ``read``
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.relay: Relay | None = None
        self.fast = False
        self.limits: list[tuple[int, int, int]] = []
        self.retire = False  # the caller's lower hard limits stick to this worker
        self.started_logged = False
        self.popen: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.err_r = -1  # the general path's child reports a failed fchdir or exec here
        self.err_w = -1
        self.client_gone = False

    # ------------------------------------------------------------------------------------------ the steps
    def admit(self) -> bool:
        """The caller's credentials (``SO_PEERCRED``, from the kernel): only an allowed uid is served."""
        creds = self.conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer_pid, peer_uid, _peer_gid = struct.unpack("3i", creds)
        self.record.update(pid=peer_pid, uid=peer_uid)
        if peer_uid in self.cfg.allow_uids:
            return True
        self.record["error"] = f"refused: uid {peer_uid} is not allowed"
        send_reply(self.conn, REPLY_REFUSED, 126,
                   f"binary: permission denied: uid {peer_uid} may not run the reference program\n")
        self.log.append(self.record)
        return False

    def read(self) -> bool:
        """The request (header, descriptors, rlimits, argv, environment); the reference's argv and cleaned
        environment, and what the call log says of them."""
        try:
            self.request = read_request(self.conn)
        except (ProtocolError, OSError, ValueError, struct.error) as exc:
            self.record["error"] = f"bad request: {exc}"
            send_reply(self.conn, REPLY_ERROR, 125, f"binary: malformed request to the proxy ({exc})\n")
            self.log.append(self.record)
            return False
        argv = self.request.argv or ["binary"]
        if not argv[0]:
            argv = ["binary", *argv[1:]]
        self.argv = argv
        env, removed = clean_env(self.request.env_entries)
        env.update(FORCED_ENV)
        self.env = env
        cwd = _fd_path(self.request.fds.get(FD_CWD))
        flags, seen = audit(argv, cwd)
        self.record.update(argv=argv, cwd=cwd, flags=flags)  # bounded when written (bounded_line)
        if seen:
            self.record["flag_paths"] = seen
        if removed:
            self.record["stripped_env"] = sorted(set(removed))
        return True

    def spawn(self) -> bool:
        """The child, started as the caller's process would have been (its ``started`` line written first); the
        request's descriptors are closed here either way, as the child holds its own copies."""
        if self.ref_kind == "script":
            self._refuse_script()
            return False
        self._open_terminal()
        self._choose_path()
        # Before the reference runs: a worker killed mid-call (the agent shares its uid) still leaves this line.
        self.started_logged = self.log.append({**self.record, "phase": "started"})
        try:
            self.pid = self._start_child()
        except (SpawnError, OSError) as exc:
            self._spawn_failed(exc)
            return False
        finally:
            if self.err_w >= 0:
                os.close(self.err_w)
                self.err_w = -1
            if self.relay is not None:
                self.relay.close_slave()
            self.request.close()
        return True

    def supervise(self) -> int:
        """Relay events until the child exits; its wait status."""
        status: int | None = None
        self.conn.setblocking(False)
        while status is None:
            for source, fd, events in self._poll():
                handler: Callable[[int, int], None] = getattr(self, "on_" + source)
                handler(fd, events)
            status = self._reaped()
        return status

    def finish(self, status: int) -> None:
        """Reply with the child's exit or death and write the call's ``ended`` line."""
        if self.popen is not None:
            self.popen.returncode = status  # reaped: Popen must not poll or adopt it any more
        if self.relay is not None:
            self.relay.finish()
        reply_kind, value, core = wait_status_to_reply(status)
        failure = self._child_failure()
        if failure:
            what, _, number = failure.partition(" ")
            self.record["error"] = f"{what}: {os.strerror(int(number or 0))}"
        self.record.update(duration_s=round(time.monotonic() - self.clock, 6))
        if reply_kind == REPLY_SIGNAL:
            self.record.update(exit=None, signal=value, core=core)
        else:
            self.record.update(exit=value, signal=None, core=False)
        if not self.client_gone:
            self.conn.setblocking(True)
            send_reply(self.conn, reply_kind, value)
        self.log.append(self.record, started_logged=self.started_logged)

    # ------------------------------------------------------------------------------------------ events
    def on_client(self, _fd: int, _events: int) -> None:
        """Bytes from the client are signals to forward; its end (the caller died) kills the child's group."""
        try:
            data = self.conn.recv(256)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.client_gone = True
            self.record["client_gone"] = True
            _kill_group(self.pid, signal.SIGKILL)
            return
        for sig in data:
            _forward(self.pid, sig, self.relay)

    def on_wake(self, _fd: int, _events: int) -> None:
        """A signal reached the worker (SIGCHLD: the child may have exited; the loop reaps it next)."""
        with contextlib.suppress(OSError):
            os.read(self.wake_r, 512)

    def on_terminal(self, fd: int, events: int) -> None:
        """The caller's terminal or the child's pseudo-terminal is ready: relay between them."""
        if self.relay is not None:
            self.relay.on_event(fd, events)

    # ------------------------------------------------------------------------------------------ helpers
    def _refuse_script(self) -> None:
        self.record.update(error="the reference is a script", exit=126, signal=None, core=False)
        send_reply(self.conn, REPLY_ERROR, 126,
                   f"binary: the reference program is a script (#!{self.cfg.interpreter}); a script cannot run "
                   "from an execute-only file (mode 111), so it cannot be run through /workspace/binary\n")
        self.request.close()
        self.log.append(self.record)

    def _open_terminal(self) -> None:
        """A relayed pseudo-terminal when the caller passed a terminal."""
        fds = self.request.fds
        if any(os.isatty(fds[bit]) for bit in (FD_STDIN, FD_STDOUT, FD_STDERR) if bit in fds):
            try:
                self.relay = Relay(self.request)
            except Exception as exc:  # the terminal cannot be relayed: hand it over as it is
                self.record["tty_error"] = str(exc)
                self.relay = None
        self.record["tty"] = self.relay is not None

    def _choose_path(self) -> None:
        """The fast path (vfork) when it reproduces the caller's process state, else the general one (fork)."""
        self.fast = self.relay is None and fast_path_possible(self.request, self.cfg.rlimits)
        self.limits = (rlimit_changes(self.request, self.cfg.rlimits) or []) if self.fast else []
        self.retire = any(hard != self.cfg.rlimits[number][1] for number, _soft, hard in self.limits)
        self.record["path"] = "fast" if self.fast else "general"

    def _start_child(self) -> int:
        """The child's pid. Between the fork and the exec the child runs ``_exec_child`` only."""
        if self.fast:
            self.popen = _spawn_fast(self.ref_fd, self.request, self.argv, self.env, self.limits,
                                     self.cfg.exec_capability)
            return self.popen.pid
        self.err_r, self.err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            relay = self.relay
            _exec_child(self.ref_fd, self.request, self.argv, self.env, relay.slave if relay else None,
                        relay.bits if relay else 0, self.err_w, self.cfg.exec_capability)
        return pid

    def _spawn_failed(self, exc: SpawnError | OSError) -> None:
        if isinstance(exc, SpawnError):
            code, message, detail = exc.code, exc.message, exc.detail
        else:
            code, message = 126, f"binary: the proxy cannot start the reference: {exc}\n"
            detail = f"fork failed: {exc}"
        self.record.update(error=detail, exit=code, signal=None, core=False)
        send_reply(self.conn, REPLY_ERROR, code, message)
        self.log.append(self.record, started_logged=self.started_logged)
        if self.relay is not None:
            self.relay.close()
        if self.err_r >= 0:
            os.close(self.err_r)
            self.err_r = -1

    def _poll(self) -> list[tuple[str, int, int]]:
        """Wait (up to a second) for the call's descriptors: ``(source, fd, events)`` of each ready one."""
        sources: dict[int, str] = {}
        if not self.client_gone:
            sources[self.conn.fileno()] = "client"
        sources[self.wake_r] = "wake"
        poller = select.poll()
        for fd in sources:
            poller.register(fd, select.POLLIN)
        if self.relay is not None:
            for fd, mask in self.relay.poll_events():
                sources[fd] = "terminal"
                poller.register(fd, mask)
        return [(sources[fd], fd, events) for fd, events in poller.poll(1000)]

    def _reaped(self) -> int | None:
        """The child's wait status once it has exited."""
        try:
            done, raw = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # must not happen: nothing else waits for our children
            self.record["error"] = "the child was reaped elsewhere; status unknown"
            done, raw = self.pid, 255 << 8
        return raw if done == self.pid else None

    def _child_failure(self) -> str:
        """What the general path's child reported before exiting (``cwd ERRNO``, ``exec ERRNO``), if anything."""
        failure = ""
        if self.err_r >= 0:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                failure = os.read(self.err_r, 64).decode()
            os.close(self.err_r)
            self.err_r = -1
        return failure


def _kill_group(pid: int, sig: int) -> None:
    for target in (-pid, pid):
        try:
            os.kill(target, sig)
            return
        except OSError:
            continue


def _forward(pid: int, sig: int, relay: Relay | None) -> None:
    if sig not in FORWARDABLE:
        return
    if relay is not None and sig == signal.SIGWINCH:
        relay.copy_winsize()  # the kernel signals the terminal's foreground group itself
        return
    group = relay.foreground_group(pid) if relay is not None else pid
    if sig == signal.SIGTSTP and relay is None:
        sig = signal.SIGSTOP  # the child's group is orphaned: a plain TSTP would be discarded
    try:
        os.kill(-group, sig)
    except OSError:
        _kill_group(pid, sig)


# ---------------------------------------------------------------------------------------------- master
MAX_CALLS_PER_WORKER = 1000
NOTE_BUSY, NOTE_IDLE, NOTE_UNRECORDED = 1, 0, 2
NOTE = struct.Struct("<ii")


def worker_main(cfg: Config, listener: socket.socket, ref_fd: int, kind: str, notify_w: int) -> None:
    """A worker: opens the call log as root, becomes the agent, then serves calls one at a time."""
    global _error_fd  # noqa: PLW0603 - one process, one error log
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # Nothing of the daemon may leak into a child: the daemon log moves off the standard descriptors.
    _error_fd = fcntl.fcntl(2, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        if null != target:
            os.dup2(null, target, inheritable=False)
    if null > 2:
        os.close(null)
    me = os.getpid()

    def unrecorded() -> None:
        with contextlib.suppress(OSError):
            os.write(notify_w, NOTE.pack(me, NOTE_UNRECORDED))

    log = CallLog(cfg.call_log, cfg.dropped_log, unrecorded)
    drop_privileges(cfg)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for _ in range(MAX_CALLS_PER_WORKER):
        try:
            conn, _addr = listener.accept()
        except InterruptedError:
            continue
        with contextlib.suppress(OSError):
            os.write(notify_w, NOTE.pack(me, NOTE_BUSY))
        try:
            retire = handle_call(cfg, ref_fd, kind, conn, log=log, wake_r=wake_r)
        except Exception as exc:
            _log_error(f"call failed: {exc!r}")
            send_reply(conn, REPLY_ERROR, 125, f"binary: internal proxy error ({exc.__class__.__name__})\n")
            conn.close()
            return  # a fresh worker takes over; this one may be in an inconsistent state
        conn.close()
        if retire:  # the caller's lower hard limits stuck to this worker: a fresh one takes over
            return
        with contextlib.suppress(OSError):
            os.write(notify_w, NOTE.pack(me, NOTE_IDLE))


def serve(cfg: Config, ready_fd: int | None = None) -> int:
    if _read_text(SUID_DUMPABLE) == "1":
        _log_error("fs.suid_dumpable is 1: execute-only programs would be dumpable; refusing to serve")
        return 3
    if cfg.exec_capability is not None and _read_text(YAMA_PTRACE_SCOPE) not in ("1", "2", "3"):
        _log_error("capability mode without Yama's ptrace_scope >= 1: the agent could trace the reference; "
                   "refusing to serve")
        return 3
    ref_fd = os.open(cfg.reference, os.O_PATH | os.O_CLOEXEC)
    kind = reference_kind(cfg.reference)
    if kind == "script":
        cfg.interpreter = script_interpreter(cfg.reference)
    cfg.rlimits = _current_rlimits()
    _set_subreaper()
    listener = _listen(cfg.socket_path)
    notify_r, notify_w = os.pipe2(os.O_CLOEXEC)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    idle: set[int] = set()
    busy: set[int] = set()
    counts = CallCount(cfg.count_log)
    if ready_fd is not None:
        os.write(ready_fd, b"ready %d %s\n" % (os.getpid(), kind.encode()))
        os.close(ready_fd)
    backoff_until = 0.0
    while not stopping:
        while len(idle) < cfg.pool and len(idle) + len(busy) < cfg.max_workers and time.monotonic() >= backoff_until:
            try:
                pid = os.fork()
            except OSError as exc:
                _log_error(f"fork failed: {exc}")
                backoff_until = time.monotonic() + 0.5
                break
            if pid == 0:
                code = 0
                try:
                    os.close(notify_r)
                    os.close(wake_r)
                    signal.set_wakeup_fd(-1)
                    os.close(wake_w)
                    worker_main(cfg, listener, ref_fd, kind, notify_w)
                except BaseException as exc:
                    _log_error(f"worker failed: {exc!r}")
                    code = 1
                os._exit(code)
            idle.add(pid)
        try:
            readable, _, _ = select.select([notify_r, wake_r], [], [], 1.0)
        except InterruptedError:
            readable = []
        if notify_r in readable:
            _take_notes(notify_r, idle, busy, counts)
        if wake_r in readable:
            with contextlib.suppress(OSError):
                os.read(wake_r, 4096)
        _reap_children(idle, busy)
    listener.close()
    for pid in idle:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    return 0


def _listen(path: str) -> socket.socket:
    """The listening socket, open to every uid (each call is admitted by ``SO_PEERCRED``)."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o111)
    try:
        listener.bind(path)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o666)  # noqa: S103 - access is decided by SO_PEERCRED, so other uids get a plain refusal
    listener.listen(256)
    return listener


def _take_notes(notify_r: int, idle: set[int], busy: set[int], counts: CallCount) -> None:
    """The workers' notes: each call counted, each worker moved between ``idle`` and ``busy``."""
    data = os.read(notify_r, 4096 * NOTE.size)  # writes of 8 bytes are atomic: never split
    for pid, state in NOTE.iter_unpack(data[: len(data) - len(data) % NOTE.size]):
        counts.note(state)  # every call counts, its worker reaped since or not
        if pid not in idle and pid not in busy:
            continue  # already reaped
        if state == NOTE_UNRECORDED:
            continue
        if state == NOTE_BUSY:
            idle.discard(pid)
            busy.add(pid)
        else:
            busy.discard(pid)
            idle.add(pid)
    counts.save()


def _reap_children(idle: set[int], busy: set[int]) -> None:
    """Reap exited workers and adopted orphans."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        idle.discard(pid)
        busy.discard(pid)


class CallCount:
    """The master's count of calls (one ``NOTE_BUSY`` per accepted call) and of unrecorded ones, kept in memory and
    in ``COUNT_LOG``: written whole at start, then overwritten in place (no new blocks: a full disk cannot stop it on
    the filesystems that do not copy on write)."""

    def __init__(self, path: str) -> None:
        self.calls = 0
        self.unrecorded = 0
        self._saved = (-1, -1)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            _log_error(f"cannot open the call count: {exc}")
            self.fd = -1
        self.save()

    def note(self, state: int) -> None:
        self.calls += state == NOTE_BUSY
        self.unrecorded += state == NOTE_UNRECORDED

    def save(self) -> None:
        if self.fd < 0 or self._saved == (self.calls, self.unrecorded):
            return
        try:
            os.pwrite(self.fd, COUNT_LINE.format(self.calls, self.unrecorded).encode(), 0)
            self._saved = (self.calls, self.unrecorded)
        except OSError as exc:
            _log_error(f"cannot write the call count: {exc}")


def _read_text(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------- setup
def _ensure_agent(name: str, uid: int) -> tuple[int, int, str]:
    try:
        entry = pwd.getpwnam(name)
        return entry.pw_uid, entry.pw_gid, entry.pw_dir
    except KeyError:
        pass
    while _uid_taken(uid):  # the image already has a user with that uid: take the next free one
        uid += 1
    home = "/home/" + name
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    gid = uid
    try:
        grp.getgrgid(gid)
        gid_taken = True
    except KeyError:
        gid_taken = False
    useradd = shutil.which("useradd")
    if useradd:
        command = [useradd, "-u", str(uid), "-d", home, "-M", "-s", shell]
        if gid_taken:
            command += ["-N", "-g", "users" if _group_exists("users") else "0"]
        else:
            if shutil.which("groupadd"):
                subprocess.run([shutil.which("groupadd") or "groupadd", "-g", str(gid), name], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            command += ["-g", str(gid)]
        subprocess.run([*command, name], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    else:
        if not gid_taken:
            with open("/etc/group", "a") as handle:
                handle.write(f"{name}:x:{gid}:\n")
        else:
            gid = 100
        with open("/etc/passwd", "a") as handle:
            handle.write(f"{name}:x:{uid}:{gid}::{home}:{shell}\n")
        if os.path.exists("/etc/shadow"):
            with open("/etc/shadow", "a") as handle:
                handle.write(f"{name}:!:19000:0:99999:7:::\n")
    entry = pwd.getpwnam(name)
    os.makedirs(entry.pw_dir, mode=0o755, exist_ok=True)
    os.chown(entry.pw_dir, entry.pw_uid, entry.pw_gid)
    return entry.pw_uid, entry.pw_gid, entry.pw_dir


def _uid_taken(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def _move(source: str, target: str) -> None:
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EPERM):
            raise
        shutil.move(source, target)


def _lock_down_docs(root: str) -> None:
    """Root-owned, world-readable, not writable by anyone else."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, None]:
            path = dirpath if name is None else os.path.join(dirpath, name)
            info = os.lstat(path)
            os.lchown(path, 0, 0)
            if stat.S_ISLNK(info.st_mode):
                continue
            mode = stat.S_IMODE(info.st_mode) & ~0o7022
            mode |= 0o444
            if stat.S_ISDIR(info.st_mode) or mode & 0o111:
                mode |= 0o111
            os.chmod(path, mode)


def setup(args: argparse.Namespace) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise SystemExit("pb-proxy setup must run as root")
    report: dict[str, Any] = {}
    if _read_text(SUID_DUMPABLE) == "1":
        raise SystemExit("fs.suid_dumpable is 1 on this host: an execute-only reference would be dumpable and "
                         "readable by the agent; set it to 0 (or 2) with `sysctl fs.suid_dumpable=0`")
    uid, gid, home = _ensure_agent(args.agent_name, args.agent_uid)
    report.update(agent_name=args.agent_name, agent_uid=uid, agent_gid=gid, agent_home=home)
    os.makedirs(PROXY_DIR, mode=0o700, exist_ok=True)
    os.chown(PROXY_DIR, 0, 0)
    os.chmod(PROXY_DIR, 0o700)
    source = args.reference_source
    if not os.path.lexists(source) and not os.path.exists(REFERENCE):
        raise SystemExit(f"no reference program at {source}")
    if os.path.lexists(source):
        if os.path.islink(source) or not os.path.isfile(source):
            raise SystemExit(f"{source} is not a regular file")
        _move(source, REFERENCE)
    os.chown(REFERENCE, 0, 0)
    os.chmod(REFERENCE, 0o111)  # noqa: S103 - executable by all, readable by root only: the child is then not dumpable
    exec_mode = "capability" if exec_needs_read(uid, gid) else "execute-only"
    if exec_mode == "capability":
        _require_capability_mode()
    report["exec_mode"] = exec_mode
    kind = reference_kind(REFERENCE)
    report["reference_kind"] = kind
    report["reference_sha256"] = _sha256(REFERENCE)
    report["reference_size"] = os.stat(REFERENCE).st_size
    # Everything else of /workspace is documentation: read-only under /workspace/docs.
    os.makedirs(WORKSPACE, exist_ok=True)
    staging = WORKSPACE + "/.pb-docs-staging"
    os.makedirs(staging, mode=0o755, exist_ok=True)
    moved = []
    for name in sorted(os.listdir(WORKSPACE)):
        if name == os.path.basename(staging):
            continue
        _move(os.path.join(WORKSPACE, name), os.path.join(staging, name))
        moved.append(name)
    os.rename(staging, DOCS_DIR)
    _lock_down_docs(DOCS_DIR)
    report["docs"] = moved
    os.chown(WORKSPACE, 0, 0)
    os.chmod(WORKSPACE, 0o755)  # noqa: S103 - the agent reads docs/ and writes src/
    os.makedirs(SRC_DIR, mode=0o755)
    os.chown(SRC_DIR, uid, gid)
    # The client.
    client_tmp = CLIENT_PATH + ".tmp"
    shutil.copyfile(STAGED_CLIENT, client_tmp)
    if args.client_kind == "python":
        with open(client_tmp, "rb") as handle:
            body = handle.read()
        if body.startswith(b"#!"):
            body = body.split(b"\n", 1)[1]
        with open(client_tmp, "wb") as handle:
            handle.write(b"#!" + os.fsencode(sys.executable) + b" -IS\n" + body)
    os.chown(client_tmp, 0, 0)
    os.chmod(client_tmp, 0o755)  # noqa: S103 - the agent runs the client
    os.rename(client_tmp, CLIENT_PATH)
    os.unlink(STAGED_CLIENT)
    report["client_kind"] = args.client_kind
    # The daemon.
    groups = [g for g in os.getgrouplist(args.agent_name, gid) if g != gid]
    serve_args = ["--agent-uid", str(uid), "--agent-gid", str(gid), "--groups", ",".join(map(str, [gid, *groups])),
                  "--pool", str(args.pool)]
    for extra in args.allow_uid or []:
        serve_args += ["--allow-uid", str(extra)]
    if exec_mode == "capability":
        serve_args.append("--exec-capability")
    report["daemon_pid"] = _spawn_daemon(serve_args)
    report["socket"] = SOCKET_PATH
    report["suid_dumpable"] = _read_text(SUID_DUMPABLE)
    report["python"] = sys.executable
    report["timeout_command"] = shutil.which("timeout") or ""
    return report


def exec_needs_read(uid: int, gid: int) -> bool:
    """Whether this kernel refuses to execute a file its caller cannot read (gVisor) where Linux needs execute
    permission only. Tried as ``uid`` on an execute-only file of junk: nothing runs either way (Linux answers
    ENOEXEC, a kernel that wants read permission EACCES)."""
    with open(EXEC_PROBE, "wb") as handle:
        handle.write(b"\0" * 64)
    os.chmod(EXEC_PROBE, 0o111)  # noqa: S103 - the probe is junk
    probe_fd = os.open(EXEC_PROBE, os.O_PATH | os.O_CLOEXEC)  # as the reference is run: its 0700 dir is not searched
    read_r, write_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        number = 0
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.execve(probe_fd, [EXEC_PROBE], {})  # noqa: S606 - junk: cannot run
        except OSError as exc:
            number = exc.errno or 0
        except BaseException:  # noqa: S110 - the child must never return into setup
            pass
        with contextlib.suppress(OSError):
            os.write(write_w, str(number).encode())
        os._exit(0)
    os.close(write_w)
    os.close(probe_fd)
    answer = os.read(read_r, 32).decode() or "0"
    os.close(read_r)
    os.waitpid(pid, 0)
    os.unlink(EXEC_PROBE)
    return int(answer) == errno.EACCES


def _require_capability_mode() -> None:
    """Capability mode leaves the running reference dumpable, as the agent's uid: only Yama keeps the agent out."""
    scope = _read_text(YAMA_PTRACE_SCOPE)
    if scope not in ("1", "2", "3"):
        raise SystemExit(f"this kernel executes a file only with read permission (gVisor), so the reference would "
                         f"run dumpable as the agent's uid, and Yama's ptrace_scope is {scope or 'absent'}: the agent "
                         "could read its memory; refusing to serve")
    try:
        ExecCapability()
    except (ImportError, OSError) as exc:
        raise SystemExit(f"this kernel executes a file only with read permission (gVisor) and the proxy cannot "
                         f"set capabilities (ctypes): {exc}") from None
    bounding = next((line.split()[1] for line in _read_text("/proc/self/status").splitlines()
                     if line.startswith("CapBnd:")), "0")
    if not int(bounding, 16) >> CAP_DAC_OVERRIDE & 1:
        raise SystemExit("this kernel executes a file only with read permission (gVisor) and CAP_DAC_OVERRIDE, "
                         "which the proxy holds for the exec alone, is not in the container's bounding set")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _spawn_daemon(serve_args: list[str]) -> int:
    """Start ``serve`` detached (new session, stdio on the daemon log) and wait until it listens."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            null = os.open(os.devnull, os.O_RDONLY)
            log = os.open(DAEMON_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(null)
            os.close(log)
            os.chdir("/")
            parser = _parser()
            args = parser.parse_args(["serve", *serve_args])
            code = serve(Config(args), ready_fd=ready_w)
        except BaseException as exc:
            _log_error(f"daemon failed: {exc!r}")
            code = 1
        os._exit(code)
    os.close(ready_w)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 20
    buffer = b""
    while b"\n" not in buffer and time.monotonic() < deadline:
        readable, _, _ = select.select([ready_r], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            break
        chunk = os.read(ready_r, 256)
        if not chunk:
            break
        buffer += chunk
    os.close(ready_r)
    if not buffer.startswith(b"ready "):
        raise SystemExit(f"the proxy daemon did not start: {_read_text(DAEMON_LOG)[-2000:]}")
    return int(buffer.split()[1])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pb-proxy-daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup")
    s.add_argument("--agent-name", default=AGENT_NAME)
    s.add_argument("--agent-uid", type=int, default=AGENT_UID)
    s.add_argument("--reference-source", default=WORKSPACE + "/executable")
    s.add_argument("--client-kind", choices=("static-c", "python"), default="static-c")
    s.add_argument("--allow-uid", type=int, action="append")
    s.add_argument("--pool", type=int, default=2)
    v = sub.add_parser("serve")
    v.add_argument("--socket", default=SOCKET_PATH)
    v.add_argument("--reference", default=REFERENCE)
    v.add_argument("--call-log", default=CALL_LOG)
    v.add_argument("--dropped-log", default=DROPPED_LOG)
    v.add_argument("--count-log", default=COUNT_LOG)
    v.add_argument("--agent-uid", type=int, required=True)
    v.add_argument("--agent-gid", type=int, required=True)
    v.add_argument("--groups", default="")
    v.add_argument("--allow-uid", type=int, action="append")
    v.add_argument("--pool", type=int, default=2)
    v.add_argument("--max-workers", type=int, default=512)
    v.add_argument("--exec-capability", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "setup":
        try:
            report = setup(args)
        except SystemExit as exc:
            print(json.dumps({"error": str(exc.code)}))
            return 2
        except Exception as exc:
            print(json.dumps({"error": f"{exc.__class__.__name__}: {exc}"}))
            return 2
        print(json.dumps(report, sort_keys=True))
        return 0
    return serve(Config(args))


if __name__ == "__main__":
    sys.exit(main())
