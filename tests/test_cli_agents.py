"""The CLI agents people run (codex, claude-code, opencode), for real, offline.

Each preset's native build comes from npm (installed once per machine into the plugin's cache by the set-up), runs
as the agent user in a fixture task's sandbox, and follows a scripted conversation from our own model server on
loopback, reached only through the relay: probe ``/workspace/binary``, write the known-good solution, say done.
Each preset's session is the command docs/agents.md shows for it ("CLI agents (codex, claude-code, opencode)"), run
as written with only the outside world substituted (tests/doc_commands.py).
"""

from __future__ import annotations

import json
import os
import shlex
import tarfile
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.agents import agent_presets
from pytest_programbench.relay.contract import PLACEHOLDER_KEY
from tests.conftest import TESTBED, Testbed
from tests.doc_commands import Substitution, block, option, stand_in, written_run_dir
from tests.scripted_models import ScriptedModels, Step
from tests.secret_scan import assert_secret_nowhere

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
PRESETS = ("codex", "claude-code", "opencode")
SOLUTION = TESTBED / "solutions" / RPN


def _heredoc(path: str) -> str:
    text = (SOLUTION / path).read_text()
    assert "PB_EOF" not in text
    return f"cat > /workspace/src/{path} <<'PB_EOF'\n{text.rstrip()}\nPB_EOF"


# Written by the agent, never copied from a mount: the docs' commands mount nothing.
WRITE_SOLUTION = f"{_heredoc('main.c')}\n{_heredoc('compile.sh')}\nchmod +x /workspace/src/compile.sh"
STEPS = (
    Step("Probing the reference.", '/workspace/binary </dev/null; echo "binary exited $?"', 1200, 40, 500),
    Step("Writing the solution.", WRITE_SOLUTION, 1500, 60, 1100),
    Step("Done: the solution is in /workspace/src.", None, 1700, 25, 1400),
)
# Several times the engine client's read timeout (scaled down below), far under any CLI's own stream timeout.
READ_TIMEOUT = "4"
KEY = "sk-host-only-9c2e41"  # the relay adds it; the CLI sees a placeholder
SILENCE = 15.0
# docs/agents.md's block, and what stands in for the outside world it names (tests/doc_commands.py): the providers'
# APIs and a local server by our scripted model server, the user's keys by keys of the test's.
AGENTS_DOC = ("agents.md", "CLI agents (codex, claude-code, opencode)")
ANTHROPIC_KEY = "sk-ant-host-only-51d7e0"
PROVIDERS = ("https://api.openai.com", "https://api.anthropic.com", "http://127.0.0.1:8000")
KEYS = {"OPENAI_API_KEY": KEY, "ANTHROPIC_API_KEY": ANTHROPIC_KEY}


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest) -> str:
    """The preset, installed from npm now (cached per machine): the sessions below find it in the cache."""
    name = str(request.param)
    parsed = agent_presets.parse(name)
    assert parsed is not None
    installed = agent_presets.ensure_installed(*parsed)
    assert installed.pick("glibc") is not None, installed
    return name


def session_args(testbed: Testbed, preset: str, server: ScriptedModels, run_dir: Path, junit: Path) -> list[str]:
    """The session that runs ``preset`` on rpn against ``server`` (the key in $PB_TEST_MODEL_KEY, see :data:`KEY`)."""
    return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
            "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2", "--pb-output", str(run_dir),
            "--pb-agent", preset, "--pb-model", "scripted-model", "--pb-model-endpoint", server.base_url,
            "--pb-model-key-env", "PB_TEST_MODEL_KEY",
            "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-agent-timeout", "600", "--junitxml", str(junit)]


