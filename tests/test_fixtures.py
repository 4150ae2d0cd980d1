"""The pipeline's fixtures (fixtures.py): listed and documented, shown step by step, overridden in a ``conftest.py``,
requested by a user's own test over a task selection; and the checkout's root ``conftest.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"
# Pipeline order; the steps an item of an agent run sets up.
STEPS = ["pb_session", "pb_task", "pb_run", "pb_engine", "pb_blobs", "pb_image", "pb_agent", "pb_relay",
         "pb_sandbox", "pb_agent_run", "pb_submission", "pb_evaluation", "pb_outcome"]
AGENT_STEPS = {"pb_agent", "pb_relay", "pb_sandbox", "pb_agent_run"}


def session_args(testbed: Testbed, run_dir: Path, task: str, *extra: str) -> list[str]:
    return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-filter", task, "--pb-pull", "never", "--pb-cpus", "2",
            "--pb-output", str(run_dir), *extra]


def set_up_steps(stdout: str) -> list[str]:
    """The fixtures ``--setup-show`` set up, in order."""
    return re.findall(r"^\s*SETUP\s+[SF] (\w+)", stdout, re.M)


def meta(run_dir: Path, task: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((run_dir / task / "pb-meta.json").read_text())
    return data


def test_fixtures_lists_every_step_with_its_docstring(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fixtures")
    assert result.ret == 0, result.stdout.str()
    text = result.stdout.str()
    for name in STEPS:
        match = re.search(rf"^{name}( \[session scope\])? -- .*fixtures\.py:\d+\n((    .+\n)+)", text, re.M)
        assert match is not None, f"{name} is not listed:\n{text[-3000:]}"
        assert "no docstring available" not in match.group(2), f"{name} has no docstring"
    assert re.search(r"^pb_session \[session scope\] -- ", text, re.M), "pb_session is session-scoped"
    assert "binary(args, stdin=...)" in text  # pb_sandbox's docstring says what the object offers


PYTHON_AGENT = textwrap.dedent("""\
    import pytest
    from pytest_programbench.agents.agent import put_tree

    SOLUTIONS = {solutions!r}

    class CopySolution:
        on_host = True

        def __init__(self, instance_id):
            self.instance_id = instance_id

        def run(self, sandbox, prompt):
            assert "{rpn}" in prompt or "/workspace/binary" in prompt, prompt[:300]
            probe = sandbox.binary([], stdin=b"1 2 +\\n")
            put_tree(sandbox, __import__("pathlib").Path(SOLUTIONS) / self.instance_id, "/workspace/src")
            class Result:
                exit_code = 7 if probe.exit_code else 0
            return Result()

    @pytest.fixture
    def pb_agent(pb_task):
        return CopySolution(pb_task.instance_id)
""")


def test_a_python_agent_replaces_the_command_and_setup_show_shows_the_steps(pytester: pytest.Pytester,
                                                                            testbed: Testbed) -> None:
    pytester.makeconftest(PYTHON_AGENT.format(solutions=str(testbed.solutions), rpn=RPN))
    run_dir = pytester.path / "run"
    # The command would fail the task: only the conftest's agent can pass it.
    result = pytester.runpytest_subprocess(*session_args(testbed, run_dir, RPN, "--pb-agent", "exit 3",
                                                         "--setup-show"), timeout=600)
    result.assert_outcomes(passed=1)
    assert set_up_steps(result.stdout.str()) == STEPS, result.stdout.str()
    # Teardown is fixture order reversed: the sandbox before the relay, the engine lease last of the task's.
    torn = re.findall(r"^\s*TEARDOWN [SF] (\w+)", result.stdout.str(), re.M)
    assert torn == list(reversed(STEPS)), torn
    recorded = meta(run_dir, RPN)
    assert recorded["agent"]["spec"] == "CopySolution", recorded["agent"]  # type: ignore[index]
    assert recorded["agent"]["exit_code"] == 0, recorded["agent"]  # type: ignore[index]
    calls = [json.loads(line) for line in (run_dir / RPN / "binary-calls.jsonl").read_text().splitlines()]
    assert [c["argv"] for c in calls] == [["/workspace/binary"]], calls


SUBMISSION_FROM_ELSEWHERE = textwrap.dedent("""\
    import shutil
    import pytest

    @pytest.fixture
    def pb_submission(pb_run, pb_task):
        source = {submissions!r} + "/" + pb_task.instance_id + "/submission.tar.gz"
        pb_run.artifacts.dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, pb_run.artifacts.submission)
        return pb_run.artifacts.submission
