"""``--pb-runtime`` (issue 42): every container of a task under gVisor's runsc, with the proxy's guarantees.

The security properties run under both runtimes (runc: the kernel's execute-only construction; runsc: the proxy's
capability mode, daemon.py's docstring). They need the test bed's engine with runsc registered
(``bash testbed/setup.sh``) and FAIL without it: never skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shlex
import tarfile
import textwrap
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from pytest_programbench import RUN_LABEL
from pytest_programbench.engine import reaper, runtimes
from pytest_programbench.engine.backpressure import Backpressure
from pytest_programbench.engine.docker_engine import EngineRun, Engines, Labels, sweep
from pytest_programbench.evaluation import harness_material
from pytest_programbench.sandbox import proxy_build
from pytest_programbench.sandbox.proxy_build import ProxyBuildError, build_client, elf_problem
from pytest_programbench.sandbox.sandbox import Sandbox
from tests.conftest import Testbed
from tests.engine_leftovers import CONTAINERD_TASKS
from tests.proxy_support import BASE_IMAGE, CATLIKE, agent, open_sandbox, require_image
from tests.runtime_observer import CREATES
from tests.test_evaluate_only import leaked
from tests.test_reliability_reaper import doomed_owner, fake_run_id

pytestmark = pytest.mark.docker

RUNTIMES = ("runc", "runsc")
RPN = "pbfix__rpn.0b5e55e"
TUIISH = "pbfix__tuiish.7e1a0b2"
# The end-to-end session's tasks: one solved whole, one whose terminal tests meet runsc's gaps. catlike's path is
# rpn's (its reference through the proxy under runsc: test_a_cat_like_reference_cannot_read_itself).
TASKS = (RPN, TUIISH)


def _require_runsc(client: Any) -> None:
    if "runsc" not in (client.api.info().get("Runtimes") or {}):
        pytest.fail("the engine has no runtime runsc: run `bash testbed/setup.sh` (installs Debian's runsc and "
                    "registers it). These tests are never skipped.", pytrace=False)


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime_client(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """A client whose run puts every container under the runtime (as a session's --pb-runtime does)."""
    engines = Engines(EngineRun(None, Backpressure(0), runtime=request.param))
    try:
        client = engines.client()
        _require_runsc(client)
        yield request.param, client
    finally:
        engines.reset()


@pytest.fixture(scope="module")
def probe_box(runtime_client: tuple[str, Any], run_labels: Labels, probe_image: str) -> Iterator[Sandbox]:
    box = open_sandbox(probe_image, run_labels, runtime_client[1])
    try:
        yield box
    finally:
        box.close()


def _py(box: Sandbox, source: str) -> Any:
    code, text = agent(box, f"python3 -c {shlex.quote(textwrap.dedent(source))}", timeout=120)
    assert code == 0, text
    return json.loads(text.strip().splitlines()[-1])


def test_the_sandbox_runs_under_the_runtime_and_says_how_it_execs(probe_box: Sandbox,
                                                                 runtime_client: tuple[str, Any]) -> None:
    runtime, client = runtime_client
    assert client.api.inspect_container(probe_box.id)["HostConfig"]["Runtime"] == runtime
    # runc: Linux runs the execute-only file as is; gVisor's loader wants read permission: capability mode.
    assert probe_box.layout.raw["exec_mode"] == {"runc": "execute-only", "runsc": "capability"}[runtime]


# A proxied `sleep` (the reference, no descendant of the agent) and a control the probe starts itself (a dumpable
# process of the agent's own, its descendant: open under Yama's ptrace_scope 1 too). Each attack on both; the
# reference's bytes must not show up in anything the agent could read of the child.
ATTACK = """
import ctypes, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
def attack(pid):
    out = {}
    for leaf in ("mem", "exe", "task/%d/mem" % pid):
        try:
            with open(f"/proc/{pid}/{leaf}", "rb") as handle:
                if leaf.endswith("mem"):
                    handle.seek(int(open(f"/proc/{pid}/maps").readline().split("-")[0], 16))
                out[leaf] = "ok:%d" % len(handle.read(64))
        except OSError as exc:
            out[leaf] = type(exc).__name__
    rc = libc.ptrace(16, pid, None, None)
    out["ptrace"] = "ok" if rc == 0 else os.strerror(ctypes.get_errno())
    if rc == 0:
        os.waitpid(pid, 0x40000000)
        libc.ptrace(17, pid, None, None)
    return out
child = subprocess.Popen(["/workspace/binary", "sleep", "30"], stdout=subprocess.PIPE)
pid = int(child.stdout.readline().decode().split("=")[1])
control = subprocess.Popen(["sleep", "30"])
result = {"reference": attack(pid), "control": attack(control.pid)}
seen = b""
for leaf in os.listdir(f"/proc/{pid}"):
    try:
        with open(f"/proc/{pid}/{leaf}", "rb") as handle:
            seen += handle.read(1 << 20)
    except OSError:
        pass
result["seen"] = seen.hex()
child.kill(); control.kill()
print(json.dumps(result))
"""


def test_the_running_reference_is_closed_to_the_agent(probe_box: Sandbox) -> None:
    result = _py(probe_box, ATTACK)
    assert all(v.startswith("ok") for v in result["control"].values()), result["control"]  # the attacks work here
    reference = result["reference"]
    assert {k: v for k, v in reference.items() if k != "ptrace"} == {
        "mem": "PermissionError", "exe": "PermissionError",
        next(k for k in reference if k.startswith("task/")): "PermissionError"}, reference
    assert reference["ptrace"] == "Operation not permitted", reference
    # Nothing the agent could read of the child holds 32 bytes of the reference's code.
    code = probe_box.exec(["sh", "-c", "od -An -v -tx1 /var/lib/pb-proxy/executable | tr -d ' \\n'"],
                          user="root", workdir="/", timeout=60).text.strip()
    windows = {code[i:i + 64] for i in range(0x1000 * 2, min(len(code), 0x3000 * 2), 64)}
    windows.discard("0" * 64)
    assert windows
    assert not [w for w in windows if w in result["seen"]]


def test_files_of_the_reference_are_the_agents(probe_box: Sandbox) -> None:
    owner = "import os; s = os.stat('made'); print(f'{s.st_uid}:{s.st_gid}')"  # coreutils' statx: EINVAL on runsc
    _code, text = agent(probe_box, f"cd /workspace/src && /workspace/binary touch made && python3 -c \"{owner}\" "
                                   "&& /workspace/binary ids")
    uid, gid = probe_box.layout.agent_uid, probe_box.layout.agent_gid
    assert f"{uid}:{gid}" in text, text
    assert f"uid={uid} euid={uid} gid={gid} egid={gid}" in text, text
    assert "cwd=/workspace/src" in text, text


def test_reference_file_is_unreadable_by_any_path(probe_box: Sandbox) -> None:
    _code, text = agent(probe_box, "head -c1 /var/lib/pb-proxy/executable; echo rc=$?; "
                                  "/workspace/binary cat /proc/self/exe > /tmp/self 2>&1; echo self=$?; cat /tmp/self")
    assert "Permission denied" in text, text
    assert "rc=1" in text, text
    assert "self=1" in text, text
    assert "/proc/self/exe: Permission denied" in text, text


@pytest.fixture(scope="module")
def catlike_box(runtime_client: tuple[str, Any], run_labels: Labels) -> Iterator[Sandbox]:
    require_image(runtime_client[1], CATLIKE)
    box = open_sandbox(CATLIKE, run_labels, runtime_client[1])
    try:
        yield box
    finally:
        box.close()


def test_a_cat_like_reference_cannot_read_itself(catlike_box: Sandbox) -> None:
    # Its error goes to stdout after the rest: stdout and stderr are two pipes, which the engine may interleave.
    _code, text = agent(catlike_box, "cd /workspace/src && echo hi > in && /workspace/binary in; "
                                     "/workspace/binary /proc/self/exe 2>/tmp/err | wc -c; echo rc=${PIPESTATUS[0]}; "
                                     "cat /tmp/err")
    lines = [line.strip() for line in text.splitlines()]
    assert lines[:3] == ["hi", "0", "rc=1"], text
    assert lines[3:] == ["catlike: /proc/self/exe: Permission denied"], text


def test_every_create_of_the_run_gets_the_runtime(runtime_client: tuple[str, Any], run_labels: Labels) -> None:
    """A plain low-level create (as the evaluation's layer and the helpers make them) asks for nothing: the run's
    runtime is there anyway, even over a runtime the caller named."""
    runtime, client = runtime_client
    require_image(client, BASE_IMAGE)
    for host_config in (None, client.api.create_host_config(runtime="runc", network_mode="none")):
        created = client.api.create_container(BASE_IMAGE, command=["true"], labels=run_labels.as_dict(),
                                              host_config=host_config)
        try:
            assert client.api.inspect_container(created["Id"])["HostConfig"]["Runtime"] == runtime
        finally:
            client.api.remove_container(created["Id"], force=True)


# ---------------------------------------------------------------------------------------------- sessions


def _session(testbed: Testbed, run_dir: Path, *args: str) -> list[str]:
    return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2", "--pb-output",
            str(run_dir), *args]


