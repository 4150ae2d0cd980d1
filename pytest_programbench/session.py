"""The opted-in session: selection, run identity, collection of task items, report header, final sweep.

Registered as a plugin object only when the session opts in, so a project that merely has the package installed
runs none of these hooks.
"""

from __future__ import annotations

import logging
import os
import warnings
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _pytest.junitxml import bin_xml_escape

from pytest_programbench import options
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.invocation import SUITE_NAME, TaskKey, is_listing, named_tasks
from pytest_programbench.items import ProgramBenchItem
from pytest_programbench.markers import register_languages
from pytest_programbench.run_record import RunIdentity, check_resumable, fingerprint, public_settings
from pytest_programbench.stash import WORKSTEAL_DEFAULTED
from pytest_programbench.tasks.catalogue import Catalogue, CatalogueError, Task
from pytest_programbench.tasks.selection import Selection, select

if TYPE_CHECKING:
    from pytest_programbench.agents.agent import AgentSpec
    from pytest_programbench.engine.engines import EnginePool
    from pytest_programbench.preflight import PreflightReport
    from pytest_programbench.results.gold import Ledger
    from pytest_programbench.results.progress import Publisher
    from pytest_programbench.results.summary import RunSummary
    from pytest_programbench.tasks.submissions import SubmissionsDir

log = logging.getLogger(__name__)

WORKERINPUT_KEY = "pytest_programbench_run"
NOTHING_TO_RUN = (
    "the ProgramBench suite is selected but there is nothing to run: pass --pb-agent CMD to run an agent, or "
    "--pb-submissions DIR to evaluate existing submissions (add --co to only list the tasks)"
)

AGENT_AND_SUBMISSIONS = (
    "--pb-agent and --pb-submissions exclude each other: --pb-submissions evaluates existing submissions without "
    "running an agent; drop one of them"
)


class ProgramBenchWarning(pytest.PytestWarning):
    """Something about the run the user should see, that does not stop it."""


# Slack above the sum of an item's own clocks for container start-up, image and blob work, packing.
TIMEOUT_MARGIN = 600


def item_timeout(task: Task, settings: options.Settings) -> int:
    """Every clock the item may legitimately wait on, plus a margin: the outer backstop must never fire first.
    The evaluation's part counts every step's own clock (the official's per-step timeouts included), so a
    submission that makes every step run to its clock still ends by those clocks, scored."""
    from pytest_programbench.evaluation.container_layer import evaluation_budget

    try:
        branches = max(1, sum(1 for info in task.load_instance()["branches"].values() if not info.get("ignored")))
    except CatalogueError:
        branches = 1  # the pipeline reports the malformed tests.json itself
    agent = settings.agent_timeout if settings.agent else 0
    evaluation = evaluation_budget(compile_timeout=settings.compile_timeout, test_timeout=settings.test_timeout,
                                   branches=branches, branch_workers=settings.branch_workers,
                                   branch_retries=settings.branch_retries)
    # The setup re-runs the pipeline once per infrastructure attempt (--pb-infra-retries): each may use every clock.
    return (1 + settings.infra_retries) * (agent + evaluation) + TIMEOUT_MARGIN


def narrow_to(selection: Selection, catalogue: Catalogue, named: tuple[str, ...]) -> Selection:
    """The selection cut to the tasks named as node ids (``pytest programbench::<id>``, or one attempt of it:
    ``<id>[attempt-2]``); an id that is no task is a usage error naming it."""
    known = {t.instance_id for t in catalogue}
    named = tuple(dict.fromkeys(TaskKey.parse(n).instance_id for n in named))
    unknown = [i for i in named if i not in known]
    if unknown:
        raise pytest.UsageError(", ".join(f"{SUITE_NAME}::{i}" for i in unknown) + ": no such ProgramBench task"
                                + " (not in the benchmark nor in a --pb-tasks-dir; bundled fixtures need "
                                  "--pb-include-fixtures)")
    chosen = set(named)
    tasks = tuple(t for t in selection.tasks if t.instance_id in chosen)
    why = "" if tasks else (f"{', '.join(named)} named as node ids, none of them in the selection of the --pb-* "
                            f"options ({len(selection.tasks)} tasks)")
    return Selection(tasks, why)


