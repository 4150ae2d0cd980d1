"""Rough edges a new user met (issue 32 §4), each through a real pytest session.

``-k``/``-m`` that leave none of the selected tasks say why and name the tasks outside the selection that match
(in the checkout, whose conftest.py narrows the default to the test bed, and with options the user typed); the
header says one thing about the schedule and names no run folder that is never made; the terminal summary gives
each mean once, under 100 columns; warnings point at what the user wrote; an agent command that does not exist is
an error in the first sandbox and ends the session before anything is evaluated; a failure's message gives its cause
before its per-test lines. The bad inputs that became usage errors are rows of test_bad_inputs.py's table.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import REPO, Testbed

pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.timeout(600)]

PANDOC = "jgm__pandoc.5caad90"  # the benchmark's one Haskell task
GO_TASK = "antonmedv__fx.86d0d34"
RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"
TUIISH = "pbfix__tuiish.7e1a0b2"
WIDTH = 100


def _testbed_args(testbed: Testbed, run_dir: Path, *extra: str) -> list[str]:
    return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-pull", "never", "--pb-cpus", "2", "--pb-output", str(run_dir),
            "--junitxml", str(run_dir.parent / "junit.xml"), *extra]


# ---------------------------------------------------------------------------------------------- -k / -m


def _in_checkout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_keyword_matching_nothing_in_the_checkout_says_why_and_what_would_match() -> None:
    done = _in_checkout("-k", "pandoc", "--co", "-q")
    assert done.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    hint = lines[lines.index("programbench: -k pandoc matched none of the 3 selected tasks: -k and -m only choose "
                             "among the selected ones"):]
    assert hint[1:5] == [
        "  the selection: --pb-filter pbfix__ (set by a conftest.py, not on the command line)",
        f"  outside it, -k pandoc matches 1 task(s): {PANDOC}",
        f"  to run them: pytest programbench::{PANDOC}",
        "  or give a selection option of your own: --pb-filter '.*' selects every task, -k pandoc then narrows them",
    ], hint
    assert hint[5].startswith("no tests collected (3 deselected)"), hint
    # Both ways it offers work as written (the conftest.py no longer narrows a session that names its tasks).
    named = _in_checkout(f"programbench::{PANDOC}", "--co", "-q")
    assert named.returncode == 0, named.stdout[-3000:] + named.stderr[-3000:]
    assert f"programbench::{PANDOC}" in named.stdout.splitlines()
    widened = _in_checkout("--pb-filter", ".*", "-k", "pandoc", "--co", "-q")
    assert widened.returncode == 0, widened.stdout[-3000:] + widened.stderr[-3000:]
    assert [line for line in widened.stdout.splitlines() if "::" in line] == [f"programbench::{PANDOC}"]


def test_a_selection_the_user_typed_is_named_with_what_to_change(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-language", "go", "-k", "pandoc", "--co",
                                           "-q")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines([
        "programbench: -k pandoc matched none of the 46 selected tasks: -k and -m only choose among the selected ones",
        "  the selection: --pb-language go",
        f"  outside it, -k pandoc matches 1 task(s): {PANDOC}",
        "  to run them, widen or drop --pb-language go",
    ])
    marks = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-language", "go", "-m", "lang_haskell",
                                          "--co", "-q")
    marks.stdout.fnmatch_lines([
        "programbench: -m lang_haskell matched none of the 46 selected tasks*",
        f"  outside it, -m lang_haskell matches 1 task(s): {PANDOC}",
    ])
    # Nowhere: said too; a keyword that keeps a task: nothing said.
    nowhere = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-language", "go", "-k", "xyzzy", "--co")
    nowhere.stdout.fnmatch_lines(["  no task outside it matches either (200 tasks in the catalogue)"])
    kept = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-language", "go", "-k", "fx", "--co", "-q")
    assert f"programbench::{GO_TASK}" in kept.stdout.str()
    assert "matched none" not in kept.stdout.str()


# ---------------------------------------------------------------------------------------------- the header


def test_preflight_names_no_run_folder(pytester: pytest.Pytester, testbed: Testbed) -> None:
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*_testbed_args(testbed, run_dir, "--pb-filter", RPN, "--pb-submissions",
                                                          str(testbed.submissions), "--pb-preflight"))
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["programbench run *: no run directory (--pb-preflight checks the selection: "
                                 "nothing runs)"])
    assert str(run_dir) not in result.stdout.str()
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------- the summary

# The pipeline replaced by a stub (README "Customising"): rpn scores 1, catlike 0.5, tuiish is an error.
STUB = textwrap.dedent("""
    import pytest
    from pytest_programbench.results.verdict import InfrastructureError, TaskOutcome

    @pytest.fixture
    def pb_outcome(pb_task):
        scores = {"pbfix__rpn.0b5e55e": 1.0, "pbfix__catlike.c47c47c": 0.5}
        if pb_task.instance_id not in scores:
            raise InfrastructureError("the engine went away")
        return TaskOutcome(pb_task.instance_id, scores[pb_task.instance_id], 2, 2)
