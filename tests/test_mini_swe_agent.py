"""The ``mini-swe-agent`` preset end to end: the official scaffold, through the model relay, against a scripted
OpenAI-compatible server on loopback that replays a fixed trajectory solving a fixture task, in a real sandbox with a
real evaluation, in a real pytest session: README's commands, run as written with only the outside world substituted
(tests/doc_commands.py), the headline's three and "Your first real evaluation"'s three; the agent's clocks. Plus the
preset's template adaptation, without Docker.
"""

from __future__ import annotations

import json
import os
import shutil
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


def check_solved_by_the_script(llm: ScriptedLLM, turns: list[Turn], result: pytest.RunResult, run_dir: Path,
                               task: str, model: str, secret: str) -> None:
    """A session of mini-swe-agent on a copy of rpn (README's ``-k cmatrix``, as written: the test below) followed the
    script through the relay and passed: what the server saw, what ran in the sandbox, the tokens, the trajectory, and
    the host's key upstream and nowhere else."""
    task_dir = run_dir / task
    log_text = (task_dir / "agent.log").read_text() if (task_dir / "agent.log").exists() else "(no agent.log)"
    detail = "\n".join(result.outlines[-60:]) + "\n--- agent.log tail ---\n" + log_text[-6000:]
    assert result.ret == 0, detail
    result.assert_outcomes(passed=1)

    # The server saw exactly the script, in the request shape of the default model class, and nothing else.
    assert llm.unexpected == [], llm.unexpected
    assert len(llm.requests) == len(turns), detail
    first = llm.requests[0]
    assert first["model"] == model
    assert [t["function"]["name"] for t in first["tools"]] == ["bash"]
    system, user = first["messages"][:2]
    assert system["role"] == "system"
    assert "<RULES>" in system["content"]
    assert "</RULES>" in system["content"]
    assert "`/workspace/binary`" in system["content"]
    assert "`./executable`" not in system["content"]
    assert user["role"] == "user"
    assert f"# Task: rebuild `{task}`" in user["content"]  # our prompt ...
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

    # The token counts are exactly what the server sent (JUnit's: the README codex session below).
    row = json.loads((run_dir / "summary.json").read_text())["tasks"][task]
    tokens = row["tokens"]
    assert tokens["requests_with_usage"] == len(turns), tokens
    assert tokens["errors"] == 0, tokens
    assert tokens["input_tokens"] == sum(t.prompt_tokens for t in turns), tokens
    assert tokens["output_tokens"] == sum(t.completion_tokens for t in turns), tokens
    assert row["score"] == 1.0
    assert row["agent_exit"] == 0
    assert not row["clock_fired"], row

    # The trajectory (official format) and the streamed log.
    traj = json.loads((task_dir / f"{task}.traj.json").read_text())
    assert traj["instance_id"] == task
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
    assert llm.authorizations == [f"Bearer {secret}"] * len(turns)
    assert_secret_nowhere(secret, run_dir=run_dir, result=result)
    assert traj["info"]["config"]["model"]["model_kwargs"]["api_key"] == "<redacted>"


CLOCK = 45  # --pb-agent-timeout of the clock test below


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
        # Long enough for mini-swe-agent's start-up and two calls on a loaded machine (the clock counts them; CI ran
        # this beside the parallel stream and its first call had not come at 18.6 s of a 20 s clock).
        result = run_session(pytester, testbed, llm, "--pb-agent-timeout", str(CLOCK))
    log_text = agent_log(pytester)
    detail = "\n".join(result.outlines[-60:]) + "\n--- agent.log tail ---\n" + log_text[-4000:]
    result.assert_outcomes(passed=1)  # the verdict is the score alone: the partial work solves the task
    assert len(llm.requests) == 2, detail  # past the deadline no model call starts
    props = properties(pytester.path / "junit.xml", RPN)
    assert props["clock_fired"] == "agent", detail
    assert props["agent_exit"] == "124"
    assert float(props["agent_seconds"]) < CLOCK + 15, detail  # cut by the clock, not by sleep's 1000 s
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
    # its imports alone can take that long there; 15 s was not in a CI at load 10); the test then waits the clock out.
    clock = 40
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

    def hang(_command: Any, _kwargs: Any) -> Any:  # a docker exec that never comes back in time: it outlasts the clock
        release.wait(3 * clock)
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


