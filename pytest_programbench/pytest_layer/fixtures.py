"""The pipeline as pytest fixtures: one fixture per step, in pipeline order, each overridable in a ``conftest.py``.

    pb_session ─ pb_task ─ pb_run ─ pb_engine ─ pb_blobs ─ pb_image ─ pb_agent ─ pb_relay ─ pb_sandbox
      ─ pb_agent_run ─ pb_submission ─ pb_evaluation ─ pb_outcome

A benchmark item (``programbench::<id>``) requests ``pb_outcome`` in its setup and asserts on it in its call, so an
infrastructure failure in any fixture is a pytest *error* and a low score a *failure*. A user's own test can request
any of them: it is run once per task of the session's selection (narrowed with
``@pytest.mark.programbench_tasks("<id>", ...)``), with its own files under ``<run dir>/tests/``.

Retries (``--pb-infra-retries``). An attempt is one fill of the item's fixtures. When it raises an
``InfrastructureError``, the item finalises the attempt's function-scoped fixtures itself (in reverse order of their
set-up: the sandbox goes before the relay, the engine lease last), removes the task's containers and fills them
again with a fresh request; session-scoped fixtures stay. What must not be done twice lives on the ``pb_run`` object
(the item's, so it outlives attempts): ``pb_submission`` returns the submission packed by an earlier attempt without
asking for the agent's fixtures again, so the agent runs once per task and a retry after it re-runs only the step
that failed. Several steps are therefore requested with ``request.getfixturevalue`` when they are needed (the agent's
window only without a submission; the evaluation only without a reused ``--pb-resume`` result), which
``--setup-show`` shows like any other fixture.

Without an opted-in session (no ``--pb-*`` option) the fixtures exist (``pytest --fixtures`` lists them) but fail
with a message saying how to opt in.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from pytest_programbench.pytest_layer.stash import SESSION

if TYPE_CHECKING:
    from pytest_programbench.agents.agent import AgentResult, AgentSpec
    from pytest_programbench.engine.images import ResolvedImage
    from pytest_programbench.engine.protocol import DockerEngine
    from pytest_programbench.evaluation.evaluation import EvaluationOutcome
    from pytest_programbench.pipeline.task_run import TaskRun
    from pytest_programbench.pytest_layer.run_state import RunState
    from pytest_programbench.relay.relay import ModelRelay
    from pytest_programbench.results.verdict import TaskOutcome
    from pytest_programbench.sandbox.sandbox import Sandbox
    from pytest_programbench.tasks.blobs import BlobSet
    from pytest_programbench.tasks.catalogue import Task

TASKS_MARKER = "programbench_tasks"
NOT_OPTED_IN = ("the ProgramBench fixtures need an opted-in session: pass a --pb-* option (e.g. --pb-agent reference) "
                "or set pb_enable = true in the ini")


class Agent(Protocol):
    """What ``pb_agent`` gives: ``run`` works in the sandbox until the agent is done (its clock is the caller's)."""

    def run(self, sandbox: Sandbox, prompt: str) -> Any:
        """Returns an ``AgentResult``, or anything (``exit_code``/``timed_out``/``notes`` are read if present)."""


class ConfiguredAgent:
    """``--pb-agent``: a command (in the sandbox or on the host) or a preset (reference, replay, a CLI, mini-swe)."""

    def __init__(self, run: TaskRun, spec: AgentSpec) -> None:
        self.task_run = run
        self.spec = spec
        self.on_host = spec.on_host
        self.label = spec.label

    def run(self, sandbox: Sandbox, prompt: str) -> AgentResult:
        from pytest_programbench.agents.agent import AgentRunner  # noqa: PLC0415 - lazy: keeps the entry point light

        run = self.task_run
        session = run.session
        runner = AgentRunner(self.spec, run.task, run.settings, log_path=run.artifacts.agent_log,
                             extra_env=run.model.env(on_host=self.on_host), config=session.config,
                             attempt=run.key.n, held=run.model.held_seconds if run.model.relay is not None else None,
                             answered_idle=run.model.answered_idle if run.model.relay is not None else None,
                             # This process's first agent run checks the command; --pb-keep-going runs it regardless.
                             check_command=not (session.agent_command_checked or run.settings.keep_going))
        try:
            return runner.run(sandbox, prompt)
        finally:
            session.agent_command_checked = session.agent_command_checked or runner.command_checked


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{TASKS_MARKER}(*instance_ids): run a test that requests a ProgramBench "
                                       "fixture (pb_task, pb_sandbox, ...) only over these tasks of the selection")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A user's test requesting ``pb_task`` (directly or through another pb_ fixture): once per selected task."""
    if "pb_task" not in metafunc.fixturenames:
        return
    session = metafunc.config.stash.get(SESSION, None)
    if session is None:
        return  # pb_task fails with the opt-in message
    tasks = list(session.selection.tasks)
    marker = metafunc.definition.get_closest_marker(TASKS_MARKER)
    if marker is not None:
        wanted = set(marker.args)
        unknown = wanted - {t.instance_id for t in session.catalogue}
        if unknown:
            raise pytest.UsageError(f"@pytest.mark.{TASKS_MARKER}: unknown task(s) {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t.instance_id in wanted]
    metafunc.parametrize("pb_task", tasks, ids=[t.instance_id for t in tasks], indirect=True)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    """The benchmark item's attempt finalises what it set up (see the module's docstring on retries)."""
    if fixturedef.scope == "function" and SESSION in request.config.stash and _is_item(request.node):
        request.node.track_fixture(fixturedef, request)
    return (yield)


def _is_item(node: Any) -> bool:
    from pytest_programbench.pytest_layer.items import ProgramBenchItem  # noqa: PLC0415 - lazy: keeps the entry point light

    return isinstance(node, ProgramBenchItem)


# -- session ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pb_session(request: pytest.FixtureRequest) -> RunState:
    """The run (session scope): settings (``.settings``), run identity and directory (``.identity``), the task
    catalogue (``.catalogue``) and selection (``.selection``), the configured agent (``.agent_spec``)."""
    session = request.config.stash.get(SESSION, None)
    if session is None:
        pytest.fail(NOT_OPTED_IN, pytrace=False)
    return session


# -- per task (function scope: one task, one attempt) -----------------------------------------------------------


@pytest.fixture
def pb_task(request: pytest.FixtureRequest, pb_session: RunState) -> Task:
    """The task (``Task``: ``instance_id``, ``language``, ``difficulty``, ``load_instance()``): the benchmark item's
    own, or for a user's test one task of the selection (``@pytest.mark.programbench_tasks`` narrows it)."""
    if _is_item(request.node):
        task: Task = request.node.task
        return task
    if not hasattr(request, "param"):
        pytest.fail("pb_task: not parametrized over the selection", pytrace=False)
    param: Task = request.param
    return param


@pytest.fixture
def pb_run(request: pytest.FixtureRequest, pb_session: RunState, pb_task: Task) -> TaskRun:
    """The task's run record (``pipeline.TaskRun``): its files (``.artifacts``), ``pb-meta.json`` (``.meta``), and
    what an attempt finished that a retry must not repeat (``.agent_result``, ``.submission``). The benchmark item's
    outlives its attempts; a user's test gets its own, with files under ``<run dir>/tests/<test>/``."""
    from pytest_programbench.pipeline.task_run import TaskRun  # noqa: PLC0415 - lazy: keeps the entry point light

    if _is_item(request.node):
        run: TaskRun = request.node.task_run
        return run
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:120]
    return TaskRun(pb_session, pb_task, artifacts_root=pb_session.identity.path / "tests" / safe, record=False)


