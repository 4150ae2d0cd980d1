"""Who owns a run's containers, images and slot files: the controller process, told apart from a recycled pid.

Every object the plugin makes carries :data:`OWNER_LABEL` (host, boot id, controller pid, its start time) and
:data:`EXPIRES_LABEL`, so the reaper can tell a dead run's leftovers from a live run's by labels alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import psutil

OWNER_LABEL = "pytest-programbench.owner"  # "<hostname>/<boot id>/<controller pid>/<started>"
EXPIRES_LABEL = "pytest-programbench.expires"  # unix seconds after which the object is garbage
START_TOLERANCE = 2.0  # seconds: a start time read back may differ from the recorded one by rounding


class RunLike(Protocol):
    """What the run's identity offers (read-only: RunIdentity is frozen)."""

    @property
    def run_id(self) -> str: ...
    @property
    def controller_pid(self) -> int: ...
    @property
    def hostname(self) -> str: ...
    @property
    def started(self) -> float: ...


@dataclass(frozen=True)
class Owner:
    """Who owns a run: the controller process. ``pid`` is checked against ``started`` (pid reuse)."""

    hostname: str
    pid: int
    started: float
    boot_id: str = ""

    def label(self) -> str:
        return f"{self.hostname}/{self.boot_id}/{self.pid}/{self.started:.3f}"

    @classmethod
    def parse(cls, value: str | None) -> Owner | None:
        if not value:
            return None
        try:
            hostname, boot_id, pid, started = value.rsplit("/", 3)
            return cls(hostname, int(pid), float(started), boot_id)
        except ValueError:
            return None


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def process_start_time(pid: int) -> float | None:
    """Wall-clock start of process ``pid``, or None when it does not exist or cannot be read."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, ValueError):
        return None


def process_alive(pid: int, started: float | None = None) -> bool:
    """A process ``pid`` exists and is not a zombie (and, given ``started``, began no later than that: not a
    recycled pid)."""
    if pid <= 0:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        began = process.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # exists, unreadable: assume alive (never reap a possibly live run)
    return started is None or began <= started + START_TOLERANCE
