"""Hooks a ``conftest.py`` or plugin can implement to take part in a run (registered with
``pluginmanager.add_hookspecs``; the same style as pytest-xdist's ``newhooks``).

Each is called in the process that does the work: the prompt and environment hooks in the worker that runs the task,
the outcome hook there too (right after the verdict), the summary hook on the controller before every write of
``summary.json``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_programbench.results.verdict import TaskOutcome
    from pytest_programbench.tasks.catalogue import Task


@pytest.hookspec(firstresult=True)
def pytest_programbench_prompt(task: Task, prompt: str, config: pytest.Config) -> str | None:
    """The prompt ``task``'s agent will get (``PB_PROMPT_FILE``). Return a new text to replace it, or ``None``."""


@pytest.hookspec
def pytest_programbench_agent_env(task: Task, env: dict[str, str], command: str, config: pytest.Config) -> None:
    """The environment the agent's ``command`` starts with: change ``env`` in place (add a variable, drop one).

    Values here are never written to the run directory by the plugin (they may be secrets)."""


@pytest.hookspec
def pytest_programbench_task_outcome(item: pytest.Item, outcome: TaskOutcome, passed: bool, task_dir: str) -> None:
    """A task was scored: ``outcome`` is the official result the verdict used (``passed``: the item passed).

    Called once per scored task, before its report is made (e.g. to upload results). Infrastructure errors are not
    scored and do not reach this hook."""


@pytest.hookspec
def pytest_programbench_summary(summary: dict[str, Any], config: pytest.Config) -> None:
    """``summary.json``'s content, before it is written (as tasks finish and at the end): change it in place."""
