"""The room a task needs on disk before it starts: what it can write into the run directory at most."""

from __future__ import annotations

from pytest_programbench.core import environment
from pytest_programbench.relay.contract import replay_limit
from pytest_programbench.relay.records import records_limit
from pytest_programbench.sandbox.agent_log import agent_log_limit
from pytest_programbench.sandbox.sandbox import CALL_LOG_READ_LIMIT, DEFAULT_SUBMISSION_LIMIT


def run_dir_need() -> int:
    """``PB_DISK_RUN_DIR_NEED``, else the most one task can write into the run directory: every artifact an agent
    controls is capped, so the sum of the caps is a bound (plus 64 MiB for results and metadata)."""
    most = (DEFAULT_SUBMISSION_LIMIT + agent_log_limit() + CALL_LOG_READ_LIMIT + records_limit() + replay_limit()
            + (64 << 20))
    return environment.DISK_RUN_DIR_NEED.size(otherwise=most)
