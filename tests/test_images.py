"""Task images: local, pulled (not reachable here), or built offline from the task's Dockerfile, once."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.engine.images import ImageError, ensure_image
from pytest_programbench.tasks.catalogue import Task
from tests.conftest import Testbed
from tests.test_evaluation_parity import RPN, tasks

pytestmark = pytest.mark.docker


def _task(tmp_path: Path, dockerfile: str | None) -> Task:
    name = f"pbimg-{uuid.uuid4().hex[:10]}"
    task_dir = tmp_path / f"pbimg__{name}.0000000"
    task_dir.mkdir()
    if dockerfile is not None:
        (task_dir / "Dockerfile").write_text(dockerfile)
        (task_dir / "docs").mkdir()
        (task_dir / "docs" / "README.md").write_text("docs\n")
        (task_dir / "secret-by-dockerignore").write_text("x\n")
        (task_dir / ".dockerignore").write_text("secret-by-dockerignore\n")
        (task_dir / "tests" / "b1" / "eval").mkdir(parents=True)
        (task_dir / "tests" / "b1" / "eval" / "run.sh").write_text("hidden\n")
        (task_dir / "tests.json").write_text("{}")
        (task_dir / "task.yaml").write_text("language: c\n")
    return Task(instance_id=task_dir.name, language="c", difficulty="easy", image_name=f"pbtest/{name}",
                task_dir=task_dir, packaged=False)


def test_local_image_is_used(testbed: Testbed, docker_client: Any) -> None:
    task = tasks(testbed)[RPN]
    resolved = ensure_image(task, pull="never", engine=docker_client)
    assert resolved.source == "local"
    assert resolved.ref == f"{task.image_name}:task_cleanroom_v6"
    assert resolved.id == docker_client.api.inspect_image(resolved.ref)["Id"]


def test_missing_without_dockerfile_names_the_image_and_the_way_out(tmp_path: Path, docker_client: Any) -> None:
    task = _task(tmp_path, None)
    with pytest.raises(ImageError) as never:
        ensure_image(task, pull="never", engine=docker_client, lock_dir=tmp_path / "locks")
    text = str(never.value)
    assert f"{task.image_name}:task_cleanroom_v6" in text
    assert "not pulled (--pb-pull never)" in text
    assert "docker pull" in text

    # Pulling is left to a stub engine: the test suite never makes the daemon reach for a registry.
    class Api:
        def __init__(self) -> None:
            self.pulls: list[str] = []

        def inspect_image(self, ref: str) -> Any:
            from docker.errors import ImageNotFound

            raise ImageNotFound(ref)

        def pull(self, repository: str, tag: str, stream: bool, decode: bool) -> Any:
            self.pulls.append(f"{repository}:{tag}")
            return iter([{"status": "Pulling"}, {"error": "no registry reachable"}])

    class Engine:
        api = Api()

    with pytest.raises(ImageError, match=r"pull failed \(no registry reachable\)"):
        ensure_image(task, pull="missing", engine=Engine(), lock_dir=tmp_path / "locks")
    assert Engine.api.pulls == [f"{task.image_name}:task_cleanroom_v6"]


def test_built_offline_once_without_hidden_tests(testbed: Testbed, tmp_path: Path, docker_client: Any) -> None:
    dockerfile = (f"FROM {testbed.base_image}\n"
                  "COPY . /ctx\n"
                  "RUN tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' > /net.txt\n")
    task = _task(tmp_path, dockerfile)
    labels = {"pytest-programbench": "pb-test-images", "pytest-programbench.task": task.instance_id}
    results: list[Any] = []
    errors: list[BaseException] = []

    def resolve() -> None:
        try:
            results.append(ensure_image(task, tag="t", pull="never", labels=labels, engine=docker_client,
                                        lock_dir=tmp_path / "locks"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = f"{task.image_name}:t"
    try:
        assert not errors, errors
        assert sorted(r.source for r in results) == ["built", "local", "local"]
        assert len({r.id for r in results}) == 1
        info = docker_client.api.inspect_image(ref)
        assert info["Config"]["Labels"]["pytest-programbench"] == "pb-test-images"
        out = docker_client.containers.run(ref, ["sh", "-c", "cat /net.txt; ls -A /ctx"], network_mode="none",
                                           remove=True, labels=labels).decode().split()
        assert out[0] == "lo"  # built with no network
        listed = set(out[1:])
        assert {"Dockerfile", "docs"} <= listed
        assert not {"tests", "tests.json", "task.yaml", "secret-by-dockerignore"} & listed
    finally:
        docker_client.api.remove_image(ref, force=True)


def test_failed_build_is_an_image_error(testbed: Testbed, tmp_path: Path, docker_client: Any) -> None:
    task = _task(tmp_path, f"FROM {testbed.base_image}\nRUN exit 7\n")
    with pytest.raises(ImageError, match=r"building .* failed"):
        ensure_image(task, pull="never", engine=docker_client, lock_dir=tmp_path / "locks",
                     labels={"pytest-programbench": "pb-test-images"})
