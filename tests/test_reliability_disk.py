"""Disk space: checked before pulls, builds and runs, with a message naming need and free space; image pruning."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench import RUN_LABEL
from pytest_programbench.engine import disk, docker_engine
from pytest_programbench.engine.backpressure import Backpressure
from pytest_programbench.engine.errors import DiskSpaceError, EngineUnavailable
from pytest_programbench.pipeline.room import run_dir_need
from pytest_programbench.text.sizes import human, parse_size
from tests.conftest import Testbed

CATLIKE = "pbfix__catlike.c47c47c"


@pytest.fixture
def fresh_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[docker_engine.Engines]:
    """Engines of their own (as a session's are): a new client, nothing learnt yet about the engine."""
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    engines = docker_engine.Engines(docker_engine.EngineRun(None, Backpressure(0)))
    yield engines
    engines.reset()


def test_sizes() -> None:
    assert parse_size("10g") == 10 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == int(1.5 * (1 << 30))
    assert parse_size("123") == 123
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")
    assert human(0) == "0 B"
    assert human(3 << 30) == "3.0 GiB"


def test_a_shortfall_names_what_where_free_and_need(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(DiskSpaceError) as caught:
        disk.require(tmp_path / "not-yet", free * 4, "run a task", label="the run directory")
    text = str(caught.value)
    assert text.startswith(f"not enough disk space to run a task: the run directory {tmp_path / 'not-yet'} has ")
    assert f"{human(free * 4)} needed" in text
    assert isinstance(caught.value, EngineUnavailable), "an infrastructure error, never a score"
    assert disk.require(tmp_path, 1, "x", label="y").free > 0
    assert disk.require(tmp_path, 0, "x", label="y").free > 0  # 0 disables


def test_docker_root_is_the_engines(fresh_client: docker_engine.Engines, docker_client: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert disk.docker_root(docker_client.api) == Path(docker_client.info()["DockerRootDir"])

    class RemoteApi:
        def info(self) -> dict[str, str]:
            raise AssertionError("a TCP engine's data root is not on this machine: never asked")

    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:2375")
    assert disk.docker_root(RemoteApi()) is None


def test_run_check_covers_the_run_directory(fresh_client: docker_engine.Engines, tmp_path: Path, docker_client: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PB_DISK_RUN_DIR_NEED", "1000t")
    with pytest.raises(DiskSpaceError, match=r"to run a task: the run directory .* 1000\.0 TiB needed"):
        disk.require_for_run(tmp_path / "run", engine_api=docker_client.api, run_dir_need=run_dir_need())
    monkeypatch.setenv("PB_DISK_RUN_DIR_NEED", "1k")
    monkeypatch.setenv("PB_DISK_RUN_NEED", "1000t")
    with pytest.raises(DiskSpaceError, match=r"the Docker data root /\S+ has .* free, 1000\.0 TiB needed"):
        disk.require_for_run(tmp_path / "run", engine_api=docker_client.api, run_dir_need=run_dir_need())
    monkeypatch.setenv("PB_DISK_RUN_NEED", "1k")
    disk.require_for_run(tmp_path / "run", engine_api=docker_client.api, run_dir_need=run_dir_need())


def test_the_client_checks_before_every_build(fresh_client: docker_engine.Engines, testbed: Testbed,
                                              docker_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PB_DISK_IMAGE_NEED", "1000t")
    tag = f"pbtest-disk/{uuid.uuid4().hex[:8]}:x"
    api = fresh_client.client().api
    with pytest.raises(DiskSpaceError, match=rf"not enough disk space to build {tag}: the Docker data root"):
        api.build(fileobj=io.BytesIO(f"FROM {testbed.base_image}\n".encode()), tag=tag, network_mode="none")
    assert docker_client.api.images(name=tag.split(":", maxsplit=1)[0]) == []
    with pytest.raises(DiskSpaceError, match=r"to pull programbench/nothing:here: "):
        api.pull("programbench/nothing", tag="here")


# ---------------------------------------------------------------------------------------------- real sessions


def _copy_task(root: Path, testbed: Testbed) -> str:
    """A fixture task under a new id: its image does not exist, its Dockerfile could build it."""
    new_id = f"pbdisk__catlike{uuid.uuid4().hex[:6]}.c47c47c"
    shutil.copytree(testbed.tasks_dir / CATLIKE, root / new_id)
    blobs = root.parent / "blobs"
    shutil.copytree(testbed.blob_dir / CATLIKE, blobs / new_id)
    (root.parent / "subs" / new_id).mkdir(parents=True)
    shutil.copy2(testbed.submissions / CATLIKE / "submission.tar.gz", root.parent / "subs" / new_id)
    return new_id


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize(("pull", "verb"), [("missing", "pull"), ("never", "build")])
def test_session_errors_before_pulling_or_building_without_space(pytester: pytest.Pytester, testbed: Testbed,
                                                                 docker_client: Any, monkeypatch: pytest.MonkeyPatch,
                                                                 pull: str, verb: str) -> None:
    from programbench.constants import image_name_from_instance_id

    tasks = pytester.mkdir("tasks")
    new_id = _copy_task(tasks, testbed)
    image = f"{image_name_from_instance_id(new_id)}:task_cleanroom_v6"
    monkeypatch.setenv("PB_DISK_IMAGE_NEED", "1000t")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks), "--pb-blob-dir", str(pytester.path / "blobs"),
        "--pb-submissions", str(pytester.path / "subs"), "--pb-output", str(pytester.path / "run"),
        "--pb-pull", pull, timeout=300)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*not enough disk space to {verb} {image}: the Docker data root * has * free, "
                                 "1000.0 TiB needed*"])
    assert docker_client.api.images(name=image.split(":", maxsplit=1)[0]) == [], "nothing was pulled or built"


# ---------------------------------------------------------------------------------------------- pruning


@pytest.fixture
def tiny_images(docker_client: Any, testbed: Testbed) -> Iterator[list[str]]:
    made: list[str] = []

    def build(tag: str) -> str:
        image, _logs = docker_client.images.build(
            fileobj=io.BytesIO(f"FROM {testbed.base_image}\nLABEL pbtest-prune={uuid.uuid4().hex}\n".encode()),
            tag=tag, labels={RUN_LABEL: "prunetest"}, network_mode="none", rm=True)
        made.append(image.id)
        return str(image.id)

    made_builder: Any = build
    yield made_builder
    for image_id in made:
        with contextlib.suppress(Exception):
            docker_client.api.remove_image(image_id, force=True)


def test_prune_removes_the_runs_images_by_id(fresh_client: docker_engine.Engines, docker_client: Any, tiny_images: Any,
                                            testbed: Testbed) -> None:
    name = f"pbtest-prune/{uuid.uuid4().hex[:8]}"
    unused = tiny_images(f"{name}:unused")
    docker_client.images.get(unused).tag(name, "second-tag")
    used = tiny_images(f"{name}:used")
    user = docker_client.containers.create(used, ["sleep", "60"], network_mode="none")
    try:
        report = disk.prune_images([unused, used, unused, "sha256:" + "0" * 64], engine=docker_client)
    finally:
        user.remove(force=True)
    assert report.removed == [unused]
    assert report.kept[used].startswith(f"in use by {user.id[:12]}")
    assert report.kept["sha256:" + "0" * 64] == "already gone"
    assert docker_client.api.images(name=name, quiet=True) == [used]


def test_prune_never_forces(fresh_client: docker_engine.Engines, docker_client: Any, tiny_images: Any) -> None:
    image = tiny_images(f"pbtest-prune/{uuid.uuid4().hex[:8]}:x")
    child = docker_client.containers.create(image, ["true"], network_mode="none")
    try:
        assert disk.prune_images([image], engine=docker_client).removed == []
        assert docker_client.images.get(image).id == image
    finally:
        child.remove(force=True)
    assert disk.prune_images([image], engine=docker_client).removed == [image]
    assert os.environ.get("DOCKER_HOST") is None
