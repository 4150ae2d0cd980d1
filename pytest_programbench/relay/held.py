"""How long the harness held a task's model requests back: the seconds the agent's clock gives back.

A request waits for the harness's own reasons -- a ``--pb-model-concurrency`` slot, the ``--pb-model-rpm`` /
``--pb-model-tpm`` buckets, the pause before a retry of a 429 or 5xx -- and the agent, blocked on its answer, can do
nothing meanwhile. Those seconds are not the agent's to lose. Several requests held at once are one wait, not
several: what is counted is the time during which at least one request was held (the union of the holds), live,
so a wait still under way already counts.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class HeldTime:
    """The union of hold intervals, readable at any time from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._holding = 0
        self._since = 0.0  # when the current run of holds began (while _holding > 0)
        self._total = 0.0  # seconds of holds that ended

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        with self._lock:
            if self._holding == 0:
                self._since = self._clock()
            self._holding += 1
        try:
            yield
        finally:
            with self._lock:
                self._holding -= 1
                if self._holding == 0:
                    self._total += self._clock() - self._since

    def seconds(self) -> float:
        with self._lock:
            return self._total + (self._clock() - self._since if self._holding else 0.0)