def check_session(result: pytest.RunResult, run_dir: Path, junit: Path | None, task: str = RPN,
                  secrets: tuple[str, ...] = (KEY,)) -> None:
    """The item passed (else the agent's log is shown) and the keys are nowhere in what the session left."""
    log = (run_dir / task / "agent.log").read_text(errors="replace") if (run_dir / task / "agent.log").exists() \
        else "(no agent.log)"
    assert result.ret == 0, "\n".join(result.outlines[-40:]) + "\n--- agent.log:\n" + log[-6000:]
    result.assert_outcomes(passed=1)
    for secret in secrets:
        assert_secret_nowhere(secret, run_dir=run_dir, junit=junit, result=result)


def check_conversation(run_dir: Path, server: ScriptedModels, preset: str, task: str = RPN, key: str = KEY,
                       secrets: tuple[str, ...] = (KEY,)) -> None:
    """``key``: what the provider must have got (the host's key the relay adds, or its placeholder without one);
    ``secrets``: host keys that must reach neither the sandbox nor the transcript."""
    assert not server.unexpected, server.unexpected
    assert set(server.keys) == {key}, server.keys  # in whichever header the API uses, added by the relay
    # Every step of the script was answered, in order, and the agent stopped after the last one.
    assert sorted(set(server.chosen)) == [0, 1, 2], server.chosen
    assert server.chosen[-1] == 2, server.chosen
    summary = json.loads((run_dir / "summary.json").read_text())
    row = summary["tasks"][task]
    assert row["agent_exit"] == 0, row
    # The tokens recorded are exactly those the server sent, every request metered.
    tokens = row["tokens"]
    assert tokens["requests_with_usage"] == server.sent.requests, (tokens, server.log)
    assert tokens["input_tokens"] == server.sent.input_tokens, (tokens, server.sent)
    assert tokens["output_tokens"] == server.sent.output_tokens, (tokens, server.sent)
    assert tokens["cached_input_tokens"] == server.sent.cached_tokens, (tokens, server.sent)
    # Turns and tool calls, read from the responses as they streamed through the relay.
    assert tokens["turns"] == server.sent.requests, (tokens, server.log)
    assert tokens["errors"] == 0, (tokens, server.log)  # start-up probes answered, nothing refused
    assert tokens["cleanroom_refused"] == 0, tokens  # the cleanroom relay lets every request of the CLI through
    # No tool that reaches the web is offered to the model: codex's web search and opencode's webfetch are off, and
    # claude-code's WebSearch and WebFetch (the latter fetches from the sandbox, the former is Anthropic's server tool).
    offered = {str(tool.get("name") or (tool.get("function") or {}).get("name") or tool.get("type")).lower()
               for body in server.bodies for tool in body.get("tools") or [] if isinstance(tool, dict)}
    assert offered, server.bodies[:1]
    # The CLI names its version to the provider (what a provider refusing outdated clients reads: agent_loop.py).
    version = agent_presets.parse(preset)[1]  # type: ignore[index]
    assert server.user_agents, server.log
    assert all(version in agent for agent in server.user_agents), server.user_agents
    assert not offered & {"websearch", "webfetch", "web_search", "web_fetch", "web_search_preview"}, sorted(offered)
    assert tokens["tool_calls"] == server.sent.tool_calls >= 2, (tokens, server.sent)
    assert tokens["model_latency_s"] > 0, tokens
    totals = summary["tokens"]  # the run's totals sum them
    assert (totals["turns"], totals["tool_calls"], totals["cached_input_tokens"]) == (
        tokens["turns"], tokens["tool_calls"], tokens["cached_input_tokens"]), totals
    # The CLI's own transcript was copied out, and names the command it ran.
    transcript = run_dir / task / "trajectory.jsonl"
    assert transcript.is_file(), sorted(p.name for p in (run_dir / task).iterdir())
    assert "cat > /workspace/src/main.c <<" in transcript.read_text(errors="replace")
    meta = json.loads((run_dir / task / "pb-meta.json").read_text())
    assert meta["agent"]["transcript"] == "trajectory.jsonl", meta["agent"]
    # The agent's probe went through the proxy to the reference; its config stayed out of the submission.
    assert meta["binary_calls"] >= 1, meta
    with tarfile.open(run_dir / task / "submission.tar.gz") as tar:
        names = tar.getnames()
    assert not [n for n in names if ".codex" in n or ".claude" in n or "opencode" in n], names
    log = (run_dir / task / "agent.log").read_text(errors="replace")
    assert f"{preset}@" in log, log[:2000]
    assert "build for a glibc image" in log, log[:2000]
    for secret in secrets:
        assert secret not in log, "the key reached the sandbox"
        assert secret not in transcript.read_text(errors="replace"), "the key reached the sandbox"


