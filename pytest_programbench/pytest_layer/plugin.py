"""pytest entry point (``pytest11``): thin hooks only. Heavy modules are imported when a session opts in (one door, in
``pytest_configure``), or when ``--pb-compare BASE,NEW``/``--pb-report`` runs a front door."""

from __future__ import annotations

import pytest

from pytest_programbench.pytest_layer import fixtures, invocation, markers, newhooks, options
from pytest_programbench.pytest_layer.stash import SESSION, WORKSTEAL_DEFAULTED

SESSION_PLUGIN = "programbench-session"  # the session object is also a plugin: its hooks run only when opted in
SCHEDULING_PLUGIN = "programbench-scheduling"  # pytest_layer/scheduling_hooks.py: longest first
FIXTURES_PLUGIN = "programbench-fixtures"  # fixtures.py: one fixture per pipeline step


def pytest_addoption(parser: pytest.Parser) -> None:
    options.register(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """The plugin's own hooks (prompt, agent environment, task outcome, summary): see newhooks.py."""
    pluginmanager.add_hookspecs(newhooks)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """The options are known now: ``--pb-tasks-dir DIR`` must not have moved the rootdir (see invocation.py)."""
    invocation.settle_rootdir(early_config)


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> object:
    """``-n`` without ``--dist``: work stealing (items take hours, xdist's default pre-splits them in chunks).

    A wrapper, so this runs before xdist's own hook turns a bare ``-n`` into ``--dist load`` (and before any
    ``pytest_configure``, so ``--pb-preflight``'s collect-only mode keeps xdist from starting workers)."""
    option = config.option
    invocation.take_node_ids(config)  # ``pytest programbench::<id>``: a selection, not a file to look for
    # --pb-preflight lists the selection like --co, then checks it: nothing runs (and xdist starts no workers).
    if options.to_bool(options.raw_value(config, options.BY_DEST["pb_preflight"])) and opted_in(config):
        option.collectonly = True
    if (getattr(option, "numprocesses", None) and getattr(option, "dist", None) == "no"
            and not getattr(option, "distload", False) and not hasattr(config, "workerinput")
            and opted_in(config)):
        option.dist = "worksteal"
        config.stash[WORKSTEAL_DEFAULTED] = True
    return (yield)


@pytest.hookimpl(tryfirst=True, specname="pytest_cmdline_main")
def pytest_cmdline_main_compare(config: pytest.Config) -> int | None:  # pytest reads pytest_* names only
    """``--pb-compare BASE,NEW``: two finished runs compared from their files; ``--pb-report DIR``: report.html for a
    foreign run. Nothing is collected or run."""
    if config.getoption(options.BY_DEST["pb_report"].dest, None) is not None:
        from pytest_programbench.pytest_layer.front_doors import report_foreign_run  # noqa: PLC0415 - lazy: Jinja2, scipy

        return report_foreign_run(config)
    opt = options.BY_DEST["pb_compare"]
    raw = config.getoption(opt.dest, None)
    if raw is None or len(opt.parse(raw)["compare"]) < 2:
        return None
    from pytest_programbench.pytest_layer.front_doors import compare_finished_runs  # noqa: PLC0415 - lazy: Jinja2, scipy

    return compare_finished_runs(config)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    markers.register_static(config)
    # Always: ``pytest --fixtures`` lists the steps; without opt-in they fail with a message saying how to opt in.
    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, FIXTURES_PLUGIN)
    if not opted_in(config):
        return
    # lazy: a session that opts in imports the pipeline and its wings (docker, programbench, rich); others never do
    # (``from <module> import <name>``: a module's attribute of the package could be an earlier in-process run's)
    from pytest_programbench.pytest_layer.scheduling_hooks import SchedulingPlugin  # noqa: PLC0415
    from pytest_programbench.pytest_layer.session import ProgramBenchSession  # noqa: PLC0415

    session = ProgramBenchSession.from_config(config)
    config.stash[SESSION] = session
    session.register(config.pluginmanager, SESSION_PLUGIN)
    # the order tasks start in
    config.pluginmanager.register(SchedulingPlugin(session), SCHEDULING_PLUGIN)


NOTHING_ASKED = ("programbench: no tasks collected, none was asked for: any --pb-* option (e.g. --pb-language go), a "
                 "programbench::<id> argument or ini pb_enable = true selects them")


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> str | None:
    """Nothing selected and no task asked for: ``pytest --co -q`` or ``-k pandoc`` beside another suite would otherwise
    say only "no tests collected". Not on xdist's controller, which collects nothing itself."""
    if items or opted_in(config) or config.pluginmanager.has_plugin("dsession"):
        return None
    return NOTHING_ASKED


def opted_in(config: pytest.Config) -> bool:
    """Any ``--pb-*`` flag or a ``programbench::<id>`` argument opts in; so does ini ``pb_enable`` when pytest runs
    from the rootdir with no path."""
    if options.given_on_command_line(config) or invocation.suite_named(config):
        return True
    if not options.to_bool(config.getini("pb_enable")):
        return False
    no_explicit_path = config.args_source != pytest.Config.ArgsSource.ARGS
    return no_explicit_path and config.invocation_params.dir == config.rootpath
