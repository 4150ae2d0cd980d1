"""What the relay reads of the agent's own loop (relay/agent_loop.py), through real sessions on the test bed:

* a CLI preset whose loop offers the model no shell tool (real claude-code, its Bash tool denied by the user's own
  settings) ends as an error of the agent's configuration: never a failure, its loop call refused before it
  reached the provider, the agent's clock not spent;
* an agent that gives its final answer and then hangs is ended after ``--pb-agent-final-grace`` and scored, the
  record saying so;
* a provider refusing the CLI's version (real codex 0.169.0, a 400 naming its version) makes the task an
  infrastructure error, and ``--pb-preflight`` says so before the run.
"""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.agents import agent_presets
from pytest_programbench.relay.agent_loop import LoopWatch, refuses_client, tool_names
from tests.conftest import TESTBED, Testbed
from tests.scripted_models import Faults, ScriptedModels, Step

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
STEPS = (
    Step("Copying the solution.", f"cp -r /pb-testbed/solutions/{RPN}/. /workspace/src/", 1500, 60, 1100),
    Step("Done.", None, 1700, 25, 1400),
)
# The user's own claude-code settings (their config dir, given with --pb-agent-env) denying its Bash tool: the loop
# has no shell.
USER_CLAUDE = "/tmp/pb-user-claude"
NO_BASH = (f"mkdir -p {USER_CLAUDE} && printf '%s' '{{\"permissions\": {{\"deny\": [\"Bash\"], "
           f"\"defaultMode\": \"bypassPermissions\"}}}}' > {USER_CLAUDE}/settings.json && chown -R agent {USER_CLAUDE}")


def _base(testbed: Testbed, server: ScriptedModels, run_dir: Path, *extra: str) -> list[str]:
    return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2",
            "--pb-infra-retries", "0", "--pb-model-endpoint", server.base_url, "--pb-output", str(run_dir), *extra]


def _meta(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / RPN / "pb-meta.json").read_text()))


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / RPN / "model-requests.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def claude_code() -> str:
    parsed = agent_presets.parse("claude-code")
    assert parsed is not None
    agent_presets.ensure_installed(*parsed)
    return f"claude-code@{parsed[1]}"


def test_preset_whose_loop_offers_no_shell_tool_is_an_error(pytester: pytest.Pytester, testbed: Testbed,
                                                             claude_code: str) -> None:
    run_dir = pytester.path / "run"
    with ScriptedModels(STEPS) as server:
        result = pytester.runpytest_subprocess(*_base(
            testbed, server, run_dir, "--pb-agent", claude_code, "--pb-model", "scripted-model",
            "--pb-agent-setup", NO_BASH, "--pb-agent-env", f"CLAUDE_CONFIG_DIR={USER_CLAUDE}",
            "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-agent-timeout", "600"),
            timeout=900)
    out = result.stdout.str()
    log = (run_dir / RPN / "agent.log").read_text(errors="replace")
    result.assert_outcomes(errors=1)  # never failed: the agent's configuration, not its work
    assert "agent configuration: the agent's configuration offers the model no shell tool" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    task = summary["tasks"][RPN]
    assert (task["outcome"], task["score"]) == ("error", None), task
    meta = _meta(run_dir)
    refused = meta["agent_loop"]["shell_tool_refused"]
    assert refused, meta["agent_loop"]
    offered = refused.split("offered [")[1].split("]")[0].lower().split(", ")
    assert offered, refused
    assert "bash" not in offered, refused
    # The loop call never reached the provider (side requests offering no tool may have).
    assert server.chosen == [], (server.chosen, server.log)
    loop_calls = [r for r in _records(run_dir) if r["status"] == 400]
    assert loop_calls, _records(run_dir)
    assert all("no shell tool" in (r["error"] or "") for r in loop_calls), _records(run_dir)
    # Refused at its first loop call, the agent ended at once: its six-hour clock is not spent on invented output.
    assert meta["agent"]["seconds"] < 120, (meta["agent"], log[-2000:])


AGENT = '''
import base64, io, json, os, sys, tarfile, time, urllib.request
tarfile.open(fileobj=io.BytesIO(base64.b64decode(SOLUTION))).extractall(".")
tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
          "properties": {"command": {"type": "string"}}}}}]
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "go"}], "tools": tools}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=300) as response:
    answer = json.loads(response.read())
print("final answer:", answer["choices"][0]["message"]["content"], flush=True)
time.sleep(3600)  # hangs after its final answer, as codex can behind a proxy
'''


def _hanging_agent() -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(TESTBED / "solutions" / RPN, arcname=".")
    script = f"SOLUTION = {base64.b64encode(buffer.getvalue()).decode()!r}\n" + AGENT
    return base64.b64encode(script.encode()).decode()