@pytest.mark.parametrize("api", ["responses", "chat", "anthropic"])
@pytest.mark.parametrize("call", [None, ("bash", {"command": "true"})])
def test_relay_meters_what_the_scripted_server_streams(api: str, call: tuple[str, dict[str, Any]] | None) -> None:
    """The relay's tap reads usage and tool calls from exactly the event shapes the real CLIs accepted above."""
    from pytest_programbench.relay.relay import UsageTap
    from tests import scripted_models as sm

    step = Step("hi", "true" if call else None, 321, 12, 100)
    events = {"responses": lambda: sm._responses_events("m", step, call),
              "chat": lambda: sm._chat_events("m", step, call, True),
              "anthropic": lambda: sm._anthropic_events("m", step, call)}[api]()
    tap = UsageTap("text/event-stream", "")
    for name, payload in events:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        tap.feed(((f"event: {name}\n" if name else "") + f"data: {data}\n\n").encode())
    usage = tap.finish()
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.cached_input_tokens) == (321, 12, 100)
    assert tap.tool_calls == (1 if call else 0)


def test_relay_answers_the_start_up_probe_itself() -> None:
    """claude-code's ``HEAD /`` outside the endpoint's ``/v1``: answered by the relay, not refused, not forwarded."""
    import http.client

    from pytest_programbench.relay.relay import ModelRelay

    with ScriptedModels(STEPS) as server, ModelRelay(server.base_url, unix=False, tcp=True) as relay:
        address = relay.tcp_address
        assert address is not None
        statuses = []
        for method, path in (("HEAD", "/"), ("HEAD", "/elsewhere"), ("GET", "/v1/models")):
            conn = http.client.HTTPConnection(*address, timeout=30)
            conn.request(method, path)
            response = conn.getresponse()
            response.read()
            statuses.append(response.status)
            conn.close()
    assert statuses == [200, 404, 200]
    assert server.log == ["GET /v1/models"]


