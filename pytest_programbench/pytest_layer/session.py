"""The opted-in session: its state (settings, selection, run identity, agent, engines), the collection of task
items, the per-item hooks (the outer backstop, report clean-up, the summary's bookkeeping), and the run's start
(reaping, the run record) and end (the final sweep).

Registered as a plugin object only when the session opts in, so a project that merely has the package installed
runs none of these hooks. Its companions, registered with it: ``reporting.SessionReporting`` (what the session
says), ``stopping.EarlyStops`` (when it stops early) and, under xdist, ``xdist_hooks.XdistHooks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_programbench.core.run_identity import RunIdentity, fingerprint, public_settings
from pytest_programbench.core.settings import Settings
from pytest_programbench.core.task_key import TaskKey
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.pytest_layer import options, run_record, run_state
from pytest_programbench.pytest_layer.invocation import is_listing, is_worker, named_tasks
from pytest_programbench.pytest_layer.items import ProgramBenchItem
from pytest_programbench.pytest_layer.markers import register_languages
from pytest_programbench.pytest_layer.reporting import SessionReporting, agent_label
from pytest_programbench.pytest_layer.stopping import EarlyStops
from pytest_programbench.pytest_layer.warned_at import ProgramBenchWarning, warn_at
from pytest_programbench.tasks.catalogue import Catalogue, CatalogueError, Task
from pytest_programbench.tasks.selection import Selection

if TYPE_CHECKING:
    from pytest_programbench.agents.agent import AgentSpec
    from pytest_programbench.engine.engines import EnginePool
    from pytest_programbench.pytest_layer.preflight import PreflightReport
    from pytest_programbench.results.gold import Ledger
    from pytest_programbench.results.progress import Publisher
    from pytest_programbench.results.summary import RunSummary
    from pytest_programbench.tasks.submissions import SubmissionsDir

log = logging.getLogger(__name__)

# Slack above the sum of an item's own clocks for container start-up, image and blob work, packing.
TIMEOUT_MARGIN = 600


def item_timeout(task: Task, settings: Settings) -> int:
    """Every clock the item may legitimately wait on, plus a margin: the outer backstop must never fire first.
    The evaluation's part counts every step's own clock (the official's per-step timeouts included), so a
    submission that makes every step run to its clock still ends by those clocks, scored."""
    from pytest_programbench.evaluation.container_layer import evaluation_budget

    try:
        branches = max(1, sum(1 for info in task.load_instance()["branches"].values() if not info.get("ignored")))
    except CatalogueError:
        branches = 1  # the pipeline reports the malformed tests.json itself
    # Held model requests give the clock back, up to its cap.
    agent = settings.agent_timeout + int(settings.agent_clock_cap) if settings.agent else 0
    evaluation = evaluation_budget(compile_timeout=settings.compile_timeout, test_timeout=settings.test_timeout,
                                   branches=branches, branch_workers=settings.branch_workers,
                                   branch_retries=settings.branch_retries, audit=settings.audit_hidden_tests)
    # The setup re-runs the pipeline once per infrastructure attempt (--pb-infra-retries): each may use every clock.
    return (1 + settings.infra_retries) * (agent + evaluation) + TIMEOUT_MARGIN


class ProgramBenchSession:
    """Session-wide state and the hooks that need it."""

    def __init__(self, config: pytest.Config, settings: Settings, catalogue: Catalogue,
                 selection: Selection, identity: RunIdentity) -> None:
        self.config = config
        self.settings = settings
        self.catalogue = catalogue
        self.selection = selection
        self.identity = identity
        self.collect_only = is_listing(config)  # --co, --fixtures, --markers...: nothing runs, no run directory
        self.explicit_paths = config.args_source == pytest.Config.ArgsSource.ARGS
        self.worker_id: str = getattr(config, "workerinput", {}).get("workerid", "controller")
        from pytest_programbench.engine.backpressure import Backpressure
        from pytest_programbench.engine.docker_engine import EngineRun, Engines
        from pytest_programbench.pytest_layer.stash import ENGINES

        # This process's engines: owner labels on everything it creates, the cross-worker cap on heavy engine calls
        # (listing only: nothing runs, nothing is labelled or capped). Clients are made at first use, per process.
        run = (EngineRun(None, Backpressure(0)) if self.collect_only
               else EngineRun.for_run(identity, concurrency=settings.docker_concurrency))
        self.docker_engines = config.stash[ENGINES] = Engines(run)
        self.summary: RunSummary | None = None
        self.progress: Publisher | None = None  # this process's phase publisher (--pb-progress)
        self._close_progress: Callable[[], None] | None = None
        self.pytest_session: pytest.Session | None = None
        self.preflight: PreflightReport | None = None
        self.agent_spec: AgentSpec | None = None
        self.agent_command_checked = False  # by this process's first agent run (agents/command_check.py)
        if settings.agent and not settings.submissions:
            from pytest_programbench.agents.agent import AgentSpec

            self.agent_spec = AgentSpec.parse(settings.agent, on_host=settings.agent_on_host)
            if not self.collect_only:
                run_state.validate_agent_inputs(settings)
            if self.agent_spec.kind == "mini-swe-agent" and not self.collect_only:
                from pytest_programbench.agents.mini_swe_agent import preflight

                preflight(settings)
        self.ledger: Ledger | None = None  # --pb-gold-ledger
        if settings.gold_ledger:
            from pytest_programbench.results.gold import Ledger, LedgerError

            try:
                self.ledger = Ledger.load(Path(settings.gold_ledger))
            except LedgerError as exc:
                raise pytest.UsageError(f"--pb-gold-ledger: {exc}") from None
        self.engines: EnginePool | None = None  # --pb-docker-host: tasks spread over these engines
        if settings.docker_hosts:
            from pytest_programbench.engine.engines import EnginePool, parse_docker_hosts

            self.engines = EnginePool.for_run(parse_docker_hosts(settings.docker_hosts), identity.run_id,
                                              sandbox_cpus=settings.sandbox_cpus, engines=self.docker_engines)
        self.submissions: SubmissionsDir | None = None
        self.without_submission: list[str] = []
        if settings.submissions:
            from pytest_programbench.tasks.submissions import SubmissionsDir

            self.submissions = SubmissionsDir(Path(settings.submissions), catalogue)
            if not settings.require_all:
                self.without_submission = [t.instance_id for t in selection.tasks
                                           if not self.submissions.has(t.instance_id)]
        self.reporting = SessionReporting(self)
        self.stops = EarlyStops(self)

    def register(self, pluginmanager: pytest.PytestPluginManager, name: str) -> None:
        """The session and its companions as plugin objects (``name``, ``name-reporting``, ...)."""
        pluginmanager.register(self, name)
        pluginmanager.register(self.reporting, f"{name}-reporting")
        pluginmanager.register(self.stops, f"{name}-stops")
        if pluginmanager.hasplugin("xdist"):  # its hooks are optional; without xdist there is nothing to hand out
            from pytest_programbench.pytest_layer.xdist_hooks import XdistHooks

            pluginmanager.register(XdistHooks(self), f"{name}-xdist")

    @classmethod
    def from_config(cls, config: pytest.Config) -> ProgramBenchSession:
        # --pb-resume DIR alone: the run's recorded settings, under what the user gave explicitly.
        settings = run_record.for_session(config, options.parse(config))
        catalogue, selection = run_state.load_selection(config, settings)
        run_state.validate(config, settings)
        register_languages(config, {t.language for t in catalogue})
        run_state.warn_thread_timeout(config)
        return cls(config, settings, catalogue, selection, run_state.identity_for(config, settings))

    # -- collection -------------------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        report = yield
        if isinstance(collector, pytest.Session) and report.passed:
            from pytest_programbench.pytest_layer.items import ProgramBenchSuite

            # A virtual path under the rootdir: reports then show "programbench" wherever pytest runs from.
            suite = ProgramBenchSuite.from_parent(collector, name="programbench", nodeid="programbench",
                                                  path=self.config.rootpath / "programbench",
                                                  tasks=self.selection.tasks, attempts=self.settings.attempts,
                                                  gold=self.settings.gold,
                                                  named=frozenset(named_tasks(self.config) or ()))
            # With no explicit path the session is the benchmark alone; with paths, the benchmark joins them.
            report.result = [*report.result, suite] if self.explicit_paths else [suite]
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if self.submissions is None:
            return
        for unknown in self.submissions.unknown_ids:  # said at the folder itself
            warn_at(config, ProgramBenchWarning(f"{unknown!r} is not a known task; ignored"),
                    self.submissions.root / unknown)
        missing = [i for i in items if isinstance(i, ProgramBenchItem)
                   and i.task.instance_id in self.without_submission]
        if missing:
            drop = set(map(id, missing))
            items[:] = [i for i in items if id(i) not in drop]
            config.hook.pytest_deselected(items=missing)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.start_summary([i.nodeid for i in session.items])
        if self.settings.preflight and not is_worker(self.config):
            from pytest_programbench.pytest_layer.preflight import run_preflight

            tasks = [i.task for i in session.items if isinstance(i, ProgramBenchItem)]
            self.preflight = run_preflight(self.settings, tasks, self.agent_spec, self.identity,
                                           engines=self.docker_engines)

    def start_summary(self, node_ids: list[str]) -> None:
        if self.summary is not None or self.collect_only or is_worker(self.config):
            return
        import shlex
        from importlib.metadata import version

        from pytest_programbench.relay.spend import SPEND_DIR, RunBudget
        from pytest_programbench.results.artifacts import TaskArtifacts
        from pytest_programbench.results.package import masked_command
        from pytest_programbench.results.summary import RunSummary, TaskRecord

        by_id = {t.instance_id: t for t in self.selection.tasks}
        keys = [k for k in map(TaskKey.of_nodeid, node_ids) if k is not None and k.instance_id in by_id]
        self.summary = RunSummary(
            self.identity.path / "summary.json",
            {
                "run_id": self.identity.run_id,
                "run_dir": self.identity.run_dir,
                "plugin_version": version("pytest-programbench"),
                "programbench_version": version("programbench"),
                "agent": agent_label(self.agent_spec) if self.agent_spec is not None else None,
                "started": self.identity.started,
                "command": shlex.join(masked_command(self.config.invocation_params.args)),
                "settings": public_settings(self.settings),
            },
            [TaskRecord(k.instance_id, by_id[k.instance_id].language, by_id[k.instance_id].difficulty,
                        by_id[k.instance_id].overridden, key=k.name, attempt=k.n) for k in keys],
            meta_loader=lambda name: TaskArtifacts(TaskKey.parse(name).run_root(self.identity.path),
                                                   TaskKey.parse(name).instance_id).read_meta(),
            token_price=self.settings.token_price,
            before_write=lambda data: self.config.hook.pytest_programbench_summary(summary=data, config=self.config),
            attempts=self.settings.gold or self.settings.attempts,
            budget=None if self.settings.budget is None else RunBudget(self.identity.path / SPEND_DIR,
                                                                         self.settings.budget),
        )
        self.summary.write()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.summary is not None:
            self.summary.record(report)

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        if not self.without_submission:
            return []
        shown = ", ".join(self.without_submission[:20])
        more = f" (+{len(self.without_submission) - 20} more)" if len(self.without_submission) > 20 else ""
        return [f"programbench: {len(self.without_submission)} selected tasks have no submission in "
                f"{self.settings.submissions} and were deselected: {shown}{more}"]

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, Any, Any]:
        # Before pytest-timeout reads the item's markers: the outer backstop above the sum of the item's clocks.
        if isinstance(item, ProgramBenchItem) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(item_timeout(item.task, self.settings), method="signal"))
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report: pytest.TestReport = yield
        from pytest_programbench.results.verdict import InfrastructureError, sanitise_report

        if isinstance(item, ProgramBenchItem):
            item.move_captured_log(report)
        # An infrastructure error is a message, not a traceback of the harness.
        if call.excinfo is not None and isinstance(call.excinfo.value, InfrastructureError):
            report.longrepr = str(call.excinfo.value)
        sanitise_report(report)  # a file name that is not UTF-8 must not stop xdist, JUnit or the terminal
        return report

    def engine_urls(self, *, up_only: bool = False) -> list[str | None]:
        """Every engine this run may use (``None``: the environment's); ``up_only``: not those marked down."""
        if self.engines is None:
            return [None]
        pool = self.engines
        return [spec.url for spec in pool.specs if not up_only or pool.down_reason(spec) is None]

    def forget_task_containers(self, instance_id: str) -> None:
        """Remove what an aborted attempt left behind, before the task runs again (on every engine of the run);
        ``instance_id`` is the item's name (its containers' task label: one attempt's, not its siblings')."""
        from pytest_programbench.engine import docker_engine

        for url in self.engine_urls(up_only=True):  # a down engine's leftovers: reaped when it is used again
            try:
                docker_engine.sweep(self.identity.run_id, task=instance_id, engine=self.docker_engines.client(url))
            except EngineUnavailable as exc:  # the item's own error already says so
                log.debug("could not remove the containers of %s on %s: %s", instance_id, url or "default", exc)
            except Exception as exc:  # the session-end sweep and the reaper remain
                log.warning("could not remove the containers of %s: %s", instance_id, exc)

    # -- run lifecycle ----------------------------------------------------------------------------------------

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.pytest_session = session
        if not self.collect_only and self.settings.progress != "off":
            from pytest_programbench.pytest_layer import progress_hooks

            self._close_progress = progress_hooks.attach(self, session)
        if self.collect_only or is_worker(self.config):
            return
        from importlib.metadata import version

        from pytest_programbench.core.run_identity import RECORDED_KEY
        from pytest_programbench.engine.reaper import reap_dead_runs
        from pytest_programbench.results.package import masked_command

        # Leftovers of dead runs (their controller is gone or their lifetime expired), never a live run's.
        for url in self.engine_urls():
            try:
                engine = self.docker_engines.client(url)
            except EngineUnavailable as exc:
                log.warning("engine %s does not answer: %s", url or "(the default)", exc)
                continue
            reaped = reap_dead_runs(self.identity.run_id, engine=engine,
                                    run_dirs=[self.config.invocation_params.dir / "pb-runs",
                                              self.identity.path.parent])
            if reaped.containers or reaped.images:
                log.warning("reaped %d containers and %d images of dead runs on %s", len(reaped.containers),
                            len(reaped.images), url or "the default engine")
        self.identity.materialise({
            "plugin_version": version("pytest-programbench"),
            "programbench_version": version("programbench"),
            "fingerprint": fingerprint(self.settings),
            RECORDED_KEY: public_settings(self.settings),  # what --pb-resume DIR alone reuses
            "selected": [t.instance_id for t in self.selection.tasks],
            "command": masked_command(self.config.invocation_params.args),  # --pb-package's submission.yaml
        })

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self._close_progress is not None:
            self._close_progress()
            self._close_progress = None
        if self.summary is not None and not is_worker(self.config):
            self.summary.set_in_flight({})
            self.summary.flush()  # a write its pacing deferred: the file is final before anything reads it
        if self.preflight is not None and self.preflight.missing and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.collect_only or is_worker(self.config):
            return
        self.reporting.finish(session)
        from pytest_programbench.engine import docker_engine

        for url in self.engine_urls():
            try:
                report = docker_engine.sweep(self.identity.run_id, engine=self.docker_engines.client(url))
            except EngineUnavailable as exc:  # its reaper will, once it answers again
                log.warning("could not sweep run %s on %s: %s", self.identity.run_id, url or "the engine", exc)
                continue
            if report.errors:
                log.warning("sweep of run %s left: %s", self.identity.run_id, "; ".join(report.errors))
        from pytest_programbench.engine import backpressure

        backpressure.release_run(self.identity.run_id)
