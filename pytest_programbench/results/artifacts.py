"""What a task leaves in the run directory: ``<id>/submission.tar.gz``, ``<id>/<id>.eval.json`` (official schema),
``<id>/pb-meta.json``, ``<id>/agent.log``, ``<id>/binary-calls.jsonl``. Writes are atomic, so an interrupted run
never leaves a half-written file that a resume or ``programbench info`` would trust."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.results import task_meta
from pytest_programbench.results.task_meta import META_FILE, TaskMeta


class TaskArtifacts:
    def __init__(self, run_dir: Path, instance_id: str) -> None:
        self.instance_id = instance_id
        self.dir = run_dir / instance_id

    @property
    def submission(self) -> Path:
        return self.dir / "submission.tar.gz"

    @property
    def eval_json(self) -> Path:
        return self.dir / f"{self.instance_id}.eval.json"

    @property
    def meta_json(self) -> Path:
        return self.dir / META_FILE

    @property
    def agent_log(self) -> Path:
        return self.dir / "agent.log"

    @property
    def binary_calls(self) -> Path:
        return self.dir / "binary-calls.jsonl"

    def write_eval_json(self, result: Any) -> None:
        """The official ``EvaluationResult`` as the official code dumps it: no extra fields."""
        atomic_write_text(self.eval_json, result.model_dump_json(indent=2))

    def write_meta(self, meta: TaskMeta) -> None:
        task_meta.write(self.dir, meta)

    def read_meta(self) -> TaskMeta | None:
        return task_meta.read(self.dir)
