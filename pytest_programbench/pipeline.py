"""The item pipeline, step by step: task → blobs → image → (agent →) submission → evaluation → verdict.

Everything before the submission's own windows that fails is infrastructure (``InfrastructureError``, reported as a
pytest error); everything inside them is scored the official way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_programbench.artifacts import TaskArtifacts, atomic_copy
from pytest_programbench.catalogue import CatalogueError, Task
from pytest_programbench.docker_engine import EngineUnavailable, Labels
from pytest_programbench.verdict import InfrastructureError, TaskOutcome

if TYPE_CHECKING:
    from pytest_programbench.items import ProgramBenchItem
    from pytest_programbench.session import ProgramBenchSession

log = logging.getLogger("pytest_programbench")


class TaskLog(logging.LoggerAdapter[logging.Logger]):
    """Every progress line names its task, so ``--log-cli-level=INFO`` reads well under xdist too."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['task'] if self.extra else '?'}] {msg}", kwargs


class TaskPipeline:
    def __init__(self, session: ProgramBenchSession, task: Task) -> None:
        self.session = session
        self.settings = session.settings
        self.task = task
        self.artifacts = TaskArtifacts(session.identity.path, task.instance_id)
        self.labels = Labels(session.identity.run_id, session.worker_id, task.instance_id)
        self.log = TaskLog(log, {"task": task.instance_id})
        self.timings: dict[str, float] = {}
        self.meta: dict[str, Any] = {"instance_id": task.instance_id, "run_id": session.identity.run_id,
                                     "worker": session.worker_id}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.log.info("%s ...", name)
        started = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = round(time.monotonic() - started, 3)
            self.log.info("%s done in %.1f s", name, self.timings[name])

    def run(self) -> TaskOutcome:
        try:
            return self._run()
        except EngineUnavailable as exc:
            raise InfrastructureError(str(exc)) from exc
        finally:
            self.meta["timings"] = self.timings
            if self.artifacts.dir.exists():
                self.artifacts.write_meta(self.meta)

    def _run(self) -> TaskOutcome:
        from pytest_programbench import evaluation
        from pytest_programbench.blobs import resolve_blobs
        from pytest_programbench.images import ensure_image

        self.artifacts.dir.mkdir(parents=True, exist_ok=True)
        with self.phase("task"):
            try:
                instance = self.task.load_instance()
            except CatalogueError as exc:
                raise InfrastructureError(f"malformed task: {exc}") from exc
        # Resolved before any agent or evaluation time is spent: a failure here is fast and an error.
        with self.phase("blobs"):
            blobs = resolve_blobs(self.task, instance, blob_dir=self.settings.blob_dir)
            self.meta["blobs"] = blobs.as_dict()
        with self.phase("image"):
            image = ensure_image(self.task, tag=self.settings.image_tag, pull=self.settings.pull, labels=self.labels)
            self.meta["image"] = image.as_dict()

        submission = self._submission()
        if submission is None:
            return self._no_submission(instance)

        with self.phase("evaluation"):
            result = evaluation.evaluate(
                self.task, submission, instance=instance, blobs=blobs, image=image.reference, labels=self.labels,
                settings=evaluation.EvalSettings.from_settings(self.settings), workdir=self.artifacts.dir,
            )
        self.meta["evaluation"] = result.meta()
        if result.infra_error:
            raise InfrastructureError(result.infra_error)
        self.artifacts.write_eval_json(result.result)
        return result.to_task_outcome(self.task.instance_id)

    def _submission(self) -> Path | None:
        """Evaluate-only: the archive from --pb-submissions, copied into the run directory first."""
        submissions = self.session.submissions
        if submissions is None:
            raise InfrastructureError("agent runs are not available yet: pass --pb-submissions DIR")
        if not submissions.has(self.task.instance_id):
            return None
        atomic_copy(submissions.archive(self.task.instance_id), self.artifacts.submission)
        self.meta["submission_source"] = str(submissions.archive(self.task.instance_id))
        return self.artifacts.submission

    def _no_submission(self, instance: dict[str, Any]) -> TaskOutcome:
        from programbench.utils.load_data import get_active_branches, get_ignored_tests

        ignored = get_ignored_tests(instance)
        n_tests = sum(
            1 for branch in get_active_branches(instance) for name in instance["branches"][branch].get("tests", [])
            if f"{branch}/{name}" not in ignored
        )
        self.meta["outcome"] = "no_submission"
        return TaskOutcome(self.task.instance_id, score=0.0, n_passed=0, n_tests=n_tests, error_code="no_submission",
                           notes=[f"no submission.tar.gz in {self.settings.submissions} (--pb-require-all)"])


def run_item_pipeline(item: ProgramBenchItem) -> TaskOutcome:
    from pytest_programbench.plugin import SESSION_PLUGIN

    session = item.config.pluginmanager.get_plugin(SESSION_PLUGIN)
    return TaskPipeline(session, item.task).run()
