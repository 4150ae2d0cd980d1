"""Each task's expected duration, for starting the longest first (a long task started last stretches the run).

Sources, first that knows a task: the durations of an earlier run (``--pb-durations RUN_DIR``: its
``summary.json``), else pytest's cache of the last run here (written at session end), else an estimate from the
task itself. What predicts a task's time: the agent's window when an agent runs (the same for every task, so it
orders nothing alone, but it puts unknown tasks on the same scale as measured ones), then the evaluation: a compile,
one container per active hidden-test branch, and the hidden tests themselves, run one after another per branch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pytest_programbench.tasks.catalogue import CatalogueError, Task

CACHE_KEY = "programbench/durations"  # pytest's cache: instance id -> seconds, of the last run that ran them

# The estimate of a task nothing measured: seconds per part (rough medians of the benchmark's evaluations).
COMPILE_SECONDS = 60.0
BRANCH_SECONDS = 10.0  # a container's start, archive copies, collection
TEST_SECONDS = 0.5


class Cache(Protocol):
    """pytest's ``config.cache`` (absent under ``-p no:cacheprovider``)."""

    def get(self, key: str, default: Any) -> Any: ...

    def set(self, key: str, value: object) -> None: ...


def instance_of(nodeid: str) -> str:
    """``programbench::<id>`` or ``programbench::<id>[attempt-2]`` -> ``<id>``."""
    return nodeid.removeprefix("programbench::").partition("[")[0]


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def read_run_durations(run_dir: Path) -> dict[str, float]:
    """What each task of a finished (or interrupted) run took, from its ``summary.json``: tasks that ran only."""
    data = json.loads((run_dir / "summary.json").read_text())
    tasks = data.get("tasks") if isinstance(data, dict) else None
    if not isinstance(tasks, dict):
        raise ValueError(f"{run_dir / 'summary.json'} has no tasks")
    found: dict[str, float] = {}
    for iid, row in tasks.items():
        if isinstance(row, dict) and row.get("outcome") not in (None, "not_run"):
            seconds = _seconds(row.get("duration"))
            if seconds is not None:
                found[str(iid)] = seconds
    return found


def read_cached_durations(cache: Cache | None) -> dict[str, float]:
    raw = cache.get(CACHE_KEY, {}) if cache is not None else {}
    if not isinstance(raw, dict):
        return {}
    return {str(k): s for k, v in raw.items() if (s := _seconds(v)) is not None}


def remember_durations(cache: Cache | None, durations: Mapping[str, float]) -> None:
    """This run's measured durations over the cached ones (tasks it did not run keep theirs)."""
    if cache is None or not durations:
        return
    merged = {**read_cached_durations(cache), **{k: round(v, 3) for k, v in durations.items() if v > 0}}
    cache.set(CACHE_KEY, merged)


def estimate(task: Task, *, agent_seconds: float) -> float:
    """Seconds a task nothing measured is expected to take: the agent's window, a compile, its branches and tests."""
    try:
        branches = [b for b in task.load_instance()["branches"].values()
                    if isinstance(b, dict) and not b.get("ignored")]
    except CatalogueError:
        branches = []
    tests = sum(len(b.get("tests") or ()) for b in branches)
    return agent_seconds + COMPILE_SECONDS + BRANCH_SECONDS * len(branches) + TEST_SECONDS * tests


@dataclass(frozen=True)
class Estimates:
    """Expected seconds per instance id, and where they came from (said in the report header). A task's estimate
    is made when asked for: making one reads the task's tests.json, and a run of three submissions should not read
    all 200 (0.4 s in the controller before xdist hands out any work)."""

    tasks: Mapping[str, Task]
    known: Mapping[str, float]  # measured durations (a run's or the cache's)
    agent_seconds: float
    source: str  # "RUN_DIR", "the cache of the last run" or "" (none measured)
    _made: dict[str, float] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, tasks: Sequence[Task], *, durations_dir: str | None, cache: Cache | None,
              agent_seconds: float) -> Estimates:
        if durations_dir is not None:
            known, source = read_run_durations(Path(durations_dir)), durations_dir
        else:
            known, source = read_cached_durations(cache), "pytest's cache of the last run"
        by_id = {t.instance_id: t for t in tasks}
        return cls(by_id, known, agent_seconds, source if any(i in known for i in by_id) else "")

    @property
    def measured(self) -> int:
        """How many of the tasks came from a run's durations."""
        return sum(i in self.known for i in self.tasks)

    def seconds_of(self, instance_id: str) -> float:
        made = self._made.get(instance_id)
        if made is None:
            task = self.tasks.get(instance_id)
            made = self.known.get(instance_id) or (
                estimate(task, agent_seconds=self.agent_seconds) if task is not None else 0.0)
            self._made[instance_id] = made
        return made

    def of(self, nodeid: str) -> float:
        return self.seconds_of(instance_of(nodeid))

    def longest_first(self, nodeids: Sequence[str]) -> list[int]:
        """Indices into ``nodeids``, the longest expected first; ties keep collection order (a stable sort)."""
        return sorted(range(len(nodeids)), key=lambda i: -self.of(nodeids[i]))

    def describe(self) -> str:
        total = len(self.tasks)
        guessed = total - self.measured
        if not self.measured:
            return "the hidden tests and branches of each task (no earlier run's durations)"
        told = f"durations of {self.measured} of {total} tasks from {self.source}"
        return told + (f", {guessed} estimated from their hidden tests and branches" if guessed else "")


def reorder(items: list[Any], is_task: Callable[[Any], bool], estimates: Estimates) -> None:
    """Without xdist: the task items longest first, in place, in the slots they hold (other tests stay put)."""
    slots = [i for i, item in enumerate(items) if is_task(item)]
    tasks = [items[i] for i in slots]
    for slot, k in zip(slots, estimates.longest_first([t.nodeid for t in tasks]), strict=True):
        items[slot] = tasks[k]