def test_a_missing_runtime_is_a_usage_error_naming_the_engine(pytester: pytest.Pytester, testbed: Testbed) -> None:
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*_session(testbed, run_dir, "--pb-agent", "true", "--pb-runtime",
                                                     "nosuchruntime"), timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    err = result.stderr.str()
    assert "--pb-runtime nosuchruntime: the Docker engine unix://" in err, err
    assert "runsc" in err, err
    checked = pytester.runpytest_subprocess(*_session(testbed, run_dir, "--pb-agent", "true", "--pb-runtime",
                                                      "nosuchruntime", "--pb-preflight"), timeout=300)
    assert checked.ret != 0
    assert "runtime nosuchruntime on unix://" in checked.stdout.str(), checked.stdout.str()


def test_the_proxy_client_builds_in_a_container_of_the_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               runtime_client: tuple[str, Any],
                                                               run_labels: Labels) -> None:
    """Built where the engine's archive API sees it under either runtime (gVisor keeps an empty /tmp to itself)."""
    runtime, client = runtime_client
    require_image(client, BASE_IMAGE)

    def no_host(*_args: Any) -> str:
        raise ProxyBuildError("no host compiler (test)")

    monkeypatch.setattr(proxy_build, "_compile_on_host", no_host)
    labels = run_labels.for_task(f"proxy-build-{runtime}")
    chosen = build_client(cache_dir=tmp_path, engine=client, builder_images=[BASE_IMAGE], labels=labels,
                          allow_fallback=False)
    assert chosen.detail == f"built in a container of {BASE_IMAGE}"
    assert elf_problem(chosen.path.read_bytes(), "x86_64") is None


