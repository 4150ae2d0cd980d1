"""Outage is not a score: real sessions on the test bed whose agent talks to the scripted model server through the
relay while the server fails.

* an outage longer than ``--pb-model-retry-budget``: the task is an error naming the status and count, never a 0,
  its files kept, counted apart in summary.json; ``--pb-resume`` runs it again once the server is back and it passes;
* a rejected key: the session stops after the first two tasks with one message, the third is not run.

The agent is a host-loop Python script: one chat request to the relay (``OPENAI_BASE_URL``), then rpn's solution into
the sandbox, so that every task it touches would pass if it were scored.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TESTBED, Testbed
from tests.scripted_models import Faults, ScriptedModels, Step

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
AGENT = '''
import json, os, subprocess, sys, threading, urllib.error, urllib.request
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

def ask():
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            print("model answered", response.status)
    except urllib.error.HTTPError as exc:
        print("model answered", exc.code)

if sys.argv[3:] == ["serial"]:  # one after the other
    for _ in range(int(sys.argv[2])):
        ask()
else:  # all at once
    threads = [threading.Thread(target=ask) for _ in range(int(sys.argv[2]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
task = os.environ["PB_TASK_ID"]
subprocess.run(f"tar -C {sys.argv[1]}/{task} -c . | {os.environ['PB_SANDBOX_EXEC']} 'tar -x -C /workspace/src'",
               shell=True, check=True)
'''


def _session(pytester: pytest.Pytester, testbed: Testbed, server: ScriptedModels, run_dir: Path, pattern: str,
             *extra: str, requests: int = 1, serial: bool = False) -> pytest.RunResult:
    agent = pytester.path / "agent.py"
    agent.write_text(AGENT)
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", pattern, "--pb-pull", "never",
        "--pb-agent", f"{sys.executable} {agent} {TESTBED}/solutions {requests}" + (" serial" if serial else ""),
        "--pb-agent-on-host", "--pb-agent-timeout", "300", "--pb-cpus", "2", "--pb-infra-retries", "1",
        "--pb-model-endpoint", server.base_url, "--pb-output", str(run_dir), *extra, timeout=600)


def test_outage_past_the_budget_is_an_error_then_resumed(pytester: pytest.Pytester, testbed: Testbed,
                                                         docker_client: Any) -> None:
    run_dir = pytester.path / "run"
    with ScriptedModels([Step("done", None, 10, 2)], faults=Faults(unavailable_for=1e9)) as server:
        first = _session(pytester, testbed, server, run_dir, "pbfix__rpn", "--pb-model-retry-budget", "2")
        first.assert_outcomes(errors=1)
        reason = "model API unavailable: 1 request(s) given up after the retry budget of 2 s (1 answered 503)"
        first.stdout.fnmatch_lines([f"*{reason}*", "*to resume*"])
        assert "infrastructure retry" not in first.stdout.str()  # the agent ran once: never run a second time
        summary = json.loads((run_dir / "summary.json").read_text())
        task = summary["tasks"][RPN]
        assert task["outcome"] == "error"
        assert task["score"] is None  # not a 0
        assert summary["headline"]["model_unavailable"] == 1
        assert summary["headline"]["errors"] == 1
        assert summary["headline"]["scored"] == 0
        meta = json.loads((run_dir / RPN / "pb-meta.json").read_text())
        assert meta["state"] == "error"
        assert meta["model_unavailable"] == reason
        assert meta["relay"]["gave_up"] == 1
        assert meta["relay"]["retries"] >= 1
        assert (run_dir / RPN / "submission.tar.gz").is_file(), "the agent's files are kept for inspection"
        [record] = [json.loads(line) for line in (run_dir / RPN / "model-requests.jsonl").read_text().splitlines()]
        assert record["status"] == 503
        assert record["gave_up"]
        assert [t["status"] for t in record["retries"]] == [503] * len(record["retries"])

        server.faults = Faults()  # the provider is back
        second = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-resume", str(run_dir), timeout=600)
    second.assert_outcomes(passed=1)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks"][RPN]["outcome"] == "passed"
    assert summary["headline"]["model_unavailable"] == 0


def test_rejected_key_stops_the_session(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any) -> None:
    run_dir = pytester.path / "run"
    with ScriptedModels([Step("done", None, 10, 2)], faults=Faults(reject_key=True)) as server:
        result = _session(pytester, testbed, server, run_dir, "pbfix__")
    result.assert_outcomes(errors=2)
    out = result.stdout.str()
    assert out.count("programbench: stopping: model API rejected the key: 1 request(s) (1 answered 401) on each "
                     "of the first 2 tasks") >= 1, out[-3000:]
    assert server.statuses == [401, 401], "the third task never started"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["headline"]["model_unavailable"] == 2
    assert summary["headline"]["not_run"] == 1


def test_concurrency_shared_by_every_worker(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any) -> None:
    """Four items under -n 4, each agent sending four requests at once to a server that takes half a second each:
    never more than two in flight at the server, the waits recorded. With --pb-model-rpm 14 the four workers share
    one bucket of 14 requests: the 15th and 16th wait for its refill (one every 60/14 s), recorded apart."""
    run_dir = pytester.path / "run"
    with ScriptedModels([Step("done", None, 10, 2)], faults=Faults(delay=0.5)) as server:
        result = _session(pytester, testbed, server, run_dir, "pbfix__rpn|pbfix__catlike", "-n", "4",
                          "--pb-attempts", "2", "--pb-model-concurrency", "2", "--pb-model-rpm", "14",
                          "--pb-progress", "lines:0.5", requests=4)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*attempt-* agent (waiting for a model slot) *"])  # the live view, per attempt
    result.stdout.fnmatch_lines(["*attempt-* agent (waiting for the model rate limit * s) *"])
    assert server.statuses == [200] * 16
    assert server.peak_in_flight == 2
    relays = [json.loads(p.read_text())["relay"] for p in run_dir.rglob("pb-meta.json")]
    assert len(relays) == 4
    assert sum(relay["slot_wait_s"] for relay in relays) > 0
    state = json.loads((run_dir / ".pb-model-slots" / "rate.json").read_text())
    assert state["sent"] == 16, state  # one bucket for the four workers' relays
    spans = [round(later - server.arrivals[0], 2) for later in server.arrivals]
    # 16 requests from a bucket of 14: two refills (one every 60/14 s), so the last arrives about 8.6 s after the first;
    # with one it would be about 4.3 s. The first request's arrival may lag its token by a few tenths under load.
    assert spans[-1] >= 2 * 60 / 14 - 0.5, spans
    assert sum(relay["rate_wait_s"] for relay in relays) > 0, relays


# Sends the task's prompt to the model, writes the answer it got into the workspace next to rpn's solution.
REPLAY_AGENT = '''
import json, os, subprocess, sys, urllib.request
prompt = subprocess.run(f"{os.environ['PB_SANDBOX_EXEC']} 'cat {os.environ['PB_PROMPT_FILE']}'", shell=True,
                        check=True, capture_output=True, text=True).stdout
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
try:
    answer = urllib.request.urlopen(request, timeout=120).read()
except urllib.error.HTTPError as exc:
    answer = exc.read()
subprocess.run(f"{os.environ['PB_SANDBOX_EXEC']} 'cat > /workspace/src/answer.json'", shell=True, check=True,
               input=answer)
subprocess.run(f"tar -C {sys.argv[1]}/{os.environ['PB_TASK_ID']} -c . | {os.environ['PB_SANDBOX_EXEC']} "
               "'tar -x -C /workspace/src'", shell=True, check=True)
'''


def _answer(run_dir: Path) -> bytes:
    with tarfile.open(run_dir / RPN / "submission.tar.gz") as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith("answer.json"))
        handle = archive.extractfile(member)
        assert handle is not None
        return handle.read()


def test_replay_reproduces_the_agent_offline_and_names_the_first_mismatch(pytester: pytest.Pytester, testbed: Testbed,
                                                                        docker_client: Any) -> None:
    agent = pytester.path / "replay_agent.py"
    agent.write_text(REPLAY_AGENT)

    def session(run_dir: Path, endpoint: str, *extra: str) -> pytest.RunResult:
        return pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-filter", "pbfix__rpn", "--pb-pull", "never",
            "--pb-agent", f"{sys.executable} {agent} {TESTBED}/solutions", "--pb-agent-on-host",
            "--pb-agent-timeout", "300", "--pb-cpus", "2", "--pb-infra-retries", "0", "--pb-model-endpoint", endpoint,
            "--pb-output", str(run_dir), *extra, timeout=600)

    recorded = pytester.path / "recorded"
    with ScriptedModels([Step("done", None, 10, 2)]) as server:
        session(recorded, server.base_url).assert_outcomes(passed=1)
        endpoint = server.base_url
    assert server.statuses == [200]
    # The server is gone: the replay may not contact it (a connection would be refused and retried, then an error).
    replayed = pytester.path / "replayed"
    session(replayed, endpoint, "--pb-agent-replay", str(recorded), "--pb-model-retry-budget", "1").assert_outcomes(
        passed=1)
    assert _answer(replayed) == _answer(recorded)  # the same answer, so the same submission
    assert b"chat.completion" in _answer(recorded)

    template = pytester.path / "changed.j2"
    template.write_text("A changed prompt for {{ task.instance_id }}.\n")
    changed = pytester.path / "changed"
    result = session(changed, endpoint, "--pb-agent-replay", str(recorded), "--pb-prompt-template", str(template))
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*--pb-agent-replay: first mismatch: request 1 (POST /v1/chat/completions) matches "
                                 "no recorded request*"])
    meta = json.loads((changed / RPN / "pb-meta.json").read_text())
    assert meta["state"] == "error"
    assert "A changed prompt" in meta["infra_error"]  # the diff shows what changed


RATE_LIMITED_S = 60.0  # the minute of 429s at the start


def _sessions_at_once(pytester: pytest.Pytester, sessions: dict[str, list[str]],
                      timeout: float) -> dict[str, pytest.RunResult]:
    """pytest sessions started together, each in a directory of its own (output files, basetemp, cwd), then waited
    for: what ``runpytest_subprocess`` does for one, without paying their waits one after the other."""
    started: dict[str, tuple[subprocess.Popen[bytes], Path, float]] = {}
    try:
        for name, args in sessions.items():
            where = pytester.mkdir(name)
            with (where / "stdout").open("w") as out, (where / "stderr").open("w") as err:
                started[name] = (pytester.popen([sys.executable, "-m", "pytest", f"--basetemp={where / 'tmp'}", *args],
                                                stdout=out, stderr=err, cwd=where), where, time.monotonic())
        deadline = time.monotonic() + timeout
        results = {}
        for name, (proc, where, began) in started.items():
            ret = proc.wait(max(1.0, deadline - time.monotonic()))
            outlines = (where / "stdout").read_text(errors="replace").splitlines()
            errlines = (where / "stderr").read_text(errors="replace").splitlines()
            results[name] = pytest.RunResult(ret, outlines, errlines, time.monotonic() - began)
        return results
    finally:
        for proc, _, _ in started.values():
            if proc.poll() is None:  # timed out, or the test failed while it ran
                proc.kill()
                proc.wait()


def test_cli_agents_solve_a_task_while_the_provider_rate_limits_at_the_start(
        pytester: pytest.Pytester, testbed: Testbed, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real codex and claude-code presets each solve rpn while their scripted server answers 429
    (Retry-After: 2) to every model request of its first minute: the item passes, every 429 stays in the relay (the
    CLI gets only the final 200s, one per model request it sent), the retries and the minute waited are metered in
    the records, pb-meta.json and summary.json. The two sessions run at once, so the minute is paid once."""
    from pytest_programbench.agents import agent_presets
    from tests.test_cli_agents import KEY, STEPS, check_conversation, check_session, session_args

    presets = ("codex", "claude-code")
    for preset in presets:
        parsed = agent_presets.parse(preset)
        assert parsed is not None
        agent_presets.ensure_installed(*parsed)
    monkeypatch.setenv("PB_TEST_MODEL_KEY", KEY)
    faults = Faults(rate_limit_for=RATE_LIMITED_S, retry_after="2")
    with ScriptedModels(STEPS, faults=faults) as codex, ScriptedModels(STEPS, faults=faults) as claude:
        servers = dict(zip(presets, (codex, claude), strict=True))
        results = _sessions_at_once(pytester, {
            preset: session_args(testbed, preset, server, pytester.path / preset / "run",
                                 pytester.path / preset / "junit.xml") for preset, server in servers.items()},
            timeout=900)
    for preset, server in servers.items():
        run_dir = pytester.path / preset / "run"
        check_session(results[preset], run_dir, pytester.path / preset / "junit.xml")
        check_conversation(run_dir, server, preset)  # solved, every step answered, tokens exact, key unseen
        limited = server.statuses.count(429)
        assert limited >= RATE_LIMITED_S / 2.2, (preset, server.statuses)  # a try every 2-2.2 s for the minute
        assert set(server.statuses) == {429, 200}, (preset, server.statuses)
        records = [json.loads(line) for line in (run_dir / RPN / "model-requests.jsonl").read_text().splitlines()]
        model = [r for r in records if r["api"] in ("responses", "anthropic.messages")
                 and not r["path"].endswith("/count_tokens")]
        # What the CLI got: one 200 per model request, each the server's 200 after the relay's tries of 429s.
        assert [r["status"] for r in model] == [200] * server.statuses.count(200), (preset, model)
        assert not [r for r in records if r["status"] == 429], (preset, "a 429 reached the CLI")
        assert [t["status"] for r in model for t in r["retries"]] == [429] * limited, preset
        waited = sum(r["retry_wait_s"] for r in model)
        assert waited >= RATE_LIMITED_S - 3, (preset, waited)  # the first request alone waited out the minute
        meta = json.loads((run_dir / RPN / "pb-meta.json").read_text())
        relay = meta["relay"]
        assert (relay["retries"], relay["gave_up"], relay["errors"]) == (limited, 0, 0), (preset, relay)
        # The minute the relay held the CLI's first request was given back to its clock (tests/test_agent_clock.py).
        assert meta["agent"]["clock_extended_s"] >= RATE_LIMITED_S - 3, (preset, meta["agent"])
        assert relay["retry_wait_s"] == pytest.approx(waited, abs=0.01), (preset, relay)
        summary = json.loads((run_dir / "summary.json").read_text())
        tokens = summary["tasks"][RPN]["tokens"]
        assert (tokens["retries"], tokens["gave_up"]) == (limited, 0), (preset, tokens)
        assert tokens["retry_wait_s"] == pytest.approx(waited, abs=0.01), (preset, tokens)
        assert summary["tokens"]["retries"] == limited, preset
        assert (summary["headline"]["errors"], summary["headline"]["model_unavailable"]) == (0, 0), preset
        page = (run_dir / "report.html").read_text()
        text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))  # what the page says
        assert f"Model API: {limited} retries ({summary['tokens']['retry_wait_s']:.0f} s waited)" in text, preset
        assert f" {limited} ({tokens['retry_wait_s']:.0f} s waited) " in text, preset  # the task's row


