"""The run's counts kept as tasks settle, so the progress view reads them in O(1) instead of summing every record
each second."""

from __future__ import annotations

from collections import Counter
from typing import Protocol


class Settling(Protocol):
    key: str
    outcome: str
    duration: float


class Tally:
    def __init__(self, selected: int) -> None:
        self.selected = selected
        self.outcomes: Counter[str] = Counter()
        self.durations: dict[str, float] = {}  # of the settled records, by key (for the ETA)

    def forget(self, rec: Settling) -> None:
        """Before a record changes: take out what it counted for."""
        if rec.outcome:
            self.outcomes[rec.outcome] -= 1
            self.durations.pop(rec.key, None)

    def count(self, rec: Settling) -> None:
        """After it changed."""
        if rec.outcome:
            self.outcomes[rec.outcome] += 1
            self.durations[rec.key] = rec.duration