def test_the_window_ends_with_the_agents_processes_killed(runtime_client: tuple[str, Any], run_labels: Labels,
                                                         probe_image: str) -> None:
    """An agent that leaves processes: the sandbox is frozen, they are counted (runc), and it is killed, under either
    runtime (where the engine refuses to kill a paused runsc container it is thawed and killed, said), never an
    error."""
    runtime, client = runtime_client
    box = open_sandbox(probe_image, run_labels, client)
    try:
        code, text = agent(box, "sleep 300 > /dev/null 2>&1 & sleep 301 > /dev/null 2>&1 & echo started")
        assert code == 0, text
        assert "started" in text, text
        end = box.end_agent_window()
        assert end.died is None, end
        assert client.api.inspect_container(box.id)["State"]["Running"] is False
        if runtime == "runc":
            assert end.survivors == 2, end
            assert end.problem is None, end
        # runsc: `docker top` with ps options lists the host's processes, not the sandbox's (Docker 20.10), so the
        # count is not the agent's (docs/gvisor.md). Thawed before its kill: the engine never kills it its own way
        # (after a 10 s wait, leaving the containerd task and its shim behind).
    finally:
        box.close()
    assert not (CONTAINERD_TASKS / box.id).exists(), f"the containerd task of {box.id[:12]} outlived its container"


