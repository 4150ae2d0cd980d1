"""The test bed itself: fixture images hold the reference where the official layout puts it, and nowhere else."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tests.conftest import Testbed
from tests.network_guard import NonLoopbackConnection

FIXTURE_IMAGES = {
    "pbfix__catlike.c47c47c": "programbench/pbfix_1776_catlike.c47c47c:task_cleanroom_v6",
    "pbfix__tuiish.7e1a0b2": "programbench/pbfix_1776_tuiish.7e1a0b2:task_cleanroom_v6",
    "pbfix__rpn.0b5e55e": "programbench/pbfix_1776_rpn.0b5e55e:task_cleanroom_v6",
    "testorg__calculator.abc1234": "programbench/testorg_1776_calculator.abc1234:task_cleanroom_v6",
}

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
        if instance_id.startswith("testorg__"):
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
