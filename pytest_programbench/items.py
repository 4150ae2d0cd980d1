"""The collected nodes: a ``programbench`` collector and one item per task (node id ``programbench::<id>``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_programbench.catalogue import Task
from pytest_programbench.markers import SUITE, difficulty_marker, language_marker
from pytest_programbench.plugin import SESSION_PLUGIN
from pytest_programbench.verdict import TaskOutcome

if TYPE_CHECKING:
    from pytest_programbench.session import ProgramBenchSession


class ProgramBenchSuite(pytest.Collector):
    def __init__(self, *, tasks: Sequence[Task], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tasks = tasks

    def collect(self) -> Iterator[ProgramBenchItem]:
        for task in self.tasks:
            yield ProgramBenchItem.from_parent(self, name=task.instance_id, task=task)


class ProgramBenchItem(pytest.Item):
    """One task. ``setup`` runs the pipeline (infrastructure failures there are errors); ``runtest`` asserts."""

    def __init__(self, *, task: Task, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.task = task
        self.outcome: TaskOutcome | None = None
        self.add_marker(SUITE)
        self.add_marker(language_marker(task.language))
        self.add_marker(difficulty_marker(task.difficulty))

    @property
    def pb_session(self) -> ProgramBenchSession:
        """The opted-in session's state (items exist only when the session opted in)."""
        session = self.config.pluginmanager.get_plugin(SESSION_PLUGIN)
        assert session is not None, "items exist only in opted-in sessions"
        return session  # type: ignore[no-any-return]

    def setup(self) -> None:
        """Run the pipeline; infrastructure errors are retried (``--pb-infra-retries``), never agent failures."""
        from pytest_programbench.pipeline import run_item_pipeline
        from pytest_programbench.verdict import InfrastructureError

        session = self.pb_session
        reasons: list[str] = []
        for attempt in range(session.settings.infra_retries + 1):
            try:
                self.outcome = run_item_pipeline(self)
            except InfrastructureError as exc:
                reasons.append(f"attempt {attempt + 1}: {exc}")
                self.user_properties.append((f"infra_attempt_{attempt + 1}", str(exc)[:2000]))
                session.forget_task_containers(self.task.instance_id)
                continue
            if reasons:
                self.outcome.notes = [*self.outcome.notes, *(f"infrastructure retry after {r}" for r in reasons)]
            return
        # Identical reasons (an engine that is down) are said once.
        distinct = list(dict.fromkeys(r.split(": ", 1)[1] for r in reasons))
        shown = reasons if len(distinct) > 1 else [distinct[0]]
        raise InfrastructureError("\n".join(
            [f"{self.task.instance_id}: infrastructure error after {len(reasons)} attempt(s):", *shown]))

    def runtest(self) -> None:
        from pytest_programbench.verdict import assert_verdict

        settings = self.pb_session.settings
        assert self.outcome is not None, "setup ran the pipeline"
        assert_verdict(self, self.outcome, min_score=settings.min_score, allow_flags=settings.allow_flags,
                       junit_tests=settings.junit_tests)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str | Any:
        from pytest_programbench.verdict import InfrastructureError, VerdictFailure

        # Our own verdicts and infrastructure errors are messages, not tracebacks.
        if isinstance(excinfo.value, VerdictFailure | InfrastructureError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        # No domain: pytest would turn the dots of an instance id into "::" when it shows one.
        return self.path, None, ""
