"""The bytes of requests one relay holds at once, bounded: a flood of large bodies waits, then is refused.

The relay reads a request's body whole before it goes upstream (the API's own size limits are far below ours, and a
body held in full can be sent again). So many connections each sending a large body could hold gigabytes in the
worker; a :class:`ByteBudget` per relay (one per task) caps the sum. A request takes its declared size before its
body is read (chunked bodies take each chunk as it comes) and gives it back when its exchange ends; one that would
pass the cap waits up to ``wait_s`` for others to finish, then is refused with a 503 the agent sees and the records
keep. ``PB_RELAY_INFLIGHT_MAX`` sets the cap (default 256 MiB), ``PB_RELAY_REQUEST_MAX`` the largest single body
(default 64 MiB, answered 413 beyond), ``PB_RELAY_BUDGET_WAIT`` the wait in seconds (default 30).
"""

from __future__ import annotations

import logging
import threading
import time

from pytest_programbench.core import environment

log = logging.getLogger(__name__)

def inflight_limit() -> int:
    return environment.RELAY_INFLIGHT_MAX.size()


def request_limit() -> int:
    return environment.RELAY_REQUEST_MAX.size()


def budget_wait() -> float:
    return environment.RELAY_BUDGET_WAIT.number(minimum=0.0)


class ByteBudget:
    """At most ``limit`` bytes taken at once; ``take`` waits up to ``wait_s`` for room, ``give`` returns bytes."""

    def __init__(self, limit: int, wait_s: float = float(environment.RELAY_BUDGET_WAIT.default)) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self.taken = 0
        self.peak = 0
        self.refused = 0
        self._closed = False
        self._room = threading.Condition()

    def take(self, size: int) -> bool:
        """Take ``size`` bytes (True), or False when there was no room within ``wait_s`` (or ever can be)."""
        if size <= 0:
            return True
        deadline = time.monotonic() + self.wait_s
        with self._room:
            while self.taken + size > self.limit:
                left = deadline - time.monotonic()
                if size > self.limit or left <= 0 or self._closed:
                    self.refused += 1
                    return False
                self._room.wait(left)
            self.taken += size
            self.peak = max(self.peak, self.taken)
            return True

    def give(self, size: int) -> None:
        if size <= 0:
            return
        with self._room:
            self.taken = max(0, self.taken - size)
            self._room.notify_all()

    def close(self) -> None:
        """The relay is closing: every waiter gives up at once, and so does every later ``take`` that must wait."""
        with self._room:
            self._closed = True
            self._room.notify_all()