def validate_agent_inputs(settings: options.Settings) -> None:
    """Bad agent inputs are usage errors before anything runs, not an error per item."""
    from pytest_programbench.agents.agent import AgentEnvError, agent_env

    try:
        agent_env(settings.agent_env)
    except AgentEnvError as exc:
        raise pytest.UsageError(str(exc)) from None
    if settings.prompt_template and not Path(settings.prompt_template).is_file():
        raise pytest.UsageError(f"--pb-prompt-template: {settings.prompt_template} is not a file")
    if settings.model_endpoint:
        from pytest_programbench.relay.relay import RelayConfigError, Upstream

        try:
            Upstream.parse(settings.model_endpoint)
        except RelayConfigError as exc:
            raise pytest.UsageError(f"--pb-model-endpoint: {exc}") from None
    if settings.model_key_env and settings.model_key_env not in os.environ:
        raise pytest.UsageError(f"--pb-model-key-env: {settings.model_key_env} is not set on the host")
    for spec in settings.agent_mounts:
        host = spec.partition(":")[0]
        if not Path(host).expanduser().exists():
            raise pytest.UsageError(f"--pb-agent-mount: {host} does not exist")


def agent_label(spec: AgentSpec, width: int = 80) -> str:
    """What the header calls the agent: a preset by name (a CLI preset with its version), a command as typed."""
    if spec.kind == "cli":
        return f"{spec.label} (preset)"
    if spec.kind != "command":
        return spec.label
    text = " ".join(spec.command.split())
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


# Tasks whose agent all exited 127/126 (never ran) before the session stops; --pb-keep-going turns it off.
STOP_AFTER_AGENT_NOT_RUN = 3
# Tasks whose model API rejected the key (401/403) before any task was scored, before the session stops.
STOP_AFTER_MODEL_REJECTED = 2


def junit_headline(summary: RunSummary) -> dict[str, str]:
    """The headline flattened to JUnit property values (plain strings)."""
    head = summary.headline()
    numbers = summary.intervals()
    out = {name: str(head.get(name)) for name in ("selected", "scored", "mean_over_scored", "mean_over_selection")}
    for name in ("mean_over_scored_ci", "mean_over_selection_ci"):
        ci = numbers.get(name)
        if ci:
            out.update({f"{name}_low": str(ci["low"]), f"{name}_high": str(ci["high"]),
                        f"{name}_method": f"bootstrap {ci['method']}, {ci['resamples']} resamples, seed {ci['seed']}, "
                                          f"over {ci['n']} {ci['over']}"})
    if summary.attempts > 1:
        out["attempts"] = str(summary.attempts)
        out["std_across_attempts"] = str(numbers.get("std_across_attempts"))
        for name in ("pass_at_k", "resolved_at_k", "near_resolved_at_k"):
            for k, value in (numbers.get(name) or {}).items():
                out[f"{name.removesuffix('k')}{k}"] = str(value)  # pass_at_1, resolved_at_4, ...
    return out


def _junit_xml(config: pytest.Config) -> Any:
    """pytest's JUnit writer when ``--junitxml`` is on (its node reporters are how a test case gets content)."""
    from _pytest.junitxml import xml_key

    return config.stash.get(xml_key, None)


