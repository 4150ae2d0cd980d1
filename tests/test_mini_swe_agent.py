"""The ``mini-swe-agent`` preset end to end: the official scaffold, through the model relay, against a scripted
OpenAI-compatible server on loopback that replays a fixed trajectory solving a fixture task, in a real sandbox with a
real evaluation, in a real pytest session. Plus the preset's template adaptation, without Docker.
"""

from __future__ import annotations

import json
import os
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TESTBED, Testbed
from tests.scripted_llm import ScriptedLLM, Turn
from tests.secret_scan import assert_secret_nowhere

RPN = "pbfix__rpn.0b5e55e"
SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

def require_minisweagent() -> None:
    """The preset is an optional extra, but this suite installs it: missing, the test fails (never skips)."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    try:
        import minisweagent  # noqa: F401
    except ImportError:
        pytest.fail("mini-swe-agent is not installed: pip install 'pytest-programbench[mini]'", pytrace=False)


def heredoc(path: str, text: str, marker: str = "PB_EOF") -> str:
    assert marker not in text
    return f"cat > {path} <<'{marker}'\n{text.rstrip(chr(10))}\n{marker}"


def script() -> list[Turn]:
    solution = TESTBED / "solutions" / RPN
    return [
        Turn("Let me look around and probe the reference binary first.",
             "id -u; pwd; ls /workspace/docs; printf '2 3 +\\n' | /workspace/binary; echo \"exit=$?\"; "
             "/workspace/binary 3 4 + 2 '*'",
             prompt_tokens=1201, completion_tokens=57),
        Turn("The docs and the probes agree. I will write the calculator in C.",
             heredoc("main.c", (solution / "main.c").read_text()),
             prompt_tokens=1502, completion_tokens=1403),
        Turn("Now compile.sh, then compare my build with the reference on a few inputs.",
             heredoc("compile.sh", (solution / "compile.sh").read_text()) + "\nchmod +x compile.sh && ./compile.sh && "
             "for e in '2 3 +' '1 2 3' '4 neg dup *' '7 0 /'; do "
             "a=$(printf '%s\\n' \"$e\" | ./executable 2>&1; echo \"rc=$?\"); "
             "b=$(printf '%s\\n' \"$e\" | /workspace/binary 2>&1; echo \"rc=$?\"); "
             "[ \"$a\" = \"$b\" ] && echo \"same: $e\" || echo \"DIFF: $e\"; done; rm -f executable; ls",
             prompt_tokens=2903, completion_tokens=211),
        Turn("Everything matches the reference. Submitting.", f"echo {SENTINEL}",
             prompt_tokens=3311, completion_tokens=19),
    ]


def properties(junit: Path, task: str) -> dict[str, str]:
    root = ET.parse(junit).getroot()
    case = next(c for c in root.iter("testcase") if c.get("name") == task)
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def tool_results(request: dict[str, Any]) -> list[str]:
    messages = request["messages"]
    assert isinstance(messages, list)
    return [str(m.get("content")) for m in messages if isinstance(m, dict) and m.get("role") == "tool"]


def run_session(pytester: pytest.Pytester, testbed: Testbed, llm: ScriptedLLM, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", RPN, "--pb-agent", "mini-swe-agent", "--pb-model", "openai/scripted",
        "--pb-model-endpoint", llm.base_url, "--pb-output", str(pytester.path / "run"), "--pb-cpus", "2",
        "--junitxml", str(pytester.path / "junit.xml"), *args, timeout=900,
    )


def agent_log(pytester: pytest.Pytester) -> str:
    path = pytester.path / "run" / RPN / "agent.log"
    return path.read_text() if path.exists() else "(no agent.log)"


@pytest.fixture
def host_env(monkeypatch: pytest.MonkeyPatch) -> str:
    """The inner session's environment: no model settings of the developer's, and a secret API key."""
    for name in ("OPENAI_BASE_URL", "OPENAI_API_BASE", "MSWEA_MODEL_NAME", "LITELLM_LOCAL_MODEL_COST_MAP",
                 "PB_MINI_SWE_AGENT_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    secret = "sk-pb-test-0123456789abcdef"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    return secret


@pytest.mark.docker
@pytest.mark.usefixtures("clean_env")
def test_mini_swe_agent_through_the_relay_solves_a_fixture_task(pytester: pytest.Pytester, testbed: Testbed,
                                                                 host_env: str) -> None:
    require_minisweagent()
    turns = script()
    run_dir = pytester.path / "run"
    junit = pytester.path / "junit.xml"
    with ScriptedLLM(turns) as llm:
        result = run_session(pytester, testbed, llm)
    task_dir = run_dir / RPN
    log_text = agent_log(pytester)
    detail = "\n".join(result.outlines[-60:]) + "\n--- agent.log tail ---\n" + log_text[-6000:]
    assert result.ret == 0, detail
    result.assert_outcomes(passed=1)

    # The server saw exactly the script, in the request shape of the default model class, and nothing else.
    assert llm.unexpected == [], llm.unexpected
    assert len(llm.requests) == len(turns), detail
    first = llm.requests[0]
    assert first["model"] == "scripted"
    assert [t["function"]["name"] for t in first["tools"]] == ["bash"]
    system, user = first["messages"][:2]
    assert system["role"] == "system"
    assert "<RULES>" in system["content"]
    assert "</RULES>" in system["content"]
    assert "`/workspace/binary`" in system["content"]
    assert "`./executable`" not in system["content"]
    assert user["role"] == "user"
    assert f"# Task: rebuild `{RPN}`" in user["content"]  # our prompt ...
    assert "## Command Execution Rules" in user["content"]
    assert f"echo {SENTINEL}" in user["content"]

    # Every command ran in the sandbox as the agent user, in /workspace/src, through the proxied reference.
    probe = tool_results(llm.requests[1])[-1]
    assert "<returncode>0</returncode>" in probe, probe
    for expected in ("1777", "/workspace/src", "README.md", "rpn.1.txt", "\n5\nexit=0\n14\n"):
        assert expected in probe, (expected, probe)
    compared = tool_results(llm.requests[3])[-1]
    assert compared.count("same: ") == 4, compared
    assert "DIFF" not in compared, compared
    assert "compile.sh" in compared
    assert "main.c" in compared

    # JUnit's token counts are exactly what the server sent.
    props = properties(junit, RPN)
    assert props["model_requests"] == str(len(turns))
    assert props["model_requests_with_usage"] == str(len(turns))
    assert props["model_errors"] == "0"
    assert props["model_input_tokens"] == str(sum(t.prompt_tokens for t in turns))
    assert props["model_output_tokens"] == str(sum(t.completion_tokens for t in turns))
    assert props["model_total_tokens"] == str(sum(t.total_tokens for t in turns))
    assert float(props["score"]) == 1.0
    assert props["agent_exit"] == "0"
    assert props["clock_fired"] == ""

    # The trajectory (official format) and the streamed log.
    traj = json.loads((task_dir / f"{RPN}.traj.json").read_text())
    assert traj["instance_id"] == RPN
    assert traj["info"]["exit_status"] == "Submitted"
    assert traj["info"]["model_stats"]["api_calls"] == len(turns)
    assert traj["info"]["config"]["environment_type"].endswith("SandboxEnvironment")
    assert traj["messages"][-1]["role"] == "exit"
    assert f"$ echo {SENTINEL}" in log_text
    assert "exit status Submitted" in log_text
    meta = json.loads((task_dir / "pb-meta.json").read_text())
    assert meta["agent"]["exit_code"] == 0
    assert meta["agent"]["timed_out"] is False
    assert meta["relay"]["requests"] == len(turns)
    records = (task_dir / "model-requests.jsonl").read_text().splitlines()
    assert len(records) == len(turns)

    # The host's key reached the endpoint (through the relay) and no file of the run.
    assert llm.authorizations == [f"Bearer {host_env}"] * len(turns)
    assert_secret_nowhere(host_env, run_dir=run_dir, junit=junit, result=result)
    assert traj["info"]["config"]["model"]["model_kwargs"]["api_key"] == "<redacted>"


@pytest.mark.docker
@pytest.mark.usefixtures("clean_env")
def test_mini_swe_agent_clock_ends_the_run_and_partial_work_is_evaluated(pytester: pytest.Pytester,
                                                                         testbed: Testbed, host_env: str) -> None:
    require_minisweagent()
    solution = TESTBED / "solutions" / RPN
    turns = [
        Turn("Writing the whole solution at once.",
             heredoc("main.c", (solution / "main.c").read_text()) + "\n"
             + heredoc("compile.sh", (solution / "compile.sh").read_text()),
             prompt_tokens=900, completion_tokens=1500),
        Turn("Now a long experiment.", "sleep 1000", prompt_tokens=1000, completion_tokens=10),
        Turn("Never asked for: the clock has run out by now.", f"echo {SENTINEL}",
             prompt_tokens=1, completion_tokens=1),
    ]
    started = time.monotonic()
    with ScriptedLLM(turns) as llm:
        result = run_session(pytester, testbed, llm, "--pb-agent-timeout", "20")
    log_text = agent_log(pytester)
    detail = "\n".join(result.outlines[-60:]) + "\n--- agent.log tail ---\n" + log_text[-4000:]
    result.assert_outcomes(passed=1)  # the verdict is the score alone: the partial work solves the task
    assert len(llm.requests) == 2, detail  # past the deadline no model call starts
    props = properties(pytester.path / "junit.xml", RPN)
    assert props["clock_fired"] == "agent", detail
    assert props["agent_exit"] == "124"
    assert float(props["agent_seconds"]) < 20 + 15, detail  # cut by the clock, not by sleep's 1000 s
    assert props["model_requests"] == "2"
    assert props["model_input_tokens"] == "1900"
    traj = json.loads((pytester.path / "run" / RPN / f"{RPN}.traj.json").read_text())
    assert traj["info"]["exit_status"] == "TimeExceeded"
    assert traj["info"]["model_stats"]["api_calls"] == 2
    tool = [m for m in traj["messages"] if m.get("role") == "tool"][-1]
    assert "timed out after" in tool["content"], tool["content"]
    assert "exit status TimeExceeded" in log_text
    assert time.monotonic() - started < 300


@pytest.mark.docker
@pytest.mark.usefixtures("clean_env")
def test_mini_swe_agent_whose_model_call_outlives_the_clock(pytester: pytest.Pytester, testbed: Testbed,
                                                            host_env: str) -> None:
    """The host side of the loop ignores the clock: the model holds its answer far past --pb-agent-timeout. The
    clock cuts the call (the client hangs up at the deadline, the agent ends with TimeExceeded, not abandoned by the
    hard stop), the outcome says the agent's clock fired, and the empty workspace is scored (a failure)."""
    require_minisweagent()
    # The first call hangs: the clock is long enough for mini-swe-agent's start-up on a loaded machine (which counts).
    turns = [Turn("Thinking for a very long time.", "true", prompt_tokens=1000, completion_tokens=10, hang=3600)]
    with ScriptedLLM(turns) as llm:
        result = run_session(pytester, testbed, llm, "--pb-agent-timeout", "40")
        abandoned = list(llm.abandoned)
    log_text = agent_log(pytester)
    detail = "\n".join(result.outlines[-60:]) + "\n--- agent.log tail ---\n" + log_text[-4000:]
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*clock fired: agent*"])
    props = properties(pytester.path / "junit.xml", RPN)
    assert props["clock_fired"] == "agent", detail
    assert props["agent_exit"] == "124", detail  # TimeExceeded: the agent ended, no thread left behind
    assert float(props["score"]) == 0.0
    assert len(llm.requests) == 1, detail
    assert abandoned == [0], detail  # the held call was given up by the client, none answered late
    traj = json.loads((pytester.path / "run" / RPN / f"{RPN}.traj.json").read_text())
    assert traj["info"]["exit_status"] == "TimeExceeded", detail
    assert "agent thread abandoned" not in log_text


