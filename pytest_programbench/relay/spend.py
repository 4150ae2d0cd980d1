"""What the run has spent on the model so far, across every worker: ``--pb-budget USD`` with ``--pb-token-price``.

Each task's relay keeps one small file in the run directory (``.pb-model-spend/<task>.json``: the USD its answered
requests cost at the token price), rewritten atomically after every metered answer; the run's spend is the sum of
those files, read by any relay before it forwards a request. Past the budget times ``HARD_FACTOR`` the relay
refuses new requests (the task ends as an error naming the budget); below that, the session stops starting tasks
once what was spent plus what the running tasks are projected to spend passes the budget (``pytest_layer/stopping.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pytest_programbench.relay.metering import Usage

SPEND_DIR = ".pb-model-spend"
HARD_FACTOR = 1.1  # past budget x this, no model request is forwarded


def usage_cost(usage: Usage | None, price: tuple[float, float]) -> float:
    """USD of one answer at ``price`` (USD per million input and output tokens)."""
    if usage is None:
        return 0.0
    return ((usage.input_tokens or 0) * price[0] + (usage.output_tokens or 0) * price[1]) / 1e6


class SpendLedger:
    """One task's spend, written to the run's ledger, and the run's total read back."""

    def __init__(self, directory: Path, task: str, price: tuple[float, float], budget: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / f"{task.replace('/', '_')}.json"
        self.price = price
        self.budget = budget
        self.spent = 0.0

    def add(self, usage: Usage | None) -> None:
        cost = usage_cost(usage, self.price)
        if not cost:
            return
        self.spent += cost
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temp.write_text(json.dumps({"usd": round(self.spent, 6)}))
        temp.replace(self.path)

    def total(self) -> float:
        return run_spend(self.directory)

    def exhausted(self) -> bool:
        """The run spent more than the budget times ``HARD_FACTOR``: no more requests."""
        return self.total() > self.budget * HARD_FACTOR


def run_spend(directory: Path) -> float:
    total = 0.0
    for path in directory.glob("*.json"):
        try:
            value = json.loads(path.read_text()).get("usd")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int | float):
            total += float(value)
    return total