class ProgramBenchSession:
    """Session-wide state and the hooks that need it."""

    def __init__(self, config: pytest.Config, settings: options.Settings, catalogue: Catalogue,
                 selection: Selection, identity: RunIdentity) -> None:
        self.config = config
        self.settings = settings
        self.catalogue = catalogue
        self.selection = selection
        self.identity = identity
        self.collect_only = is_listing(config)  # --co, --fixtures, --markers...: nothing runs, no run directory
        self.explicit_paths = config.args_source == pytest.Config.ArgsSource.ARGS
        self.worker_id: str = getattr(config, "workerinput", {}).get("workerid", "controller")
        if not self.collect_only:
            from pytest_programbench.engine import docker_engine

            # Owner labels on everything this process creates, and the cross-worker cap on heavy engine calls.
            docker_engine.configure_run(identity, concurrency=settings.docker_concurrency)
        self.summary: RunSummary | None = None
        self.progress: Publisher | None = None  # this process's phase publisher (--pb-progress)
        self._close_progress: Callable[[], None] | None = None
        self.report_path: Path | None = None
        self.crashes: dict[str, list[str]] = {}
        self.min_mean_failed = ""
        self.end_lines: list[tuple[str, list[str]]] = []  # --pb-compare / --pb-package: (section, lines)
        self.end_failed = ""  # --pb-max-regression's message, or a comparison it needed that failed
        self.pytest_session: pytest.Session | None = None
        # The agent's exit statuses of the first tasks, while none of them ran (127/126): see _watch_agent_exit.
        self.agent_not_run: list[tuple[str, int]] = []
        self.agent_ran = False
        self.model_rejected: list[str] = []  # the first tasks whose key was rejected, while none was scored
        self.scored_any = False
        self.stop_reason = ""
        self.preflight: PreflightReport | None = None
        self.agent_spec: AgentSpec | None = None
        if settings.agent and not settings.submissions:
            from pytest_programbench.agents.agent import AgentSpec

            self.agent_spec = AgentSpec.parse(settings.agent, on_host=settings.agent_on_host)
            if not self.collect_only:
                validate_agent_inputs(settings)
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
                                              sandbox_cpus=settings.sandbox_cpus)
        self.submissions: SubmissionsDir | None = None
        self.without_submission: list[str] = []
        if settings.submissions:
            from pytest_programbench.tasks.submissions import SubmissionsDir

            self.submissions = SubmissionsDir(Path(settings.submissions), catalogue)
            if not settings.require_all:
                self.without_submission = [t.instance_id for t in selection.tasks
                                           if not self.submissions.has(t.instance_id)]

    @classmethod
    def from_config(cls, config: pytest.Config) -> ProgramBenchSession:
        from pytest_programbench import run_record

        # --pb-resume DIR alone: the run's recorded settings, under what the user gave explicitly.
        settings = run_record.for_session(config, options.parse(config))
        try:
            catalogue = Catalogue.load(settings.tasks_dirs, include_fixtures=settings.include_fixtures)
        except CatalogueError as exc:
            raise pytest.UsageError(f"malformed task: {exc}") from None
        selection = select(
            catalogue,
            languages=settings.languages,
            difficulties=settings.difficulties,
            filter_spec=settings.filter,
            slice_spec=settings.slice,
            shuffle_seed=settings.shuffle,
        )
        named = named_tasks(config)
        if named is not None:
            selection = narrow_to(selection, catalogue, named)
        if not selection.tasks:
            raise pytest.UsageError(f"no ProgramBench task matched: {selection.why_empty}")
        if not is_listing(config) and not settings.agent and not settings.submissions and not settings.gold:
            raise pytest.UsageError(NOTHING_TO_RUN)
        if settings.gold and (settings.agent or settings.submissions or settings.attempts > 1):
            raise pytest.UsageError("--pb-gold N evaluates the reference itself: it runs no agent and takes no "
                                    "submissions (drop --pb-agent, --pb-submissions and --pb-attempts)")
        if settings.ignore_flaky and not settings.gold_ledger:
            raise pytest.UsageError("--pb-ignore-flaky needs --pb-gold-ledger FILE: the ledger's tests are ignored")
        if settings.agent and settings.submissions:
            raise pytest.UsageError(AGENT_AND_SUBMISSIONS)
        if settings.budget is not None and settings.token_price is None:
            raise pytest.UsageError("--pb-budget USD needs --pb-token-price IN,OUT: the price of the metered tokens")
        if settings.max_regression is not None and not settings.compare:
            raise pytest.UsageError("--pb-max-regression X needs --pb-compare BASE: the run the regression is "
                                    "measured against")
        if settings.compare and not config.option.collectonly:
            from pytest_programbench.results.compare import CompareError, FinishedRun

            try:  # before any agent time is spent: the baseline must be readable at the end
                FinishedRun.load(Path(settings.compare[0]))
            except CompareError as exc:
                raise pytest.UsageError(f"--pb-compare: {exc}") from None
        register_languages(config, {t.language for t in catalogue})
        method = config.getoption("timeout_method", None) or config.getini("timeout_method")
        if method == "thread":
            config.issue_config_time_warning(ProgramBenchWarning(
                "pytest-timeout's thread method os._exit()s the whole worker when it fires; ProgramBench items use "
                "the signal method regardless (their markers say so), other tests of this session do not"),
                stacklevel=2)
        if is_worker(config):
            identity = RunIdentity.from_dict(config.workerinput[WORKERINPUT_KEY])  # type: ignore[attr-defined]
        else:
            # pb-runs/ where pytest was invoked, as a relative --pb-output is: not under a rootdir that moves.
            identity = RunIdentity.create(config.invocation_params.dir, output=settings.output,
                                          resume=settings.resume)
            if identity.resumed:
                check_resumable(identity, settings)
        return cls(config, settings, catalogue, selection, identity)

    # -- collection -------------------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        report = yield
        if isinstance(collector, pytest.Session) and report.passed:
            from pytest_programbench.items import ProgramBenchSuite

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
        for unknown in self.submissions.unknown_ids:
            warnings.warn(ProgramBenchWarning(
                f"{self.submissions.root / unknown}: {unknown!r} is not a known task; ignored"), stacklevel=1)
        missing = [i for i in items if isinstance(i, ProgramBenchItem)
                   and i.task.instance_id in self.without_submission]
        if missing:
            drop = set(map(id, missing))
            items[:] = [i for i in items if id(i) not in drop]
            config.hook.pytest_deselected(items=missing)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._start_summary([i.nodeid for i in session.items])
        if self.settings.preflight and not is_worker(self.config):
            from pytest_programbench.preflight import run_preflight

            tasks = [i.task for i in session.items if isinstance(i, ProgramBenchItem)]
            self.preflight = run_preflight(self.settings, tasks, self.agent_spec, self.identity)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if self.summary is None:  # the first worker's list: the controller collects nothing, so say it here, once
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            for line in self.pytest_report_collectionfinish(self.config):
                if reporter is not None:
                    reporter.write_line(line)
        self._start_summary(ids)

    def _start_summary(self, node_ids: list[str]) -> None:
        if self.summary is not None or self.collect_only or is_worker(self.config):
            return
        import shlex
        from importlib.metadata import version

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
        )
        self.summary.write()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.summary is not None:
            self.summary.record(report)

    @pytest.hookimpl(tryfirst=True, specname="pytest_runtest_logreport")
    def pytest_runtest_logreport_junit(self, report: pytest.TestReport) -> None:
        """JUnit ``<system-out>``: the agent.log tail, added before junitxml closes the test case (on teardown)."""
        key = TaskKey.of_nodeid(report.nodeid)
        if report.when != "teardown" or key is None:
            return
        xml = _junit_xml(self.config)
        if xml is None:
            return
        from pytest_programbench.results.verdict import tail_lines

        tail = tail_lines(key.task_dir(self.identity.path) / "agent.log")
        if tail:
            out = ET.Element("system-out")
            out.text = bin_xml_escape("\n".join([f"last {len(tail)} lines of agent.log:", *tail, ""]))
            xml.node_reporter(report).append(out)

    @pytest.hookimpl(trylast=True, specname="pytest_runtest_logreport")
    def pytest_runtest_logreport_explain(self, report: pytest.TestReport) -> None:
        """After the progress line is written: the failure header names the task; a missing agent stops the run."""
        key = TaskKey.of_nodeid(report.nodeid)
        if key is None:
            return
        instance_id = key.name
        if report.failed and report.location is not None:
            # pytest titles a failure with the location's domain ("test session" when empty).
            report.location = (report.location[0], report.location[1], instance_id)
        if report.when == "call":
            self.scored_any = True
            self._watch_agent_exit(instance_id, dict(report.user_properties).get("agent_exit"))
        elif report.when == "setup" and report.failed:
            self._watch_model_rejected(instance_id, report.user_properties)
        if report.when == "teardown":
            self._watch_budget()

    def _watch_budget(self) -> None:
        """--pb-budget: once spent plus the running tasks' projected cost passes it, no new task starts (the rest
        is not run, resumable with a larger budget)."""
        budget, summary = self.settings.budget, self.summary
        if budget is None or summary is None or self.stop_reason:
            return
        from pytest_programbench.relay.spend import SPEND_DIR, run_spend

        spent = run_spend(self.identity.path / SPEND_DIR)
        costs = [rec.cost_usd for rec in summary.records.values() if rec.outcome and rec.cost_usd is not None]
        workers = getattr(self.config.option, "numprocesses", None)
        running = len(summary.in_flight) or max(0, (workers if isinstance(workers, int) else 1) - 1)
        projected = (sum(costs) / len(costs)) * running if costs else 0.0
        if spent + projected <= budget:
            return
        self._stop(f"programbench: stopping: budget: ${spent:.4f} spent + ${projected:.4f} projected for {running} "
                   f"running task(s) passes --pb-budget ${budget:g}; the tasks not started are not run "
                   "(--pb-resume with a larger --pb-budget runs them)")

    def _watch_model_rejected(self, instance_id: str, properties: list[tuple[str, object]]) -> None:
        """Stop the session when the model API rejected the key on the first tasks: every task would do the same."""
        from pytest_programbench.relay.relay import MODEL_REJECTED

        if self.settings.keep_going or self.stop_reason or self.scored_any:
            return
        reasons = [str(value) for name, value in properties
                   if str(name).startswith("infra_attempt_") and str(value).startswith(MODEL_REJECTED)]
        if not reasons:
            return
        self.model_rejected.append(instance_id)
        if len(self.model_rejected) < STOP_AFTER_MODEL_REJECTED:
            return
        self._stop(f"programbench: stopping: {reasons[0].split(';')[0]} on each of the first "
                   f"{len(self.model_rejected)} tasks; check --pb-model-key-env {self.settings.model_key_env!r} "
                   f"and --pb-model-endpoint {self.settings.model_endpoint!r} (--pb-resume runs the tasks once the "
                   "key works); --pb-keep-going runs every task anyway")

    def _watch_agent_exit(self, instance_id: str, agent_exit: Any) -> None:
        """Stop the session when the first tasks' agents all exited 127/126: every other task would do the same."""
        from pytest_programbench.results.verdict import AGENT_NOT_RUN

        if self.settings.keep_going or self.agent_spec is None or agent_exit in (None, "") or self.stop_reason:
            return
        if agent_exit not in AGENT_NOT_RUN:
            self.agent_ran = True
        if self.agent_ran:
            return
        self.agent_not_run.append((instance_id, int(agent_exit)))
        if len(self.agent_not_run) < STOP_AFTER_AGENT_NOT_RUN:
            return
        codes = sorted({code for _, code in self.agent_not_run})
        what = "; ".join(f"{code}: {AGENT_NOT_RUN[code]}" for code in codes)
        first = self.agent_not_run[0][0]
        self.stop_reason = (
            f"programbench: stopping: the agent of each of the first {len(self.agent_not_run)} tasks exited "
            f"{'/'.join(map(str, codes))} ({what}); check --pb-agent {self.settings.agent!r} (the shell's message "
            f"is in {self.identity.path / first / 'agent.log'}); --pb-keep-going runs every task anyway")
        self._stop(self.stop_reason)

    def _stop(self, reason: str) -> None:
        """No new task starts; the session ends with ``reason`` (under xdist too)."""
        self.stop_reason = reason
        dsession = self.config.pluginmanager.get_plugin("dsession")
        if dsession is not None:
            dsession.shouldstop = self.stop_reason  # xdist's controller loop reads its own flag
        if self.pytest_session is not None:
            self.pytest_session.shouldstop = self.stop_reason

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.preflight is not None:
            terminalreporter.write_sep("=", "programbench preflight")
            for line in self.preflight.lines():
                terminalreporter.write_line(line, red=bool(self.preflight.missing) and not line.startswith(
                    "checked:"))
        if self.summary is None:
            return
        terminalreporter.write_sep("=", "programbench summary")
        for line in self.summary.terminal_lines():
            terminalreporter.write_line(line)
        terminalreporter.write_line(f"run directory: {self.identity.run_dir}")
        headline = self.summary.headline()
        if exitstatus == pytest.ExitCode.INTERRUPTED or headline.get("errors") or headline.get("not_run"):
            from pytest_programbench.run_record import command

            terminalreporter.write_line("to resume (finished tasks are kept): "
                                        + command(config.invocation_params.args, self.identity.path), bold=True)
        if self.report_path is not None:
            terminalreporter.write_line(f"report: {self.report_path}")
        if self.min_mean_failed:
            terminalreporter.write_line(self.min_mean_failed, red=True, bold=True)
        for title, lines in self.end_lines:
            terminalreporter.write_sep("=", title)
            for line in lines:
                terminalreporter.write_line(line)
        if self.end_failed:
            terminalreporter.write_line(self.end_failed, red=True, bold=True)

    def _write_report(self) -> None:
        """report.html next to summary.json; a page that cannot be written is said, never fails the run."""
        from pytest_programbench.results.report import TaskScope, write_report

        assert self.summary is not None
        by_id = {t.instance_id: t for t in self.selection.tasks}

        def scope(instance_id: str) -> TaskScope | None:
            from programbench.utils.load_data import get_active_branches, get_ignored_tests

            task = by_id.get(instance_id)
            try:
                instance = task.load_instance() if task is not None else None
            except CatalogueError:
                return None
            if instance is None:
                return None
            return TaskScope(tuple(get_active_branches(instance)), frozenset(get_ignored_tests(instance)))

        try:
            self.report_path = write_report(self.identity.path, self.summary.as_dict(), scope)
        except Exception as exc:
            log.warning("could not write %s: %s", self.identity.path / "report.html", exc)

    def _check_min_mean(self, session: pytest.Session) -> None:
        """--pb-min-mean: the run fails when the mean over the selection (errors count 0) is below the bar."""
        if self.summary is None or self.settings.min_mean is None:
            return
        mean = self.summary.headline()["mean_over_selection"] or 0.0
        if mean < self.settings.min_mean:
            self.min_mean_failed = (f"programbench: mean over the selection {mean:.4f} is below --pb-min-mean "
                                    f"{self.settings.min_mean:g}")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _write_gold_ledger(self) -> None:
        """--pb-gold: gold-ledger.json from the gold runs' official results; said, never fails the run."""
        if not self.settings.gold:
            return
        from pytest_programbench.results.gold import build_ledger, ledger_lines, write_ledger

        try:
            instances = {t.instance_id: t.load_instance() for t in self.selection.tasks}
            ledger = build_ledger(self.identity.path, instances, self.settings.gold, {
                name: getattr(self.settings, name) for name in ("cpus", "memory", "branch_workers", "branch_retries",
                                                                "compile_timeout", "test_timeout", "strict")})
            path = write_ledger(self.identity.path, ledger)
        except Exception as exc:
            self.end_lines.append(("programbench gold ledger", [f"not written: {exc!r}"]))
            return
        self.end_lines.append(("programbench gold ledger", [*ledger_lines(ledger), f"ledger: {path}"]))

    def _compare_and_package(self, session: pytest.Session) -> None:
        """--pb-compare BASE (compare.json/html; --pb-max-regression gates the exit status), then --pb-package (last:
        it splits each eval.json the official way). Neither changes a score; a failure of either is said."""
        if self.settings.compare:
            from pytest_programbench.results.compare import write

            try:
                written = write(Path(self.settings.compare[0]), self.identity.path, ledger=self.ledger,
                                max_regression=self.settings.max_regression)
            except Exception as exc:  # a gate that cannot be computed fails; a plain comparison is only said
                self.end_lines.append(("programbench compare", [f"comparison failed: {exc!r}"]))
                if self.settings.max_regression is not None:
                    self.end_failed = f"programbench: --pb-max-regression: no comparison ({exc})"
            else:
                self.end_lines.append(("programbench compare", written.lines()))
                self.end_failed = written.gate_failure
            if self.end_failed and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.settings.package:
            from pytest_programbench.results.package import PackageError, package

            try:
                packaged = package(self.identity.path)
            except PackageError as exc:
                self.end_lines.append(("programbench package", [f"not packaged: {exc}"]))
            else:
                self.end_lines.append(("programbench package", packaged.lines()))

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

    # -- xdist ------------------------------------------------------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[WORKERINPUT_KEY] = self.identity.as_dict()
        if self.identity.resumed:
            from pytest_programbench.run_record import WORKERINPUT_KEY as RESUMED_KEY

            node.workerinput[RESUMED_KEY] = public_settings(self.settings)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        """A worker died running a task: remove its containers, reschedule it within the infra budget, else error."""
        key = TaskKey.of_nodeid(crashitem)
        if key is None:
            return
        instance_id = key.name
        self.forget_task_containers(instance_id)
        crashes = self.crashes.setdefault(crashitem, [])
        crashes.append(str(report.longrepr))
        if len(crashes) <= self.settings.infra_retries:
            try:
                sched.mark_test_pending(crashitem)
            except NotImplementedError:
                pass  # this --dist mode cannot reschedule (use --dist load or worksteal)
            else:
                report.outcome = "rerun"  # type: ignore[assignment]
                log.warning("%s: rescheduled after a worker crash (%d of %d)", instance_id, len(crashes),
                            self.settings.infra_retries)
                return
        # An infrastructure error, in the error column: the item's own windows did not end it.
        report.when = "setup"
        report.longrepr = (f"infrastructure error: the xdist worker crashed {len(crashes)} time(s) while running "
                           f"it (run directory: {key.task_dir(self.identity.path)})\n" + "\n".join(crashes))

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
                docker_engine.sweep(self.identity.run_id, task=instance_id, engine=docker_engine.client(url))
            except EngineUnavailable as exc:  # the item's own error already says so
                log.debug("could not remove the containers of %s on %s: %s", instance_id, url or "default", exc)
            except Exception as exc:  # the session-end sweep and the reaper remain
                log.warning("could not remove the containers of %s: %s", instance_id, exc)

    # -- reporting --------------------------------------------------------------------------------------------

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        from importlib.metadata import version

        import programbench  # noqa: F401 - the version comes from its metadata

        per_language = Counter(t.language for t in self.selection.tasks)
        languages = ", ".join(f"{lang} {n}" for lang, n in sorted(per_language.items(), key=lambda kv: -kv[1]))
        lines = [
            f"programbench {version('programbench')}: {len(self.selection.tasks)} tasks selected ({languages})",
            f"programbench run {self.identity.run_id}: {self.identity.run_dir}",
        ]

        if self.identity.resumed:
            lines.append("programbench: resuming with the run's recorded settings (options given now replace them)")
        if config.stash.get(WORKSTEAL_DEFAULTED, False):
            lines.append("programbench: -n without --dist: using --dist worksteal (tasks take hours; pass --dist to "
                         "choose another mode)")
        overridden = [t.instance_id for t in self.selection.tasks if t.overridden]
        if overridden:
            lines.append(f"programbench overridden by --pb-tasks-dir: {', '.join(overridden)}")
        if self.agent_spec is not None:
            lines.append(f"programbench agent: {agent_label(self.agent_spec)}"
                         + (" (on the host)" if self.agent_spec.on_host else " (in the sandbox)"))
            if not self.collect_only:
                lines.append(f"programbench binary proxy client: {self._proxy_client_label()}")
                lines.append(f"programbench sandbox storage: {self._storage_label()}")
        if self.engines is not None:
            described = ", ".join(f"{spec.name}" + (f" ({spec.slots} slots)" if spec.slots else "")
                                  for spec in self.engines.specs)
            lines.append(f"programbench engines: {described}")
        elif not self.collect_only:
            from pytest_programbench.engine import docker_engine

            problem = docker_engine.preflight()
            if problem:
                lines.append(f"programbench: {problem} (every item will error)")
        return lines

    def _storage_label(self) -> str:
        """Whether the engine can limit a sandbox's writable layer: said up front where it cannot."""
        from pytest_programbench.engine import docker_engine
        from pytest_programbench.sandbox.sandbox import storage_limit, storage_quota

        limit = storage_limit()
        if not limit:
            return "no size limit asked (PB_SANDBOX_STORAGE=0)"
        try:
            return storage_quota(docker_engine.client().api).describe(limit)
        except EngineUnavailable as exc:
            return f"unknown ({exc})"

    def _proxy_client_label(self) -> str:
        """Built (or found in its cache) once here, so a fallback to the slow Python client is visible up front."""
        from pytest_programbench.sandbox.proxy_build import ProxyBuildError, build_client

        try:
            return build_client().label
        except (ProxyBuildError, OSError) as exc:
            return f"unavailable ({exc}); each sandbox will try again"

    # -- run lifecycle ----------------------------------------------------------------------------------------

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.pytest_session = session
        if not self.collect_only and self.settings.progress != "off":
            from pytest_programbench.results import progress

            self._close_progress = progress.attach(self, session)
        if self.collect_only or is_worker(self.config):
            return
        from importlib.metadata import version

        from pytest_programbench.engine import docker_engine
        from pytest_programbench.engine.reaper import reap_dead_runs
        from pytest_programbench.results.package import masked_command
        from pytest_programbench.run_record import RECORDED_KEY

        # Leftovers of dead runs (their controller is gone or their lifetime expired), never a live run's.
        for url in self.engine_urls():
            try:
                engine = docker_engine.client(url) if url is not None else None
            except EngineUnavailable as exc:
                log.warning("engine %s does not answer: %s", url, exc)
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

    @pytest.hookimpl(tryfirst=True, specname="pytest_sessionfinish")
    def pytest_sessionfinish_junit(self, session: pytest.Session) -> None:
        """The headline's numbers as JUnit suite properties (``programbench_*``), before junitxml writes the file:
        both means with their intervals, and under --pb-attempts the spread and pass@k."""
        xml = _junit_xml(self.config)
        if xml is None or self.summary is None or is_worker(self.config):
            return
        for name, value in junit_headline(self.summary).items():
            xml.add_global_property(f"programbench_{name}", value)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self._close_progress is not None:
            self._close_progress()
            self._close_progress = None
        if self.summary is not None and not is_worker(self.config):
            self.summary.set_in_flight({})
            self.summary.flush()  # a write its pacing deferred: the file is final before anything reads it
            self._write_report()
        if self.preflight is not None and self.preflight.missing and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.collect_only or is_worker(self.config):
            return
        self._check_min_mean(session)
        self._write_gold_ledger()
        self._compare_and_package(session)
        from pytest_programbench.engine import docker_engine

        for url in self.engine_urls():
            try:
                report = docker_engine.sweep(self.identity.run_id, engine=docker_engine.client(url))
            except EngineUnavailable as exc:  # its reaper will, once it answers again
                log.warning("could not sweep run %s on %s: %s", self.identity.run_id, url or "the engine", exc)
                continue
            if report.errors:
                log.warning("sweep of run %s left: %s", self.identity.run_id, "; ".join(report.errors))
        from pytest_programbench.engine import backpressure

        backpressure.release_run(self.identity.run_id)
