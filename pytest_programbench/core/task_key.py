"""One item of the suite (``TaskKey``): a task, and which of its attempts (``--pb-attempts``) or gold runs
(``--pb-gold``) it is; its name, node id and place in a run directory."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SUITE_NAME = "programbench"  # the collector's node id: every task is ``programbench::<instance id>``


# --pb-attempts K > 1: ``<id>[attempt-N]``; --pb-gold N: ``<id>[gold-N]``. A bracket, as pytest's parametrized ids:
# ``-k attempt-2``, ``-k cmatrix``, ``--lf`` and node ids given as arguments all work on it.
_SUFFIX = re.compile(r"^(?P<id>.+)\[(?P<kind>attempt|gold)-(?P<n>[1-9][0-9]*)\]$")
ATTEMPT, GOLD = "attempt", "gold"


@dataclass(frozen=True, order=True)
class TaskKey:
    """One item of the suite: a task, which of its attempts (``--pb-attempts``) or gold runs (``--pb-gold``)."""

    instance_id: str
    kind: str = ATTEMPT
    n: int = 1
    single: bool = True  # the only attempt: its name is the bare instance id (as before attempts existed)

    @property
    def name(self) -> str:
        """The item's name (its node id after ``programbench::``), the task's key in the summary and its labels."""
        return self.instance_id if self.single else f"{self.instance_id}[{self.kind}-{self.n}]"

    @property
    def nodeid(self) -> str:
        return f"{SUITE_NAME}::{self.name}"

    def run_root(self, run_dir: Path) -> Path:
        """The directory holding this item's ``<id>/``: the run directory for attempt 1 (``programbench info RUN``
        reads it as before), ``attempts/<n>`` for the others, ``gold/<n>`` for gold runs (each a run directory's
        layout: ``programbench info RUN/attempts/2`` is the per-attempt view)."""
        if self.kind == GOLD:
            return run_dir / "gold" / str(self.n)
        return run_dir if self.n == 1 else run_dir / "attempts" / str(self.n)

    def task_dir(self, run_dir: Path) -> Path:
        return self.run_root(run_dir) / self.instance_id

    @classmethod
    def parse(cls, name: str) -> TaskKey:
        """A name as ``name`` writes it (a bare id is attempt 1, the only one)."""
        match = _SUFFIX.match(name)
        if match is None:
            return cls(name)
        return cls(match["id"], match["kind"], int(match["n"]), single=False)

    @classmethod
    def of_nodeid(cls, nodeid: str) -> TaskKey | None:
        """The key of one of the suite's node ids; None for any other test."""
        prefix = f"{SUITE_NAME}::"
        return cls.parse(nodeid[len(prefix):]) if nodeid.startswith(prefix) else None
