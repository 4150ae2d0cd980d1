"""Backpressure on the Docker engine: at most N heavy operations at once across every process of a run.

Heavy operations (create, start, build, pull, commit, remove, load) are what makes a shared engine stall when 8
xdist workers each fire a burst of them. Every call through an :class:`~pytest_programbench.engine.engine.Engine`
takes a slot of its run's :class:`Backpressure` transparently; nobody else needs to know.

Across processes the cap is a set of ``flock`` slot files in a run-scoped directory: ``slot-0`` .. ``slot-<N-1>``.
A holder keeps one slot file locked for the duration of one operation (a streamed build or pull: until its stream
ends). The kernel drops a lock when its holder dies, so a crashed worker never leaks a slot. ``flock`` locks belong
to the open file description, so threads of one process exclude each other too. A thread that already holds a
slot does not take a second one (no self-deadlock when a heavy call nests another).

Where the cap comes from, first match wins: :meth:`Backpressure.for_run` (the session builds it at configure time,
on the controller and on every worker, and keeps it in its run's engines), else the environment
(``PB_DOCKER_CONCURRENCY``, ``PB_DOCKER_SLOTS_DIR``; :meth:`Backpressure.for_run` exports both, so xdist workers
spawned afterwards inherit them), else, in an xdist worker, :data:`DEFAULT_LIMIT` slots shared by the workers of the
session (keyed by xdist's ``PYTEST_XDIST_TESTRUNUID``), else :data:`DEFAULT_LIMIT` slots local to the process
(:meth:`Backpressure.from_environment`). A limit of 0 means no cap.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import random
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pytest_programbench.core import environment
from pytest_programbench.engine.ownership import Owner, boot_id, process_alive, process_start_time

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 4
OWNER_FILE = "owner.json"
# Waiting for a slot is logged once it takes this long (then every period again).
WAIT_LOG_SECONDS = 60.0
_POLL_MIN = 0.01
_POLL_MAX = 0.25


def slots_root() -> Path:
    """Where run-scoped slot directories live by default (local disk: ``flock`` wants a local filesystem)."""
    return Path(tempfile.gettempdir()) / f"pytest-programbench-{os.getuid()}" / "docker-slots"


class Backpressure:
    """One run's cap on heavy engine operations, as seen by this process: ``limit`` slots (0: no cap) in
    ``directory`` (shared by every process of the run) or, without one, in this process only."""

    def __init__(self, limit: int, directory: Path | None = None) -> None:
        if limit < 0:
            raise ValueError(f"docker concurrency must be >= 0, not {limit}")
        self.limit = limit
        self.directory = directory
        self._lock = threading.Lock()
        self._sem = threading.BoundedSemaphore(limit) if limit and directory is None else None
        self._depth: dict[int, int] = {}  # thread ident -> real slots it holds (a holder's nested calls take none)

    @classmethod
    def for_run(cls, *, run_id: str | None = None, limit: int | None = None, directory: Path | str | None = None,
                owner: dict[str, object] | None = None, export: bool = True) -> Backpressure:
        """The cap of a run (and, with ``export``, of processes started from this one later).

        ``limit`` None: the environment's or :data:`DEFAULT_LIMIT`. ``directory`` defaults to
        ``slots_root() / run_id`` when a run id is given; without either the slots are local to the process.
        ``owner`` (controller pid, host, start time) is written next to the slots so the reaper can remove the
        directory of a dead run.
        """
        if limit is None:
            limit = _env_limit()
        path: Path | None = None
        if directory is not None:
            path = Path(directory)
        elif run_id:
            path = slots_root() / run_id
        if path is not None:
            path.mkdir(parents=True, exist_ok=True)
            if owner is not None and not (path / OWNER_FILE).exists():
                _write_owner(path, {"run_id": run_id, **owner})
        if export:
            os.environ[environment.DOCKER_CONCURRENCY.name] = str(limit)
            if path is not None:
                os.environ[environment.DOCKER_SLOTS_DIR.name] = str(path)
            else:
                os.environ.pop(environment.DOCKER_SLOTS_DIR.name, None)
        log.debug("docker backpressure: %s slots in %s", limit or "unlimited", path or "this process")
        return cls(limit, path)

    @classmethod
    def from_environment(cls) -> Backpressure:
        """The cap a process outside a configured session works under (see the module docstring)."""
        env_dir = environment.DOCKER_SLOTS_DIR.raw()
        directory = Path(env_dir) if env_dir else _xdist_default()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            if not env_dir and not (directory / OWNER_FILE).exists():
                _write_owner(directory, _parent_owner())
        return cls(_env_limit(), directory)

    def acquire(self, operation: str) -> Slot:
        """Block until a slot is free (or return at once when uncapped, or when this thread holds one already)."""
        me = threading.get_ident()
        with self._lock:
            if self._depth.get(me, 0) > 0:
                return Slot(self, None, None, real=False)
        started = time.monotonic()
        fd: int | None = None
        sem = self._sem
        if self.limit == 0:
            pass  # uncapped: nothing to hold
        elif sem is not None:
            if not sem.acquire(blocking=False):
                while not sem.acquire(timeout=WAIT_LOG_SECONDS):
                    log.warning("docker %s: waited %.0f s for one of %d engine slots", operation,
                                time.monotonic() - started, self.limit)
        elif self.directory is not None:
            fd = _acquire_file_slot(self.directory, self.limit, operation, started)
        with self._lock:
            self._depth[me] = self._depth.get(me, 0) + 1
        return Slot(self, fd, sem)

    @contextlib.contextmanager
    def slot(self, operation: str) -> Iterator[None]:
        """``with slots.slot("create"):`` around one heavy engine operation."""
        held = self.acquire(operation)
        try:
            yield
        finally:
            held.release()

    def _released(self, thread: int) -> None:
        with self._lock:
            held = self._depth.get(thread, 0) - 1
            if held > 0:
                self._depth[thread] = held
            else:
                self._depth.pop(thread, None)


def _env_limit() -> int:
    return max(0, environment.DOCKER_CONCURRENCY.integer())


def _xdist_default() -> Path | None:
    """Unconfigured xdist workers of one session still share slots: keyed by xdist's test run uid."""
    uid = environment.XDIST_TESTRUNUID.raw()
    return slots_root() / f"xdist-{uid}" if uid and environment.XDIST_WORKER.is_set() else None