def test_templates_keep_the_official_rules_and_our_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "False")  # forced to True below, restored after the test
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    require_minisweagent()
    from pytest_programbench.agents.mini_swe_agent import (
        adapt_instance_template,
        adapt_system_template,
        official_config,
    )

    official = official_config()
    system = adapt_system_template(official["agent"]["system_template"])
    assert "`./executable`" not in system
    assert "(`cp /workspace/binary ./executable`)" in system
    for rule in ("### 1. Obtaining source code", "### 2. Wrapping or reusing the original binary",
                 "### 3. Binary analysis of the provided executable", "You MUST NOT decompile `/workspace/binary`"):
        assert rule in system
    instance = adapt_instance_template(official["agent"]["instance_template"])
    assert instance.startswith("{{ task }}\n\n## Command Execution Rules")
    assert f"echo {SENTINEL}" in instance
    assert "{{system}} {{release}}" in instance
    assert "located at `./executable`" not in instance
    assert official["environment"]["timeout"] == 180
    assert os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"  # official_config() imports it offline


def test_a_model_is_required() -> None:
    from pytest_programbench.agents.mini_swe_agent import MiniSweAgentError, check, preflight
    from pytest_programbench.core.settings import Settings

    with pytest.raises(MiniSweAgentError, match="--pb-model"):
        check(Settings(agent="mini-swe-agent"))
    with pytest.raises(pytest.UsageError, match="--pb-model"):
        preflight(Settings(agent="mini-swe-agent"))