""")


def test_a_submission_taken_from_elsewhere_is_evaluated_without_the_agent(pytester: pytest.Pytester,
                                                                        testbed: Testbed) -> None:
    pytester.makeconftest(SUBMISSION_FROM_ELSEWHERE.format(submissions=str(testbed.submissions)))
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*session_args(testbed, run_dir, RPN, "--pb-agent", "exit 3",
                                                         "--setup-show"), timeout=600)
    result.assert_outcomes(passed=1)
    steps = set_up_steps(result.stdout.str())
    assert not AGENT_STEPS & set(steps), steps
    assert not (run_dir / RPN / "agent.log").exists()
    assert meta(run_dir, RPN)["outcome"]["score"] == 1.0  # type: ignore[index]


OUTCOME_EXTENDED = textwrap.dedent("""\
    import pytest

    @pytest.fixture
    def pb_outcome(pb_outcome, pb_submission):
        pb_outcome.notes.append("checked by the conftest: " + pb_submission.name)
        return pb_outcome
""")


def test_evaluate_only_is_the_submission_step_and_a_step_can_extend_the_built_in(pytester: pytest.Pytester,
                                                                               testbed: Testbed) -> None:
    pytester.makeconftest(OUTCOME_EXTENDED)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*session_args(testbed, run_dir, RPN, "--pb-submissions",
                                                         str(testbed.submissions), "--setup-show"), timeout=600)
    result.assert_outcomes(passed=1)
    steps = set_up_steps(result.stdout.str())
    assert "pb_submission" in steps, steps
    assert not AGENT_STEPS & set(steps), steps
    recorded = meta(run_dir, RPN)
    assert recorded["submission_source"] == str(testbed.submissions / RPN / "submission.tar.gz")
    assert "checked by the conftest: submission.tar.gz" in recorded["outcome"]["notes"]  # type: ignore[index]


PROBE = textwrap.dedent("""\
    import pytest

    @pytest.mark.programbench_tasks("{catlike}")
    def test_reference_echoes(pb_task, pb_sandbox):
        result = pb_sandbox.binary([], stdin=b"through the proxy\\n")
        assert result.exit_code == 0, result.text
        assert result.text == "through the proxy\\n"
        assert [c["argv"] for c in pb_sandbox.call_log()] == [["/workspace/binary"]]
        assert pb_sandbox.layout.agent_uid != 0

    def test_every_selected_task(pb_task):
        assert pb_task.instance_id.startswith("pbfix__")
""")


def test_a_users_test_requests_the_sandbox_over_a_task_selection(pytester: pytest.Pytester,
                                                                testbed: Testbed) -> None:
    pytester.makepyfile(test_probe=PROBE.format(catlike=CATLIKE))
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*session_args(testbed, run_dir, "pbfix__", "--pb-agent", "true",
                                                         "test_probe.py", "-m", "not programbench", "-v"),
                                           timeout=600)
    result.assert_outcomes(passed=4)  # one task for the marked test, the three of the selection for the other
    result.stdout.fnmatch_lines([f"*test_reference_echoes[[]{CATLIKE}[]] PASSED*"])
    assert not (run_dir / CATLIKE / "pb-meta.json").exists()  # a user's test leaves the task's record alone


def test_the_root_conftest_finds_the_testbed_only_in_opted_in_sessions(testbed: Testbed) -> None:
    def collect(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    listed = collect("--pb-agent", "reference")
    ids = sorted(re.findall(r"^programbench::(\S+)$", listed, re.M))
    assert ids == sorted(p.name for p in testbed.tasks_dir.iterdir() if p.name.startswith("pbfix__")), listed
    # The project's own suite (an explicit path, no --pb-* option) is left as it is.
    own = collect("tests/test_layout.py")
    assert "programbench::" not in own, own
    assert "tests/test_layout.py::" in own, own
