"""The collected nodes: a ``programbench`` collector and one item per task (node id ``programbench::<id>``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_programbench.agents.command_check import AGENT_COMMAND_MISSING, AgentCommandMissing
from pytest_programbench.core.task_key import ATTEMPT, GOLD, TaskKey
from pytest_programbench.pipeline.task_run import TaskRun
from pytest_programbench.pytest_layer.markers import SUITE, difficulty_marker, language_marker
from pytest_programbench.pytest_layer.stash import SESSION
from pytest_programbench.results.verdict import InfrastructureError, TaskOutcome, VerdictFailure, assert_verdict
from pytest_programbench.tasks.catalogue import CatalogueError, Task

if TYPE_CHECKING:
    from pytest_programbench.pytest_layer.run_state import RunState


HARNESS_LOG = "harness.log"  # in a task's directory: what pytest captured of the harness's logging, per phase


def task_keys(task: Task, *, attempts: int, gold: int) -> list[TaskKey]:
    """A task's items: its gold runs (``--pb-gold N``), else its attempts (one: named by the bare id)."""
    if gold:
        return [TaskKey(task.instance_id, GOLD, n, single=False) for n in range(1, gold + 1)]
    return [TaskKey(task.instance_id, ATTEMPT, n, single=attempts == 1) for n in range(1, attempts + 1)]


