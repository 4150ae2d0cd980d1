"""``--dist`` chosen by the plugin (``-n`` alone): work stealing that hands tasks out longest first.

xdist's worksteal splits the whole collection evenly up front and steals half a queue from the busiest worker when
one runs dry: good for many short tests, but a long task at the end of one worker's chunk starts last. Here every
worker holds at most xdist's minimum (the task it runs and the next, which a worker must know before it starts one),
filled one task per idle worker per round from a queue sorted by expected duration: the longest tasks run at once
on different workers, the shortest fill the gaps at the end. Everything else is worksteal's own: a crashed worker's
task goes back to the head of the queue (``mark_test_pending``, from ``pytest_handlecrashitem``), a dead worker's
queue is taken back, idle workers shut down when nothing is left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from xdist.remote import Producer
from xdist.scheduler.worksteal import MIN_PENDING, WorkStealingScheduling


class LongestFirstScheduling(WorkStealingScheduling):  # type: ignore[misc]  # xdist is untyped here
    collection: list[str] | None

    def __init__(self, config: pytest.Config, log: Producer | None,
                 longest_first: Callable[[Sequence[str]], list[int]]) -> None:
        super().__init__(config, log)
        self.longest_first = longest_first  # node ids -> their indices in the order to start them

    def schedule(self) -> None:
        """worksteal's, with the queue in longest-first order instead of collection order."""
        assert self.collection_is_completed
        if self.collection is not None:
            self.check_schedule()
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        self.pending[:] = self.longest_first(self.collection)
        if self.collection:
            self.check_schedule()

    def check_schedule(self) -> None:
        """Top idle workers up one task per round from the head of the queue, then worksteal's own (with no queue
        left: steal from a worker that holds more than it needs, else shut the idle ones down)."""
        def idle() -> list[object]:
            return [node for node, pending in self.node2pending.items()
                    if not node.shutting_down and len(pending) < MIN_PENDING]

        waiting = idle()
        while self.pending and waiting:
            for node in waiting:
                if not self.pending:
                    break
                self._send_tests(node, 1)
            waiting = idle()
        super().check_schedule()
