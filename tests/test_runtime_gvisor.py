"""``--pb-runtime`` (issue 42): every container of a task under gVisor's runsc, with the proxy's guarantees.

The security properties run under both runtimes (runc: the kernel's execute-only construction; runsc: the proxy's
capability mode, daemon.py's docstring). They need the test bed's engine with runsc registered
(``bash testbed/setup.sh``) and FAIL without it: never skipped.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.engine.backpressure import Backpressure
from pytest_programbench.engine.docker_engine import EngineRun, Engines, Labels
from pytest_programbench.sandbox.sandbox import Sandbox
from tests.conftest import Testbed
from tests.proxy_support import BASE_IMAGE, CATLIKE, agent, open_sandbox, require_image

pytestmark = pytest.mark.docker

RUNTIMES = ("runc", "runsc")
RPN = "pbfix__rpn.0b5e55e"


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
    _code, text = agent(catlike_box, "cd /workspace/src && echo hi > in && /workspace/binary in; "
                                     "/workspace/binary /proc/self/exe | wc -c; echo rc=${PIPESTATUS[0]}")
    lines = text.splitlines()
    assert lines[0] == "hi", text
    assert "Permission denied" in text, text
    assert "rc=1" in text, text
    assert "0" in [line.strip() for line in lines], text


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