class ProgramBenchSuite(pytest.Collector):
    def __init__(self, *, tasks: Sequence[Task], attempts: int = 1, gold: int = 0,
                 named: frozenset[str] = frozenset(), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tasks = tasks
        self.attempts = attempts
        self.gold = gold
        self.named = named  # names given as node ids with their attempt (``<id>[attempt-2]``): only those of a task

    def collect(self) -> Iterator[ProgramBenchItem]:
        for task in self.tasks:
            keys = task_keys(task, attempts=self.attempts, gold=self.gold)
            chosen = [k for k in keys if k.name in self.named]
            for key in chosen or keys:
                yield ProgramBenchItem.from_parent(self, name=key.name, task=task, key=key)


def programbench_task(pb_outcome: TaskOutcome) -> None:
    """The benchmark item's function: its fixtures are the pipeline (fixtures.py); the item asserts the verdict."""


class ProgramBenchItem(pytest.Function):
    """One task. ``setup`` fills its fixtures, the pipeline (infrastructure failures there are errors, retried);
    ``runtest`` asserts the verdict on ``pb_outcome``."""

    def __init__(self, *, task: Task, key: TaskKey | None = None, **kwargs: Any) -> None:
        super().__init__(callobj=programbench_task, **kwargs)
        self.task = task
        self.key = key or TaskKey(task.instance_id)
        self.outcome: TaskOutcome | None = None
        self.add_marker(SUITE)
        self.add_marker(language_marker(task.language))
        self.add_marker(difficulty_marker(task.difficulty))
        self._task_run: TaskRun | None = None
        self._attempt_fixtures: list[tuple[Any, Any]] = []

    @property
    def pb_session(self) -> RunState:
        """The opted-in session's state (items exist only when the session opted in)."""
        return self.config.stash[SESSION]

    @property
    def task_dir(self) -> Path:
        """This item's task directory in the run directory (agent.log, submission, eval.json, pb-meta.json):
        ``<id>/`` for the first attempt, ``attempts/<n>/<id>/`` or ``gold/<n>/<id>/`` for the others."""
        return self.key.task_dir(self.pb_session.identity.path)

    @property
    def task_run(self) -> TaskRun:
        """The task's run record (``pb_run``): one per item, kept across infrastructure retries."""
        if self._task_run is None:
            self._task_run = TaskRun(self.pb_session, self.task, key=self.key)
        return self._task_run

    def track_fixture(self, fixturedef: Any, request: Any) -> None:
        """A function-scoped fixture set up in this attempt (fixtures.py's hook): finalised if the attempt fails."""
        self._attempt_fixtures.append((fixturedef, request))

    def setup(self) -> None:
        """Fill the fixtures; infrastructure errors are retried (``--pb-infra-retries``), never agent failures."""
        session = self.pb_session
        # Said for errors too (setup), so they come first; plain strings for xdist.
        self.user_properties.extend([("language", self.task.language), ("difficulty", self.task.difficulty),
                                     ("run_dir", session.identity.run_dir), ("task_dir", str(self.task_dir))])
        if not self.key.single:
            self.user_properties.extend([("instance_id", self.task.instance_id), (self.key.kind, self.key.n)])
        run = self.task_run
        reasons: list[str] = []
        for attempt in range(session.settings.infra_retries + 1):
            try:
                self.outcome = run.attempt(self._fill)
            except AgentCommandMissing as exc:  # the user's input: said as it is, and the session stops (stopping.py)
                self.user_properties.append((AGENT_COMMAND_MISSING, str(exc)))
                raise
            except InfrastructureError as exc:
                reasons.append(f"attempt {attempt + 1}: {exc}")
                run.retried_after.append(reasons[-1])
                self.user_properties.append((f"infra_attempt_{attempt + 1}", str(exc)[:2000]))
                self._end_attempt()
                session.forget_task_containers(self.key.name)
                if not exc.retryable:
                    break
                continue
            return
        # The first line is the reason, once (pytest's short summary and ours show it; the header is the task id);
        # identical reasons (an engine that is down) are said once.
        distinct = list(dict.fromkeys(r.split(": ", 1)[1].removeprefix(f"{self.task.instance_id}: ")
                                      for r in reasons))
        lines = [f"infrastructure error after {len(reasons)} attempt(s): {distinct[-1]}"]
        if len(distinct) > 1:
            lines += ["every attempt:", *(f"  {r}" for r in reasons)]
        lines.append(f"run directory: {self.task_dir}")
        raise InfrastructureError("\n".join(lines))

    def _fill(self) -> TaskOutcome:
        self._request._fillfixtures()
        outcome: TaskOutcome = self.funcargs["pb_outcome"]  # type: ignore[assignment]
        return outcome

    def _end_attempt(self) -> None:
        """Finalise this attempt's function-scoped fixtures, last set up first (sandbox, relay, engine lease), and
        start the next attempt with a fresh request; session-scoped fixtures stay."""
        fixtures, self._attempt_fixtures = self._attempt_fixtures, []
        for fixturedef, request in reversed(fixtures):
            try:
                fixturedef.finish(request)
            except Exception as exc:  # the attempt failed already; its containers are swept next
                logging.getLogger("pytest_programbench").warning("%s: finalising %s: %s", self.task.instance_id,
                                                                 fixturedef.argname, exc)
        self._initrequest()

    def runtest(self) -> None:
        settings = self.pb_session.settings
        assert self.outcome is not None, "setup ran the pipeline"
        self._gold_ledger_properties()
        passed = False
        try:
            # A gold run measures the reference: any score passes, and its flags (the hash check's) are by design.
            gold = self.key.kind == GOLD
            assert_verdict(self, self.outcome, min_score=0.0 if gold else settings.min_score,
                           allow_flags=settings.allow_flags or gold,
                           junit_tests=settings.junit_tests, task_dir=self.task_dir, basis=settings.score_basis)
            passed = True
        finally:  # scored either way: the pytest_programbench_task_outcome hook sees every verdict
            self.config.hook.pytest_programbench_task_outcome(item=self, outcome=self.outcome, passed=passed,
                                                              task_dir=str(self.task_dir))

    def _gold_ledger_properties(self) -> None:
        """--pb-gold-ledger: the task's ceiling beside its score; --pb-ignore-flaky: the score with the ledger's
        impossible and flaky tests also ignored (beside the official one, which the verdict keeps)."""
        ledger = self.pb_session.ledger
        if ledger is None:
            return
        iid = self.task.instance_id
        ceiling = ledger.ceiling(iid)
        self.user_properties.append(("gold_ceiling", "" if ceiling is None else ceiling))
        if self.pb_session.settings.ignore_flaky:
            try:
                value = ledger.score_without_unreliable(iid, self.task_dir / f"{iid}.eval.json",
                                                        self.task.load_instance())
            except CatalogueError:
                value = None
            self.user_properties.append(("score_ignoring_gold_flaky", "" if value is None else value))

    def move_captured_log(self, report: pytest.TestReport) -> None:
        """The harness's log of this phase (each step's start and time) goes to ``harness.log`` in the task's
        directory, not into the report: repeated under every failure, it buried the failure's own message."""
        title = f"Captured log {report.when}"
        text = "\n".join(content for name, content in report.sections if name == title)
        report.sections = [(name, content) for name, content in report.sections if not name.startswith("Captured log ")]
        if not text.strip():
            return
        try:
            self.task_dir.mkdir(parents=True, exist_ok=True)
            with (self.task_dir / HARNESS_LOG).open("a", encoding="utf-8", errors="backslashreplace") as handle:
                handle.write(f"-- {report.when} --\n{text.rstrip()}\n")
        except OSError as exc:  # the log is a convenience: never a reason to fail the report
            logging.getLogger("pytest_programbench").debug("%s: %s", self.task_dir / HARNESS_LOG, exc)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException]) -> str | Any:  # type: ignore[override]
        # Our own verdicts and infrastructure errors are messages, not tracebacks.
        if isinstance(excinfo.value, VerdictFailure | InfrastructureError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        # No domain here: pytest's progress lines would turn the dots of an instance id into "::". The failure
        # header gets the task id from RunState.pytest_runtest_logreport instead.
        return self.path, None, ""
