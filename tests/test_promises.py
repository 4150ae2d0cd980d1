"""README and docs/security.md promises that no other test checks, each in as few real sessions as possible.

Two real sessions on fixture tasks carry most of them, with small agents that record what they see:

* an in-sandbox agent (``--pb-agent-setup``, ``--pb-prompt-template``, the ``PB_*`` variables, ``--pb-model-key-env``
  through the relay, a read-only ``--pb-agent-mount``) whose submission ships a root ``conftest.py``: flagged, so the
  item fails although the score is 1.0;
* a host-loop agent (``--pb-agent-on-host``: ``PB_CONTAINER_ID``, ``PB_SANDBOX_EXEC``; the sandbox's CPU/memory
  defaults inspected on the container; ``--pb-image-tag``; ``summary.json`` written as tasks finish and its tables)
  whose flagged submissions pass under ``--pb-allow-flags``.

The rest is unit level: programbench's own ``aggregate`` when all 200 tasks are selected, the proxy daemon's bounds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Testbed
from tests.proxy_support import load_daemon
from tests.scripted_models import ScriptedModels, Step
from tests.secret_scan import assert_secret_nowhere

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
TUIISH = "pbfix__tuiish.7e1a0b2"
KEY_ENV = "PB_PROMISE_MODEL_KEY"


def _session(pytester: pytest.Pytester, testbed: Testbed, tasks: str, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", tasks, "--pb-pull", "never", "--pb-cpus", "2", "--pb-output", str(pytester.path / "run"),
        "--junitxml", str(pytester.path / "junit.xml"), "--pb-agent-timeout", "300", "--pb-branch-workers", "3",
        *args, timeout=600)


def _properties(pytester: pytest.Pytester, task: str) -> dict[str, str]:
    root = ET.parse(pytester.path / "junit.xml").getroot()
    case = next(c for c in root.iter("testcase") if c.get("name") == task)
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def _failure_text(pytester: pytest.Pytester, task: str) -> str:
    root = ET.parse(pytester.path / "junit.xml").getroot()
    case = next(c for c in root.iter("testcase") if c.get("name") == task)
    return "\n".join((f.get("message") or "") + "\n" + (f.text or "") for f in case.iter("failure"))


# -------------------------------------------------------------------------------- the in-sandbox agent's session
SANDBOX_AGENT = r'''
import json, os, shutil, stat, urllib.request
obs = {"uid": os.getuid(), "cwd": os.getcwd(), "env": {k: v for k, v in os.environ.items() if k.startswith("PB_")}}
setup = "/opt/pb-promise-setup.txt"
obs["setup"] = open(setup).read() if os.path.exists(setup) else None
obs["setup_owner"] = os.stat(setup).st_uid if os.path.exists(setup) else None
obs["prompt"] = open(os.environ["PB_PROMPT_FILE"]).read()
# The mount's directory is world-writable on the host: only the read-only mount can refuse the write.
obs["mount_mode"] = oct(stat.S_IMODE(os.stat("/pb-ro").st_mode))
try:
    with open("/pb-ro/written-by-the-agent", "w") as handle:
        handle.write("x")
    obs["mount_write"] = "ok"
except OSError as exc:
    obs["mount_write"] = os.strerror(exc.errno)
# One model call through the relay, with whatever key the agent was given.
key = os.environ.get("OPENAI_API_KEY", "")
obs["key_seen"] = key
obs["environ"] = dict(os.environ)  # the whole of it: the host's key must be nowhere in it
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                 data=json.dumps({"model": "scripted", "messages": [{"role": "user",
                                                  "content": "hi"}]}).encode(),
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as response:
    obs["model_status"] = response.status
    obs["model_answer"] = json.loads(response.read())["choices"][0]["message"]["content"]
# The work: the known-good solution, plus a root conftest.py (an integrity flag).
shutil.copytree("/pb-ro/solution", ".", dirs_exist_ok=True)
with open("conftest.py", "w") as handle:
    handle.write("# a submission's own pytest configuration\n")
print("PROMISE-OBS " + json.dumps(obs), flush=True)
'''

SETUP = "id -u > /opt/pb-promise-setup.txt; ls -A /workspace/src | wc -l >> /opt/pb-promise-setup.txt; exit 3"

TEMPLATE = "PROMISE-TEMPLATE for {{ task.instance_id }} in {{ language }}: call {{ binary }}, docs in {{ docs }}.\n"


@pytest.mark.docker
def test_an_in_sandbox_agent_gets_what_the_options_promise(pytester: pytest.Pytester, testbed: Testbed,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"sk-promise-{uuid.uuid4().hex}"
    monkeypatch.setenv(KEY_ENV, secret)
    mount = pytester.mkdir("ro")
    shutil.copytree(testbed.solutions / RPN, mount / "solution")
    (mount / "agent.py").write_text(SANDBOX_AGENT)
    for path in [mount, *mount.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    template = pytester.path / "prompt.j2"
    template.write_text(TEMPLATE)
    with ScriptedModels([Step("promised", None, 7, 3)]) as server:
        result = _session(pytester, testbed, RPN, "--pb-agent", "python3 /pb-ro/agent.py",
                          "--pb-agent-mount", f"{mount}:/pb-ro", "--pb-agent-setup", SETUP,
                          "--pb-prompt-template", str(template), "--pb-model", "scripted",
                          "--pb-model-endpoint", server.base_url, "--pb-model-key-env", KEY_ENV)
    run_dir = pytester.path / "run"
    log = (run_dir / RPN / "agent.log").read_text(errors="replace")
    line = next((li for li in log.splitlines() if li.startswith("PROMISE-OBS ")), None)
    assert line is not None, "\n".join(result.outlines[-40:]) + "\n--- agent.log:\n" + log[-4000:]
    obs = json.loads(line.removeprefix("PROMISE-OBS "))

    # --pb-agent-setup ran in the sandbox, as root, before the agent (the workspace was still empty); its failure is
    # a note, and the agent ran all the same.
    assert obs["setup"] == "0\n0\n"
    assert obs["setup_owner"] == 0
    assert not Path("/opt/pb-promise-setup.txt").exists()  # not on the host
    # The agent: unprivileged, in /workspace/src, the documented variables.
    assert obs["uid"] != 0
    assert obs["cwd"] == "/workspace/src"
    assert {k: obs["env"].get(k) for k in ("PB_TASK_ID", "PB_LANGUAGE", "PB_BINARY", "PB_DOCS", "PB_SRC")} == {
        "PB_TASK_ID": RPN, "PB_LANGUAGE": "c", "PB_BINARY": "/workspace/binary", "PB_DOCS": "/workspace/docs",
        "PB_SRC": "/workspace/src"}
    # --pb-prompt-template: the prompt file is the template rendered.
    assert obs["prompt"] == (f"PROMISE-TEMPLATE for {RPN} in c: call /workspace/binary, docs in /workspace/docs.\n")
    # --pb-agent-mount is read-only, even where the host's modes would let the agent write.
    assert obs["mount_mode"] == "0o777"
    assert obs["mount_write"] == "Read-only file system"
    assert not (mount / "written-by-the-agent").exists()
    # --pb-model-key-env: the agent saw a placeholder, the upstream got the host's key.
    assert obs["model_status"] == 200
    assert obs["model_answer"] == "ok"
    assert obs["key_seen"] != secret
    assert secret not in json.dumps(obs)  # nor anywhere in its environment
    assert server.keys == [secret], server.keys
    # The relay: the SDK variables point at the in-sandbox bridge, and it recorded the one request.
    assert obs["environ"]["OPENAI_BASE_URL"] == obs["env"]["PB_MODEL_RELAY_URL"] == "http://127.0.0.1:47801/v1"
    assert len((run_dir / RPN / "model-requests.jsonl").read_text().splitlines()) == 1

    # A flagged submission fails the item although its score is 1.0 (no --pb-allow-flags).
    result.assert_outcomes(failed=1)
    props = _properties(pytester, RPN)
    assert float(props["score"]) == 1.0
    assert "pytest_config" in props["integrity_flags"], props
    failure = _failure_text(pytester, RPN)
    assert "pytest_config" in failure, failure
    meta = json.loads((run_dir / RPN / "pb-meta.json").read_text())
    assert "agent set-up exited 3" in meta["agent"]["notes"], meta["agent"]
    assert "agent set-up exited 3" in failure, failure  # the agent's notes reach the item's message too
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks"][RPN]["outcome"] == "failed"
    assert "pytest_config" in json.dumps(summary["tasks"][RPN]["integrity_flags"])

    # The key is in no file of the run, not in the JUnit XML, not in the terminal output.
    assert_secret_nowhere(secret, run_dir=run_dir, junit=pytester.path / "junit.xml", result=result)


# --------------------------------------------------------------------------------- the host-loop agent's session
HOST_AGENT = r'''
import json, os, subprocess, sys
from pathlib import Path
import docker
out_dir, run_dir, solutions = map(Path, sys.argv[1:4])
task = os.environ["PB_TASK_ID"]
client = docker.from_env()
info = client.api.inspect_container(os.environ["PB_CONTAINER_ID"])
obs = {"image": info["Config"]["Image"], "image_id": info["Image"], "nano_cpus": info["HostConfig"]["NanoCpus"],
       "memory": info["HostConfig"]["Memory"], "labels": info["Config"]["Labels"], "running": info["State"]["Running"]}
summary = run_dir / "summary.json"
obs["summary_seen"] = ({k: v["outcome"] for k, v in json.loads(summary.read_text())["tasks"].items()}
                       if summary.exists() else None)
# The work, through PB_SANDBOX_EXEC: the known-good solution and a root conftest.py (an integrity flag).
tree = subprocess.run(["tar", "-C", str(solutions / task), "-c", "."], capture_output=True, check=True).stdout
done = subprocess.run(os.environ["PB_SANDBOX_EXEC"] + " 'tar -x -C /workspace/src && "
                      "echo \"# flagged\" > /workspace/src/conftest.py && id -u && pwd'",
                      shell=True, input=tree, capture_output=True, check=True)
obs["sandbox"] = done.stdout.decode().split()
(out_dir / (task + ".json")).write_text(json.dumps(obs))
'''


def _meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


@pytest.fixture
def promise_tag(docker_client: Any) -> Any:
    """Both fixture images under a tag of this test's own, as images of their own (one more label: another id), so
    that the sandbox and the evaluation show which one they were made from. Removed after."""
    tag = f"pb-promise-{uuid.uuid4().hex[:8]}"
    names = [f"programbench/{task.replace('__', '_1776_')}" for task in (RPN, TUIISH)]
    made = []
    try:
        for name in names:
            container = docker_client.containers.create(f"{name}:task_cleanroom_v6", command=["true"])
            try:
                made.append(container.commit(repository=name, tag=tag, changes=[f"LABEL pb-promise-tag={tag}"]))
            finally:
                container.remove(force=True)
        yield tag
    finally:
        for image in made:
            docker_client.images.remove(image.id, force=True)


@pytest.mark.docker
def test_a_host_loop_agent_gets_the_container_and_the_run_its_summary(pytester: pytest.Pytester, testbed: Testbed,
                                                                      promise_tag: str, docker_client: Any) -> None:
    seen = pytester.mkdir("seen")
    agent = pytester.path / "host_agent.py"
    agent.write_text(HOST_AGENT)
    run_dir = pytester.path / "run"
    command = f"{sys.executable} {agent} {seen} {run_dir} {testbed.solutions}"
    result = _session(pytester, testbed, f"{RPN}|{TUIISH}", "--pb-agent", command, "--pb-agent-on-host",
                      "--pb-image-tag", promise_tag, "--pb-allow-flags")
    observed = {path.stem: json.loads(path.read_text()) for path in seen.glob("*.json")}
    assert set(observed) == {RPN, TUIISH}, "\n".join(result.outlines[-40:])

    cpus = min(20, os.cpu_count() or 1)
    memory = min(60 << 30, int(_meminfo_total() * 0.8))
    for task, obs in observed.items():
        # PB_CONTAINER_ID names the task's running sandbox, made from the --pb-image-tag image.
        assert obs["running"] is True
        assert obs["labels"]["pytest-programbench.task"] == task, obs["labels"]
        image = f"programbench/{task.replace('__', '_1776_')}:{promise_tag}"
        assert obs["image_id"] == docker_client.images.get(image).id  # not the default tag's image
        # The sandbox's defaults: min(20, cores) CPUs, min(60g, 80% of RAM).
        assert obs["nano_cpus"] == cpus * 10**9
        assert abs(obs["memory"] - memory) <= memory // 100, (obs["memory"], memory)
        # PB_SANDBOX_EXEC runs as the agent user, in /workspace/src.
        assert obs["sandbox"][0] != "0"
        assert obs["sandbox"][1] == "/workspace/src"

    # summary.json is written as tasks finish: the task that ran second saw the first one settled.
    def saw_the_other_settled(task: str) -> bool:
        seen = observed[task]["summary_seen"] or {}
        return any(outcome != "not_run" for other, outcome in seen.items() if other != task)

    first, second = sorted(observed, key=saw_the_other_settled)
    assert observed[second]["summary_seen"][second] == "not_run", observed
    assert observed[second]["summary_seen"][first] in ("passed", "failed"), observed
    assert observed[first]["summary_seen"] in (None, {first: "not_run", second: "not_run"}), observed

    # --pb-allow-flags: the flagged submissions pass, their flags kept.
    result.assert_outcomes(passed=2)
    summary = json.loads((run_dir / "summary.json").read_text())
    for task in (RPN, TUIISH):
        assert summary["tasks"][task]["outcome"] == "passed"
        assert "pytest_config" in json.dumps(summary["tasks"][task]["integrity_flags"])
        meta = json.loads((run_dir / task / "pb-meta.json").read_text())
        assert meta["image"]["ref"].endswith(f":{promise_tag}"), meta["image"]
    # Its tables by language and difficulty.
    # (the headline adds its confidence intervals to the same figures)
    assert set(summary["by_language"]) == {"c"}
    row = summary["by_language"]["c"]
    assert {"selected", "scored", "mean_over_scored", "mean_over_selection", "resolved", "errors"} <= set(row)
    assert row == {key: summary["headline"][key] for key in row}
    assert set(summary["by_difficulty"]) == {"easy", "medium"}
    for level in ("easy", "medium"):
        row = summary["by_difficulty"][level]
        assert (row["selected"], row["scored"], row["passed"], row["mean_over_scored"]) == (1, 1, 1, 1.0), row


# ------------------------------------------------------------------------------------ the proxy daemon's bounds
# The real daemon on this host (we are root), its bounds made small: the same code paths as in a sandbox, in seconds.
DAEMON_HARNESS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("pb_proxy_daemon_bounds", sys.argv[1])
daemon = importlib.util.module_from_spec(spec)
spec.loader.exec_module(daemon)
daemon.REQUEST_DEADLINE = float(sys.argv[2])
daemon.LOG_MAX_BYTES = int(sys.argv[3])
args = daemon._parser().parse_args(["serve", *sys.argv[4:]])
sys.exit(daemon.serve(daemon.Config(args), ready_fd=1))
"""