@pytest.mark.parametrize("remover", ["the run's sweep", "a later session's reaper"])
def test_a_frozen_runsc_container_left_behind_goes_with_its_containerd_task(remover: str, docker_client: Any) -> None:
    """A run's container left frozen under runsc (its worker killed while the compile container was paused for its
    commit, or while the sandbox was frozen) is removed by the run's sweep or, its run dead, by another session's
    reaper: with its containerd task. Removed frozen, the engine waits 10 s and leaves the task and its shim."""
    _require_runsc(docker_client)
    api = docker_client.api
    run = fake_run_id()
    with doomed_owner() as (owner, end_owner):
        created = api.create_container(BASE_IMAGE, command=["sleep", "600"], labels={RUN_LABEL: run, **owner.labels()},
                                       host_config=api.create_host_config(network_mode="none", runtime="runsc"))
        cid = str(created["Id"])
        try:
            api.start(cid)
            api.pause(cid)
            assert api.inspect_container(cid)["State"]["Paused"] is True
            if remover == "the run's sweep":
                report: Any = sweep(run, engine=docker_client)
            else:
                end_owner()
                report = reaper.reap_dead_runs(None, engine=docker_client, slot_dirs=False, runs=[run])
            assert report.errors == []
            assert cid[:12] in report.containers
        finally:
            with contextlib.suppress(Exception):
                api.unpause(cid)
            with contextlib.suppress(Exception):
                api.remove_container(cid, force=True)
    assert not (CONTAINERD_TASKS / cid).exists(), f"the containerd task of {cid[:12]} outlived its container"


# ------------------------------------------------------------------------------------ a whole session under runsc

# The agent (as the agent user, in /workspace/src): runs the reference through the proxy, hunts for the reference's
# bytes (size and sha256 from the test) in every file it can read and behind every /proc/<pid>/exe, finds its file
# there and unreadable, then copies the task's solution. set -e: a failed check leaves /workspace/src empty (0).
HUNT = r"""set -e
case "$PB_TASK_ID" in
  pbfix__rpn.*) test "$(printf '2 3 +\n' | /workspace/binary)" = 5 ;;
  pbfix__catlike.*) printf 'hi\n' > probe; test "$(/workspace/binary probe)" = hi; rm probe ;;
  pbfix__tuiish.*) test "$(/workspace/binary T | head -n1)" = "== T ==" ;;
esac
echo "proxy: the reference answered"
want=$(cat "/pb-check/$PB_TASK_ID.sha256"); size=$(cat "/pb-check/$PB_TASK_ID.size")
{ find / \( -path /proc -o -path /sys -o -path /dev \) -prune -o -type f -size "${size}c" -readable -print \
    2>/dev/null || true; for e in /proc/[0-9]*/exe; do echo "$e"; done; } > /tmp/pb-candidates
copies=0
while read -r f; do
  sum=$(sha256sum "$f" 2>/dev/null | cut -d' ' -f1) || true
  if [ "$sum" = "$want" ]; then echo "readable copy: $f"; copies=$((copies + 1)); fi
done < /tmp/pb-candidates
echo "hunt: $(wc -l < /tmp/pb-candidates) candidate(s), $copies readable copies"
test "$copies" = 0
if err=$(head -c1 /var/lib/pb-proxy/executable 2>&1 > /dev/null); then echo "its file: readable"; exit 1; fi
case "$err" in *"Permission denied"*) echo "its file: $err" ;; *) echo "not refused: $err"; exit 1 ;; esac
cp -r "/pb-solutions/$PB_TASK_ID/." .
echo "agent: done"
"""