def test_agent_that_answers_then_hangs_is_ended_after_the_grace_and_scored(pytester: pytest.Pytester,
                                                                           testbed: Testbed) -> None:
    run_dir = pytester.path / "run"
    agent = f"echo {_hanging_agent()} | base64 -d > /tmp/agent.py && python3 /tmp/agent.py"
    with ScriptedModels([Step("All done.", None, 100, 10)]) as server:
        result = pytester.runpytest_subprocess(*_base(
            testbed, server, run_dir, "--pb-agent", agent, "--pb-agent-timeout", "120",
            "--pb-agent-final-grace", "4"), timeout=600)
    out = result.stdout.str()
    log = (run_dir / RPN / "agent.log").read_text(errors="replace")
    assert result.ret == 0, (out[-3000:], log[-2000:])
    result.assert_outcomes(passed=1)  # scored: its work was done before it hung
    assert "final answer: All done." in log, log[-2000:]
    agent_meta = _meta(run_dir)["agent"]
    assert not agent_meta["timed_out"], agent_meta
    assert agent_meta["seconds"] < 60, agent_meta  # ended a few seconds after its answer, not at its clock
    said = agent_meta["ended_after_answer"]
    assert said, agent_meta
    assert "made no model request for 4 s" in said, agent_meta
    assert said in agent_meta["notes"], agent_meta
    assert "--pb-agent-final-grace" in log, log[-2000:]


@pytest.fixture(scope="module")
def old_codex() -> str:
    parsed = agent_presets.parse("codex@0.169.0")
    assert parsed is not None
    agent_presets.ensure_installed(*parsed)
    return "codex@0.169.0"


def test_provider_refusing_an_outdated_client_is_an_error_and_preflight_says_so(
        pytester: pytest.Pytester, testbed: Testbed, old_codex: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PB_TEST_MODEL_KEY", "sk-test-outdated")
    run_dir = pytester.path / "run"
    refuse = Faults(refuse_client="codex_exec/0.169.0")
    with ScriptedModels(STEPS, faults=refuse) as server:
        args = _base(testbed, server, run_dir, "--pb-agent", old_codex, "--pb-model", "scripted-model",
                     "--pb-model-key-env", "PB_TEST_MODEL_KEY", "--pb-agent-timeout", "600")
        preflight = pytester.runpytest_subprocess(*args, "--pb-preflight", timeout=600)
        asked = list(server.refused_clients)
        result = pytester.runpytest_subprocess(*args, timeout=900)
    pre = preflight.stdout.str()
    assert preflight.ret != 0, pre[-3000:]
    assert asked == ["codex_exec/0.169.0 (codex_exec; 0.169.0)"], asked
    preflight.stdout.fnmatch_lines(["*codex@0.169.0 accepted by the provider*the provider refuses "
                                    "codex_exec/0.169.0*as outdated*pin a newer --pb-agent codex@VERSION*"])
    out = result.stdout.str()
    result.assert_outcomes(errors=1)
    assert "the provider refused the agent's client (codex_exec/0.169.0" in out, out[-3000:]
    assert "requires a newer version of the client" in out, out[-3000:]
    task = json.loads((run_dir / "summary.json").read_text())["tasks"][RPN]
    assert (task["outcome"], task["score"]) == ("error", None), task
    assert _meta(run_dir)["agent_loop"]["outdated_client"], _meta(run_dir)["agent_loop"]


# ------------------------------------------------------------------------------------------------ the pieces


@pytest.mark.parametrize(("tools", "names"), [
    ([], None),
    ([{"type": "function", "function": {"name": "read"}}], ["read"]),
    ([{"type": "function", "name": "exec_command"}, {"type": "local_shell"}], ["exec_command", "local_shell"]),
    ([{"name": "Bash", "input_schema": {}}, {"type": "bash_20250124", "name": "bash"}],
     ["Bash", "bash", "bash_20250124"]),
    ([{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "shell"}]}],
     ["ns", "shell", "namespace"]),
])
def test_tool_names_of_every_api(tools: list[dict[str, Any]], names: list[str] | None) -> None:
    assert tool_names({"tools": tools}) == names


def test_loop_watch_judges_the_first_call_offering_tools() -> None:
    def body(*names: str) -> bytes:
        return json.dumps({"model": "m", "tools": [{"type": "function", "name": n} for n in names]}).encode()

    watch = LoopWatch(require_shell=True)
    assert watch.admit("responses", json.dumps({"model": "m", "input": "a title"}).encode()) is False
    assert watch.refusal is None  # a side call offering no tool decides nothing
    watch.ended(offered_tools=False, status=200, tool_calls=0)
    assert watch.answered_idle() is None  # a side call's text is no final answer
    assert watch.admit("responses", body("read", "write")) is True
    assert watch.refusal is not None
    assert watch.refusal.offered == ("read", "write")
    fine = LoopWatch(require_shell=True)
    fine.admit("responses", body("exec_command"))
    assert fine.refusal is None
    fine.ended(offered_tools=True, status=200, tool_calls=1)
    assert fine.answered_idle() is None  # it called a tool: working
    fine.admit("responses", body("exec_command"))
    assert fine.answered_idle() is None  # in flight
    fine.ended(offered_tools=True, status=200, tool_calls=0)
    idle = fine.answered_idle()
    assert idle is not None
    assert idle >= 0


@pytest.mark.parametrize(("status", "message", "agent", "refused"), [
    (400, "The 'gpt-9' model requires a newer version of Codex. Please upgrade.", "codex_exec/0.169.0", True),
    (400, "client 0.169.0 is not supported for this model", "codex_exec/0.169.0 (x)", True),
    (400, "max_tokens: must be at most 8192", "claude-cli/2.1.332", False),
    (403, "requires a newer version", "codex_exec/0.169.0", False),
])
def test_outdated_client_is_told_from_a_400(status: int, message: str, agent: str, refused: bool) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()
    assert (refuses_client(status, body, agent) is not None) is refused