def test_relay_ignores_proxy_settings_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP(S)_PROXY on the host never reroutes the relay: it goes to the endpoint and nowhere else."""
    import http.client
    import socket

    from pytest_programbench.relay.relay import ModelRelay

    with socket.socket() as proxy:  # a would-be proxy that only counts who connects
        proxy.bind(("127.0.0.1", 0))
        proxy.listen(8)
        proxy.settimeout(0)
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.getsockname()[1]}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        with ScriptedModels(STEPS) as server, ModelRelay(server.base_url, unix=False, tcp=True) as relay:
            address = relay.tcp_address
            assert address is not None
            conn = http.client.HTTPConnection(*address, timeout=30)
            conn.request("GET", "/v1/models")
            response = conn.getresponse()
            assert (response.status, json.loads(response.read())["data"][0]["id"]) == (200, "scripted")
            conn.close()
        with pytest.raises(BlockingIOError):
            proxy.accept()
    assert server.log == ["GET /v1/models"]


def agents_doc_commands(preset: str, substitution: Substitution) -> tuple[str, list[str], dict[str, str]]:
    """docs/agents.md's command for ``preset``, its words substituted, and the block's environment (its ``export``
    and the keys its commands name). Every command of the block is substituted, so the table covers exactly them."""
    commands = block(*AGENTS_DOC)
    env = substitution.env(commands)
    runs = {command: substitution.words(command) for command in commands if command.startswith("pytest ")}
    substitution.check_all_used()
    assert sorted(str(option(w, "--pb-agent")).split("@")[0] for w in runs.values()) == sorted(PRESETS), runs
    command, words = next((c, w) for c, w in runs.items() if str(option(w, "--pb-agent")).split("@")[0] == preset)
    pinned = str(option(words, "--pb-agent")).partition("@")[2]
    assert pinned in ("", agent_presets.PRESETS[preset].default_version), \
        f"{command!r} pins a version other than the default the set-up installs"
    return command, words, env


def test_cli_agent_solves_a_task_through_the_relay_outlasting_a_withheld_first_response(
        pytester: pytest.Pytester, testbed: Testbed, docker_client: Any, preset: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/agents.md's command for the preset, as written (its endpoint our scripted server's, its keys the test's,
    the benchmark a copy of rpn: tests/doc_commands.py): the real CLI solves the task through the relay (the whole
    conversation checked: every step answered in order, tokens metered exactly, transcript copied out, no key of
    the host's in the sandbox, the named one, or none, upstream), although its first model response is withheld for
    several times the engine client's read timeout: no timeout in the path (engine exec stream, bridge, relay) cuts
    the wait. One session for all of it: a CLI agent's session is the costly part."""
    monkeypatch.setenv("PB_DOCKER_API_TIMEOUT", READ_TIMEOUT)
    with ScriptedModels(STEPS, withhold_first=SILENCE) as server:
        origin = server.base_url.removesuffix("/v1")
        command, words, env = agents_doc_commands(preset, Substitution(dict.fromkeys(PROVIDERS, origin), KEYS))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with stand_in(pytester.path / "bench", testbed, docker_client, words) as bench:
            result = pytester.runpytest_subprocess(*words, *bench.args, timeout=900)
            run = written_run_dir(pytester.path, result)
            check_session(result, run, None, bench.task, tuple(env.values()))
    key_env = option(shlex.split(command), "--pb-model-key-env")
    check_conversation(run, server, preset, bench.task, env[key_env] if key_env else PLACEHOLDER_KEY,
                       tuple(env.values()))
    records = [json.loads(line) for line in (run / bench.task / "model-requests.jsonl").read_text().splitlines()]
    waited = [r for r in records if r["first_byte_s"] is not None and r["first_byte_s"] >= SILENCE]
    assert len(waited) == 1, records
    assert (waited[0]["status"], waited[0]["error"]) == (200, None), records


# ---------------------------------------------------------------------------------------------- installing


FAKE_NPM = """#!/bin/sh
# Stands in for npm: records the call, lays out codex's platform package as the registry's would.
echo "$@" >> "$PB_FAKE_NPM_CALLS"
[ -n "$PB_FAKE_NPM_FAIL" ] && { echo "npm error 404 Not Found - $PB_FAKE_NPM_FAIL" >&2; exit 1; }
# Hold the install open while a second, unlocked install could start (then it shows as a second call line).
[ -n "$PB_FAKE_NPM_HOLD" ] && for _ in $(seq 50); do
    [ "$(wc -l < "$PB_FAKE_NPM_CALLS")" -gt 1 ] && break; sleep 0.1
done
while [ $# -gt 0 ]; do [ "$1" = --prefix ] && prefix=$2; shift; done
dir="$prefix/node_modules/@openai/codex/vendor/x86_64-unknown-linux-musl"
mkdir -p "$dir/bin" "$dir/codex-path"
printf 'fake codex' > "$dir/bin/codex"; printf 'fake rg' > "$dir/codex-path/rg"
"""


@pytest.fixture
def fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    npm = tmp_path / "npm"
    npm.write_text(FAKE_NPM)
    npm.chmod(0o755)
    calls = tmp_path / "npm-calls"
    calls.touch()
    monkeypatch.setenv("PB_NPM", str(npm))
    monkeypatch.setenv("PB_FAKE_NPM_CALLS", str(calls))
    monkeypatch.setenv("PB_AGENT_CACHE", str(tmp_path / "cache"))
    return calls


