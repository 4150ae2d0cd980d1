"""The suite's session defaults (tests/session_defaults.py): the sessions a test starts run without the hidden-test
audit, unless the test is marked ``users_defaults``; a session that is not a ProgramBench run is left alone."""

from __future__ import annotations

import pytest

from tests.session_defaults import with_suite_defaults

SHOW_AUDIT = """
def pytest_configure(config):
    print("audit option:", config.getoption("pb_audit_hidden_tests"))
"""


def test_only_a_programbench_run_that_does_not_choose_gets_the_audit_off() -> None:
    assert with_suite_defaults(["--pb-agent", "true", "-n", "2"]) == [
        "--pb-agent", "true", "-n", "2", "--pb-audit-hidden-tests=off"]
    assert with_suite_defaults(["-q", "tests"]) == ["-q", "tests"], "no --pb-* option: not opted in, left alone"
    assert with_suite_defaults(["--pb-agent", "true", "--pb-audit-hidden-tests", "on"])[-1] == "on"
    for finished in (["--pb-compare", "a,b"], ["--pb-report=a"]):
        assert with_suite_defaults(finished) == finished, "runs nothing: refuses any option of a run"


def test_a_session_a_test_starts_has_the_audit_off(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SHOW_AUDIT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-filter", "none-such", "--co", "-s")
    result.stdout.fnmatch_lines(["audit option: off"])


@pytest.mark.users_defaults
def test_a_test_marked_users_defaults_keeps_the_users_default(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SHOW_AUDIT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-filter", "none-such", "--co", "-s")
    result.stdout.fnmatch_lines(["audit option: None"])