def _parent_owner() -> dict[str, object]:
    """The controller of an xdist worker is its parent process (popen gateways)."""
    parent = os.getppid()
    return {"hostname": socket.gethostname(), "controller_pid": parent,
            "started": (process_start_time(parent) or time.time()) + 1.0, "boot_id": boot_id()}


def _write_owner(path: Path, owner: dict[str, object]) -> None:
    tmp = path / f".{OWNER_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(owner))
    tmp.replace(path / OWNER_FILE)


# ---------------------------------------------------------------------------------------------- the slots


class Slot:
    """One held slot; :meth:`release` is idempotent (and safe from another thread)."""

    def __init__(self, owner: Backpressure, fd: int | None, sem: threading.BoundedSemaphore | None, *,
                 real: bool = True) -> None:
        self._owner = owner
        self._fd = fd
        self._sem = sem
        self._real = real  # False: a nested acquisition, the thread's outer slot covers it
        self._thread = threading.get_ident()
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        if not self._real:
            return
        self._owner._released(self._thread)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(self._fd)
        if self._sem is not None:
            self._sem.release()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # an abandoned stream must not keep its slot
        with contextlib.suppress(Exception):
            self.release()


def _acquire_file_slot(directory: Path, limit: int, operation: str, started: float) -> int:
    """Lock one of ``slot-0..slot-<limit-1>`` in ``directory``; polls with a jittered backoff."""
    delay = _POLL_MIN
    next_log = started + WAIT_LOG_SECONDS
    first = random.randrange(limit)  # noqa: S311 - spreading load, not security
    while True:
        for k in range(limit):
            index = (first + k) % limit
            path = directory / f"slot-{index}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:  # the directory was removed under us (a reaper, a cleanup): recreate it
                directory.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                continue
            return fd
        now = time.monotonic()
        if now >= next_log:
            log.warning("docker %s: waited %.0f s for one of %d engine slots in %s", operation, now - started,
                        limit, directory)
            next_log = now + WAIT_LOG_SECONDS
        time.sleep(delay * (0.5 + random.random()))  # noqa: S311
        delay = min(_POLL_MAX, delay * 2)


def in_use(directory: Path | None) -> int:
    """How many slots of ``directory`` are held right now, by anyone (0 for none: slots local to a process)."""
    if directory is None or not directory.is_dir():
        return 0
    busy = 0
    for path in directory.glob("slot-*"):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            busy += 1
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return busy


# ---------------------------------------------------------------------------------------------- clean-up


def release_run(run_id: str | None = None, directory: Path | None = None) -> None:
    """Remove a run's slot directory (the controller at session end; nothing may hold a slot any more)."""
    path = directory or (slots_root() / run_id if run_id else None)
    if path is not None and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def stale_slot_dirs() -> list[Path]:
    """Slot directories under :func:`slots_root` whose owner (controller) is gone; used by the reaper."""
    root = slots_root()
    if not root.is_dir():
        return []
    stale = []
    host = socket.gethostname()
    for path in root.iterdir():
        owner_file = path / OWNER_FILE
        try:
            data = json.loads(owner_file.read_text())
            owner = Owner(str(data["hostname"]), int(data["controller_pid"]), float(data["started"]),
                          str(data.get("boot_id", "")))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge (no or unreadable owner file)
        if owner.hostname == host and not process_alive(owner.pid, owner.started):
            stale.append(path)
    return stale