def test_a_call_begun_below_the_log_cap_ends_in_the_log_and_is_counted_once(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_programbench.sandbox.sandbox import CallLog, merge_call_records

    daemon = load_daemon("pb_proxy_daemon_cap_edge")
    calls, dropped = tmp_path / "calls.jsonl", tmp_path / "calls.dropped"
    log = daemon.CallLog(str(calls), str(dropped))
    record = {"call": "1.1", "argv": ["binary"], "at": 1.0}
    monkeypatch.setattr(daemon, "LOG_MAX_BYTES", 1)  # the call's "started" line alone reaches the cap
    started_logged = log.append({**record, "phase": "started"})
    assert started_logged
    assert log.append({**record, "phase": "ended", "exit": 0}, started_logged=started_logged)
    # A later call finds the log full: counted, not recorded.
    assert not log.append({"call": "1.2", "phase": "started"})
    assert not log.append({"call": "1.2", "phase": "ended", "exit": 0}, started_logged=False)
    records = merge_call_records(calls.read_bytes())
    assert [(r["call"], r.get("interrupted"), r.get("exit")) for r in records] == [("1.1", None, 0)]
    assert CallLog(records, dropped.stat().st_size, None).count == 2


def test_the_daemon_keeps_its_worker_cap_request_deadline_and_log_cap(tmp_path: Path) -> None:
    import socket
    import subprocess
    import time

    import psutil

    from pytest_programbench.sandbox.proxy_build import DAEMON_SOURCE, PYTHON_CLIENT
    from pytest_programbench.sandbox.sandbox import CallLog, merge_call_records

    daemon = load_daemon("pb_proxy_daemon_promises")
    sock, calls, dropped = tmp_path / "proxy.sock", tmp_path / "calls.jsonl", tmp_path / "calls.dropped"
    max_workers, deadline, log_cap = 3, 1.0, 1500
    proc = subprocess.Popen(
        [sys.executable, "-c", DAEMON_HARNESS, str(DAEMON_SOURCE), str(deadline), str(log_cap), "--socket", str(sock),
         "--reference", "/bin/echo", "--call-log", str(calls), "--dropped-log", str(dropped), "--agent-uid", "0",
         "--agent-gid", "0", "--groups", "0", "--pool", "1", "--max-workers", str(max_workers)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        ready = proc.stdout.readline()
        assert ready.startswith(b"ready "), (ready, proc.stderr.read() if proc.poll() is not None else b"")
        master = psutil.Process(proc.pid)

        # The call log: past its cap calls are counted, one byte each, and the harness says so.
        env = {"PB_PROXY_SOCKET": str(sock), "PATH": os.environ.get("PATH", "/bin")}
        for i in range(12):
            done = subprocess.run([sys.executable, "-I", "-S", str(PYTHON_CLIENT), "call", str(i)], env=env,
                                  capture_output=True, timeout=60)
            assert (done.returncode, done.stdout) == (0, f"call {i}\n".encode()), done
        data = calls.read_bytes()
        records = merge_call_records(data)
        assert 1 <= len(records) < 12
        assert len(data) <= log_cap + 2 * max_workers * daemon.RECORD_MAX
        # A call whose start is in the log ends there too, though past the cap: never counted twice.
        assert not [r for r in records if r.get("interrupted")], records
        log = CallLog(records, dropped.stat().st_size, None)
        assert log.count == 12
        assert any("reached its cap" in note for note in log.notes()), log.notes()

        # Stalled requests: each answered "incomplete" at the deadline; never more workers than the cap, which the
        # stalled connections (twice the cap) reach.
        started = time.monotonic()
        stalled = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2 * max_workers)]
        answers: dict[int, tuple[float, bytes]] = {}
        most = 0
        try:
            for conn in stalled:
                conn.connect(str(sock))
                conn.setblocking(False)
            while len(answers) < len(stalled) and time.monotonic() - started < 60:
                most = max(most, len(master.children()))
                for index, conn in enumerate(stalled):
                    if index not in answers:
                        with contextlib.suppress(BlockingIOError):
                            answers[index] = (time.monotonic() - started, conn.recv(4096))
                time.sleep(0.02)
        finally:
            for conn in stalled:
                conn.close()
        assert len(answers) == len(stalled), answers
        for _when, answer in answers.values():
            assert b"binary: malformed request to the proxy" in answer, answer
        # At the (1 s) deadline, not the default 30 s: the first wave after 1 s, the second (queued behind the cap)
        # after about 2 s; generous upper bound for a loaded machine.
        times = sorted(when for when, _answer in answers.values())
        assert times[0] >= 0.9 * deadline, times
        assert times[-1] < 20, times
        assert most == max_workers, most
        assert proc.poll() is None  # the daemon itself lived through it
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_documented_proxy_bounds_are_the_daemons() -> None:
    """docs/security.md: "at most 512 workers, a 30 s request deadline and a 64 MiB call log of 16 KiB records";
    the pbagent user with uid 1777; and the sandbox starts the daemon with those defaults."""
    import inspect

    from pytest_programbench.sandbox import sandbox as sandbox_module

    daemon = load_daemon("pb_proxy_daemon_promises")
    docs = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    assert "at most 512 workers, a 30 s request deadline and a 64 MiB call log of 16 KiB records" in docs
    assert "(`pbagent`, uid 1777, or the next free uid)" in docs
    serve = daemon._parser().parse_args(["serve", "--agent-uid", "1", "--agent-gid", "1"])
    assert (serve.max_workers, daemon.REQUEST_DEADLINE, daemon.LOG_MAX_BYTES, daemon.RECORD_MAX) == (
        512, 30.0, 64 << 20, 16 << 10)
    assert (daemon.AGENT_NAME, daemon.AGENT_UID) == ("pbagent", 1777)
    # setup passes no --max-workers of its own to serve: the default above is what runs in a sandbox.
    assert "--max-workers" not in inspect.getsource(daemon.setup)
    assert sandbox_module.PROXY_MAX_WORKERS == 512


@pytest.mark.docker
def test_the_agent_user_takes_the_next_free_uid(docker_client: Any, testbed: Testbed) -> None:
    """An image that already has a user with uid 1777 gets pbagent at 1778 (the daemon's own code, in a container)."""
    from pytest_programbench.sandbox.proxy_build import DAEMON_SOURCE

    script = ("useradd -u 1777 -M someone && python3 -c 'import sys; sys.path.insert(0, \"/pb\"); import daemon; "
              "print(daemon._ensure_agent(\"pbagent\", 1777)[0])' && id -u pbagent")
    out = docker_client.containers.run(
        testbed.base_image, ["sh", "-c", script], remove=True, network_mode="none",
        volumes={str(DAEMON_SOURCE.parent): {"bind": "/pb", "mode": "ro"}})
    assert out.decode().split() == ["1778", "1778"]


# ------------------------------------------------------------- the whole benchmark selected: official aggregate
# A real session over the 200 packaged tasks whose outcomes come from a conftest's pb_outcome (the pipeline's
# documented override point): no Docker, so the whole selection costs seconds. By the task's place in the sorted
# benchmark: 50 resolved; at the near-resolved threshold (0.95, programbench.submission.NEAR_RESOLVED_THRESHOLD) 7
# exactly on it, 7 just over (0.9501), 6 just under (0.9499, not near-resolved); 10 infrastructure errors; the rest 0.
OUTCOME_CONFTEST = """
import pytest
from programbench.submission import benchmark_instances
from pytest_programbench.results.verdict import InfrastructureError, TaskOutcome

ORDER = sorted(benchmark_instances())

@pytest.fixture
def pb_outcome(pb_task):
    index = ORDER.index(pb_task.instance_id)
    if 70 <= index < 80:
        raise InfrastructureError("stub: the engine went away", retryable=False)
    score = 1.0 if index < 50 else 0.95 if index < 57 else 0.9501 if index < 64 else 0.9499 if index < 70 else 0.0
    return TaskOutcome(pb_task.instance_id, score=score, n_passed=int(score * 100), n_tests=100)
"""


def _stub_score(index: int) -> float | None:
    if 70 <= index < 80:
        return None
    return 1.0 if index < 50 else 0.95 if index < 57 else 0.9501 if index < 64 else 0.9499 if index < 70 else 0.0


def test_the_whole_benchmark_gets_programbench_s_own_aggregate(pytester: pytest.Pytester) -> None:
    from programbench.submission import benchmark_instances

    benchmark = benchmark_instances()
    order = sorted(benchmark)
    assert len(order) == 200
    pytester.makeconftest(OUTCOME_CONFTEST)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-agent", "true", "--pb-infra-retries", "0",
                                           "--pb-output", str(run_dir), "--pb-progress", "off", "-q", timeout=600)
    result.assert_outcomes(passed=50, failed=140, errors=10)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["official_headline"] == {"mean_score": 0.345, "resolved_pct": 25.0, "near_resolved_pct": 32.0,
                                            "n_instances_attempted": 190, "n_instances_total": 200}
    result.stdout.fnmatch_lines(["official headline (all benchmark tasks): mean 0.345, resolved 25.0%, "
                                 "near-resolved 32.0%"])
    # Ours at the threshold, as the official: 0.95 and 0.9501 are near-resolved, 0.9499 is not.
    assert (summary["headline"]["resolved"], summary["headline"]["near_resolved"]) == (50, 64), summary["headline"]
    # The tables by language and difficulty, recomputed here from the stub's scores.
    for key, table in (("language", summary["by_language"]), ("difficulty", summary["by_difficulty"])):
        groups: dict[str, list[float | None]] = {}
        for index, iid in enumerate(order):
            name = str(benchmark[iid].get(key) or "unset")
            groups.setdefault({"rs": "rust", "hs": "haskell"}.get(name, name), []).append(_stub_score(index))
        assert set(table) == set(groups), (key, sorted(table), sorted(groups))
        for name, scores in groups.items():
            scored = [s for s in scores if s is not None]
            row = table[name]
            assert (row["selected"], row["scored"], row["errors"], row["resolved"], row["near_resolved"]) == (
                len(scores), len(scored), len(scores) - len(scored), sum(s == 1.0 for s in scored),
                len([s for s in scored if s >= 0.95])), (key, name, row)
            assert row["mean_over_scored"] == (round(sum(scored) / len(scored), 6) if scored else None)
    assert {name: row["selected"] for name, row in summary["by_language"].items()} == {
        "c": 33, "cpp": 12, "go": 46, "haskell": 1, "java": 1, "rust": 107}


