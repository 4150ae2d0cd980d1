"""The agent's clock gives back the seconds the relay held its model requests (relay/held.py): real sessions on the
test bed against the scripted model server, three at once.

* in the sandbox (the path of every CLI preset): the server answers 429 (Retry-After: 1) for the first 14 s, longer
  than the 10 s clock; the agent asks once, works 5 s more and writes rpn's solution: it passes, ``clock_extended_s``
  ≈ the wait, in pb-meta.json and summary.json (without it the agent would be stopped at 10 s, before writing
  anything);
* a host-loop agent, the same;
* in the sandbox with nothing held (the model itself takes 4 s to answer, which is the agent's time): an agent that
  works past its 10 s is stopped on time (TERMed at 10 s), nothing given back.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TESTBED, Testbed
from tests.scripted_models import Faults, ScriptedModels, Step
from tests.test_model_outage import _sessions_at_once

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CLOCK = 10
MODEL_TIME = 4.0  # the quiet server's own answer time: the model's, not the harness's, so never given back
HELD = 14.0  # past CLOCK: the cap is the longer of the clock and the retry budget (Settings.agent_clock_cap)

# One chat request through the relay, some work, then the solution written where the agent works (its cwd).
AGENT = '''
import base64, io, json, os, sys, tarfile, time, urllib.error, urllib.request
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
began = time.monotonic()
try:
    with urllib.request.urlopen(request, timeout=300) as response:
        print("model answered", response.status, "after", round(time.monotonic() - began, 1), "s", flush=True)
except urllib.error.HTTPError as exc:  # the relay should have absorbed every 429: nothing is written then
    sys.exit(f"model answered {exc.code}")
time.sleep(float(sys.argv[1]))
tarfile.open(fileobj=io.BytesIO(base64.b64decode(SOLUTION))).extractall(sys.argv[2])
print("solution written", flush=True)
'''


def _agent_script() -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(TESTBED / "solutions" / RPN, arcname=".")
    return f"SOLUTION = {base64.b64encode(buffer.getvalue()).decode()!r}\n" + AGENT


def _args(testbed: Testbed, server: ScriptedModels, run_dir: Path, agent: list[str]) -> list[str]:
    return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-filter", "pbfix__rpn", "--pb-pull", "never", *agent,
            "--pb-agent-timeout", str(CLOCK), "--pb-cpus", "2", "--pb-infra-retries", "0",
            "--pb-model-endpoint", server.base_url, "--pb-output", str(run_dir)]


def _agent_meta(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / RPN / "pb-meta.json").read_text())["agent"])


def test_held_model_requests_give_the_clock_back(pytester: pytest.Pytester, testbed: Testbed,
                                                 docker_client: Any) -> None:
    script = _agent_script()
    encoded = base64.b64encode(script.encode()).decode()
    host_script = pytester.path / "agent.py"
    host_script.write_text(script)

    def in_sandbox(work: float) -> list[str]:
        return ["--pb-agent", f"echo {encoded} | base64 -d > /tmp/agent.py && python3 /tmp/agent.py {work} ."]

    # The host-loop agent writes into the sandbox through PB_SANDBOX_EXEC.
    solution = pytester.mkdir("host-solution")
    on_host = ["--pb-agent", f"{sys.executable} {host_script} 5 {solution} && tar -C {solution} -c . | "
               "$PB_SANDBOX_EXEC 'tar -x -C /workspace/src'", "--pb-agent-on-host"]
    limited = Faults(rate_limit_for=HELD, retry_after="1")
    with ScriptedModels([Step("done", None, 10, 2)], faults=limited) as sandboxed, \
            ScriptedModels([Step("done", None, 10, 2)], faults=limited) as hosted, \
            ScriptedModels([Step("done", None, 10, 2)], faults=Faults(delay=MODEL_TIME)) as quiet:
        runs = {name: pytester.path / name / "run" for name in ("sandboxed", "hosted", "quiet")}
        results = _sessions_at_once(pytester, {
            "sandboxed": _args(testbed, sandboxed, runs["sandboxed"], in_sandbox(5)),
            "hosted": _args(testbed, hosted, runs["hosted"], on_host),
            "quiet": _args(testbed, quiet, runs["quiet"], in_sandbox(CLOCK + 12)),
        }, timeout=600)
    for name in ("sandboxed", "hosted"):
        out = "\n".join(results[name].outlines)
        log = (runs[name] / RPN / "agent.log").read_text(errors="replace")
        assert results[name].ret == 0, (name, out[-2000:], log[-2000:], _agent_meta(runs[name]))
        results[name].assert_outcomes(passed=1)
        agent = _agent_meta(runs[name])
        assert not agent["timed_out"], agent
        assert HELD - 2 <= agent["clock_extended_s"] <= HELD + 4, agent
        assert agent["seconds"] > HELD, agent  # it ran past its own 10 s, on the seconds given back
        task = json.loads((runs[name] / "summary.json").read_text())["tasks"][RPN]
        assert task["clock_extended_s"] == agent["clock_extended_s"], task
        assert "model answered 200" in log, log[-2000:]
        assert "solution written" in log, log[-2000:]
    quiet_out = "\n".join(results["quiet"].outlines)
    results["quiet"].assert_outcomes(failed=1)
    agent = _agent_meta(runs["quiet"])
    assert agent["timed_out"], agent
    assert agent["clock_extended_s"] < 1, agent
    assert agent["seconds"] < CLOCK + 5, (agent, quiet_out[-2000:])  # TERMed at its clock, not at the grace's end
    quiet_log = (runs["quiet"] / RPN / "agent.log").read_text(errors="replace")
    assert "model answered 200" in quiet_log, quiet_log[-2000:]
    assert "solution written" not in quiet_log
