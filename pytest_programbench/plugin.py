"""pytest entry point (``pytest11``): thin hooks only. Heavy modules are imported when a session opts in."""

from __future__ import annotations

import pytest

from pytest_programbench import options

SESSION_PLUGIN = "programbench-session"


def pytest_addoption(parser: pytest.Parser) -> None:
    options.register(parser)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    from pytest_programbench import markers

    markers.register_static(config)
    if not _opted_in(config):
        return
    from pytest_programbench.session import ProgramBenchSession

    config.pluginmanager.register(ProgramBenchSession.from_config(config), SESSION_PLUGIN)


def _opted_in(config: pytest.Config) -> bool:
    """Any ``--pb-*`` flag opts in; so does ini ``pb_enable`` when pytest runs from the rootdir with no path."""
    if options.given_on_command_line(config):
        return True
    if not options.to_bool(config.getini("pb_enable")):
        return False
    no_explicit_path = config.args_source != pytest.Config.ArgsSource.ARGS
    return no_explicit_path and config.invocation_params.dir == config.rootpath
