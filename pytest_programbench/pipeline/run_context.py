"""What a task's run and the progress view need of the session: small protocols, not the whole session object.

``ProgramBenchSession`` satisfies both; a test or another front end can hand ``TaskRun`` anything that does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import pytest

    from pytest_programbench.agents.agent import AgentSpec
    from pytest_programbench.core.run_identity import RunIdentity
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.engine.docker_engine import Engines
    from pytest_programbench.engine.engines import EnginePool
    from pytest_programbench.results.progress import Publisher
    from pytest_programbench.tasks.submissions import SubmissionsDir


class RunContext(Protocol):
    """The run a ``TaskRun`` belongs to: its settings and identity, this process's worker and live publisher, its
    Docker engines (this process's clients, with the run's labels and cap), the engine pool (``--pb-docker-host``),
    the given submissions (evaluate-only) and the configured agent."""

    settings: Settings
    identity: RunIdentity
    worker_id: str
    progress: Publisher | None
    docker_engines: Engines
    engines: EnginePool | None
    submissions: SubmissionsDir | None
    agent_spec: AgentSpec | None
    config: pytest.Config
    agent_command_checked: bool  # this process's first agent run found its command (agents/command_check.py)
