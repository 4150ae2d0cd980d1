"""The plugin's hooks (newhooks.py), each used by a ``conftest``-style plugin in a real session."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import TESTBED, Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"

HOOKS_PLUGIN = textwrap.dedent("""\
    import json, os
    from pathlib import Path

    def pytest_programbench_prompt(task, prompt, config):
        return prompt + "\\nA LINE FROM THE HOOK for " + task.instance_id + "\\n"

    def pytest_programbench_agent_env(task, env, command, config):
        env["PB_FROM_HOOK"] = "yes:" + task.language
        env.pop("PAGER", None)

    def pytest_programbench_task_outcome(item, outcome, passed, task_dir):
        record = {"task": outcome.instance_id, "score": outcome.score, "passed": passed, "task_dir": task_dir,
                  "nodeid": item.nodeid}
        with open(os.environ["PB_TEST_HOOK_LOG"], "a") as log:
            log.write(json.dumps(record) + "\\n")

    def pytest_programbench_summary(summary, config):
        summary["uploaded_by_hook"] = sorted(summary["tasks"])
""")

AGENT = (f"tail -n 1 \"$PB_PROMPT_FILE\"; echo \"env: $PB_FROM_HOOK pager=${{PAGER:-unset}}\"; "
         f"cp -r /pb-testbed/solutions/{RPN}/. .")


def test_every_hook_takes_part_in_a_run(pytester: pytest.Pytester, testbed: Testbed,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(pb_hooks=HOOKS_PLUGIN)
    hook_log = pytester.path / "hook-log.jsonl"
    monkeypatch.setenv("PB_TEST_HOOK_LOG", str(hook_log))
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "pb_hooks", "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
        str(testbed.blob_dir), "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2", "--pb-output",
        str(run_dir), "--pb-agent", AGENT, "--pb-agent-mount", f"{TESTBED}:/pb-testbed", timeout=600)
    result.assert_outcomes(passed=1)
    log = (run_dir / RPN / "agent.log").read_text()
    assert f"A LINE FROM THE HOOK for {RPN}" in log, log
    assert "env: yes:c pager=unset" in log, log
    records = [json.loads(line) for line in hook_log.read_text().splitlines()]
    assert len(records) == 1, records
    assert records[0]["task"] == RPN
    assert records[0]["score"] == 1.0
    assert records[0]["passed"] is True
    assert Path(records[0]["task_dir"]) == run_dir / RPN
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["uploaded_by_hook"] == [RPN]


def test_hooks_are_listed_for_plugin_authors(pytester: pytest.Pytester) -> None:
    """The hook specs are registered even in a session that does not opt in (plugins validate against them)."""
    pytester.makeconftest("""
        def pytest_programbench_prompt(task, prompt, config):
            return None
    """)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
