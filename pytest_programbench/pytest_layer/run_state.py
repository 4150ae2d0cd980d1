"""The run's state apart from the session's hooks (``RunState``), made once before anything runs: the settings (from
the options and a resumed run's record), the selection of tasks and the identity, each combination the user cannot
mean refused by a named check (as pytest-timeout's ``_validate_*``), so a mistake is a usage error before any agent
time is spent; then the agent, the engines, the summary."""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Self

import pytest

from pytest_programbench.agents import mini_swe_agent
from pytest_programbench.agents.agent import AgentEnvError, AgentSpec, agent_env
from pytest_programbench.core.run_identity import RunIdentity, public_settings
from pytest_programbench.core.settings import Settings
from pytest_programbench.core.task_key import SUITE_NAME, TaskKey
from pytest_programbench.engine import docker_engine, runtimes
from pytest_programbench.engine.backpressure import Backpressure
from pytest_programbench.engine.docker_engine import EngineRun, Engines
from pytest_programbench.engine.engines import EnginePool, parse_docker_hosts
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.evaluation.container_layer import evaluation_budget
from pytest_programbench.pytest_layer import options
from pytest_programbench.pytest_layer.invocation import is_listing, is_worker, named_tasks
from pytest_programbench.pytest_layer.markers import register_languages
from pytest_programbench.pytest_layer.run_record import WORKERINPUT_IDENTITY, check_resumable, for_session, new_identity
from pytest_programbench.pytest_layer.warned_at import ProgramBenchWarning, option_place, warn_at
from pytest_programbench.relay.contract import RelayConfigError, Upstream
from pytest_programbench.relay.spend import SPEND_DIR, RunBudget
from pytest_programbench.results.artifacts import TaskArtifacts
from pytest_programbench.results.compare import CompareError, check_run
from pytest_programbench.results.gold import Ledger, LedgerError
from pytest_programbench.results.package import masked_command
from pytest_programbench.results.summary import RunSummary, TaskRecord
from pytest_programbench.tasks.catalogue import Catalogue, CatalogueError, Task
from pytest_programbench.tasks.selection import Selection, select
from pytest_programbench.tasks.submissions import SubmissionsDir

if TYPE_CHECKING:
    from pytest_programbench.pytest_layer.preflight import PreflightReport
    from pytest_programbench.results.progress import Publisher

log = logging.getLogger(__name__)


NOTHING_TO_RUN = (
    "the ProgramBench suite is selected but there is nothing to run: pass --pb-agent CMD to run an agent, or "
    "--pb-submissions DIR to evaluate existing submissions (add --co to only list the tasks)"
)

AGENT_AND_SUBMISSIONS = (
    "--pb-agent and --pb-submissions exclude each other: --pb-submissions evaluates existing submissions without "
    "running an agent; drop one of them"
)


def agent_label(spec: AgentSpec, width: int = 80) -> str:
    """What the header calls the agent: a preset by name (a CLI preset with its version), a command as typed."""
    if spec.kind == "cli":
        return f"{spec.label} (preset)"
    if spec.kind != "command":
        return spec.label
    text = " ".join(spec.command.split())
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def load_selection(config: pytest.Config, settings: Settings) -> tuple[Catalogue, Selection]:
    """The tasks (the official catalogue and any ``--pb-tasks-dir``) and the selection the options and node ids make;
    a malformed task or an empty selection is a usage error."""
    try:
        catalogue = Catalogue.load(settings.tasks_dirs, include_fixtures=settings.include_fixtures)
    except CatalogueError as exc:
        raise pytest.UsageError(f"malformed task: {exc}") from None
    selection = select(catalogue, languages=settings.languages, difficulties=settings.difficulties,
                       filter_spec=settings.filter, slice_spec=settings.slice, shuffle_seed=settings.shuffle)
    named = named_tasks(config)
    if named is not None:
        selection = narrow_to(selection, catalogue, named)
    if not selection.tasks:
        raise pytest.UsageError(f"no ProgramBench task matched: {selection.why_empty}")
    return catalogue, selection


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


def validate(config: pytest.Config, settings: Settings) -> None:
    """Every check of the settings as a whole, in the order a user meets them."""
    _validate_work(config, settings)
    _validate_gold(settings)
    _validate_flaky(settings)
    _validate_agent_or_submissions(settings)
    _validate_budget(settings)
    _validate_compare(config, settings)


def _validate_work(config: pytest.Config, settings: Settings) -> None:
    if not is_listing(config) and not settings.agent and not settings.submissions and not settings.gold:
        raise pytest.UsageError(NOTHING_TO_RUN)