def test_no_official_aggregate_without_the_whole_benchmark(tmp_path: Path) -> None:
    from programbench.submission import benchmark_instances

    from pytest_programbench.results.summary import PASSED, RunSummary, TaskRecord

    records = [TaskRecord(iid, "c", "easy", outcome=PASSED, score=1.0) for iid in sorted(benchmark_instances())]
    whole = RunSummary(tmp_path / "a.json", {}, records)
    assert whole.official_headline() is not None
    assert RunSummary(tmp_path / "b.json", {}, records[1:]).official_headline() is None
    overridden = [*records[1:], TaskRecord(records[0].instance_id, "c", "easy", overridden=True, outcome=PASSED,
                                           score=1.0)]
    assert RunSummary(tmp_path / "c.json", {}, overridden).official_headline() is None


def test_the_benchmark_ids_are_the_official_benchmark_instances() -> None:
    """The summary reads the ids without the tests (fast); they are exactly ``benchmark_instances()``' keys."""
    from programbench.submission import benchmark_instances

    from pytest_programbench.results.summary import benchmark_ids

    assert benchmark_ids() == frozenset(benchmark_instances())
    assert len(benchmark_ids()) == 200


def test_the_packaged_tasks_are_read_once_per_process(tmp_path: Path) -> None:
    """The catalogue and the summary's benchmark ids share one read of the 201 task.yaml files; with the plugin's cache
    holding a valid copy of that read (tasks/catalogue.PackagedCopy), a process reads none."""
    script = ("import programbench.utils.load_data as d\n"
              "reads = []\n"
              "real = d.load_all_instances\n"
              "d.load_all_instances = lambda *a, **k: reads.append(1) or real(*a, **k)\n"
              "from pytest_programbench.tasks.catalogue import Catalogue\n"
              "from pytest_programbench.results.summary import benchmark_ids\n"
              "tasks = Catalogue.load().tasks\n"
              "assert len(benchmark_ids()) == 200 and len(tasks) == 200, len(tasks)\n"
              "Catalogue.load()\n"
              "print(len(reads))\n")
    env = {**os.environ, "PYTEST_PROGRAMBENCH_CACHE": str(tmp_path / "cache")}
    counts = []
    for _ in range(2):  # an empty cache, then the copy the first process left
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, env=env)
        assert done.returncode == 0, done.stderr
        counts.append(done.stdout.strip())
    assert counts == ["1", "0"]


