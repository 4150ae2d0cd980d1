"""Model requests in flight upstream across the whole run, bounded: ``--pb-model-concurrency N``.

Every task has its own relay, in whichever xdist worker runs it (and on whichever engine), so the bound cannot live in
one process: it is N lock files in the run directory (``.pb-model-slots/slot-<i>``), each held with ``flock`` by the
request using it, from before it is sent until its answer's last byte went to the agent (or it failed, or it waits
to be retried). A request finding every slot held polls until one is free. ``flock`` belongs to the open file: a
worker that dies (killed, crashed) frees what it held with its descriptors, so no slot is ever lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

SLOTS_DIR = ".pb-model-slots"
_POLL_S = 0.05


class SlotsClosed(Exception):
    """The relay closed while its request waited for a slot (or for the run's rate limit, ``rate.py``)."""


class ModelSlots:
    """``count`` slots shared by every process that names the same ``directory``."""

    def __init__(self, directory: Path, count: int) -> None:
        if count < 1:
            raise ValueError("at least one slot")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.count = count

    def acquire(self, closing: threading.Event, on_wait: Callable[[], None] | None = None) -> tuple[int, float]:
        """A held slot's descriptor and the seconds waited for it; :class:`SlotsClosed` if ``closing`` is set."""
        started = time.monotonic()
        told = False
        while True:
            order = list(range(self.count))
            random.shuffle(order)
            for index in order:
                fd = os.open(self.directory / f"slot-{index}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                return fd, round(time.monotonic() - started, 3)
            if not told and on_wait is not None:
                on_wait()
                told = True
            if closing.wait(_POLL_S):
                raise SlotsClosed

    @staticmethod
    def release(fd: int) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(fd)