@pytest.fixture
def pb_engine(pb_run: TaskRun) -> Iterator[Any]:
    """The Docker engine client of this attempt (``--pb-docker-host``: a leased slot of the least busy engine, given
    back at teardown), after checking the room on disk. Override to use another engine client."""
    engine = pb_run.lease_engine()
    try:
        yield engine
    finally:
        pb_run.release_engine()


@pytest.fixture
def pb_blobs(pb_run: TaskRun, pb_engine: DockerEngine) -> BlobSet:
    """The hidden test archives of the task's active branches (``BlobSet``: ``.paths``, ``.sha256``), resolved and
    hashed before any agent time is spent (``--pb-blob-dir``, the task dir, or Hugging Face)."""
    return pb_run.resolve_blobs()


@pytest.fixture
def pb_image(pb_run: TaskRun, pb_blobs: BlobSet) -> ResolvedImage:
    """The task's image (``ResolvedImage``: ``.ref``, ``.id``, ``.source``): local, pulled or built, once per image."""
    return pb_run.ensure_image()


@pytest.fixture
def pb_agent(pb_session: RunState, pb_run: TaskRun) -> Agent:
    """The agent: an object with ``run(sandbox, prompt) -> result``. Built in: ``--pb-agent`` (a command or a
    preset). Override it with a Python agent (``on_host = True`` if it talks to a ``--pb-model-endpoint`` relay
    from the host; ``run`` may return an ``AgentResult`` or an object with ``exit_code``)."""
    if pb_session.agent_spec is None:
        pytest.fail("pb_agent: no --pb-agent given (or --pb-submissions evaluates existing submissions)",
                    pytrace=False)
    return ConfiguredAgent(pb_run, pb_session.agent_spec)