def test_budget_ends_the_running_task_stops_new_ones_and_resume_continues(pytester: pytest.Pytester,
                                                                         testbed: Testbed, docker_client: Any) -> None:
    """Each answer costs $1.10 (11 input tokens at $100,000 per million); each agent asks three times in a row; the
    budget is $1. The first task's third request finds $2.20 spent, past $1.10: refused, the task an error naming
    the budget; no other task starts. Resumed with a larger budget, all three run and pass. Spent and projected are
    in summary.json's ``budget``, the terminal summary and the live view's header."""
    run_dir = pytester.path / "run"
    with ScriptedModels([Step("done", None, 10, 2)]) as server:
        first = _session(pytester, testbed, server, run_dir, "pbfix__", "--pb-budget", "1", "--pb-token-price",
                         "100000,0", "--pb-progress", "lines:0.5", requests=3, serial=True)
        first.assert_outcomes(errors=1)
        assert server.statuses == [200, 200], "the third request was never forwarded"
        first.stdout.fnmatch_lines([
            "programbench 0/3: * | budget $*of $1 (projected $*)",  # the live view's header
            "*model budget spent: 1 request(s) refused once the run had spent $2.2000 of --pb-budget $1 (x1.1)*",
            "budget $2.2000 of $1 (projected $2.2000); it stopped the run: the tasks not started are not run",
            "*programbench: stopping: budget: $2.2000 spent + $0.0000 projected for 0 running task(s) passes "
            "--pb-budget $1*"])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["headline"]["errors"] == 1
        assert summary["headline"]["not_run"] == 2
        assert summary["headline"]["scored"] == 0
        assert summary["budget"] == {"limit": 1.0, "spent": 2.2, "projected": 2.2, "running": 0, "refused_past": 1.1,
                                     "stopped": True}
        second = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-resume", str(run_dir),
                                               "--pb-budget", "100", timeout=600)
    second.assert_outcomes(passed=3)
    assert len(server.statuses) == 2 + 9
    budget = json.loads((run_dir / "summary.json").read_text())["budget"]
    assert (budget["limit"], budget["spent"], budget["stopped"]) == (100.0, 12.1, False)  # 2.2 before, 9 x 1.1 now
    second.stdout.fnmatch_lines(["budget $12.1000 of $100 (projected $12.1000)"])
