"""The pull path against a real registry on loopback (Debian's ``docker-registry``, the reference registry).

A test-bed image is pushed from the shared engine to a registry serving on 127.0.0.1 only; a private engine (one
that has none of the task images) is configured with that registry as its Docker Hub mirror, which is how a task's
``programbench/<id>`` name reaches a private registry without changing the name; a real pytest session with
``--pb-pull missing`` then pulls the image by name, evaluates the known-good submission and passes.

No traffic leaves the machine: the registry listens on loopback, and the private engine's HTTP(S) proxy is a closed
loopback port, so a fallback to Docker Hub (should the mirror fail) dies on 127.0.0.1 instead of going out.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Testbed
from tests.test_chaos import start_session
from tests.test_chaos_engine import PrivateEngine, _remove_tree, serial_phase

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("clean_env")]

CATLIKE = "pbfix__catlike.c47c47c"
REPOSITORY = "programbench/pbfix_1776_catlike.c47c47c"
TAG = "task_cleanroom_v6"


@dataclass(frozen=True)
class Registry:
    address: str  # 127.0.0.1:<port>
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.fail("docker-registry is not installed: `apt-get install -y docker-registry` (scripts/test-suite.sh "
                    "installs it)", pytrace=False)
    address = f"127.0.0.1:{_free_port()}"
    config = tmp_path / "registry.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "version": 0.1, "log": {"level": "info", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "storage")}},
        "http": {"addr": address},
    }))
    log = tmp_path / "registry.log"
    with log.open("wb") as handle:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _answers(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"docker-registry did not serve on {address}:\n{log.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.1)
        yield Registry(address, log)
    finally:
        proc.terminate()  # ours, by pid
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _push(docker_client: Any, registry: Registry) -> str:
    """The fixture task's image into the registry under its own name; returns the image id."""
    image = docker_client.images.get(f"{REPOSITORY}:{TAG}")
    remote = f"{registry.address}/{REPOSITORY}"
    image.tag(remote, tag=TAG)
    try:
        for event in docker_client.api.push(remote, tag=TAG, stream=True, decode=True):
            assert "error" not in event, event
    finally:
        docker_client.api.remove_image(f"{remote}:{TAG}", noprune=True)  # the tag only: the image stays
    return str(image.id)


@pytest.fixture
def mirrored_engine(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Iterator[PrivateEngine]:
    """A private engine with no task image, Docker Hub mirrored by the loopback registry."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # discard port, closed: a fallback dies here
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with serial_phase():
        root = Path(tempfile.mkdtemp(prefix="pbr-", dir="/tmp"))  # short: containerd's socket paths live under it
        engine = PrivateEngine(root, extra_config={"registry-mirrors": [f"http://{registry.address}"],
                                                   "insecure-registries": [registry.address]})
        try:
            engine.start()
            yield engine
        finally:
            engine.stop()
            _remove_tree(root)


def test_a_session_pulls_the_task_image_from_a_registry(docker_client: Any, testbed: Testbed, registry: Registry,
                                                        mirrored_engine: PrivateEngine, tmp_path: Path) -> None:
    image_id = _push(docker_client, registry)
    client = mirrored_engine.client()
    try:
        assert client.images.list() == [], "the private engine must start without the image"
    finally:
        client.close()

    session = start_session(mirrored_engine, tmp_path / "session", testbed, "--pb-filter", CATLIKE,
                            "--pb-submissions", str(testbed.submissions), "--pb-pull", "missing")
    assert session.wait(600) == pytest.ExitCode.OK, session.output()[-4000:]
    outcome, props = session.outcomes()[CATLIKE]
    assert (outcome, float(props["score"])) == ("passed", 1.0), session.output()[-4000:]
    meta = json.loads((session.run_dir / CATLIKE / "pb-meta.json").read_text())
    assert meta["image"]["source"] == "pulled", meta["image"]
    assert meta["image"]["id"] == image_id, "the pulled image is the pushed one"
    # The registry served it (the engine did not find it anywhere else).
    served = registry.log.read_text()
    assert f"/v2/{REPOSITORY}/manifests/{TAG}" in served, served[-3000:]