@pytest.mark.parametrize(("variants", "libc", "expected"), [
    (("static",), "glibc", "static"), (("static",), "musl", "static"), (("static",), "unknown", "static"),
    (("glibc", "musl"), "glibc", "glibc"), (("glibc", "musl"), "musl", "musl"), (("glibc", "musl"), "unknown", "musl"),
    (("glibc",), "musl", None), (("glibc",), "unknown", None),
])
def test_build_picked_for_the_image(tmp_path: Path, variants: tuple[str, ...], libc: str, expected: str | None) -> None:
    """codex's static build runs anywhere; the others take the image's libc, musl when it cannot be told."""
    installed = agent_presets.Installed(agent_presets.PRESETS["opencode"], "1", tmp_path,
                                        {v: f"sandbox-{v}.tar" for v in variants})
    picked = installed.pick(libc)
    assert (picked[0] if picked else None) == expected


def test_concurrent_installs_run_npm_once(fake_npm: Path, tmp_path: Path) -> None:
    """Two processes (xdist workers) asking for the same preset at once: one npm install, both get it."""
    import subprocess
    import sys

    script = ("from pytest_programbench.agents import agent_presets as p; "
              "i = p.ensure_installed(*p.parse('codex@1.2.3')); print(sorted(i.variants))")
    env = {**os.environ, "PB_FAKE_NPM_HOLD": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs == ["['static']\n", "['static']\n"]
    calls = fake_npm.read_text().splitlines()
    assert len(calls) == 1, calls
    assert "@openai/codex@1.2.3-linux-x64" in calls[0]
    assert "--ignore-scripts" in calls[0]
    # What the sandbox gets: root-owned, read-only for everyone, under /opt/pb-agent.
    with tarfile.open(tmp_path / "cache" / "codex-1.2.3" / "sandbox-static.tar") as tar:
        files = {m.name: (m.uid, m.gid, m.mode) for m in tar.getmembers() if m.isfile()}
    assert files == {"opt/pb-agent/codex-1.2.3/bin/codex": (0, 0, 0o555),
                     "opt/pb-agent/codex-1.2.3/bin/rg": (0, 0, 0o555)}


@pytest.mark.parametrize("problem", ["install fails", "no npm"])
def test_preset_that_cannot_be_installed_is_a_usage_error(pytester: pytest.Pytester, testbed: Testbed,
                                                          fake_npm: Path, monkeypatch: pytest.MonkeyPatch,
                                                          problem: str) -> None:
    if problem == "install fails":
        monkeypatch.setenv("PB_FAKE_NPM_FAIL", "@openai/codex@9.9.9-linux-x64")
        expected = "`npm install @openai/codex@9.9.9-linux-x64` exited 1: npm error 404 Not Found"
    else:
        monkeypatch.delenv("PB_NPM")
        monkeypatch.setenv("PATH", str(pytester.mkdir("empty-path")))
        expected = "--pb-agent codex: npm is not on PATH"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-filter", RPN,
        "--pb-agent", "codex@9.9.9", timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.outlines[-20:]
    assert expected in "\n".join(result.errlines), result.errlines[-20:]


def test_newest_claude_code_installs_where_npm_checks_engines_strictly(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """claude-code from 2.1.198 declares ``node >= 22``; the host's Node may be older (this machine's is 20) and its
    npm may check engines strictly: the install of the native build still succeeds (nothing of it runs on the host)."""
    import subprocess

    node = subprocess.run(["node", "--version"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setenv("npm_config_engine_strict", "true")
    monkeypatch.setenv("PB_AGENT_CACHE", str(tmp_path / "cache"))
    parsed = agent_presets.parse("claude-code")
    assert parsed is not None
    assert parsed[1] == agent_presets.PRESETS["claude-code"].default_version
    installed = agent_presets.ensure_installed(*parsed)
    assert installed.pick("glibc") is not None, (node, installed)
