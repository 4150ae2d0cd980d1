"""Any part of the suite under another Docker runtime (issue 42's parity runs):

    PB_TEST_RUNTIME=runsc PYTEST_PLUGINS=tests.under_runtime pytest tests/test_evaluation_parity.py

In the test process, every client made outside a session (``EngineRun.from_environment``: the direct evaluations,
sandboxes and benches) puts its containers under ``$PB_TEST_RUNTIME``; every ProgramBench session a test starts
inherits ``PYTEST_PLUGINS`` (tests/conftest.py keeps it) and gets ``--pb-runtime $PB_TEST_RUNTIME`` unless it chose a
runtime itself (or only compares or reports finished runs). The official ``programbench eval`` a parity test runs
keeps the engine's default (runc): the reference the runtime is compared with. Without ``$PB_TEST_RUNTIME`` this
plugin does nothing.
"""

from __future__ import annotations

import os

import pytest

from pytest_programbench.engine.backpressure import Backpressure
from pytest_programbench.engine.docker_engine import EngineRun
from tests.session_defaults import RUNS_NOTHING

RUNTIME = "PB_TEST_RUNTIME"
OPTION = "--pb-runtime"


def _from_environment(cls: type[EngineRun]) -> EngineRun:
    return cls(None, Backpressure.from_environment(), runtime=os.environ[RUNTIME])


def pytest_load_initial_conftests(early_config: pytest.Config, args: list[str], parser: pytest.Parser) -> None:
    runtime = os.environ.get(RUNTIME)
    if not runtime:
        return
    EngineRun.from_environment = classmethod(_from_environment)  # type: ignore[method-assign, assignment]
    # A ProgramBench session (a --pb-* option) that names no runtime: in place, as tests/session_defaults.py does.
    if any(a.startswith("--pb-") for a in args) and not any(a.startswith((OPTION, *RUNS_NOTHING)) for a in args):
        args[:] = [*args, OPTION, runtime]
