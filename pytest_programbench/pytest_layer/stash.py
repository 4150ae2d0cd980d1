"""The run's state, kept in ``config.stash`` (no process-wide globals): the keys the pytest layer shares."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_programbench.engine.docker_engine import Engines
    from pytest_programbench.pytest_layer.session import ProgramBenchSession

    SessionKey = pytest.StashKey[ProgramBenchSession]
    EnginesKey = pytest.StashKey[Engines]

# The opted-in session's state; absent when the session did not opt in (then there are no ProgramBench items).
SESSION: SessionKey = pytest.StashKey()
# This process's Docker engines for the run (the run's labels and cap; one client per engine, made at first use);
# set with SESSION.
ENGINES: EnginesKey = pytest.StashKey()
# Set when the plugin chose --dist worksteal for a -n given without --dist (the report header says so).
WORKSTEAL_DEFAULTED = pytest.StashKey[bool]()

# What the controller hands every xdist worker in ``workerinput`` (plain data): the run's identity, and when the run is
# resumed the settings it ran with (so workers collect the same selection).
WORKERINPUT_IDENTITY = "pytest_programbench_run"
WORKERINPUT_RESUMED_SETTINGS = "pytest_programbench_resumed_settings"