# -- README's commands, as written (tests/doc_commands.py: only the outside world substituted) -----------------------

HEADLINE = ("README.md", "pytest-programbench")
FIRST_RUN = ("README.md", "Your first real evaluation")
README_KEY = "sk-readme-host-only-7e03aa"


def _readme_session(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any, monkeypatch: pytest.MonkeyPatch,
                    name: str, words: list[str], prepare: Any = None) -> tuple[pytest.RunResult, Path, str]:
    """``words`` (a README command, substituted) run in a directory of its own with the test bed in the benchmark's
    place: (the result, the directory, the stand-in task's id)."""
    from tests.doc_commands import stand_in

    cwd = pytester.mkdir(name)
    monkeypatch.chdir(cwd)
    with stand_in(cwd / ".bench", testbed, docker_client, words) as bench:
        if prepare is not None:
            prepare(cwd, bench.task)
        result = pytester.runpytest_subprocess(*words, *bench.args, timeout=900)
    return result, cwd, bench.task


def _passed(result: pytest.RunResult, cwd: Path, task: str) -> Path:
    from tests.doc_commands import written_run_dir

    log = next(iter(cwd.glob(f"pb-runs/*/{task}/agent.log")), None)
    detail = "\n".join([*result.outlines[-40:], *result.errlines[-20:]]) + "\n--- agent.log:\n" + (
        log.read_text()[-4000:] if log else "(none)")
    assert result.ret == 0, detail
    result.assert_outcomes(passed=1)
    run = written_run_dir(cwd)
    assert_secret_nowhere(README_KEY, run_dir=run, result=result)
    return run


