"""What a task leaves in the run directory: ``<id>/submission.tar.gz``, ``<id>/<id>.eval.json`` (official schema),
``<id>/pb-meta.json``, ``<id>/agent.log``, ``<id>/binary-calls.jsonl``. Writes are atomic, so an interrupted run
never leaves a half-written file that a resume or ``programbench info`` would trust."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_programbench.results.task_meta import TaskMeta


def _new_temp(directory: Path, name: str) -> tuple[int, str]:
    """A fresh temporary file next to ``name``, created with mode 0666 so the umask applies as to any other file
    (``mkstemp`` makes 0600: the official's outputs are 0644 under the usual umask)."""
    while True:
        tmp = str(directory / f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp(path.parent, path.name)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.resolve() == target.resolve():
        return
    fd, tmp = _new_temp(target.parent, target.name)
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as src:
            shutil.copyfileobj(src, out)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        from pytest_programbench.results.task_meta import META_FILE

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
        from pytest_programbench.results import task_meta

        task_meta.write(self.dir, meta)

    def read_meta(self) -> TaskMeta | None:
        from pytest_programbench.results import task_meta

        return task_meta.read(self.dir)
