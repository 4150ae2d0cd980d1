"""The first hour of a new user: the headline uses, each run the way a user runs it.

A silent agent outlasting the engine client's read timeout, ``pytest --help``, an in-sandbox agent talking to a model
through the relay, and an infrastructure failure after the agent finished (the agent is not run twice). An agent
command that does not exist: tests/test_rough_edges.py (an error before anything is evaluated) and
tests/test_failures_explained.py (run anyway under --pb-keep-going, each task 127: command not found).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.pytest_layer.options import OPTIONS
from tests.conftest import REPO, TESTBED, Testbed
from tests.scripted_llm import ScriptedLLM, Turn

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
RPN_SOLUTION = "/pb-testbed/solutions/pbfix__rpn.0b5e55e"
# Small enough that the tests' silences are several times longer, large enough for a loaded engine's creates.
READ_TIMEOUT = "4"
SILENCE = 15


def _session_args(testbed: Testbed, run_dir: Path, *extra: str) -> list[str]:
    return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2",
            "--pb-output", str(run_dir), "--junitxml", str(run_dir.parent / "junit.xml"), *extra]


def _summary_task(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())["tasks"][RPN]
    return data


# ---------------------------------------------------------------------------------------------- pytest --help


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("where", ["unrelated", "checkout"])
def test_help_lists_every_option(flag: str, where: str, tmp_path: Path) -> None:
    cwd = tmp_path if where == "unrelated" else REPO
    done = subprocess.run([sys.executable, "-m", "pytest", flag], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    missing = [o.flag for o in OPTIONS if o.flag not in done.stdout]
    assert not missing, f"not in {flag}: {missing}"


# ---------------------------------------------------------------------------------------------- silence


def test_silent_agent_outlasting_the_read_timeout_keeps_its_window(pytester: pytest.Pytester, testbed: Testbed,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Quiet for several read timeouts, then prints and works: all of it counts, and the item passes."""
    monkeypatch.setenv("PB_DOCKER_API_TIMEOUT", READ_TIMEOUT)
    run_dir = pytester.path / "run"
    agent = f"echo before-silence; sleep {SILENCE}; echo after-silence; cp -r {RPN_SOLUTION}/. ."
    result = pytester.runpytest_subprocess(
        *_session_args(testbed, run_dir, "--pb-agent", agent, "--pb-agent-mount", f"{TESTBED}:/pb-testbed"),
        timeout=600)
    result.assert_outcomes(passed=1)
    log = (run_dir / RPN / "agent.log").read_text()
    assert "before-silence" in log
    assert "after-silence" in log, log
    assert _summary_task(run_dir)["agent_exit"] == 0
    agent = json.loads((run_dir / RPN / "pb-meta.json").read_text())["agent"]
    assert agent["seconds"] >= SILENCE, agent
    assert not agent["timed_out"]


