"""The test bed itself: fixture images hold the reference where the official layout puts it, and nowhere else."""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TESTBED, Testbed
from tests.network_guard import NonLoopbackConnection

FIXTURE_IMAGES = {
    "pbfix__catlike.c47c47c": "programbench/pbfix_1776_catlike.c47c47c:task_cleanroom_v6",
    "pbfix__tuiish.7e1a0b2": "programbench/pbfix_1776_tuiish.7e1a0b2:task_cleanroom_v6",
    "pbfix__rpn.0b5e55e": "programbench/pbfix_1776_rpn.0b5e55e:task_cleanroom_v6",
    "pbfix__coin.c0112ab": "programbench/pbfix_1776_coin.c0112ab:task_cleanroom_v6",
    "testorg__calculator.abc1234": "programbench/testorg_1776_calculator.abc1234:task_cleanroom_v6",
}
GOLD_FIXTURES = {"pbfix__coin.c0112ab"}  # testbed/gold_tasks: one branch

# Root can read an exec-only file; hash it, then look for any other file with the same bytes.
PROBE = r"""
set -e
stat -c '%a %U' /workspace/executable
ref=$(sha256sum /workspace/executable | cut -d' ' -f1)
size=$(stat -c %s /workspace/executable)
echo "hash $ref"
find / -xdev -type f -size "${size}c" ! -path /workspace/executable -print0 2>/dev/null \
  | xargs -0 -r sha256sum | grep "^$ref " || true
"""


def run_probe(docker_client: Any, image: str) -> str:
    container = docker_client.containers.create(image, ["bash", "-c", PROBE], network_mode="none",
                                                labels={"pytest-programbench.testbed-check": "1"})
    try:
        container.start()
        status = container.wait(timeout=120)
        output = container.logs().decode()
        assert status["StatusCode"] == 0, output
        return str(output)
    finally:
        container.remove(force=True)


@pytest.mark.parametrize("instance_id", sorted(FIXTURE_IMAGES))
def test_reference_at_workspace_executable_only(docker_client: Any, testbed: Testbed, instance_id: str) -> None:
    output = run_probe(docker_client, FIXTURE_IMAGES[instance_id])
    lines = output.strip().splitlines()
    assert lines[0] == "111 root", output
    assert lines[1].startswith("hash ")
    assert len(lines[1]) == len("hash ") + 64
    assert lines[2:] == [], f"copies of the reference elsewhere in the image:\n{output}"


def test_blob_dir_has_every_branch(testbed: Testbed) -> None:
    import json

    for instance_id in FIXTURE_IMAGES:
        if instance_id.startswith("testorg__") or instance_id in GOLD_FIXTURES:
            continue
        branches = json.loads((testbed.tasks_dir / instance_id / "tests.json").read_text())["branches"]
        assert len([b for b, info in branches.items() if not info.get("ignored")]) >= 2
        for branch in branches:
            assert (testbed.blob_dir / instance_id / "tests" / f"{branch}.tar.gz").is_file(), (instance_id, branch)


def test_network_guard_fails_non_loopback_connections() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(NonLoopbackConnection, match=r"10\.255\.255\.1"):
            sock.connect(("10.255.255.1", 9))  # the guard raises before any packet leaves
        with pytest.raises(NonLoopbackConnection):
            sock.connect_ex(("192.0.2.1", 9))
    finally:
        sock.close()


def test_network_guard_allows_loopback() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        client.connect(server.getsockname())
    finally:
        client.close()
        server.close()


def test_network_guard_reaches_the_sessions_a_test_starts(pytester: pytest.Pytester) -> None:
    """The plugin under test mostly runs in subprocess sessions: the guard must be there too."""
    pytester.makepyfile(test_out="""
        import socket

        def test_out():
            socket.socket().connect(("10.255.255.1", 9))
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*NonLoopbackConnection: a test reached for non-loopback address*"])


def _setup(copy: Path, tag: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "PB_TESTBED_REPLACE"}
    return subprocess.run(["bash", str(copy / "setup.sh")], capture_output=True, text=True, timeout=600,
                          env={**base, "PB_PYTHON": sys.executable, "PB_TESTBED_IMAGE_TAG": tag, **env})


def test_setup_tags_only_what_the_test_bed_owns(docker_client: Any, testbed: Testbed, tmp_path: Path) -> None:
    """testbed/setup.sh on a shared engine (a copy of the test bed, its images under a tag of this test's own): a tag
    with no test-bed label (another process's, as programbench's own image of the packaged calculator would be) and
    one another checkout built with other content are refused before anything changes; PB_TESTBED_REPLACE=1 takes
    the other checkout's; a second run changes nothing."""
    copy = tmp_path / "testbed"
    shutil.copytree(TESTBED, copy, ignore=shutil.ignore_patterns(".state", "__pycache__"))
    tag = f"pbtest-{uuid.uuid4().hex[:8]}"
    refs = [f"programbench/{iid.replace('__', '_1776_')}:{tag}" for iid in FIXTURE_IMAGES]
    calculator = f"programbench/testorg_1776_calculator.abc1234:{tag}"
    try:
        docker_client.images.get(testbed.base_image).tag(calculator)  # the base has no labels: not the test bed's
        foreign = docker_client.images.get(calculator).id
        refused = _setup(copy, tag)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        assert f"REFUSED: {calculator} exists and it has no label pytest-programbench.testbed" in refused.stderr
        assert "nothing was changed" in refused.stderr
        assert docker_client.images.get(calculator).id == foreign
        assert [r for r in refs if r != calculator and docker_client.images.list(name=r)] == []
        docker_client.images.remove(calculator)  # the tag only

        other = docker_client.images.build(
            fileobj=io.BytesIO(f"FROM {testbed.base_image}\n".encode()), tag=calculator, network_mode="none", rm=True,
            labels={"pytest-programbench.testbed": "0123456789abcdef",
                    "pytest-programbench.testbed.checkout": "/elsewhere/testbed"})[0].id
        refused = _setup(copy, tag)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        assert f"REFUSED: {calculator} exists and the test bed of another checkout (/elsewhere/testbed)" \
               in refused.stderr
        assert docker_client.images.get(calculator).id == other

        replaced = _setup(copy, tag, PB_TESTBED_REPLACE="1")
        assert replaced.returncode == 0, replaced.stdout + replaced.stderr
        for ref in refs:
            assert docker_client.images.get(ref).labels["pytest-programbench.testbed.checkout"] == str(copy), ref
        again = _setup(copy, tag)
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.count(" up to date") == len(refs), again.stdout
        assert "image: building" not in again.stdout
        assert again.stdout.count("(0 rewritten)") == 2, again.stdout  # blobs, submissions
    finally:  # every tag of this test's own, whichever run made it
        for image in docker_client.images.list(filters={"reference": f"programbench/*:{tag}"}):
            for name in image.tags:
                if name.endswith(f":{tag}"):
                    docker_client.images.remove(name)