# -- without Docker: the environment's contract and the hard stop, over a fake sandbox --------------------------


class FakeSandbox:
    """Just what the preset uses of a Sandbox: ``id``, ``exec`` and ``kill_agent_processes``."""

    id = "f" * 64

    def __init__(self, respond: Any) -> None:
        self.respond = respond
        self.calls: list[dict[str, Any]] = []
        self.killed = 0

    def exec(self, command: Any, **kwargs: Any) -> Any:
        self.calls.append({"command": command, **kwargs})
        return self.respond(command, kwargs)

    def kill_agent_processes(self) -> None:
        self.killed += 1


def exec_result(output: str, exit_code: int | None = 0, *, timed_out: bool = False) -> Any:
    from pytest_programbench.sandbox.sandbox import ExecResult

    return ExecResult(exit_code, output.encode(), 0.01, timed_out)


def probe_or(result: Any) -> Any:
    def respond(command: Any, kwargs: Any) -> Any:
        if isinstance(command, str) and command.startswith("uname"):
            return exec_result("Linux\n6.1\n#1 SMP\nx86_64\nsandbox\n/usr/bin/bash\n")
        return result(command, kwargs) if callable(result) else result
    return respond


def test_environment_maps_results_like_the_official_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    require_minisweagent()
    from minisweagent.exceptions import Submitted, TimeExceeded

    from pytest_programbench.agents.mini_swe_agent import SandboxEnvironment

    outcomes = iter([exec_result("partial", 124, timed_out=True), exec_result("boom\n", 3),
                     exec_result(f"{SENTINEL}\n", 1), exec_result(f"  {SENTINEL}\nsummary\n", 0)])
    box = FakeSandbox(probe_or(lambda _c, _k: next(outcomes)))
    env = SandboxEnvironment.for_sandbox(box, env={"PB_TASK_ID": RPN})  # type: ignore[arg-type]
    assert env.config.interpreter == ("bash", "-lc")
    assert env.get_template_vars()["system"] == "Linux"
    timed_out = env.execute({"command": "sleep 999"})
    assert timed_out["returncode"] == -1
    assert "timed out after 180 seconds" in timed_out["exception_info"]
    assert timed_out["output"] == "partial"
    assert env.execute({"command": "false"}) == {"output": "boom\n", "returncode": 3, "exception_info": ""}
    assert env.execute({"command": f"echo {SENTINEL}; exit 1"})["returncode"] == 1  # a failed submit is not one
    with pytest.raises(Submitted) as submitted:
        env.execute({"command": f"echo {SENTINEL}"})
    assert submitted.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "summary\n"}
    call = box.calls[-1]
    assert call["command"] == ["bash", "-lc", f"echo {SENTINEL}"]
    assert call["user"] == "agent"
    assert call["workdir"] == "/workspace/src"
    assert call["timeout"] == 180
    env.deadline = time.monotonic() + 0.5  # less than a second left: nothing starts
    with pytest.raises(TimeExceeded):
        env.execute({"command": "true"})


