"""The agent sandbox: container settings, layout, commands, files, packing, cleanup, network.

Needs Docker and the test bed (fails, never skips, without them).
"""

from __future__ import annotations

import importlib.util
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench import RUN_LABEL, TASK_LABEL, WORKER_LABEL
from pytest_programbench.core.settings import Settings
from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.sandbox import layout
from pytest_programbench.sandbox.proxy_build import DAEMON_SOURCE
from pytest_programbench.sandbox.sandbox import (
    CAP_DROP,
    LIFETIME_MARGIN,
    Sandbox,
    SandboxError,
    SubmissionTooLarge,
)
from pytest_programbench.tasks.catalogue import Task
from tests.proxy_support import CATLIKE, TUIISH, agent, open_sandbox, require_image

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def box(engine: Any, run_labels: Labels) -> Iterator[Sandbox]:
    require_image(engine, CATLIKE)
    sandbox = open_sandbox(CATLIKE, run_labels.for_task("pbfix__catlike.c47c47c"), engine, cpus=1.5, memory=768 << 20,
                           lifetime=900, pids_limit=512)
    try:
        yield sandbox
    finally:
        sandbox.close()


def test_container_settings(engine: Any, box: Sandbox, run_labels: Labels) -> None:
    attrs = engine.api.inspect_container(box.id)
    host = attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["NanoCpus"] == 1_500_000_000
    assert host["Memory"] == 768 << 20
    assert host["MemorySwap"] == 768 << 20
    assert host["PidsLimit"] == 512
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert set(host["CapDrop"]) == set(CAP_DROP)
    assert "SYS_PTRACE" in host["CapDrop"]
    assert host["AutoRemove"] is False  # a sandbox the agent brought down keeps its files for packing
    assert host["Init"] is True
    # A private IPC namespace whose shared memory is bounded (a quarter of the memory limit) and reclaimed.
    assert host["IpcMode"] == "private"
    assert host["ShmSize"] == 192 << 20
    assert host["Sysctls"] == {"kernel.shmmax": str(192 << 20), "kernel.shmall": str((192 << 20) // 4096),
                               "kernel.shmmni": "256", "kernel.shm_rmid_forced": "1", "kernel.msgmni": "64"}
    assert box.ipc_bounded
    labels = attrs["Config"]["Labels"]
    assert labels[RUN_LABEL] == run_labels.run_id
    assert labels[WORKER_LABEL] == run_labels.worker
    assert labels[TASK_LABEL] == "pbfix__catlike.c47c47c"
    assert attrs["Config"]["Entrypoint"] == ["sleep"]
    assert attrs["Config"]["Cmd"] == ["900"]  # the lifetime: it expires by itself if the harness dies
    assert attrs["Image"] == box.image_id == engine.images.get(CATLIKE).id


def test_layout(box: Sandbox) -> None:
    layout = box.layout
    assert layout.agent_name == "pbagent"
    assert layout.agent_uid == 1777
    assert layout.reference_kind == "elf"
    assert layout.docs == ("README.md", "catlike.1.txt")
    code, text = agent(box, "id -u; id -G; pwd; ls -A /workspace; ls -A /workspace/src | wc -l; "
                            "stat -c '%U %a' /workspace /workspace/src /workspace/docs /workspace/docs/README.md "
                            "/workspace/binary; echo x > /workspace/docs/new 2>/dev/null || echo docs-read-only; "
                            "echo x >> /workspace/docs/README.md 2>/dev/null || echo readme-read-only; "
                            "touch /workspace/new 2>/dev/null || echo workspace-closed; touch ok && echo src-writable; "
                            "rm ok; ls /var/lib/pb-proxy 2>&1 | head -1; test -e /workspace/tests || echo no-tests")
    assert code == 0
    lines = text.splitlines()
    assert lines[:5] == ["1777", "1777", "/workspace/src", "binary", "docs"] or lines[:6] == [
        "1777", "1777", "/workspace/src", "binary", "docs", "src"]
    assert "0" in lines  # src is empty
    assert "root 755" in text  # /workspace, docs
    assert "pbagent 755" in text  # src
    assert "root 644" in text  # docs files
    for expected in ("docs-read-only", "readme-read-only", "workspace-closed", "src-writable", "Permission denied",
                     "no-tests"):
        assert expected in text, (expected, text)


def test_the_proxy_daemon_shares_the_layout() -> None:
    """The daemon runs inside the container with its own copy of the layout (a single stdlib file): kept equal."""
    spec = importlib.util.spec_from_file_location("pb_proxy_daemon_layout", DAEMON_SOURCE)
    assert spec is not None
    assert spec.loader is not None
    daemon = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(daemon)
    names = ("AGENT_NAME", "AGENT_UID", "WORKSPACE", "SRC_DIR", "DOCS_DIR", "PROXY_DIR")
    assert [getattr(daemon, name) for name in names] == [getattr(layout, name) for name in names]
    assert daemon.CLIENT_PATH == layout.BINARY_PATH


def test_exec_as_agent_and_root(box: Sandbox) -> None:
    result = box.exec(["sh", "-c", "id -un; echo $HOME; echo err >&2; exit 7"], timeout=30)
    assert result.exit_code == 7
    assert sorted(result.text.splitlines()) == ["/home/pbagent", "err", "pbagent"]  # two pipes: any interleaving
    assert not result.timed_out
    result = box.exec("id -u", timeout=30, user="root", workdir="/")
    assert result.text.strip() == "0"


def test_exec_env_stdin_and_output_file(box: Sandbox, tmp_path: Path) -> None:
    result = box.exec(["sh", "-c", "cat; echo $GREETING"], timeout=30, stdin=b"from stdin\n",
                      env={"GREETING": "hello there"})
    assert result.text == "from stdin\nhello there\n"
    log = tmp_path / "agent.log"
    result = box.exec("for i in 1 2 3; do echo line $i; done", timeout=30, output=log)
    assert result.exit_code == 0
    assert result.output == b""
    assert log.read_text() == "line 1\nline 2\nline 3\n"


def test_exec_output_is_capped(box: Sandbox) -> None:
    result = box.exec("head -c 3000000 /dev/zero", timeout=30, max_output=1000)
    assert len(result.output) == 1000
    assert result.truncated


def test_exec_timeout_kills_the_command(box: Sandbox) -> None:
    result = box.exec("sleep 300; echo never", timeout=2)
    assert result.timed_out  # the clock fired...
    assert result.exit_code == 124
    assert "never" not in result.text
    # ...and took the command with it: no `sleep 300` is left in the sandbox.
    left = box.exec("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | "
                    "grep -c '^sleep 300 $'", timeout=60)
    assert left.text.strip() == "0", left.text


def test_exec_returns_while_a_background_process_holds_the_output(box: Sandbox) -> None:
    # Waiting for the output to close would last until the 60 s clock (the background sleep holds it for 120 s):
    # the shell's own exit status says the call returned when the command ended.
    result = box.exec("sleep 120 & echo started", timeout=60)
    assert not result.timed_out
    assert result.exit_code == 0
    assert "started" in result.text
    box.kill_agent_processes()


def test_proxy_survives_killing_every_agent_process(box: Sandbox) -> None:
    """kill_agent_processes (after an agent timeout) also kills the proxy's agent-uid workers: they come back."""
    box.kill_agent_processes()
    deadline = time.monotonic() + 120  # a bound on the wait, not a measure of speed
    while True:
        _code, text = agent(box, "echo back | /workspace/binary")
        if text == "back\n" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert text == "back\n"


def test_put_file(box: Sandbox) -> None:
    box.put_file(b"# the prompt\n", "/workspace/src/PROMPT.md")
    box.put_file(b"secret", "/tmp/root-only", mode=0o600, owner="root")
    _code, text = agent(box, "stat -c '%U %a' /workspace/src/PROMPT.md; cat /workspace/src/PROMPT.md; "
                            "cat /tmp/root-only 2>&1 | head -1; rm /workspace/src/PROMPT.md")
    assert text.splitlines() == ["pbagent 644", "# the prompt", "cat: /tmp/root-only: Permission denied"]


def test_pack_src(box: Sandbox, tmp_path: Path) -> None:
    agent(box, "cd /workspace/src && mkdir -p pkg/sub && printf 'int main(){}' > pkg/main.c && "
               "printf '#!/bin/sh\\n' > compile.sh && chmod 755 compile.sh && ln -s pkg/main.c link.c && "
               "ln pkg/main.c hard.c && mkfifo fifo && mkdir target && head -c 5000 /dev/urandom > target/big && "
               "touch -d '2020-01-02 03:04:05' pkg/main.c")
    dest = tmp_path / "out" / "submission.tar.gz"
    size = box.pack_src(dest)
    assert size == dest.stat().st_size > 0
    with tarfile.open(dest) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {"pkg", "pkg/sub", "pkg/main.c", "compile.sh", "link.c", "hard.c", "target",
                                "target/big"}
        assert members["compile.sh"].mode & 0o777 == 0o755
        assert members["link.c"].issym()
        assert members["link.c"].linkname == "pkg/main.c"
        assert members["pkg/main.c"].mtime == time.mktime(time.strptime("2020-01-02 03:04:05", "%Y-%m-%d %H:%M:%S"))
        assert all(m.uid == 0 and m.gid == 0 for m in members.values())
        assert tar.extractfile("pkg/main.c").read() == b"int main(){}"  # type: ignore[union-attr]
        if members["hard.c"].islnk():
            assert members["hard.c"].linkname in ("pkg/main.c", "hard.c")
    size = box.pack_src(dest, exclude=("target",))
    with tarfile.open(dest) as tar:
        assert not any(name.startswith("target") for name in tar.getnames())
    with pytest.raises(SubmissionTooLarge):
        box.pack_src(tmp_path / "small.tar.gz", max_bytes=4096)
    assert not (tmp_path / "small.tar.gz").exists()
    assert not (tmp_path / "small.tar.gz.partial").exists()
    agent(box, "cd /workspace/src && rm -rf ./* ")


def test_call_log_is_copied(box: Sandbox, tmp_path: Path) -> None:
    agent(box, "echo hi | /workspace/binary; /workspace/binary /nonexistent; true")
    dest = tmp_path / "binary-calls.jsonl"
    count = box.copy_call_log(dest)
    records = [json.loads(line) for line in dest.read_text().splitlines()]
    assert count == len(records) >= 2
    assert records[-2]["argv"] == ["/workspace/binary"]
    assert records[-2]["exit"] == 0
    assert records[-1]["argv"] == ["/workspace/binary", "/nonexistent"]
    assert records[-1]["exit"] == 1
    _code, text = agent(box, "cat /var/lib/pb-proxy/calls.jsonl")
    assert "Permission denied" in text  # the agent cannot read or forge the log


def test_network_is_loopback_only_and_dns_resolves_nothing(box: Sandbox) -> None:
    """Checked without sending traffic: interfaces and routes from /proc, a UDP connect (sends nothing)."""
    _code, text = agent(box, """python3 - <<'EOF'
import json, socket
ifaces = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
routes = open("/proc/net/route").read().splitlines()[1:]
routes6 = [l for l in open("/proc/net/ipv6_route").read().splitlines() if not l.rstrip().endswith(" lo")]
out = {"ifaces": ifaces, "routes": routes, "routes6": routes6}
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.connect(("192.0.2.1", 53))  # TEST-NET-1; a UDP connect only picks a route
    out["udp"] = "connected"
except OSError as exc:
    out["udp"] = exc.strerror
try:
    socket.getaddrinfo("example.com", 443)
    out["dns"] = "resolved"
except OSError as exc:
    out["dns"] = "failed"
print(json.dumps(out))
EOF""")
    result = json.loads(text.strip().splitlines()[-1])
    assert result["ifaces"] == ["lo"]
    assert result["routes"] == []
    assert result["routes6"] == []
    assert result["udp"] == "Network is unreachable"
    assert result["dns"] == "failed"


def test_close_removes_the_container(engine: Any, run_labels: Labels) -> None:
    from docker.errors import NotFound

    sandbox = open_sandbox(CATLIKE, run_labels, engine, lifetime=300)
    container_id = sandbox.id
    sandbox.close()
    sandbox.close()  # twice is fine
    with pytest.raises(NotFound):
        engine.api.inspect_container(container_id)


def test_failed_setup_leaves_nothing(engine: Any, run_labels: Labels) -> None:
    labels = run_labels.for_task("broken-setup")
    with pytest.raises(SandboxError, match="set-up failed"):
        # The test bed's base image has no /workspace/executable: the set-up must fail cleanly.
        open_sandbox("pb-testbed-base:latest", labels, engine, lifetime=300)
    left = engine.api.containers(all=True, filters={"label": [f"{TASK_LABEL}=broken-setup"]})
    assert left == []


def test_pristine_image_is_checked_by_id(engine: Any, run_labels: Labels) -> None:
    require_image(engine, TUIISH)
    wrong = engine.images.get(CATLIKE).id
    labels = run_labels.for_task("pristine-check")  # a task label only this test's sandbox carries
    with pytest.raises(SandboxError, match="expected the pristine"):
        Sandbox(TUIISH, labels=labels, cpus=1, memory=1 << 30, lifetime=300, expected_image_id=wrong,
                engine=engine).start()
    assert engine.api.containers(all=True, filters={"label": [f"{RUN_LABEL}={run_labels.run_id}",
                                                                 f"{TASK_LABEL}=pristine-check"]}) == []


def test_missing_image_is_an_infrastructure_error(engine: Any, run_labels: Labels) -> None:
    with pytest.raises(SandboxError, match="is not present"):
        Sandbox("programbench/no-such-task:task_cleanroom_v6", labels=run_labels, cpus=1, memory=1 << 30,
                lifetime=300, engine=engine).start()


def test_for_task_uses_the_settings(engine: Any, run_labels: Labels) -> None:
    task = Task(instance_id="pbfix__catlike.c47c47c", language="c", difficulty="easy",
                image_name="programbench/pbfix_1776_catlike.c47c47c", task_dir=Path("/nonexistent"), packaged=False)
    settings = Settings(sandbox_cpus=3.0, sandbox_memory=3 << 30, agent_timeout=100, image_tag="task_cleanroom_v6",
                        agent_mounts=("/tmp:/opt/tmp",))
    sandbox = Sandbox.for_task(task, settings, run_labels, engine=engine)
    assert sandbox.image == CATLIKE
    assert (sandbox.cpus, sandbox.memory, sandbox.lifetime) == (3.0, 3 << 30, 100 + LIFETIME_MARGIN)
    assert sandbox.labels.task == task.instance_id
    assert sandbox.mounts == (("/tmp", "/opt/tmp"),)


def test_works_under_the_python_client(engine: Any, run_labels: Labels, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PB_PROXY_CLIENT", "python")
    with Sandbox(CATLIKE, labels=run_labels, cpus=1, memory=1 << 30, lifetime=300, engine=engine) as sandbox:
        assert sandbox.proxy_client.kind == "python"
        assert "Python fallback" in sandbox.proxy_client.label
        _code, text = agent(sandbox, "head -c 3 /workspace/binary; echo; echo abc | /workspace/binary; "
                                    "/workspace/binary /nonexistent; echo rc=$?; /workspace/binary /proc/self/exe; "
                                    "echo rc=$?")
    assert text.splitlines()[:2] == ["#!/", "abc"]
    assert "rc=1" in text
    assert "Permission denied" in text
