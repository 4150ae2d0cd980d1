"""How a command line reaches the plugin: option values written as their own word, node ids given as arguments, and
pytest's listings (``--fixtures``, ``--markers``, ``--fixtures-per-test``).

pytest finds its rootdir and ini file before any plugin's options are known, so in ``--pb-tasks-dir /data/tasks``
the value reads as a path to test: the rootdir moves (to ``/data``, or the common ancestor with the invocation
directory), and with it how node ids are shown, where conftest files are cut off and which ini file is read, while
``--pb-tasks-dir=/data/tasks`` leaves them alone. Once the options are known the set-up is worked out again, as pytest
would have had it known them.
"""

from __future__ import annotations

import copy
import os
import shlex
from collections.abc import Sequence
from pathlib import Path

import pytest
from _pytest.config.findpaths import determine_setup

from pytest_programbench.core import environment
from pytest_programbench.core.task_key import SUITE_NAME
from pytest_programbench.pytest_layer import options

# Node ids given as arguments (``programbench::<id>``; ``()`` when the whole suite was named): the selection.
NODE_IDS = pytest.StashKey[tuple[str, ...]]()
# pytest's listings: they show what a session would have, and run nothing.
LISTINGS = ("showfixtures", "show_fixtures_per_test", "markers")


def is_listing(config: pytest.Config) -> bool:
    """``--co``, ``--fixtures``, ``--fixtures-per-test``, ``--markers``: nothing runs, no run directory is made."""
    return bool(config.option.collectonly) or any(getattr(config.option, name, False) for name in LISTINGS)


# ---------------------------------------------------------------------------------------------- the rootdir


def _separate_values(args: Sequence[str]) -> bool:
    """Whether one of our options is followed by its value as the next word (the spelling that moves the rootdir)."""
    takes_value = {o.flag for o in options.OPTIONS if o.kind != "bool"}
    return any(word in takes_value for word in args[:-1])


def settle_rootdir(config: pytest.Config) -> None:
    """Work out the rootdir, ini file and conftest cut-off again, with our options' values no longer read as paths.

    Called once the plugin's options are registered (``pytest_load_initial_conftests``); pytest's own first try took
    ``PYTEST_ADDOPTS`` and the command line, before the ini's ``addopts``, and so does this one."""
    args = [*shlex.split(environment.PYTEST_ADDOPTS.raw()), *config.invocation_params.args]
    if not _separate_values(args):
        return
    parser = config._parser
    ns = parser.parse_known_args(args, namespace=copy.copy(config.option))
    rootpath, inipath, inicfg, ignored = determine_setup(
        inifile=ns.inifilename, override_ini=config.known_args_namespace.override_ini, args=ns.file_or_dir,
        rootdir_cmd_arg=ns.rootdir or None, invocation_dir=config.invocation_params.dir)
    if (rootpath, inipath) == (config.rootpath, config.inipath):
        return
    config._rootpath = rootpath
    config._inipath = inipath
    config._inicfg = inicfg
    config._ignored_config_files = ignored
    config._inicache.clear()
    parser.extra_info["rootdir"] = str(rootpath)
    parser.extra_info["inifile"] = str(inipath)
    if ns.confcutdir is None:  # pytest's default, from the set-up it had found: the same rule on the right one
        config.known_args_namespace.confcutdir = str(inipath.parent if inipath is not None else rootpath)


# ---------------------------------------------------------------------------------------------- node ids as arguments


def _suite_part(config: pytest.Config, arg: str) -> str | None:
    """``arg``'s part after the suite (``""``: the suite itself) when it names ``programbench``, else None.

    ``programbench`` itself, or a path to the suite's virtual place under the rootdir: pytest writes node ids relative
    to the invocation directory (``../programbench::<id>`` below the rootdir), so one copied from a FAILED line works
    where it was copied."""
    path, sep, rest = arg.partition("::")
    if not path:
        return None
    where = Path(os.path.normpath(config.invocation_params.dir / path))
    if (path != SUITE_NAME and where != config.rootpath / SUITE_NAME) or where.exists():
        return None  # a real path: pytest's to resolve
    return rest if sep else ""


def take_node_ids(config: pytest.Config) -> None:
    """Node ids of the suite given as arguments (``pytest programbench::<id> ...``) become the selection: taken out
    of ``config.args`` (pytest would look for a file called ``programbench``) and kept in ``NODE_IDS``."""
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        return
    named: list[str] = []
    whole = False
    kept: list[str] = []
    for arg in config.args:
        part = _suite_part(config, arg)
        if part is None:
            kept.append(arg)
        elif part:
            named.append(part)
        else:
            whole = True
    if len(kept) == len(config.args):
        return
    config.args = kept
    config.stash[NODE_IDS] = () if whole else tuple(dict.fromkeys(named))


def named_tasks(config: pytest.Config) -> tuple[str, ...] | None:
    """The instance ids named as arguments (None: none named, or the whole suite)."""
    named = config.stash.get(NODE_IDS, None)
    return named or None


def suite_named(config: pytest.Config) -> bool:
    """Whether the suite, or tasks of it, were named as arguments (that opts the session in)."""
    return NODE_IDS in config.stash


def is_worker(config: pytest.Config) -> bool:
    """An xdist worker's session (the controller and a plain session are not)."""
    return hasattr(config, "workerinput")