def _validate_gold(settings: Settings) -> None:
    if settings.gold and (settings.agent or settings.submissions or settings.attempts > 1):
        raise pytest.UsageError("--pb-gold N evaluates the reference itself: it runs no agent and takes no "
                                "submissions (drop --pb-agent, --pb-submissions and --pb-attempts)")


def _validate_flaky(settings: Settings) -> None:
    if settings.ignore_flaky and not settings.gold_ledger:
        raise pytest.UsageError("--pb-ignore-flaky needs --pb-gold-ledger FILE: the ledger's tests are ignored")


def _validate_agent_or_submissions(settings: Settings) -> None:
    if settings.agent and settings.submissions:
        raise pytest.UsageError(AGENT_AND_SUBMISSIONS)


def _validate_budget(settings: Settings) -> None:
    if settings.budget is not None and settings.token_price is None:
        raise pytest.UsageError("--pb-budget USD needs --pb-token-price IN,OUT: the price of the metered tokens")


def _validate_compare(config: pytest.Config, settings: Settings) -> None:
    if settings.max_regression is not None and not settings.compare:
        raise pytest.UsageError("--pb-max-regression X needs --pb-compare BASE: the run the regression is "
                                "measured against")
    if settings.compare and not config.option.collectonly:
        try:  # before any agent time is spent: the baseline must be readable at the end
            check_run(Path(settings.compare[0]))
        except CompareError as exc:
            raise pytest.UsageError(f"--pb-compare: {exc}") from None


def validate_agent_inputs(settings: Settings) -> None:
    """Bad agent inputs are usage errors before anything runs, not an error per item."""
    try:
        agent_env(settings.agent_env)
    except AgentEnvError as exc:
        raise pytest.UsageError(str(exc)) from None
    if settings.prompt_template and not Path(settings.prompt_template).is_file():
        raise pytest.UsageError(f"--pb-prompt-template: {settings.prompt_template} is not a file")
    if settings.model_endpoint:
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


def warn_thread_timeout(config: pytest.Config) -> None:
    """pytest-timeout's thread method would take a whole worker down: said once, where the option was set."""
    method = config.getoption("timeout_method", None) or config.getini("timeout_method")
    if method == "thread":
        warn_at(config, ProgramBenchWarning(
            "pytest-timeout's thread method os._exit()s the whole worker when it fires; ProgramBench items use "
            "the signal method regardless (their markers say so), other tests of this session do not"),
            *option_place(config, "timeout_method", "timeout_method"))


def identity_for(config: pytest.Config, settings: Settings) -> RunIdentity:
    """A worker's identity is its controller's; the controller makes a new run's or checks a resumed one's."""
    if is_worker(config):
        return RunIdentity.from_dict(config.workerinput[WORKERINPUT_IDENTITY])  # type: ignore[attr-defined]
    # pb-runs/ where pytest was invoked, as a relative --pb-output is: not under a rootdir that moves.
    identity = new_identity(config.invocation_params.dir, output=settings.output, resume=settings.resume)
    if identity.resumed:
        check_resumable(identity, settings)
    return identity


# Slack above the sum of an item's own clocks for container start-up, image and blob work, packing.
TIMEOUT_MARGIN = 600


def item_timeout(task: Task, settings: Settings) -> int:
    """Every clock the item may legitimately wait on, plus a margin: the outer backstop must never fire first.
    The evaluation's part counts every step's own clock (the official's per-step timeouts included), so a
    submission that makes every step run to its clock still ends by those clocks, scored."""
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


DESELECTED_NAMED = 3  # tasks without a submission named in the header line; the rest counted


def forgotten_tasks_dir(submissions: SubmissionsDir, selected: Sequence[Task]) -> None:
    """Submissions of tasks the catalogue lacks and none for a selected task: tasks of the user's own whose
    ``--pb-tasks-dir`` was forgotten. Without this, every task deselected, an empty report and exit 5."""
    unknown = submissions.unknown_ids
    if not unknown or any(submissions.has(t.instance_id) for t in selected):
        return
    shown = ", ".join(unknown[:3]) + (f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else "")
    raise pytest.UsageError(
        f"--pb-submissions: {submissions.root} holds tasks that are not in the catalogue ({shown}) and none for a "
        "selected task; tasks of your own need --pb-tasks-dir DIR (the folder holding <id>/task.yaml, tests.json)")


