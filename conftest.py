"""The checkout's own ``conftest.py``: the embedded default, and the worked example of overriding a pipeline step.

In an opted-in session (any ``--pb-*`` option, e.g. ``pytest --pb-agent reference`` here at the root) it fills in what
the test bed provides, unless given: ``--pb-tasks-dir testbed/tasks``, ``--pb-blob-dir`` (``testbed/setup.sh``'s
blobs, from ``testbed/.state/env.sh``), and a selection of the test bed's tasks (``--pb-filter pbfix__``) when no
selection option is given and no task is named as a node id (nothing when resuming: the run's record has them). The
plugin never depends on this file; a session that did not opt in (the project's own suite, ``pytest tests``) is left
exactly as it is.

Every step of an item is a fixture (``pytest --fixtures`` lists them: ``pb_task`` ... ``pb_outcome``) and a
``conftest.py`` overrides one by defining a fixture with the same name. The example below is off unless
``PB_EXAMPLE_AGENT=python`` is set: it replaces the ``--pb-agent`` command with an agent written in Python that
copies the test bed's known-good solution into the sandbox (what ``--pb-agent reference`` does), e.g.

    PB_EXAMPLE_AGENT=python pytest --pb-agent python-example --setup-show
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_programbench.pytest_layer.invocation import named_tasks
from pytest_programbench.pytest_layer.plugin import opted_in

ROOT = Path(__file__).resolve().parent
TESTBED_TASKS = ROOT / "testbed" / "tasks"
TESTBED_SOLUTIONS = ROOT / "testbed" / "solutions"
TESTBED_ENV = ROOT / "testbed" / ".state" / "env.sh"
SELECTION_OPTIONS = ("pb_language", "pb_difficulty", "pb_filter", "pb_slice")


def testbed_env() -> dict[str, str]:
    """``export NAME=VALUE`` lines of ``testbed/.state/env.sh`` (written by ``testbed/setup.sh``)."""
    if not TESTBED_ENV.is_file():
        return {}
    pairs = re.findall(r"^export (\w+)=(.*)$", TESTBED_ENV.read_text(), re.M)
    return {name: value.strip().strip("'\"") for name, value in pairs}


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    option = config.option
    if not opted_in(config) or option.pb_resume:  # a resumed run's record has its tasks, blobs and selection
        return
    if not option.pb_tasks_dir and not config.getini("pb_tasks_dir") and TESTBED_TASKS.is_dir():
        option.pb_tasks_dir = [str(TESTBED_TASKS)]
    if option.pb_blob_dir is None and not config.getini("pb_blob_dir") and "PROGRAMBENCH_BLOB_DIR" not in os.environ:
        blobs = testbed_env().get("PB_TESTBED_BLOB_DIR") or str(ROOT / "testbed" / ".state" / "blobs")
        if Path(blobs).is_dir():
            option.pb_blob_dir = blobs
    # Tasks named as node ids (``pytest programbench::<id>``) are a selection too: they are looked up within this one.
    if named_tasks(config) is None and all(getattr(option, dest) is None and not config.getini(dest)
                                           for dest in SELECTION_OPTIONS):
        option.pb_filter = "pbfix__"


# -- the worked example: a step overridden (here the agent) ------------------------------------------------------

if os.environ.get("PB_EXAMPLE_AGENT") == "python":

    class CopySolution:
        """An agent written in Python: ``run(sandbox, prompt)`` works in the sandbox until it is done."""

        on_host = True  # it runs in this process (a --pb-model-endpoint relay would listen on the host)

        def __init__(self, solution: Path) -> None:
            self.solution = solution

        def run(self, sandbox: Any, prompt: str) -> SimpleNamespace:
            from pytest_programbench.agents.agent import put_tree

            # The reference is there to probe, as an agent would (the call lands in binary-calls.jsonl).
            sandbox.binary(["--help"], timeout=30)
            put_tree(sandbox, self.solution, "/workspace/src")
            return SimpleNamespace(exit_code=0)

    @pytest.fixture
    def pb_agent(pb_task: Any) -> CopySolution:
        """The example's agent (replaces ``--pb-agent``'s command): the task's known-good solution, copied in."""
        return CopySolution(TESTBED_SOLUTIONS / pb_task.instance_id)
