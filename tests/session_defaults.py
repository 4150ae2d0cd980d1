"""The suite's own default for the sessions its tests start: the hidden-test audit off, unless the test keeps it.

The audit (``--pb-audit-hidden-tests``, on for users) runs a passing task's hidden tests once more, which cost the
suite about a third of its time when every session paid it. Tests of the audit, README's commands run as written, and
tests that read what the audit adds keep it with the marker ``users_defaults`` (conftest.py then sets
``KEEP_AUDIT``). Loaded like the network guard, through ``PYTEST_PLUGINS``, in every session a test starts.
"""

from __future__ import annotations

import os

import pytest

KEEP_AUDIT = "PB_SUITE_KEEP_AUDIT"
AUDIT_OPTION = "--pb-audit-hidden-tests"
# The modes that run nothing and refuse any option of a run (results/compare.py, results/foreign_runs.py).
RUNS_NOTHING = ("--pb-compare", "--pb-report")


def with_suite_defaults(args: list[str]) -> list[str]:
    """``args`` with the audit off, for a session that is a ProgramBench run and does not choose the audit itself.

    A session with no ``--pb-*`` option is left alone: adding one would opt it in to ProgramBench items. So is one
    that compares or reports finished runs.
    """
    if not any(arg.startswith("--pb-") for arg in args) or any(arg.startswith((AUDIT_OPTION, *RUNS_NOTHING))
                                                               for arg in args):
        return args
    return [*args, f"{AUDIT_OPTION}=off"]


def pytest_load_initial_conftests(early_config: pytest.Config, args: list[str], parser: pytest.Parser) -> None:
    # In place: pytest parses this same list once the initial conftests are loaded.
    if os.environ.get(KEEP_AUDIT) != "1":
        args[:] = with_suite_defaults(args)