@pytest.mark.docker
@pytest.mark.users_defaults
@pytest.mark.usefixtures("clean_env")
def test_the_readme_headline_commands_run_as_written(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any,
                                                     host_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's first block: codex over the Go tasks under ``-n 8`` into ``out.xml``, mini-swe-agent on ``-k pandoc``
    and ``--pb-submissions runs/my-run -n 4``, each as written. Substituted (tests/doc_commands.py): the providers by
    our scripted model servers (codex's OpenAI Responses: tests/scripted_models.py; mini-swe-agent's chat
    completions: tests/scripted_llm.py), the key by the test's, the benchmark by a copy of rpn named and of the
    language each selects (a Go task, a task named pandoc); ``runs/my-run`` holds a known-good submission for it.
    ``out.xml``'s token properties are exactly what the server sent."""
    from tests.doc_commands import Substitution, block
    from tests.scripted_models import ScriptedModels
    from tests.test_cli_agents import STEPS

    require_minisweagent()
    monkeypatch.setenv("OPENAI_API_KEY", README_KEY)
    commands = block(*HEADLINE)
    assert len(commands) == 3, commands
    turns = script()
    with ScriptedModels(STEPS) as models, ScriptedLLM(turns) as llm:
        table = Substitution({"https://api.openai.com": models.base_url.removesuffix("/v1"),
                              "https://api.example": llm.base_url.removesuffix("/v1")}, {"OPENAI_API_KEY": README_KEY})
        assert table.env(commands) == {"OPENAI_API_KEY": README_KEY}
        codex, mini, evaluate = (table.words(c) for c in commands)
        table.check_all_used()

        result, cwd, task = _readme_session(pytester, testbed, docker_client, monkeypatch, "codex", codex)
        run = _passed(result, cwd, task)
        assert json.loads((run / "summary.json").read_text())["tasks"][task]["language"] == "go"
        assert sorted(set(models.chosen)) == [0, 1, 2], models.chosen
        assert set(models.keys) == {README_KEY}
        props = properties(cwd / "out.xml", task)
        assert float(props["score"]) == 1.0
        assert (props["agent_exit"], props["clock_fired"], props["model_errors"]) == ("0", "", "0"), props
        assert props["model_requests_with_usage"] == str(models.sent.requests), props
        assert props["model_input_tokens"] == str(models.sent.input_tokens), props
        assert props["model_output_tokens"] == str(models.sent.output_tokens), props
        assert props["model_total_tokens"] == str(models.sent.input_tokens + models.sent.output_tokens), props

        result, cwd, task = _readme_session(pytester, testbed, docker_client, monkeypatch, "mini", mini)
        _passed(result, cwd, task)
        assert "pandoc" in task
        assert len(llm.requests) == len(turns), llm.requests
        assert llm.unexpected == [], llm.unexpected

    good = testbed.submissions / RPN

    def submissions(cwd: Path, task: str) -> None:
        (cwd / "runs" / "my-run" / task).mkdir(parents=True)
        shutil.copy2(good / "submission.tar.gz", cwd / "runs" / "my-run" / task / "submission.tar.gz")

    result, cwd, task = _readme_session(pytester, testbed, docker_client, monkeypatch, "evaluate", evaluate,
                                        submissions)
    _passed(result, cwd, task)


@pytest.mark.docker
@pytest.mark.users_defaults
@pytest.mark.usefixtures("clean_env")
def test_the_readme_first_real_evaluation_runs_as_written(pytester: pytest.Pytester, testbed: Testbed,
                                                          docker_client: Any, host_env: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """README's "Your first real evaluation", each command as written: the preflight (nothing missing, nothing run),
    ``-k cmatrix`` (mini-swe-agent through the relay solves it, every detail of the conversation checked:
    :func:`check_solved_by_the_script`), then the lot under ``-n 8`` with ``--pb-budget 50 --pb-token-price
    0.25,2`` (passed, the spend priced from the tokens our server reported). Substituted (tests/doc_commands.py):
    OpenAI by our scripted chat-completions server (a fresh one per command: it replays its script once),
    ``OPENAI_API_KEY`` by the test's, the 200 tasks by a copy of rpn (named cmatrix for ``-k cmatrix``)."""
    from tests.doc_commands import Substitution, block

    require_minisweagent()
    commands = block(*FIRST_RUN)
    assert len(commands) == 3, commands
    turns = script()
    with ScriptedLLM(turns) as asked, ScriptedLLM(turns) as llm, ScriptedLLM(turns) as whole:
        tables = [Substitution({"https://api.openai.com": server.base_url.removesuffix("/v1")},
                               {"OPENAI_API_KEY": README_KEY}) for server in (asked, llm, whole)]
        for name, value in tables[0].env(commands).items():
            monkeypatch.setenv(name, value)
        preflight, one, lot = (table.words(c) for table, c in zip(tables, commands, strict=True))
        assert set().union(*(t.used for t in tables)) == {"https://api.openai.com"}

        result, cwd, task = _readme_session(pytester, testbed, docker_client, monkeypatch, "preflight", preflight)
        assert result.ret == 0, "\n".join([*result.outlines[-40:], *result.errlines[-20:]])
        result.stdout.fnmatch_lines(["*= programbench preflight =*", "nothing is missing"])
        assert not (cwd / "pb-runs").exists()

        result, cwd, task = _readme_session(pytester, testbed, docker_client, monkeypatch, "one", one)
        assert "cmatrix" in task
        check_solved_by_the_script(llm, turns, result, _passed(result, cwd, task), task, "gpt-5-mini", README_KEY)

        result, cwd, task = _readme_session(pytester, testbed, docker_client, monkeypatch, "lot", lot)
        run = _passed(result, cwd, task)
        assert whole.authorizations == [f"Bearer {README_KEY}"] * len(turns)
    summary = json.loads((run / "summary.json").read_text())
    tokens = summary["tasks"][task]["tokens"]
    price = tokens["input_tokens"] * 0.25 / 1e6 + tokens["output_tokens"] * 2 / 1e6
    assert summary["budget"]["limit"] == 50, summary["budget"]
    assert summary["budget"]["spent"] == pytest.approx(price, rel=1e-3), (summary["budget"], tokens)
    assert summary["budget"]["stopped"] is False