def test_hard_stop_abandons_a_hung_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Long enough for mini-swe-agent to start and reach the hanging command on a loaded 2-core machine (6 s was not:
    # its imports alone can take that long there); the test then waits the clock out.
    clock = 15
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    require_minisweagent()
    import threading

    from pytest_programbench.agents import mini_swe_agent
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.tasks.catalogue import Task

    monkeypatch.setattr(mini_swe_agent, "HARD_STOP_GRACE", 1.0)
    monkeypatch.setattr(mini_swe_agent, "STOP_WAIT", 0.2)
    release = threading.Event()

    def hang(_command: Any, _kwargs: Any) -> Any:  # a docker exec that never comes back in time
        release.wait(30)
        return exec_result("late\n")

    box = FakeSandbox(probe_or(hang))
    task = Task(RPN, "c", "easy", "programbench/x", tmp_path, packaged=False)
    log_path = tmp_path / RPN / "agent.log"
    env = {"OPENAI_BASE_URL": "", "PB_TASK_ID": RPN, "PB_MODEL_RELAY_URL": "http://127.0.0.1:1", "SECRET": "x"}
    try:
        with ScriptedLLM([Turn("Hang.", "sleep 100", 10, 1)]) as llm:
            env["OPENAI_BASE_URL"] = llm.base_url
            started = time.monotonic()
            exit_code, timed_out = mini_swe_agent.run_mini_swe_agent(
                box, task=task, settings=Settings(model="openai/scripted"), prompt="Solve it.",  # type: ignore[arg-type]
                env=env, log_path=log_path, timeout=clock)
            elapsed = time.monotonic() - started
    finally:
        release.set()
    assert box.calls[-1]["command"] == ["bash", "-lc", "sleep 100"], log_path.read_text()
    assert (exit_code, timed_out) == (None, True)
    assert clock < elapsed < clock + 60  # the agent's clock, not sleep's 100 s (loose: a loaded machine is slow)
    assert box.killed >= 1
    assert len(llm.requests) == 1
    assert llm.authorizations == ["Bearer pb-no-key"]  # no key anywhere: a placeholder the SDK accepts
    command_env = box.calls[-1]["env"]
    assert command_env["PB_TASK_ID"] == RPN
    for host_only in ("OPENAI_BASE_URL", "PB_MODEL_RELAY_URL", "SECRET"):
        assert host_only not in command_env
    assert command_env["PAGER"] == "cat"
    assert command_env["TQDM_DISABLE"] == "1"  # the official command environment
    traj = json.loads((tmp_path / RPN / f"{RPN}.traj.json").read_text())
    assert traj["info"]["exit_status"] == "HardStop"
    assert "hard stop" in log_path.read_text()
