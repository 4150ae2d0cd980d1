"""``pb-meta.json``: one task attempt's record of what the harness did, one typed schema.

Written only by ``TaskRun.write_meta`` (through ``write``) after every step of an attempt, so an interrupted run keeps
what it had; read by the summary, the report, ``--pb-resume`` (a finished task's outcome is reused), ``--pb-compare``
and ``--pb-package``. The keys are the file's JSON keys: a run directory written before this schema reads the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypedDict

from pytest_programbench.core.atomic import atomic_write_text

META_FILE = "pb-meta.json"

# started: written at the first step; finished: ``outcome`` holds the TaskOutcome; error: ``infra_error`` says why;
# interrupted: ``error`` names the exception (Ctrl-C, a timeout's signal).
State = Literal["started", "finished", "error", "interrupted"]


class BlobsMeta(TypedDict):
    source: str
    sha256: dict[str, str]


class TaskMeta(TypedDict, total=False):
    """Every key pb-meta.json may hold (all optional: a run directory of an older version, a step never reached)."""

    instance_id: str
    run_id: str
    worker: str
    attempt: int  # --pb-attempts: 1..K (absent: the only attempt)
    gold_run: int  # --pb-gold: 1..N, the reference evaluated as the submission
    state: State
    infra_error: str
    error: str
    # The TaskOutcome (``TaskOutcome.as_dict``) once finished; a bare error code when there was no submission.
    outcome: dict[str, Any] | str
    timings: dict[str, float]
    phases: list[dict[str, Any]]  # each phase's start (epoch seconds), name and seconds, in the order they ended
    coverage: dict[str, Any]  # results/coverage.py: the hidden tests' options against the agent's
    engine: str  # --pb-docker-host: the engine of the last infrastructure retry
    runtime: str  # --pb-runtime (else the engine's default): the Docker runtime of every container of the task
    engines_tried: list[str]
    blobs: BlobsMeta
    image: dict[str, Any]  # images.ResolvedImage
    relay: dict[str, Any]  # relay.RelayStats.as_dict: tokens, turns, cost
    relay_bounds: dict[str, Any]
    cleanroom: dict[str, Any]  # relay.apis.CleanroomTally.as_dict: provider-side tools allowed, refusals by label
    model_unavailable: str  # relay.ModelRelay.unavailable(): why the model API could not be used (an error)
    agent_loop: dict[str, Any]  # relay.agent_loop: a shell tool refused, final answers seen, an outdated client
    atif: str  # results/atif.py: the attempt's trajectory in Harbor's ATIF, beside ours
    sandbox: dict[str, Any]  # container, proxy_client, reference_kind
    sandbox_end: dict[str, Any]  # sandbox.WindowEnd
    agent: dict[str, Any]  # spec, then AgentResult.meta (exit_code, seconds, ...), pack_error
    binary_calls: int
    binary_calls_unrecorded: int
    submission_bytes: int
    submission_source: str
    notes: list[str]
    evaluation: dict[str, Any]  # evaluation.EvaluationOutcome.meta
    pruned: dict[str, Any]  # disk.PruneReport


def new(instance_id: str, run_id: str, worker: str, *, attempt: int | None = None,
        gold_run: int | None = None) -> TaskMeta:
    meta = TaskMeta(instance_id=instance_id, run_id=run_id, worker=worker)
    if attempt is not None:
        meta["attempt"] = attempt
    if gold_run is not None:
        meta["gold_run"] = gold_run
    return meta


def write(task_dir: Path, meta: TaskMeta) -> None:
    """The one writer of pb-meta.json (atomic: a reader never sees half a file)."""
    atomic_write_text(task_dir / META_FILE, json.dumps(meta, indent=2, sort_keys=True, default=str))


def read(task_dir: Path) -> TaskMeta | None:
    """The attempt's record, or None when there is none or it is not a JSON object (never raises)."""
    try:
        data = json.loads((task_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None  # type: ignore[return-value]