def test_the_strip_list_is_exactly_the_documented_one() -> None:
    """docs/security.md's "Environment variables removed" section, both ways: every name it lists is stripped by the
    daemon's filter, and the filter strips nothing it does not list (exact names, prefixes, the forced variable)."""
    import re

    daemon = load_daemon("pb_proxy_daemon_promises")
    docs = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    section = docs.split("## Environment variables removed before the reference runs", 1)[1].split("\n## ", 1)[0]
    quoted = " ".join(re.findall(r"`([^`]+)`", section.split("Each call's log record", 1)[0])).split()
    prefixes = {word.removesuffix("*") for word in quoted if word.endswith("*")}
    forced = dict(word.split("=", 1) for word in quoted if "=" in word)
    exact = {word for word in quoted if re.fullmatch(r"[A-Z_][A-Z0-9_]*", word) and not word.startswith("_5")}
    assert set(daemon.STRIP_ENV_EXACT) == exact
    assert set(daemon.STRIP_ENV_PREFIXES) == prefixes == {"LD_", "LUA_INIT", "LUA_PATH", "LUA_CPATH"}
    assert daemon.FORCED_ENV == forced == {"PYTHONNOUSERSITE": "1"}
    # And the filter itself: README's LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH, every listed name, the prefixes' kin.
    names = ["LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", *sorted(exact), *(p + "_5_4" for p in sorted(prefixes))]
    env, removed = daemon.clean_env([f"{name}=x" for name in names] + ["KEEP=1", "LDX=1", "PYTHONIOENCODING=x"])
    assert sorted(removed) == sorted(names)
    assert env == {"KEEP": "1", "LDX": "1", "PYTHONIOENCODING": "x"}