def test_broken_stream_waits_for_the_running_command(testbed: Testbed, engine: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection to a running command is cut: the harness waits for the command and keeps its exit status."""
    from pytest_programbench.engine import container as container_module
    from pytest_programbench.engine.docker_engine import Labels, sweep
    from pytest_programbench.engine.exec_stream import ExecStream
    from pytest_programbench.sandbox import sandbox as sandbox_module

    streams: list[ExecStream] = []

    class Recorded(ExecStream):
        def __init__(self, sock: Any) -> None:
            super().__init__(sock)
            streams.append(self)

    monkeypatch.setattr(container_module, "ExecStream", Recorded)  # the one exec path (engine/container.py)
    labels = Labels(f"pbtest-first-hour-{uuid.uuid4().hex[:10]}", "controller", RPN)
    box = sandbox_module.Sandbox("programbench/pbfix_1776_rpn.0b5e55e:task_cleanroom_v6", labels=labels,
                                 cpus=1, memory=512 << 20, lifetime=300, engine=engine)
    try:
        with box:
            marker = "/workspace/src/finished"
            results: list[sandbox_module.ExecResult] = []
            before = len(streams)  # the set-up's own commands
            runner = threading.Thread(target=lambda: results.append(
                box.exec(f"sleep 6; touch {marker}; exit 3", timeout=120)))
            runner.start()
            deadline = time.monotonic() + 60
            while len(streams) == before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(streams) > before, "the command never started"
            streams[-1].shutdown()  # cut from outside while the command sleeps
            runner.join(120)
            assert results, "exec did not return"
            result = results[0]
            assert result.exit_code == 3, result
            assert any("broke" in note for note in result.notes), result.notes
            assert box.exec(f"test -e {marker}", timeout=30, user="root").exit_code == 0, "the command was cut short"
    finally:
        sweep(labels.run_id, engine=engine)


# ---------------------------------------------------------------------------------------------- the model relay


RELAY_AGENT = textwrap.dedent("""\
    import json, os, urllib.request
    base = os.environ["OPENAI_BASE_URL"]
    body = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "solve it"}]}).encode()
    request = urllib.request.Request(base + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer x"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.load(response)
    print("model said:", answer["choices"][0]["message"]["content"])
    print("tokens:", answer["usage"]["total_tokens"])
""")


def test_in_sandbox_agent_reaches_the_model_through_the_relay(pytester: pytest.Pytester, testbed: Testbed) -> None:
    agent_dir = pytester.mkdir("agent")
    (agent_dir / "relay_agent.py").write_text(RELAY_AGENT)
    agent_dir.chmod(0o755)  # the agent user reads it through the mount
    (agent_dir / "relay_agent.py").chmod(0o644)
    run_dir = pytester.path / "run"
    agent = f"python3 /pb-agent/relay_agent.py && cp -r {RPN_SOLUTION}/. ."
    with ScriptedLLM([Turn("I will copy the solution.", "true", 123, 45)]) as llm:
        result = pytester.runpytest_subprocess(
            *_session_args(testbed, run_dir, "--pb-agent", agent, "--pb-model-endpoint", llm.base_url,
                           "--pb-agent-mount", f"{TESTBED}:/pb-testbed",
                           "--pb-agent-mount", f"{agent_dir}:/pb-agent"),
            timeout=600)
        served = len(llm.requests)
    result.assert_outcomes(passed=1)
    assert served == 1
    log = (run_dir / RPN / "agent.log").read_text()
    assert "model said: I will copy the solution." in log, log
    records = [json.loads(line) for line in (run_dir / RPN / "model-requests.jsonl").read_text().splitlines()]
    assert len(records) == 1, records
    assert "/chat/completions" in json.dumps(records[0])
    assert _summary_task(run_dir)["tokens"]["total_tokens"] == 168


# ---------------------------------------------------------------------------------------------- the agent runs once


FAIL_ONCE_PLUGIN = textwrap.dedent("""\
    import os
    from pathlib import Path

    import pytest

    from pytest_programbench.evaluation import evaluation
    from pytest_programbench.sandbox import sandbox
    from pytest_programbench.results.verdict import InfrastructureError

    def _once(name):
        flag = Path(os.environ["PB_TEST_FAIL_DIR"]) / name
        if flag.exists():
            return False
        flag.write_text("failed once")
        return True

    _pack = sandbox.Sandbox.pack_src
    _evaluate = evaluation.evaluate

    def pack_src(self, *args, **kwargs):
        if _once("pack"):
            raise sandbox.SandboxError("injected: the engine dropped the archive stream")
        return _pack(self, *args, **kwargs)

    def evaluate(*args, **kwargs):
        if _once("evaluate"):
            raise InfrastructureError("injected: the engine failed during evaluation")
        return _evaluate(*args, **kwargs)

    def pytest_configure(config):
        sandbox.Sandbox.pack_src = pack_src
        evaluation.evaluate = evaluate
""")

COUNTING_AGENT = (
    'n=$(cat "$COUNTS/runs" 2>/dev/null || echo 0); echo $((n + 1)) > "$COUNTS/runs"; '
    f'tar -C {TESTBED}/solutions/{RPN} -c . | $PB_SANDBOX_EXEC "tar -x -C /workspace/src"'
)


def test_failures_after_the_agent_retry_only_the_failed_step(pytester: pytest.Pytester, testbed: Testbed,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    counts = pytester.mkdir("counts")
    monkeypatch.setenv("COUNTS", str(counts))
    monkeypatch.setenv("PB_TEST_FAIL_DIR", str(pytester.mkdir("failed")))
    pytester.makepyfile(pb_fail_once=FAIL_ONCE_PLUGIN)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "pb_fail_once",
        *_session_args(testbed, run_dir, "--pb-agent", COUNTING_AGENT, "--pb-agent-on-host",
                       "--pb-infra-retries", "1"),
        timeout=600)
    result.assert_outcomes(passed=1)
    assert (pytester.path / "failed" / "pack").exists()
    assert (pytester.path / "failed" / "evaluate").exists()
    assert (counts / "runs").read_text().strip() == "1", "the agent ran a second time"
    meta = json.loads((run_dir / RPN / "pb-meta.json").read_text())
    assert any("packing retried after: injected" in note for note in meta.get("notes", [])), meta.get("notes")
    assert any("infrastructure retry after attempt 1: injected: the engine failed during evaluation" in note
               for note in meta["outcome"]["notes"]), meta["outcome"]["notes"]
