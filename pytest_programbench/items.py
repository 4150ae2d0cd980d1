"""The collected nodes: a ``programbench`` collector and one item per task (node id ``programbench::<id>``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from pytest_programbench.catalogue import Task
from pytest_programbench.markers import SUITE, difficulty_marker, language_marker


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
        self.add_marker(SUITE)
        self.add_marker(language_marker(task.language))
        self.add_marker(difficulty_marker(task.difficulty))

    def setup(self) -> None:
        from pytest_programbench.pipeline import run_item_pipeline

        self.outcome = run_item_pipeline(self)

    def runtest(self) -> None:
        from pytest_programbench.verdict import assert_verdict

        assert_verdict(self, self.outcome)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "programbench", None, f"programbench::{self.task.instance_id}"
