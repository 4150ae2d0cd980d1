"""The Docker-SDK container layer: ContainerEnvironment's interface and semantics on docker-py."""

from __future__ import annotations

import io
import os
import tarfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.engine.container import OutputCap
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.engine.facts import facts
from pytest_programbench.evaluation import container_layer
from pytest_programbench.evaluation.container_layer import (
    PIDS_LIMIT,
    SdkContainerEnvironment,
    audit_official_sources,
    install_remove_image_dispatch,
)
from tests.conftest import Testbed

LABELS = {"pytest-programbench": "pb-test-layer", "pytest-programbench.task": "layer"}


def test_installed_official_sources_are_the_audited_ones() -> None:
    """Fails when programbench's eval.py / container.py (or their helpers) change: the message says what to
    re-check in the SDK layer before updating the hashes."""
    problems = audit_official_sources()
    assert not problems, "\n".join(problems)


def test_capped_buffer_keeps_head_and_tail() -> None:
    buf = OutputCap(10)
    for _ in range(100):
        buf.write(b"0123456789")
    text = buf.text("stdout")
    assert text.startswith("0123456789\n[pytest-programbench: 980 bytes of stdout omitted")
    assert text.endswith("]\n0123456789")
    small = OutputCap(10)
    small.write(b"a\r\nb\rc")
    assert small.text("stdout") == "a\nb\nc"
    # The sandbox's cap: the head only (tail 0), the rest counted as omitted; one chunk past the head at once.
    head_only = OutputCap(10, tail=0)
    head_only.write(b"0123456789abcdef")
    head_only.write(b"ghij")
    assert (bytes(head_only.head), bytes(head_only.tail), head_only.omitted) == (b"0123456789", b"", 10)


@pytest.fixture
def env(docker_client: Any, testbed: Testbed) -> Any:
    container = SdkContainerEnvironment(image=testbed.base_image, cwd="/workspace", engine=docker_client, cpus=2,
                                        env={"EXTRA": "1"}, run_args=["--init"], labels=LABELS, lifetime=600)
    yield container
    container.cleanup()


pytestmark = pytest.mark.docker


