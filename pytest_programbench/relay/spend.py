"""What the run has spent on the model so far, across every worker: ``--pb-budget USD`` with ``--pb-token-price``.

Each task's relay keeps one small file in the run directory (``.pb-model-spend/<task>.json``: the USD its answered
requests cost at the token price), rewritten atomically after every metered answer; the run's spend is the sum of
those files, read by any relay before it forwards a request. Past the budget times ``HARD_FACTOR`` the relay
refuses new requests (the task ends as an error naming the budget); below that, the session stops starting tasks
once what was spent plus what the running tasks are projected to spend passes the budget (``pytest_layer/stopping.py``).
That figure has one home, :class:`RunBudget` (the controller's): the stop, ``summary.json``'s ``budget``, the terminal
summary and the live view's header all read it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        # What this task spent before (an infrastructure retry, a --pb-resume) was spent too: added to, not replaced.
        self.spent = _usd(self.path)

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


def _usd(path: Path) -> float:
    """One task's ledger file; 0 when there is none (or it cannot be read)."""
    try:
        value = json.loads(path.read_text()).get("usd")
    except (OSError, ValueError, AttributeError):
        return 0.0
    return float(value) if isinstance(value, int | float) else 0.0


def run_spend(directory: Path) -> float:
    return sum(_usd(path) for path in directory.glob("*.json"))


@dataclass(frozen=True)
class BudgetState:
    """The run against ``--pb-budget``: ``spent`` (the ledger), ``projected`` (spent plus each of the ``running``
    tasks at the finished tasks' mean cost), and whether the budget ``stopped`` the run starting tasks."""

    limit: float
    spent: float
    projected: float
    running: int
    stopped: bool

    @property
    def passes(self) -> bool:
        """What was spent plus what the running tasks are projected to spend passes the budget."""
        return self.projected > self.limit

    def text(self) -> str:
        return f"budget ${self.spent:.4f} of ${self.limit:g} (projected ${self.projected:.4f})"

    def as_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "spent": round(self.spent, 6), "projected": round(self.projected, 6),
                "running": self.running, "refused_past": round(self.limit * HARD_FACTOR, 6), "stopped": self.stopped}


class RunBudget:
    """The controller's view of ``--pb-budget``: the run's ledger in ``directory``, and whether it stopped the run."""

    def __init__(self, directory: Path, limit: float) -> None:
        self.directory = directory
        self.limit = limit
        self.stopped = False  # set when the session stopped starting tasks for the budget

    def state(self, finished_costs: Iterable[float], running: int) -> BudgetState:
        """Spent so far, and projected: each running task at the mean cost of the finished ones (none: nothing)."""
        spent = run_spend(self.directory)
        costs = list(finished_costs)
        ahead = sum(costs) / len(costs) * running if costs else 0.0
        return BudgetState(self.limit, spent, spent + ahead, running, self.stopped)
