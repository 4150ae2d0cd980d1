"""The item's own message and JUnit properties for an evaluation: what a user sees, one outcome model (TaskOutcome)."""

from __future__ import annotations

from typing import Any

from pytest_programbench.evaluation.evaluation import EvaluationOutcome
from pytest_programbench.pipeline.task_run import task_outcome
from pytest_programbench.results.verdict import TaskOutcome, failure_message, junit_properties
from pytest_programbench.tasks.catalogue import Task


def item_outcome(outcome: EvaluationOutcome, task: Task) -> TaskOutcome:
    return task_outcome(outcome, task.load_instance())


def item_message(outcome: EvaluationOutcome, task: Task, *, min_score: float = 1.0) -> str:
    """The failure message the item reports (integrity flags shown as without --pb-allow-flags)."""
    scored = item_outcome(outcome, task)
    return failure_message(scored, min_score, flagged=bool(scored.flags))


def item_properties(outcome: EvaluationOutcome, task: Task) -> dict[str, Any]:
    return dict(junit_properties(item_outcome(outcome, task)))
