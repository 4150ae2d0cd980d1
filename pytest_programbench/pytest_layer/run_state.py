"""The run's state before anything runs, checked once as plain data: the session's settings (from the options and a
resumed run's record), its selection of tasks and its identity, each combination the user cannot mean refused by a
named check (as pytest-timeout's ``_validate_*``), so a mistake is a usage error before any agent time is spent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_programbench.agents.agent import AgentEnvError, agent_env
from pytest_programbench.core.run_identity import RunIdentity
from pytest_programbench.core.settings import Settings
from pytest_programbench.core.task_key import SUITE_NAME, TaskKey
from pytest_programbench.pytest_layer.invocation import is_listing, is_worker, named_tasks
from pytest_programbench.pytest_layer.run_record import check_resumable, new_identity
from pytest_programbench.pytest_layer.stash import WORKERINPUT_IDENTITY
from pytest_programbench.pytest_layer.warned_at import ProgramBenchWarning, option_place, warn_at
from pytest_programbench.relay.relay import RelayConfigError, Upstream
from pytest_programbench.results.compare import CompareError, check_run
from pytest_programbench.tasks.catalogue import Catalogue, CatalogueError
from pytest_programbench.tasks.selection import Selection, select

NOTHING_TO_RUN = (
    "the ProgramBench suite is selected but there is nothing to run: pass --pb-agent CMD to run an agent, or "
    "--pb-submissions DIR to evaluate existing submissions (add --co to only list the tasks)"
)

AGENT_AND_SUBMISSIONS = (
    "--pb-agent and --pb-submissions exclude each other: --pb-submissions evaluates existing submissions without "
    "running an agent; drop one of them"
)


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