# What tuiish's pseudo-terminal tests need of the runtime's terminals: tcsetattr(TCSAFLUSH) (TCSETSF) and a hangup on
# the master once the program's side closed. Debian's runsc 0.0~20221219 has neither (google/gvisor#9335, fixed in
# 2023-09; the hangup: #13738's notes), so there the tests of tuiish's pty branch fail whatever the program.
PTY_PROBE = """
import os, pty, select, subprocess, termios
m, s = pty.openpty()
attrs = termios.tcgetattr(s)
try:
    termios.tcsetattr(s, termios.TCSAFLUSH, attrs)
    flush = True
except termios.error:
    flush = False
subprocess.Popen(["true"], stdin=s, stdout=s, stderr=s).wait()
os.close(s)
print("complete" if flush and select.select([m], [], [], 3)[0] else "partial")
"""
PTY_BRANCH = "5e6f7a8b9c0d"


def _reference(client: Any, image: str) -> bytes:
    """The reference binary's bytes, through the engine's archive API of a container that never starts."""
    created = client.api.create_container(image, command=["true"], network_disabled=True)
    try:
        stream, _stat = client.api.get_archive(created["Id"], "/workspace/executable")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.extractfile("executable")
            assert member is not None
            return member.read()
    finally:
        client.api.remove_container(created["Id"], force=True)


class CreateEvents:
    """The engine's own record of every container created with the run label, streamed while the session runs (the
    engine keeps only the last 256 events of any kind for a later query)."""

    def __init__(self, api: Any) -> None:
        self.stream = api.events(decode=True, filters={"type": "container", "event": "create", "label": RUN_LABEL})
        self.seen: list[tuple[str, str]] = []  # (container id, its run label)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for event in self.stream:
                attributes = (event.get("Actor") or {}).get("Attributes") or {}
                self.seen.append((str(event.get("id") or event["Actor"]["ID"]), str(attributes.get(RUN_LABEL))))
        except Exception:  # the stream closed under the reader: the end
            return

    def close(self) -> list[tuple[str, str]]:
        self.stream.close()
        self.thread.join(10)
        return list(self.seen)


def _kind(line: dict[str, Any]) -> str:
    """What a recorded container was for, from its name, command and mounts."""
    mounts = line["mounts"]
    if harness_material.HELPER_MOUNT in mounts:
        return "grader volume helper"
    if line["name"].startswith("pb-eval-"):
        if any(m.startswith(harness_material.AUDIT_DIR_PREFIX) for m in mounts):
            return "audit"
        if harness_material.TIMEOUT_RETRY_TARGET in mounts:
            return "branch"
        return "install" if any(m.startswith(harness_material.GRADER_MOUNT_ROOT) for m in mounts) else "compile"
    return "sandbox" if line["command"][:1] == ["sleep"] else line["name"]


