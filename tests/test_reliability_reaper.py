"""The reaper: a dead run's containers and images go, a live run's never do; decided from labels alone.

Engine tests use the shared engine, restricted to the fake run ids they create (``runs=``), so they never judge
anyone else's containers; the session-start variant on a private engine is in ``test_chaos.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench import RUN_LABEL
from pytest_programbench.engine import backpressure, ownership, reaper
from pytest_programbench.engine.ownership import EXPIRES_LABEL, OWNER_LABEL, Owner, boot_id
from tests.conftest import Testbed

HOST = socket.gethostname()


@dataclass
class FakeOwner:
    owner: Owner

    def labels(self, *, expires: float | None = None) -> dict[str, str]:
        labels = {OWNER_LABEL: self.owner.label()}
        if expires is not None:
            labels[EXPIRES_LABEL] = str(int(expires))
        return labels


@contextlib.contextmanager
def live_owner() -> Iterator[FakeOwner]:
    """A live "controller": a process of ours, started before the run's recorded start."""
    proc = subprocess.Popen(["sleep", "900"])
    try:
        began = ownership.process_start_time(proc.pid)
        assert began is not None
        yield FakeOwner(Owner(HOST, proc.pid, began + 1.0, boot_id()))
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def dead_owner() -> Iterator[FakeOwner]:
    """A controller that has exited (its pid may be recycled later: the start time check covers that)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    yield FakeOwner(Owner(HOST, proc.pid, time.time() - 5, boot_id()))


@contextlib.contextmanager
def doomed_owner() -> Iterator[tuple[FakeOwner, Callable[[], None]]]:
    """A controller alive while its run's objects are made, and the call that ends it: other sessions on the shared
    engine reap dead runs when they start, so a run made dead from the outset can be reaped by them mid-set-up."""
    proc = subprocess.Popen(["sleep", "900"])
    began = ownership.process_start_time(proc.pid)
    assert began is not None

    def end() -> None:
        proc.kill()
        proc.wait()

    try:
        yield FakeOwner(Owner(HOST, proc.pid, began + 1.0, boot_id())), end
    finally:
        end()


def fake_run_id() -> str:
    return "f" + uuid.uuid4().hex[:7]


# ---------------------------------------------------------------------------------------------- liveness rules


def test_owner_label_round_trip() -> None:
    owner = Owner("host-a.example", 4242, 1700000000.125, "0c5c-boot")
    assert Owner.parse(owner.label()) == Owner("host-a.example", 4242, 1700000000.125, "0c5c-boot")
    assert Owner.parse("garbage") is None
    assert Owner.parse(None) is None


def test_process_alive_checks_pid_and_start_time() -> None:
    me = os.getpid()
    began = ownership.process_start_time(me)
    assert began is not None
    assert began <= time.time()
    assert ownership.process_alive(me)
    assert ownership.process_alive(me, began + 1)
    # A run that started before this process did cannot have this process as its controller: a recycled pid.
    assert not ownership.process_alive(me, began - 3600)
    with dead_owner() as dead:
        assert not ownership.process_alive(dead.owner.pid, dead.owner.started)


def _verdict(labels: dict[str, str], *, created: float | None = None, current: str | None = "c0ffee00",
             records: dict[str, Owner] | None = None) -> tuple[bool, str]:
    return reaper.run_verdict(labels, time.time() - 60 if created is None else created, current_run=current,
                              run_records=records)


def test_verdicts_from_labels_alone() -> None:
    now = time.time()
    with live_owner() as alive, dead_owner() as dead:
        assert _verdict({RUN_LABEL: "c0ffee00", **dead.labels()}) == (False, "the current run")
        assert _verdict({RUN_LABEL: "r1", **dead.labels()})[0] is True
        assert "is gone" in _verdict({RUN_LABEL: "r1", **dead.labels()})[1]
        assert _verdict({RUN_LABEL: "r2", **alive.labels()})[0] is False
        # Alive wins over an expired deadline: a live run's containers are never touched.
        assert _verdict({RUN_LABEL: "r2", **alive.labels(expires=now - 10)})[0] is False
    other = FakeOwner(Owner("another-host", 1, now - 100, "other-boot"))
    assert _verdict({RUN_LABEL: "r3", **other.labels(expires=now + 3600)})[0] is False
    dead_verdict = _verdict({RUN_LABEL: "r3", **other.labels(expires=now - 1)})
    assert dead_verdict[0] is True
    assert "lifetime expired" in dead_verdict[1]
    # Same hostname, another boot: the controller died with the reboot.
    rebooted = FakeOwner(Owner(HOST, os.getpid(), now, "an-older-boot"))
    assert _verdict({RUN_LABEL: "r4", **rebooted.labels()})[0] is True


def test_unlabelled_objects_use_run_records_else_age() -> None:
    young = {RUN_LABEL: "r5"}
    assert _verdict(young)[0] is False
    assert _verdict(young, created=time.time() - reaper.UNLABELLED_MAX_AGE - 60)[0] is True
    with dead_owner() as dead:
        assert _verdict(young, records={"r5": Owner(HOST, dead.owner.pid, dead.owner.started)})[0] is True
    with live_owner() as alive:
        assert _verdict(young, records={"r5": Owner(HOST, alive.owner.pid, alive.owner.started)})[0] is False


def test_run_records_come_from_pb_run_json(tmp_path: Path) -> None:
    run_dir = tmp_path / "pb-runs" / "20260101T000000Z-abcd1234"
    run_dir.mkdir(parents=True)
    (run_dir / "pb-run.json").write_text(json.dumps({
        "run_id": "abcd1234", "controller_pid": 99, "hostname": "h", "started": 10.0,
        "history": [{"run_id": "older000", "controller_pid": 98, "started": 5.0},
                    {"run_id": "abcd1234", "controller_pid": 99, "started": 10.0}]}))
    (tmp_path / "pb-runs" / "broken").mkdir()
    (tmp_path / "pb-runs" / "broken" / "pb-run.json").write_text("{not json")
    records = reaper.load_run_records([tmp_path / "pb-runs"])
    assert records == {"abcd1234": Owner("h", 99, 10.0), "older000": Owner("h", 98, 5.0)}
    assert reaper.load_run_records([run_dir]) == records


# ---------------------------------------------------------------------------------------------- on the engine


def _container(docker_client: Any, image: str, labels: dict[str, str]) -> str:
    api = docker_client.api
    created = api.create_container(image, command=["sleep", "600"], labels=labels,
                                   host_config=api.create_host_config(network_mode="none"))
    api.start(created["Id"])
    return str(created["Id"])


def _image(docker_client: Any, container_id: str, labels: dict[str, str], tag: str) -> str:
    repository, _, tag_name = tag.rpartition(":")
    image = docker_client.api.commit(container_id, repository=repository, tag=tag_name, conf={"Labels": labels})
    return str(image["Id"])


def _container_exists(docker_client: Any, container_id: str) -> bool:
    from docker.errors import NotFound

    try:
        docker_client.api.inspect_container(container_id)
        return True
    except NotFound:
        return False


def _image_exists(docker_client: Any, image_id: str) -> bool:
    from docker.errors import ImageNotFound

    try:
        docker_client.images.get(image_id)
        return True
    except ImageNotFound:
        return False


@pytest.fixture
def cleanup(docker_client: Any) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for ref in reversed(made):
        with contextlib.suppress(Exception):
            if ref.startswith("sha256:"):
                docker_client.api.remove_image(ref, force=True)
            else:
                docker_client.api.remove_container(ref, force=True)


def test_dead_runs_are_reaped_live_runs_kept(docker_client: Any, testbed: Testbed, cleanup: list[str]) -> None:
    dead_run, live_run, far_run, expired_run = (fake_run_id() for _ in range(4))
    with live_owner() as alive, doomed_owner() as (dead, end_dead_owner):
        now = time.time()
        far = FakeOwner(Owner("elsewhere", 7, now, "x"))
        dead_c = _container(docker_client, testbed.base_image, {RUN_LABEL: dead_run, **dead.labels()})
        live_c = _container(docker_client, testbed.base_image, {RUN_LABEL: live_run, **alive.labels()})
        # Expiry judged at a later clock (``now`` below), so no other session's reaper finds it expired meanwhile.
        far_c = _container(docker_client, testbed.base_image, {RUN_LABEL: far_run, **far.labels(expires=now + 1800)})
        expired_c = _container(docker_client, testbed.base_image,
                               {RUN_LABEL: expired_run, **far.labels(expires=now + 600)})
        cleanup += [dead_c, live_c, far_c, expired_c]
        dead_img = _image(docker_client, dead_c, {RUN_LABEL: dead_run, **dead.labels()},
                          f"pbtest-reaper/{dead_run}:dead")
        live_img = _image(docker_client, live_c, {RUN_LABEL: live_run, **alive.labels()},
                          f"pbtest-reaper/{live_run}:live")
        cleanup += [dead_img, live_img]

        end_dead_owner()  # the run dies only now, its objects made
        report = reaper.reap_dead_runs("c0ffee00", engine=docker_client, slot_dirs=False, now=now + 1200,
                                       runs=[dead_run, live_run, far_run, expired_run])
        assert report.errors == []
        assert not _container_exists(docker_client, dead_c)
        assert not _container_exists(docker_client, expired_c)
        assert not _image_exists(docker_client, dead_img)
        assert _container_exists(docker_client, live_c)
        assert _container_exists(docker_client, far_c)
        assert _image_exists(docker_client, live_img)
        assert set(report.dead_runs) == {dead_run, expired_run}
        assert set(report.live_runs) == {live_run, far_run}
        assert "is gone" in report.dead_runs[dead_run]
        assert dead_c[:12] in report.containers
        assert dead_img[:19] in report.images

        # Idempotent: nothing more to do, no error.
        again = reaper.reap_dead_runs("c0ffee00", engine=docker_client, slot_dirs=False, now=now + 1200,
                                      runs=[dead_run, live_run, far_run, expired_run])
        assert (again.containers, again.images, again.errors) == ([], [], [])


def test_a_dead_runs_image_in_use_by_a_live_container_is_kept(docker_client: Any, testbed: Testbed,
                                                              cleanup: list[str]) -> None:
    dead_run, live_run = fake_run_id(), fake_run_id()
    with live_owner() as alive, dead_owner() as dead:
        source = _container(docker_client, testbed.base_image, {RUN_LABEL: live_run, **alive.labels()})
        cleanup.append(source)
        image = _image(docker_client, source, {RUN_LABEL: dead_run, **dead.labels()},
                       f"pbtest-reaper/{dead_run}:shared")
        cleanup.append(image)
        user = _container(docker_client, image, {RUN_LABEL: live_run, **alive.labels()})
        cleanup.append(user)
        report = reaper.reap_dead_runs(None, engine=docker_client, slot_dirs=False, runs=[dead_run, live_run])
        assert _image_exists(docker_client, image)
        assert _container_exists(docker_client, user)
        assert any("kept: used by container" in e and user[:12] in e for e in report.errors), report.errors


def test_two_reapers_at_once_are_harmless(docker_client: Any, testbed: Testbed, cleanup: list[str]) -> None:
    runs = [fake_run_id() for _ in range(3)]
    with doomed_owner() as (dead, end_dead_owner):
        ids = [_container(docker_client, testbed.base_image, {RUN_LABEL: run, **dead.labels()}) for run in runs]
        cleanup += ids
        end_dead_owner()  # the runs die only now, their containers made
        reports: list[reaper.ReapReport] = []

        def reap() -> None:
            reports.append(reaper.reap_dead_runs(None, engine=docker_client, slot_dirs=False, runs=runs))

        threads = [threading.Thread(target=reap) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert [r.errors for r in reports] == [[], []]
    assert not [i for i in ids if _container_exists(docker_client, i)]
    # Every container is reported by a reaper, and none but the runs'. The engine may answer both removals of one
    # container with success (the second one fetched it before the first removed it, then found its removal no
    # longer in progress: seen in CI under load), so a container can be in both reports.
    assert {c for r in reports for c in r.containers} == {i[:12] for i in ids}


def test_unreachable_engine_is_reported_not_raised(tmp_path: Path) -> None:
    import docker

    dead = docker.DockerClient(base_url=f"unix://{tmp_path}/none.sock", version="1.41")
    report = reaper.reap_dead_runs("x", engine=dead, slot_dirs=False)
    assert report.errors
    assert "cannot list" in report.errors[0]


def test_slot_dirs_of_dead_runs_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backpressure, "slots_root", lambda: tmp_path / "slots")
    with live_owner() as alive, dead_owner() as dead:
        for run, who in (("deadrun1", dead), ("liverun1", alive)):
            path = tmp_path / "slots" / run
            path.mkdir(parents=True)
            (path / backpressure.OWNER_FILE).write_text(json.dumps({
                "run_id": run, "hostname": who.owner.hostname, "controller_pid": who.owner.pid,
                "started": who.owner.started, "boot_id": who.owner.boot_id}))
        (tmp_path / "slots" / "ownerless").mkdir()
        report = reaper.ReapReport()
        reaper._reap_slot_dirs(report)
    assert report.slot_dirs == [str(tmp_path / "slots" / "deadrun1")]
    assert sorted(p.name for p in (tmp_path / "slots").iterdir()) == ["liverun1", "ownerless"]