def test_container_configuration(env: Any, docker_client: Any) -> None:
    info = docker_client.api.inspect_container(env.container_id)
    host = info["HostConfig"]
    assert host["NetworkMode"] == "default"  # what `docker run` without --network gets, as the official
    assert host["Init"] is True
    assert host["PidsLimit"] == PIDS_LIMIT
    assert host["NanoCpus"] == 2_000_000_000
    assert host["Memory"] == 0  # no memory limit unless configured
    assert info["Config"]["Labels"] == LABELS
    assert info["Config"]["Cmd"] == ["sleep", "600"]
    assert info["Config"]["WorkingDir"] == "/workspace"
    assert "PYTEST_XDIST_AUTO_NUM_WORKERS=2" in info["Config"]["Env"]
    assert "EXTRA=1" in info["Config"]["Env"]
    r = env.execute("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert r["output"].split() == ["lo"]


def _pingpong_threshold(env: Any) -> str:
    return str(env.execute(f"cat /proc/sys/net/ipv4/{container_layer.QUICK_ACK_SYSCTL.rsplit('.', 1)[1]}")["output"])


def test_quick_acks_in_every_evaluation_container(env: Any, docker_client: Any, testbed: Testbed) -> None:
    """The container's network namespace answers ACKs at once (pytest-rerunfailures' per-test exchange between
    xdist's controller and a worker is then not held 40 ms a test); PYTEST_PROGRAMBENCH_QUICK_ACKS=0's setting keeps
    the kernel's threshold; a sibling keeps the setting."""
    sysctls = {container_layer.QUICK_ACK_SYSCTL: container_layer.QUICK_ACK_EXCHANGES}
    assert docker_client.api.inspect_container(env.container_id)["HostConfig"]["Sysctls"] == sysctls
    assert _pingpong_threshold(env).strip() == container_layer.QUICK_ACK_EXCHANGES
    kernels = SdkContainerEnvironment(image=testbed.base_image, engine=docker_client, cpus=1, labels=LABELS,
                                      quick_acks=False)
    sibling = kernels.sibling(testbed.base_image)
    try:
        for plain in (kernels, sibling):
            assert not docker_client.api.inspect_container(plain.container_id)["HostConfig"].get("Sysctls")
            with open(f"/proc/sys/net/ipv4/{container_layer.QUICK_ACK_SYSCTL.rsplit('.', 1)[1]}") as host:
                assert _pingpong_threshold(plain).strip() == host.read().strip()  # a fresh namespace's default
    finally:
        kernels.cleanup()
        sibling.cleanup()


def test_a_kernel_without_the_quick_ack_sysctl_gets_containers_without_it(testbed: Testbed,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose kernel has no such sysctl refuses the container at its start (runc cannot write it): it is
    made again without, and the client remembers (its next container is made without at once)."""
    import docker

    monkeypatch.setattr(container_layer, "QUICK_ACK_SYSCTL", "net.ipv4.tcp_pb_no_such_setting")
    client = docker.from_env(timeout=120)  # facts of its own
    made = []
    try:
        for _ in range(2):
            made.append(SdkContainerEnvironment(image=testbed.base_image, engine=client, cpus=1, labels=LABELS))
            assert made[-1].execute("echo up")["output"].strip() == "up"
            assert not client.api.inspect_container(made[-1].container_id)["HostConfig"].get("Sysctls")
            assert "tcp_pb_no_such_setting" in str(facts(client.api).quick_acks_refused)
        named = client.api.containers(all=True, filters={"name": made[0]._name})
        assert [c["Id"] for c in named] == [made[0].container_id]  # made again under its name: the refused one gone
    finally:
        for env in made:
            env.cleanup()
        client.close()


def test_memory_limit_when_configured(docker_client: Any, testbed: Testbed) -> None:
    env = SdkContainerEnvironment(image=testbed.base_image, engine=docker_client, cpus=1, memory=256 << 20,
                                  labels=LABELS)
    try:
        assert docker_client.api.inspect_container(env.container_id)["HostConfig"]["Memory"] == 256 << 20
    finally:
        env.cleanup()


def test_unsupported_run_args_are_refused(docker_client: Any, testbed: Testbed) -> None:
    with pytest.raises(ValueError, match="unsupported docker run argument"):
        SdkContainerEnvironment(image=testbed.base_image, engine=docker_client, run_args=["--privileged"])


def test_execute_like_the_official(env: Any) -> None:
    r = env.execute("echo out; echo err >&2; echo out2; exit 3")
    assert r == {"output": "out\nout2\nerr\n", "returncode": 3, "exception_info": ""}
    r = env.execute("pwd; echo $PYTEST_XDIST_AUTO_NUM_WORKERS; shopt -q login_shell && echo login")
    assert r["output"] == "/workspace\n2\nlogin\n"
    assert env.execute("printf 'a\\r\\nb\\rc'")["output"] == "a\nb\nc"
    # subprocess.run(text=True) raises on bytes that are not UTF-8, so do we (the official then scores 0).
    with pytest.raises(UnicodeDecodeError, match="stdout of the command is not UTF-8") as raised:
        env.execute("printf 'ok \\xff'")
    assert isinstance(raised.value, container_layer.UndecodableOutput)
    assert raised.value.output == "ok \\xff"
    with pytest.raises(UnicodeDecodeError, match="stderr"):
        env.execute("printf '\\xe2\\x82' >&2")  # a truncated sequence at the end counts
    assert env.execute("printf '\\xe2\\x82\\xac'")["output"] == "\u20ac"


def test_execute_caps_output_with_a_marker(docker_client: Any, testbed: Testbed) -> None:
    env = SdkContainerEnvironment(image=testbed.base_image, engine=docker_client, cpus=1, labels=LABELS,
                                  output_cap=1000)
    try:
        r = env.execute("head -c 100000 /dev/zero | tr '\\0' x; echo END")
        assert r["returncode"] == 0
        assert r["output"].endswith("END\n")
        assert "[pytest-programbench: 98004 bytes of stdout omitted from this log]" in r["output"]
        assert len(r["output"]) < 2200
    finally:
        env.cleanup()


def test_timeout_kills_everything_but_pid_1_like_the_official(env: Any, docker_client: Any) -> None:
    r = env.execute("sleep 600 & sleep 600", timeout=2)
    assert r == {"output": "", "returncode": -1, "exception_info": "Command timed out after 2s"}  # the clock fired
    # `kill -KILL -1` from inside also takes the `sleep` under docker-init: the container stops, as it does
    # for the official ContainerEnvironment (well before the sleeps would have ended).
    docker_client.api.wait(env.container_id, timeout=300)
    assert not docker_client.api.inspect_container(env.container_id)["State"]["Running"]
    after = env.execute("true")
    assert after["returncode"] == 1
    assert "is not running" in after["output"]


def test_host_kill_when_the_in_container_kill_does_not_end_it(env: Any, docker_client: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(container_layer, "KILL_ALL_BUT_INIT", "true")  # an in-container kill that kills nothing
    monkeypatch.setattr(container_layer, "DRAIN_GRACE", 1.0)
    r = env.execute("sleep 600", timeout=1)
    assert r["returncode"] == -1
    assert r["exception_info"] == "Command timed out after 1s"
    # The host's kill: the container is stopped when the call returns, the sleep long before its end.
    assert not docker_client.api.inspect_container(env.container_id)["State"]["Running"]


def test_copy_in_tar_keeps_escaping_symlinks(env: Any, tmp_path: Path) -> None:
    archive = tmp_path / "s.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"hello\n"
        info = tarfile.TarInfo("./cfg/file")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("./cfg/invalidrel/.skeema")
        link.type = tarfile.SYMTYPE
        link.linkname = "../../../etc/bashrc"
        tar.addfile(link)
    env.copy_in_tar(archive, "/workspace/new/dir/")
    r = env.execute("readlink new/dir/cfg/invalidrel/.skeema; cat new/dir/cfg/file")
    assert r["output"] == "../../../etc/bashrc\nhello\n"


def test_copy_in_tar_failure_names_tars_complaint(env: Any, tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"definitely not gzip" * 100)
    with pytest.raises(RuntimeError, match=r"tar stream into container failed: .*gzip"):
        env.copy_in_tar(bad, "/workspace/")


def test_copy_in_file_and_directory(env: Any, tmp_path: Path) -> None:
    f = tmp_path / "plugin.py"
    f.write_text("x = 1\n")
    os.chmod(f, 0o600)
    env.copy_in(f, "/tmp/dest.py")
    assert env.execute("stat -c '%a %u' /tmp/dest.py; cat /tmp/dest.py")["output"] == "600 0\nx = 1\n"
    d = tmp_path / "tree"
    (d / "a").mkdir(parents=True)
    (d / "a" / "b").write_text("b")
    os.symlink("/etc/passwd", d / "escape")
    env.copy_in(d, "/workspace/tree")
    assert env.execute("cat tree/a/b; readlink tree/escape")["output"] == "b/etc/passwd\n"


def test_read_file(env: Any) -> None:
    env.execute("printf 'x\\r\\ny' > /workspace/f; ln -s /etc/passwd /workspace/l; mkdir -p /workspace/d")
    assert env.read_file("/workspace/f") == (0, b"x\r\ny")
    rc, msg = env.read_file("/workspace/missing")
    assert rc == 1
    assert "No such container:path" in str(msg)
    rc, msg = env.read_file("/workspace/l")
    assert rc == 1
    assert "symbolic link" in str(msg)
    assert env.read_file("/workspace/d")[0] == 1


def test_diff_walks_the_upper_dir_with_engine_semantics(env: Any, docker_client: Any) -> None:
    env.execute("echo x > /workspace/new; echo y >> /etc/profile; rm -f /etc/issue; mkdir -p /opt/a/b")
    ours = {(c["Path"], c["Kind"]) for c in env.diff()}
    engine = {(c["Path"], c["Kind"]) for c in docker_client.api.diff(env.container_id)}
    assert ours == engine


def test_commit_labels_and_sdk_removal(env: Any, docker_client: Any) -> None:
    from programbench.eval import eval as official_eval

    install_remove_image_dispatch()
    env.execute("echo built > /workspace/out")
    ref = f"programbench-compiled/pb-test-layer:{uuid.uuid4().hex[:12]}"  # this test's own name on the shared engine
    assert env.commit(ref) == ref
    labels = docker_client.api.inspect_image(ref)["Config"]["Labels"]
    assert labels["pytest-programbench"] == "pb-test-layer"
    official_eval.remove_image(ref, executable="docker")  # the dispatcher: ours, through the SDK
    from docker.errors import ImageNotFound

    with pytest.raises(ImageNotFound):
        docker_client.api.inspect_image(ref)


def test_dispatcher_leaves_other_images_to_the_official_function(monkeypatch: pytest.MonkeyPatch) -> None:
    install_remove_image_dispatch()
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(container_layer, "_original_remove_image",
                        [lambda ref, executable="docker": calls.append((ref, executable))])
    from programbench.eval import eval as official_eval

    official_eval.remove_image("programbench-compiled/someone-else:1", executable="podman")
    assert calls == [("programbench-compiled/someone-else:1", "podman")]


def test_cleanup_is_idempotent(docker_client: Any, testbed: Testbed) -> None:
    from docker.errors import NotFound

    env = SdkContainerEnvironment(image=testbed.base_image, engine=docker_client, cpus=1, labels=LABELS)
    env.cleanup()
    env.cleanup()
    with pytest.raises(NotFound):
        docker_client.api.inspect_container(env.container_id)


def test_missing_image_is_a_start_failure(docker_client: Any) -> None:
    with pytest.raises(RuntimeError, match="Failed to start container"):
        SdkContainerEnvironment(image="programbench/does-not-exist:nope", engine=docker_client, cpus=1,
                               labels=LABELS)


def test_unreachable_engine_is_engine_unavailable(tmp_path: Path) -> None:
    import docker

    dead = docker.DockerClient(base_url=f"unix://{tmp_path}/no-such.sock", version="1.41")
    with pytest.raises(EngineUnavailable):
        SdkContainerEnvironment(image="anything", engine=dead)