""")


def test_the_summary_says_each_mean_once_within_100_columns(pytester: pytest.Pytester, testbed: Testbed) -> None:
    pytester.makeconftest(STUB)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*_testbed_args(testbed, run_dir, "--pb-filter", "pbfix__", "--pb-agent",
                                                          "true", "--pb-infra-retries", "0"))
    result.assert_outcomes(passed=1, failed=1, errors=1)
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if line.startswith("mean over "))
    end = next(i for i, line in enumerate(lines) if line.startswith("tokens: "))
    block = lines[start:end]
    assert [line.split(":")[0] for line in block if not line.startswith(" ")] == [
        "mean over scored tasks", "mean over the selection"], block
    result.stdout.fnmatch_lines([
        "mean over scored tasks:  0.750, 95% CI [[]0.500, 1.000[]] (2 scored)",
        "mean over the selection: 0.500, 95% CI [[]0.000, 1.000[]] (3 selected; the 1 unscored count as 0)",
        "  95% CI: bootstrap percentile, 9999 resamples, seed *, over 2 tasks (one attempt per task:*",
    ])
    too_wide = [line for line in block if len(line) >= WIDTH]
    assert not too_wide, too_wide


# ---------------------------------------------------------------------------------------------- warnings


def _warnings(result: pytest.RunResult) -> list[str]:
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "warnings summary" in line)
    return lines[start + 1:next(i for i, line in enumerate(lines) if line.startswith("-- Docs: "))]


def test_warnings_point_at_what_the_user_wrote(pytester: pytest.Pytester, testbed: Testbed) -> None:
    ini_file = pytester.makeini("[pytest]\ntimeout_method = thread\n")  # tox.ini
    ini = _warnings(pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-filter", "jgm", "--co"))
    assert ini[0] == f"{ini_file.name}:2", ini
    assert ini[1].endswith(f"{ini_file.name}:2: ProgramBenchWarning: pytest-timeout's thread method os._exit()s the "
                           "whole worker when it fires; ProgramBench items use the signal method regardless (their "
                           "markers say so), other tests of this session do not"), ini
    assert ini[2].strip() == "timeout_method = thread", ini
    ini_file.unlink()
    typed = _warnings(pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-filter", "jgm", "--co",
                                                    "--timeout-method", "thread"))
    assert typed[0] == "<command line>:0", typed
    subs = pytester.mkdir("subs")
    shutil.copytree(testbed.submissions / CATLIKE, subs / CATLIKE)
    (subs / "nobody__nothing.0000000").mkdir()
    (subs / "nobody__nothing.0000000" / "submission.tar.gz").write_bytes(b"")
    unknown = _warnings(pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-tasks-dir",
                                                      str(testbed.tasks_dir), "--pb-filter", CATLIKE,
                                                      "--pb-submissions", str(subs), "--co"))
    assert unknown[0] == "subs/nobody__nothing.0000000:0", unknown
    assert unknown[1].endswith("ProgramBenchWarning: 'nobody__nothing.0000000' is not a known task; ignored"), unknown
    for said in (ini, typed, unknown):
        assert not [line for line in said if "pytest_programbench" in line], said


# ---------------------------------------------------------------------------------------------- no such agent


@pytest.mark.parametrize("where", ["sandbox", "host"])
def test_a_missing_agent_command_ends_the_session_before_any_evaluation(pytester: pytest.Pytester,
                                                                        testbed: Testbed, where: str) -> None:
    run_dir = pytester.path / "run"
    on_host = ["--pb-agent-on-host"] if where == "host" else []
    result = pytester.runpytest_subprocess(*_testbed_args(testbed, run_dir, "--pb-filter", "pbfix__", "--pb-agent",
                                                          "no-such-agent --flag", *on_host))
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str()[-3000:]
    result.assert_outcomes(errors=1)
    place = "on the host" if where == "host" else "in the sandbox of *"
    result.stdout.fnmatch_lines([f"*! Interrupted: programbench: stopping: --pb-agent 'no-such-agent --flag': "
                                 f"'no-such-agent' is not found {place}*Nothing was evaluated !*"])
    cases = list(ET.parse(run_dir.parent / "junit.xml").getroot().iter("testcase"))
    assert len(cases) == 1, "the session ended with the first task"
    assert not list(run_dir.rglob("*.eval.json")), "nothing was evaluated"
    assert not list(run_dir.rglob("submission.tar.gz")), "nothing was packed"
    tasks = json.loads((run_dir / "summary.json").read_text())["tasks"]
    assert sorted(t["outcome"] for t in tasks.values()) == ["error", "not_run", "not_run"], tasks
    # The task's own record: an error (never a score) whose message leads with the command and where it was looked
    # for, asked before the agent ran; its agent.log says so too.
    errored = next(iid for iid, t in tasks.items() if t["outcome"] == "error")
    error = cases[0].find("error")
    assert error is not None, ET.tostring(cases[0])[:2000]
    text = (error.text or "").strip()
    looked = "on the host" if where == "host" else f"in the sandbox of {errored}"
    assert text.startswith(f"--pb-agent 'no-such-agent --flag': 'no-such-agent' is not found {looked}"), text[:500]
    if where == "sandbox":
        assert "(checked before" in text, text[:500]
        assert "is not found" in (run_dir / errored / "agent.log").read_text()


# ---------------------------------------------------------------------------------------------- the message


def test_a_failures_cause_comes_before_its_per_test_lines(pytester: pytest.Pytester, testbed: Testbed) -> None:
    subs = pytester.mkdir("subs")
    (subs / CATLIKE).mkdir()
    with tarfile.open(subs / CATLIKE / "submission.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("main.c")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*_testbed_args(testbed, run_dir, "--pb-filter", CATLIKE,
                                                          "--pb-submissions", str(subs)))
    result.assert_outcomes(failed=1)
    failure = next(ET.parse(run_dir.parent / "junit.xml").getroot().iter("failure"))
    lines = (failure.text or "").splitlines()
    cause = next(i for i, line in enumerate(lines) if line.startswith("compile_failed: "))
    per_test = next(i for i, line in enumerate(lines) if line.startswith("branch ") and "tests failing" in line)
    assert cause < per_test, lines
