"""Isolation by construction (issue 38): what the grader brings is in place before any submission code runs, nothing
the submission ran survives into grading, the harness checks with its own tools, and batched steps read as
``docker exec`` does. Each attack or parity case is rebuilt through the real pipeline, against the official
``programbench eval`` where it has a score to compare.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_programbench import RUN_LABEL
from pytest_programbench.engine import docker_engine
from pytest_programbench.engine.container import Container
from pytest_programbench.evaluation import harness_material
from tests.conftest import Testbed
from tests.test_evaluation_parity import CATLIKE, tasks

pytestmark = pytest.mark.docker


def _image(testbed: Testbed) -> str:
    task = tasks(testbed)[CATLIKE]
    return f"{task.image_name}:task_cleanroom_v6"


def _leftovers(docker_client: Any, run_id: str) -> list[str]:
    api = docker_client.api
    label = {"label": f"{RUN_LABEL}={run_id}"}
    found = [c["Id"][:12] for c in api.containers(all=True, filters=label)]
    found += [i["Id"][:19] for i in api.images(filters=label)]
    found += [v["Name"] for v in (api.volumes(filters=label) or {}).get("Volumes") or []]
    return found


@pytest.fixture
def run_id(docker_client: Any) -> Iterator[str]:
    run = f"pb-test-construction-{uuid.uuid4().hex[:8]}"
    yield run
    docker_engine.sweep(run, engine=docker_client)
    assert _leftovers(docker_client, run) == []


def test_a_grader_volume_is_read_only_checked_made_once_and_swept(docker_client: Any, testbed: Testbed,
                                                                  run_id: str) -> None:
    api = docker_client.api
    files = {"pb_plugin.py": b"X = 1\n", "w.whl": b"\x00wheel"}
    labels = {RUN_LABEL: run_id}
    mount = harness_material.grader_mount(docker_client, files, target="/pytest-programbench-grader/t",
                                          labels=labels, image=_image(testbed))
    again = harness_material.grader_mount(docker_client, files, target="/elsewhere", labels=labels,
                                          image=_image(testbed))
    assert again.volume == mount.volume  # once per content
    info = api.inspect_volume(mount.volume)
    assert info["Labels"][RUN_LABEL] == run_id
    # A container made with it sees exactly the files, root-owned, and cannot change them, as root.
    host_config = api.create_host_config(network_mode="none", mounts=[mount.mount()])
    box = str(api.create_container(_image(testbed), command=["sleep", "60"], labels=labels,
                                   host_config=host_config)["Id"])
    api.start(box)
    container = Container(api, box)
    assert harness_material.volume_listing(container, mount.target) == harness_material.expected_entries(
        files, harness_material.FILE_MODE)
    exec_id = api.exec_create(box, ["sh", "-c", f"echo y > {mount.target}/pb_plugin.py || rm -f "
                                                f"{mount.target}/w.whl || touch {mount.target}/new"])["Id"]
    api.exec_start(exec_id)
    assert api.exec_inspect(exec_id)["ExitCode"] != 0
    assert harness_material.volume_listing(container, mount.target) == harness_material.expected_entries(
        files, harness_material.FILE_MODE)
    api.remove_container(box, force=True)
    # The sweep removes it; asked again, it is made again (never an empty volume the engine would make by name).
    report = docker_engine.sweep(run_id, engine=docker_client)
    assert mount.volume in report.volumes
    remade = harness_material.grader_mount(docker_client, files, target="/t", labels=labels, image=_image(testbed))
    assert remade.volume != mount.volume
    assert harness_material.remove_grader_volumes(docker_client, run_id) == [remade.volume]
