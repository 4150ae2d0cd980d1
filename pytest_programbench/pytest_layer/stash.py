"""The run's state, kept in ``config.stash`` (no process-wide globals): the keys the pytest layer shares."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_programbench.engine.docker_engine import Engines
    from pytest_programbench.pytest_layer.run_state import RunState

    SessionKey = pytest.StashKey[RunState]
    EnginesKey = pytest.StashKey[Engines]

# The opted-in session's state; absent when the session did not opt in (then there are no ProgramBench items).
SESSION: SessionKey = pytest.StashKey()
# This process's Docker engines for the run (the run's labels and cap; one client per engine, made at first use);
# set with SESSION.
ENGINES: EnginesKey = pytest.StashKey()
# Set when the plugin chose --dist worksteal for a -n given without --dist (the report header says so).
WORKSTEAL_DEFAULTED = pytest.StashKey[bool]()