class RunState:
    """The opted-in session's state, apart from its hooks (``session.ProgramBenchSession`` adds those): settings,
    selection, identity, agent, engines, summary. Its companions (reporting, stops, xdist, scheduling, progress, the
    items and fixtures) are typed against it."""

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
        # This process's engines: owner labels on everything it creates, the cross-worker cap on heavy engine calls
        # (listing only: nothing runs, nothing is labelled or capped). Clients are made at first use, per process.
        run = (EngineRun(None, Backpressure(0)) if self.collect_only
               else EngineRun.for_run(identity, concurrency=settings.docker_concurrency, runtime=settings.runtime))
        self.docker_engines = Engines(run)
        self.summary: RunSummary | None = None
        self.progress: Publisher | None = None  # this process's phase publisher (--pb-progress)
        self.pytest_session: pytest.Session | None = None
        self.preflight: PreflightReport | None = None
        self.agent_spec: AgentSpec | None = None
        self.agent_command_checked = False  # by this process's first agent run (agents/command_check.py)
        if settings.agent and not settings.submissions:
            self.agent_spec = AgentSpec.parse(settings.agent, on_host=settings.agent_on_host)
            if not self.collect_only:
                validate_agent_inputs(settings)
            if self.agent_spec.kind == "mini-swe-agent" and not self.collect_only:
                mini_swe_agent.preflight(settings)
        self.ledger: Ledger | None = None  # --pb-gold-ledger
        if settings.gold_ledger:
            try:
                self.ledger = Ledger.load(Path(settings.gold_ledger))
            except LedgerError as exc:
                raise pytest.UsageError(f"--pb-gold-ledger: {exc}") from None
        self.engines: EnginePool | None = None  # --pb-docker-host: tasks spread over these engines
        if settings.docker_hosts:
            self.engines = EnginePool.for_run(parse_docker_hosts(settings.docker_hosts), identity.run_id,
                                              sandbox_cpus=settings.sandbox_cpus, engines=self.docker_engines)
        if settings.runtime and not self.collect_only and self.worker_id == "controller":
            self.require_runtime(settings.runtime)
        self.submissions: SubmissionsDir | None = None
        self.without_submission: list[str] = []
        if settings.submissions:
            self.submissions = SubmissionsDir(Path(settings.submissions), catalogue)
            forgotten_tasks_dir(self.submissions, selection.tasks)
            if not settings.require_all:
                self.without_submission = [t.instance_id for t in selection.tasks
                                           if not self.submissions.has(t.instance_id)]

    @classmethod
    def from_config(cls, config: pytest.Config) -> Self:
        # --pb-resume DIR alone: the run's recorded settings, under what the user gave explicitly.
        settings = for_session(config, options.parse(config))
        catalogue, selection = load_selection(config, settings)
        validate(config, settings)
        register_languages(config, {t.language for t in catalogue})
        warn_thread_timeout(config)
        return cls(config, settings, catalogue, selection, identity_for(config, settings))

    def start_summary(self, node_ids: list[str]) -> None:
        if self.summary is not None or self.collect_only or is_worker(self.config):
            return
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

    def deselected_lines(self) -> list[str]:
        """What the header says of selected tasks that have no submission (--pb-submissions without
        --pb-require-all)."""
        if not self.without_submission:
            return []
        # A few names: every evaluate-only run of part of the catalogue says this, once, in the header.
        shown = ", ".join(self.without_submission[:DESELECTED_NAMED])
        left = len(self.without_submission) - DESELECTED_NAMED
        more = f" (+{left} more; --pb-require-all makes a missing one an error)" if left > 0 else ""
        return [f"programbench: {len(self.without_submission)} selected tasks have no submission in "
                f"{self.settings.submissions} and were deselected: {shown}{more}"]

    def require_runtime(self, runtime: str) -> None:
        """--pb-runtime on an engine that lacks it would error every task: a usage error naming the engine, now. An
        engine that does not answer is left to the items (their infrastructure error says so)."""
        for url in self.engine_urls():
            try:
                api = self.docker_engines.client(url).api
                problem = runtimes.missing(api, runtime, self.docker_engines.get(url).name)
            except EngineUnavailable:
                continue
            if problem:
                raise pytest.UsageError(problem)

    def engine_urls(self, *, up_only: bool = False) -> list[str | None]:
        """Every engine this run may use (``None``: the environment's); ``up_only``: not those marked down."""
        if self.engines is None:
            return [None]
        pool = self.engines
        return [spec.url for spec in pool.specs if not up_only or pool.down_reason(spec) is None]

    def forget_task_containers(self, instance_id: str) -> None:
        """Remove what an aborted attempt left behind, before the task runs again (on every engine of the run);
        ``instance_id`` is the item's name (its containers' task label: one attempt's, not its siblings')."""
        for url in self.engine_urls(up_only=True):  # a down engine's leftovers: reaped when it is used again
            try:
                docker_engine.sweep(self.identity.run_id, task=instance_id, engine=self.docker_engines.client(url))
            except EngineUnavailable as exc:  # the item's own error already says so
                log.debug("could not remove the containers of %s on %s: %s", instance_id, url or "default", exc)
            except Exception as exc:  # the session-end sweep and the reaper remain
                log.warning("could not remove the containers of %s: %s", instance_id, exc)
