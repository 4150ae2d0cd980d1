"""When ``summary.json`` is rewritten: paced, not on every finished task.

A rewrite costs time in proportion to the run (every task's row, the headline's bootstrap intervals), so rewriting
it on each of N finishes is O(N²) over a run: minutes of a 600-item controller's time. A finish only marks the
summary changed; the file is written at once if the last write is old enough, else once, later, by a timer. The gap
is at least ``min_gap`` and at least ``cost_factor`` times what the last write took, so writing takes at most
1 / (1 + cost_factor) of the controller's time, up to ``max_gap`` (a reader never waits longer than that). The
first write's cost does not count: it imports and caches what later writes reuse. The end of the session writes it
regardless (``flush``), and every task's own ``pb-meta.json`` is written as it finishes: a resume never needs the
summary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MIN_GAP = 1.0  # seconds between two writes at least (what a reader polling summary.json waits at most, plus cost)
COST_FACTOR = 50.0  # ... and at least this many times the last write's duration: writing is ≤ 2% of the time
MAX_GAP = 15.0  # ... but never more than this (a 600-item summary takes ~0.2 s to write: 10 s)


class Pacer:
    """Calls ``write`` when asked, at most once per gap; requests inside the gap are served once, when it ends.

    ``write`` runs outside the pacer's lock (it takes its owner's lock, which callers may hold while asking)."""

    def __init__(self, write: Callable[[], None], *, min_gap: float = MIN_GAP, cost_factor: float = COST_FACTOR,
                 max_gap: float = MAX_GAP, clock: Callable[[], float] = time.monotonic) -> None:
        self._write = write
        self.min_gap = min_gap
        self.max_gap = max_gap
        self.cost_factor = cost_factor
        self._clock = clock
        self._lock = threading.Lock()
        self._next = float("-inf")  # the earliest time the next write may start; inf while one runs
        self._pending = False
        self._timer: threading.Timer | None = None
        self.writes = 0

    def request(self) -> None:
        with self._lock:
            if self._clock() < self._next:
                self._pending = True
                self._arm()
                return
            self._next, self._pending = float("inf"), False
        self._run()

    def flush(self) -> None:
        """Write now if a request is waiting; no timer is left behind."""
        with self._lock:
            self._cancel()
            if not self._pending:
                return
            self._next, self._pending = float("inf"), False
        self._run()

    def _arm(self) -> None:
        if self._timer is None and self._next != float("inf"):
            self._timer = threading.Timer(max(0.0, self._next - self._clock()), self._deferred)
            self._timer.daemon = True
            self._timer.start()

    def _deferred(self) -> None:
        with self._lock:
            self._timer = None
            if not self._pending:
                return
            if self._clock() < self._next:
                self._arm()
                return
            self._next, self._pending = float("inf"), False
        self._run()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _run(self) -> None:
        started = self._clock()
        try:
            self._write()
        finally:
            with self._lock:
                cost = self._clock() - started if self.writes else 0.0
                self.writes += 1
                self._next = self._clock() + min(self.max_gap, max(self.min_gap, self.cost_factor * cost))
                if self._pending:
                    self._arm()