def _agent_on_host(request: pytest.FixtureRequest) -> bool:
    """Where the agent runs (asked only with a relay: a sandbox alone needs no agent)."""
    return bool(getattr(request.getfixturevalue("pb_agent"), "on_host", True))


@pytest.fixture
def pb_relay(request: pytest.FixtureRequest, pb_session: RunState,
             pb_run: TaskRun) -> Iterator[ModelRelay | None]:
    """``--pb-model-endpoint``: the model relay, the agent's only way out (``None`` without the option); its
    records in ``model-requests.jsonl``, its usage in the outcome's tokens. Closed after the sandbox."""
    relay = pb_run.model.start(on_host=_agent_on_host(request)) if pb_session.settings.model_endpoint else None
    try:
        yield relay
    finally:
        pb_run.model.close()


@pytest.fixture
def pb_sandbox(request: pytest.FixtureRequest, pb_run: TaskRun, pb_image: ResolvedImage,
               pb_relay: ModelRelay | None) -> Iterator[Sandbox]:
    """The task's sandbox (``Sandbox``): no network, limits, the reference behind ``/workspace/binary``. Use
    ``exec(cmd, timeout=..., user="agent")``, ``binary(args, stdin=...)`` (a call through the proxy) and
    ``layout``. Lives for one task (closed at teardown, or when ``pb_submission`` packed the agent's work)."""
    tunnel_to = pb_relay if pb_relay is not None and not _agent_on_host(request) else None
    sandbox = pb_run.open_sandbox(pb_image, tunnel_to=tunnel_to)
    try:
        yield sandbox
    finally:
        pb_run.close_sandbox()


@pytest.fixture
def pb_agent_run(pb_run: TaskRun, pb_agent: Agent, pb_sandbox: Sandbox) -> AgentResult:
    """The agent's window: the prompt written (the prompt hook applied), ``pb_agent.run(sandbox, prompt)``, the
    sandbox checked alive, ``binary-calls.jsonl`` saved. The ``AgentResult`` (``exit_code``, ``seconds``, ...)."""
    prompt = pb_run.write_prompt(pb_sandbox, on_host=bool(getattr(pb_agent, "on_host", True)))
    return pb_run.run_agent(pb_agent, pb_sandbox, prompt)


@pytest.fixture
def pb_submission(request: pytest.FixtureRequest, pb_session: RunState, pb_run: TaskRun) -> Path | None:
    """The submission (``submission.tar.gz`` in the task's run directory; ``None``: nothing to evaluate, scored 0).
    Built in: with ``--pb-submissions`` the given archive (evaluate-only), else the agent's ``/workspace/src``
    packed after ``pb_agent_run`` (which ends the agent's window: sandbox and relay closed). Override it to
    evaluate a submission taken from elsewhere (copy it to ``pb_run.artifacts.submission``)."""
    if pb_session.settings.gold:  # the reference itself (results/gold.py)
        return pb_run.gold_submission(request.getfixturevalue("pb_image"))
    if pb_session.submissions is not None:
        return pb_run.given_submission()
    if pb_run.submission is not None:  # packed by an earlier attempt: the agent is not run again
        return pb_run.submission
    if pb_run.pack_error:
        return None
    pb_run.require_agent_not_run()
    request.getfixturevalue("pb_agent_run")
    sandbox: Sandbox = request.getfixturevalue("pb_sandbox")
    try:
        return pb_run.pack(sandbox)
    finally:
        pb_run.end_agent_window()


@pytest.fixture
def pb_evaluation(pb_run: TaskRun, pb_blobs: BlobSet, pb_image: ResolvedImage,
                  pb_submission: Path | None) -> EvaluationOutcome | None:
    """The official evaluation of the submission (``EvaluationOutcome``; ``<id>.eval.json`` in the run directory);
    ``None`` without a submission."""
    if pb_submission is None:
        return None
    return pb_run.evaluate(pb_submission, pb_image, pb_blobs)


@pytest.fixture
def pb_outcome(request: pytest.FixtureRequest, pb_run: TaskRun, pb_blobs: BlobSet,
               pb_image: ResolvedImage) -> TaskOutcome:
    """The task's outcome (``TaskOutcome``: score, passed/total, error code, flags, clocks, notes), the one the
    verdict asserts on: the evaluation's, a ``--pb-resume`` run's finished one, or 0 without a submission."""
    reused = pb_run.reuse_finished(pb_image, pb_blobs)
    if reused is not None:
        return reused
    evaluation: EvaluationOutcome | None = request.getfixturevalue("pb_evaluation")
    if evaluation is None:
        return pb_run.no_submission()
    return pb_run.outcome(evaluation)
