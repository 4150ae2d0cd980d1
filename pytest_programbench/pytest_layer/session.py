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
from importlib.metadata import version
from typing import Any

import pytest

from pytest_programbench.core.run_identity import RECORDED_KEY, RunIdentity, fingerprint, public_settings
from pytest_programbench.core.settings import Settings
from pytest_programbench.engine import backpressure, docker_engine
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.engine.reaper import reap_dead_runs
from pytest_programbench.pytest_layer import progress_hooks
from pytest_programbench.pytest_layer.invocation import is_worker, named_tasks
from pytest_programbench.pytest_layer.items import ProgramBenchItem, ProgramBenchSuite
from pytest_programbench.pytest_layer.preflight import run_preflight
from pytest_programbench.pytest_layer.reporting import SessionReporting
from pytest_programbench.pytest_layer.run_state import RunState, item_timeout
from pytest_programbench.pytest_layer.stash import ENGINES
from pytest_programbench.pytest_layer.stopping import EarlyStops
from pytest_programbench.pytest_layer.warned_at import ProgramBenchWarning, warn_at
from pytest_programbench.pytest_layer.xdist_hooks import XdistHooks
from pytest_programbench.results.package import masked_command
from pytest_programbench.results.verdict import InfrastructureError, sanitise_report
from pytest_programbench.tasks.catalogue import Catalogue
from pytest_programbench.tasks.selection import Selection

log = logging.getLogger(__name__)


class ProgramBenchSession(RunState):
    """The run's state (``RunState``) and the hooks that need it, with its companions."""

    def __init__(self, config: pytest.Config, settings: Settings, catalogue: Catalogue,
                 selection: Selection, identity: RunIdentity) -> None:
        super().__init__(config, settings, catalogue, selection, identity)
        config.stash[ENGINES] = self.docker_engines
        self._close_progress: Callable[[], None] | None = None
        self.reporting = SessionReporting(self)
        self.stops = EarlyStops(self)

    def register(self, pluginmanager: pytest.PytestPluginManager, name: str) -> None:
        """The session and its companions as plugin objects (``name``, ``name-reporting``, ...)."""
        pluginmanager.register(self, name)
        pluginmanager.register(self.reporting, f"{name}-reporting")
        pluginmanager.register(self.stops, f"{name}-stops")
        if pluginmanager.hasplugin("xdist"):  # its hooks are optional; without xdist there is nothing to hand out
            pluginmanager.register(XdistHooks(self), f"{name}-xdist")

    # -- collection -------------------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        report = yield
        if isinstance(collector, pytest.Session) and report.passed:
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
            tasks = [i.task for i in session.items if isinstance(i, ProgramBenchItem)]
            self.preflight = run_preflight(self.settings, tasks, self.agent_spec, self.identity,
                                           engines=self.docker_engines)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.summary is not None:
            self.summary.record(report)

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        return self.deselected_lines()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, Any, Any]:
        # Before pytest-timeout reads the item's markers: the outer backstop above the sum of the item's clocks.
        if isinstance(item, ProgramBenchItem) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(item_timeout(item.task, self.settings), method="signal"))
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report: pytest.TestReport = yield
        if isinstance(item, ProgramBenchItem):
            item.move_captured_log(report)
        # An infrastructure error is a message, not a traceback of the harness.
        if call.excinfo is not None and isinstance(call.excinfo.value, InfrastructureError):
            report.longrepr = str(call.excinfo.value)
        sanitise_report(report)  # a file name that is not UTF-8 must not stop xdist, JUnit or the terminal
        return report

    # -- run lifecycle ----------------------------------------------------------------------------------------

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.pytest_session = session
        if not self.collect_only and self.settings.progress != "off":
            self._close_progress = progress_hooks.attach(self, session)
        if self.collect_only or is_worker(self.config):
            return
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
        for url in self.engine_urls():
            try:
                report = docker_engine.sweep(self.identity.run_id, engine=self.docker_engines.client(url))
            except EngineUnavailable as exc:  # its reaper will, once it answers again
                log.warning("could not sweep run %s on %s: %s", self.identity.run_id, url or "the engine", exc)
                continue
            if report.errors:
                log.warning("sweep of run %s left: %s", self.identity.run_id, "; ".join(report.errors))
        backpressure.release_run(self.identity.run_id)
