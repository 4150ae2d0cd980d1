"""Which Docker engine runs a task: ``--pb-docker-host URL[=SLOTS]`` (repeatable), leased across xdist workers.

Each task runs wholly on one engine: its image, its sandbox and its evaluation. An engine has slots; a task holds
one from its first engine call to its last. A slot is a ``flock`` on a file in a run-scoped directory, so every
worker of the run sees the same slots and a crashed worker's slot frees itself. An engine that stops answering is
marked down (a file beside its slots, seen by every worker): its running tasks end as infrastructure errors and are
retried on another engine, new tasks avoid it, and it is probed again after :data:`PROBE_AFTER` seconds.

Without the option there is no pool: one engine, the environment's (``DOCKER_HOST``), with no slot limit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_programbench.core import environment
from pytest_programbench.engine.errors import EngineUnavailable

if TYPE_CHECKING:
    from pytest_programbench.engine.docker_engine import Engines

log = logging.getLogger(__name__)

SCHEMES = ("unix://", "tcp://", "ssh://", "http://", "https://")
PROBE_AFTER = environment.ENGINE_PROBE_AFTER.number()
WAIT_LOG_SECONDS = 60.0
_POLL = 0.2


class EngineSpecError(ValueError):
    """A ``--pb-docker-host`` value that names no engine (a usage error)."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its URL (``None``: the environment's) and its slots (``None``: from its CPUs, at first use)."""

    url: str | None
    slots: int | None = None

    @property
    def name(self) -> str:
        return self.url or environment.DOCKER_HOST.raw() or "unix:///var/run/docker.sock"

    @property
    def remote(self) -> bool:
        """Not on this machine's filesystem: nothing may be bind-mounted from here."""
        return self.url is not None and not self.url.startswith("unix://")

    @property
    def key(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()[:16]

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """``URL`` or ``URL=SLOTS`` (``ssh://user@host``, ``tcp://host:2376``, ``unix:///path``; ``default``: the
        environment's engine)."""
        value = text.strip()
        url, sep, tail = value.rpartition("=")
        slots: int | None = None
        if sep and tail.isdigit():
            slots = int(tail)
            if slots < 1:
                raise EngineSpecError(f"--pb-docker-host {text!r}: SLOTS must be at least 1")
            value = url
        if value == "default":
            return cls(None, slots)
        if not value.startswith(SCHEMES):
            raise EngineSpecError(f"--pb-docker-host {text!r}: expected unix://, tcp://, ssh://, http:// or "
                                  "https:// (as DOCKER_HOST takes), optionally followed by =SLOTS")
        if value.startswith("unix://") and not value.removeprefix("unix://").startswith("/"):
            raise EngineSpecError(f"--pb-docker-host {text!r}: a unix:// URL takes an absolute path")
        return cls(value, slots)


def parse_docker_hosts(values: Sequence[str]) -> list[EngineSpec]:
    specs = [EngineSpec.parse(value) for value in values]
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise EngineSpecError(f"--pb-docker-host names an engine twice: {', '.join(repeated)}")
    return specs


def leases_root() -> Path:
    """Where run-scoped lease directories live (local disk: ``flock`` wants a local filesystem)."""
    return Path(tempfile.gettempdir()) / f"pytest-programbench-{os.getuid()}" / "engines"


class EngineLease:
    """One task's hold on one engine's slot; ``release()`` (or the holder's death) frees it."""

    def __init__(self, spec: EngineSpec, fd: int | None, pool: EnginePool) -> None:
        self.spec = spec
        self._fd = fd
        self._pool = pool
        self.started = time.monotonic()

    @property
    def url(self) -> str | None:
        return self.spec.url

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> EngineLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class EnginePool:
    """The engines of a run. Every process of the run (controller, xdist workers) builds one on the same directory;
    ``engines`` are the process's clients of them (asked for CPUs and probed)."""

    def __init__(self, specs: Sequence[EngineSpec], directory: Path, *, sandbox_cpus: float, engines: Engines) -> None:
        if not specs:
            raise EngineSpecError("an engine pool needs at least one engine")
        self.specs = list(specs)
        self.directory = directory
        self.sandbox_cpus = sandbox_cpus
        self.engines = engines
        self._slots: dict[str, int] = {}

    @classmethod
    def for_run(cls, specs: Sequence[EngineSpec], run_id: str, *, sandbox_cpus: float,
                engines: Engines) -> EnginePool:
        return cls(specs, leases_root() / run_id, sandbox_cpus=sandbox_cpus, engines=engines)

    # -- slots ----------------------------------------------------------------------------------------------------

    def slots(self, spec: EngineSpec) -> int:
        """``SLOTS`` as given, else the engine's CPUs over ``--pb-sandbox-cpus`` (at least 1)."""
        if spec.slots is not None:
            return spec.slots
        if spec.key not in self._slots:
            cpus = int(self.engines.client(spec.url).info().get("NCPU") or 1)
            self._slots[spec.key] = max(1, int(cpus // max(self.sandbox_cpus, 0.001)))
        return self._slots[spec.key]

    def _dir(self, spec: EngineSpec) -> Path:
        path = self.directory / spec.key
        path.mkdir(parents=True, exist_ok=True)
        return path

    def in_use(self, spec: EngineSpec) -> int:
        """Slots held right now, by any process of the run."""
        held = 0
        for path in self._dir(spec).glob("slot-*"):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    held += 1
            finally:
                os.close(fd)  # closing drops a lock taken just to look
        return held

    def _try_slot(self, spec: EngineSpec, limit: int) -> int | None:
        directory = self._dir(spec)
        for index in range(limit):
            fd = os.open(directory / f"slot-{index}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    continue
                raise
            return fd
        return None

    # -- health ---------------------------------------------------------------------------------------------------

    def mark_down(self, spec: EngineSpec, reason: str) -> None:
        """Every process of the run avoids ``spec`` until it answers a probe again."""
        marker = self._dir(spec) / "down"
        partial = marker.with_name(f"down.{os.getpid()}")
        partial.write_text(json.dumps({"since": time.time(), "reason": reason[:2000]}))
        os.replace(partial, marker)
        log.warning("engine %s marked down: %s", spec.name, reason[:300])

    def down_reason(self, spec: EngineSpec) -> str | None:
        """Why ``spec`` is down, or ``None``. A mark older than :data:`PROBE_AFTER` is probed first."""
        marker = self._dir(spec) / "down"
        try:
            data = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        if time.time() - float(data.get("since", 0)) < PROBE_AFTER:
            return str(data.get("reason") or "down")
        if self._answers(spec):
            with contextlib.suppress(OSError):
                marker.unlink()
            log.warning("engine %s answers again", spec.name)
            return None
        self.mark_down(spec, str(data.get("reason") or "down"))  # probed: down for another period
        return str(data.get("reason") or "down")

    def _answers(self, spec: EngineSpec) -> bool:
        try:
            self.engines.client(spec.url).api.ping()
        except Exception:
            self.engines.forget(spec.url)
            return False
        return True

    # -- leasing --------------------------------------------------------------------------------------------------

    def lease(self, *, avoid: Collection[str] = (), task: str = "") -> EngineLease:
        """A slot on the least busy engine that is up (``avoid``: names tried already by this task, used only
        when nothing else is up). Waits while every slot is taken; raises :class:`EngineUnavailable` when every
        engine is down."""
        started = time.monotonic()
        said = started
        while True:
            up = [spec for spec in self.specs if self.down_reason(spec) is None]
            if not up:
                reasons = "; ".join(f"{spec.name}: {self.down_reason(spec)}" for spec in self.specs)
                raise EngineUnavailable(f"every Docker engine of the run is down ({reasons})")
            preferred = [spec for spec in up if spec.name not in avoid] or up
            for spec in sorted(preferred, key=lambda s: (self.in_use(s) / self.slots(s), self.specs.index(s))):
                fd = self._try_slot(spec, self.slots(spec))
                if fd is not None:
                    return EngineLease(spec, fd, self)
            now = time.monotonic()
            if now - said > WAIT_LOG_SECONDS:
                said = now
                log.warning("%s waits %.0f s for a free engine slot", task or "a task", now - started)
            time.sleep(_POLL)

    def usage(self) -> dict[str, dict[str, Any]]:
        """Per engine: slots, held now, down reason (for the report header and summary)."""
        return {spec.name: {"slots": spec.slots, "in_use": self.in_use(spec), "down": self.down_reason(spec)}
                for spec in self.specs}