@pytest.mark.users_defaults  # the audit on, as users get it
def test_a_session_under_runsc_solves_the_tasks_end_to_end(pytester: pytest.Pytester, testbed: Testbed,
                                                          docker_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pb-runtime runsc``: a scripted agent through the proxy (checking the reference is unreadable by any file
    and behind any process), the evaluation and the audit solve the fixture tasks; every container the session
    made ran under runsc (inspected as each create returned, against the engine's own event stream of the run's
    creates), and nothing is left: no container, no containerd task."""
    _require_runsc(docker_client)
    check = pytester.path / "check"
    check.mkdir()
    (check / "agent.sh").write_text(HUNT)
    for task in TASKS:
        image = f"programbench/{task.replace('__', '_1776_')}:task_cleanroom_v6"
        reference = _reference(docker_client, require_image(docker_client, image))
        (check / f"{task}.sha256").write_text(hashlib.sha256(reference).hexdigest())
        (check / f"{task}.size").write_text(str(len(reference)))
    pty = docker_client.containers.run(BASE_IMAGE, ["python3", "-c", PTY_PROBE], runtime="runsc",
                                       network_mode="none", remove=True).decode().strip()
    creates = pytester.path / "creates.jsonl"
    monkeypatch.setenv(CREATES, str(creates))
    run_dir = pytester.path / "run"
    events = CreateEvents(docker_client.api)
    try:
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-p", "tests.runtime_observer", "-n", "2", "--pb-runtime", "runsc",
            "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter",
            "|".join(TASKS), "--pb-pull", "never", "--pb-cpus", "2", "--pb-agent", "sh /pb-check/agent.sh",
            "--pb-agent-mount", f"{check}:/pb-check", "--pb-agent-mount", f"{testbed.solutions}:/pb-solutions",
            "--pb-output", str(run_dir), "--junitxml", str(pytester.path / "junit.xml"), timeout=1800)
    finally:
        seen = events.close()
    out = result.stdout.str()
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    props = {task: {p.get("name"): p.get("value") for p in cases[task].iter("property")} for task in TASKS}
    for task in TASKS:
        log = (run_dir / task / "agent.log").read_text()
        assert props[task]["agent_exit"] == "0", log
        assert log.count("proxy: the reference answered") == 1, log  # the agent ran once
        assert "proxy: the reference answered" in log, log
        assert ", 0 readable copies" in log, log
        meta = json.loads((run_dir / task / "pb-meta.json").read_text())
        assert meta["runtime"] == "runsc"
        assert meta["evaluation"]["audit"]["state"] == "ran", meta["evaluation"]["audit"]
        assert meta["evaluation"]["audit"]["result"] == "clean", meta["evaluation"]["audit"]
        assert meta["evaluation"]["reruns"] == "on"
    # Solved: 1.0 where runc scores 1.0, but for tuiish's terminal tests on a runsc whose terminals lack what they
    # need (PTY_PROBE): those fail, every other test passes.
    solved = [t for t in TASKS if pty == "complete" or t != TUIISH]
    assert [float(props[t]["score"] or "nan") for t in solved] == [1.0] * len(solved), out
    if pty != "complete":
        results = json.loads((run_dir / TUIISH / f"{TUIISH}.eval.json").read_text())["test_results"]
        failing = {r["branch"] for r in results if r["status"] != "passed"}
        assert failing == {PTY_BRANCH}, results
        assert {r["status"] for r in results if r["branch"] != PTY_BRANCH} == {"passed"}
    result.assert_outcomes(passed=len(solved), failed=len(TASKS) - len(solved))
    # Every container of the run ran under runsc: each one the engine says was created with the run's label was
    # inspected as its create returned, and none of any kind ran under another runtime.
    run_id = json.loads((run_dir / "pb-run.json").read_text())["run_id"]
    lines = [json.loads(line) for line in creates.read_text().splitlines()]
    assert {(line["id"], line["runtime"]) for line in lines if line["runtime"] != "runsc"} == set()
    engine_said = {cid for cid, run in seen if run == run_id}
    assert engine_said, seen
    assert engine_said <= {line["id"] for line in lines}, engine_said - {line["id"] for line in lines}
    kinds = {_kind(line) for line in lines}
    assert kinds == {"sandbox", "compile", "install", "branch", "audit", "grader volume helper"}, kinds
    assert leaked(docker_client, run_dir) == []
    # Each went with its containerd task: the compile container, frozen for its commit, is thawed before its removal
    # (removed frozen, the engine waits 10 s and leaves the task and its shim for good).
    assert [cid[:12] for cid in engine_said if (CONTAINERD_TASKS / cid).exists()] == []


def test_the_engines_runtimes_are_asked_once_per_client(docker_client: Any) -> None:
    """Every task asks the default runtime (pb-meta.json) and whether its compile container's is gVisor's; the engine
    runs ``runc --version`` and ``docker-init --version`` for each ``docker info``: asked once per client."""
    _require_runsc(docker_client)
    client = docker.from_env()  # a client of its own: nothing asked yet
    api = client.api
    asked: list[None] = []
    real_info = api.info

    def counted_info() -> Any:
        asked.append(None)
        return real_info()

    api.info = counted_info  # type: ignore[method-assign]
    try:
        assert runtimes.default(api) == "runc"
        assert runtimes.is_gvisor(api, "runsc")
        assert not runtimes.is_gvisor(api, None)
        assert not runtimes.is_gvisor(api, "runc")
        assert runtimes.default(api) == "runc"
    finally:
        client.close()
    assert len(asked) == 1
