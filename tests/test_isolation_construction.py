"""Isolation by construction (issue 38): what the grader brings is in place before any submission code runs, nothing
the submission ran survives into grading, the harness checks with its own tools, and batched steps read as
``docker exec`` does. Each attack or parity case is rebuilt through the real pipeline, against the official
``programbench eval`` where it has a score to compare.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from programbench.utils.load_data import get_active_branches

from pytest_programbench import RUN_LABEL
from pytest_programbench.engine import docker_engine, ownership, reaper
from pytest_programbench.engine.container import Container
from pytest_programbench.engine.images import ensure_image
from pytest_programbench.engine.ownership import OWNER_LABEL, Owner, boot_id
from pytest_programbench.evaluation import harness_material
from pytest_programbench.evaluation.container_layer import HarnessError, SdkContainerEnvironment
from pytest_programbench.evaluation.evaluation import EvalSettings, EvaluationOutcome
from pytest_programbench.evaluation.step_batch import Step
from pytest_programbench.tasks.blobs import resolve_blobs
from pytest_programbench.tasks.catalogue import Task
from tests.conftest import Testbed
from tests.proxy_support import environment_engine
from tests.test_evaluation_divergences import one_branch
from tests.test_evaluation_integrity import NOPE_COMPILE
from tests.test_evaluation_parity import (
    CATLIKE,
    RPN,
    evaluate_swept,
    official_blob_dir,
    official_score,
    official_with_wheels,
    pack,
    run_official,
    statuses,
    tasks,
)

pytestmark = pytest.mark.docker
TEST_RUN = "pb-test-construction"
__all__ = ["official_blob_dir", "official_with_wheels", "one_branch"]  # fixtures
SITE = "/usr/lib/python3/dist-packages"
# A force-pass pytest plugin and a .pth that loads it in every Python process (PYTEST_PLUGINS).
FORCE_PASS = (b"import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
              b"    outcome = yield\n    report = outcome.get_result()\n    report.outcome = 'passed'\n"
              b"    report.longrepr = None\n")


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


def test_the_reaper_removes_a_dead_runs_grader_volumes(docker_client: Any, testbed: Testbed, run_id: str) -> None:
    """A session that died leaves its grader volumes: the next session's reaper removes them with its containers and
    images; a live run's volume stays."""
    doomed = subprocess.Popen(["sleep", "900"])
    began = ownership.process_start_time(doomed.pid)
    assert began is not None
    dead_owner = Owner(socket.gethostname(), doomed.pid, began + 1.0, boot_id())
    live_run = f"{run_id}-live"
    live_owner = Owner(socket.gethostname(), os.getpid(), time.time(), boot_id())
    files = {"w.whl": b"wheel"}
    try:
        dead = harness_material.grader_mount(docker_client, files, target="/t", image=_image(testbed),
                                             labels={RUN_LABEL: run_id, OWNER_LABEL: dead_owner.label()})
        live = harness_material.grader_mount(docker_client, files, target="/t", image=_image(testbed),
                                             labels={RUN_LABEL: live_run, OWNER_LABEL: live_owner.label()})
        doomed.kill()
        doomed.wait()
        report = reaper.reap_dead_runs(None, engine=docker_client, runs=[run_id, live_run], slot_dirs=False)
        assert report.volumes == [dead.volume]
        assert run_id in report.dead_runs
        assert live_run in report.live_runs
        assert [v["Name"] for v in docker_client.api.volumes(filters={"label": f"{RUN_LABEL}={live_run}"})
                ["Volumes"] or []] == [live.volume]
    finally:
        doomed.kill()
        doomed.wait()
        harness_material.remove_grader_volumes(docker_client, live_run)
    assert _leftovers(docker_client, live_run) == []


def _volume_names(docker_client: Any) -> set[str]:
    return {str(v["Name"]) for v in (docker_client.api.volumes() or {}).get("Volumes") or []}


def test_a_grader_volume_removed_before_a_container_is_made_is_never_mounted(docker_client: Any, testbed: Testbed,
                                                                             run_id: str) -> None:
    """The run's sweep (or a reaper) removes a grader volume after it was made and checked, before a branch container
    is created with it: the engine would make an empty, unlabelled volume of that name, and the tests would run with
    an empty plugin package that still imports. The container is refused (an infrastructure error), and neither it
    nor the stand-in stays. Renewing a container with the volume refuses too, never going on without it."""
    labels = {RUN_LABEL: run_id}
    mount = harness_material.grader_mount(docker_client, {"__init__.py": b"RETRY = 1\n"},
                                          target="/pytest-programbench-grader/plugin", labels=labels,
                                          image=_image(testbed))
    assert mount.volume in docker_engine.sweep(run_id, engine=docker_client).volumes
    with pytest.raises(HarnessError, match=mount.volume):
        SdkContainerEnvironment(image=_image(testbed), engine=docker_client, labels=labels, cpus=1, mounts=[mount])
    assert mount.volume not in _volume_names(docker_client)
    assert _leftovers(docker_client, run_id) == []

    env = SdkContainerEnvironment(image=_image(testbed), engine=docker_client, labels=labels, cpus=1)
    try:
        with pytest.raises(HarnessError, match=mount.volume):
            env.renew(f"pb-test-construction/{run_id}:renewed", mounts=[mount])
    finally:
        env.cleanup()
        docker_client.api.remove_image(f"pb-test-construction/{run_id}:renewed", force=True)
    assert mount.volume not in _volume_names(docker_client)


def test_the_reaper_removes_the_engines_stand_ins_for_grader_volumes(docker_client: Any, testbed: Testbed,
                                                                    run_id: str) -> None:
    """An unlabelled volume of a grader volume's name (what the engine makes for a container created after the volume
    was removed) is removed by a full reap once no container uses it; one in use stays."""
    api = docker_client.api
    free, used = (f"{harness_material.VOLUME_PREFIX}-standin-{uuid.uuid4().hex[:8]}" for _ in range(2))
    boxes = []
    try:
        for name in (free, used):
            host_config = api.create_host_config(network_mode="none", mounts=[
                harness_material.GraderMount(name, "/g", {}, harness_material.FILE_MODE, "").mount()])
            boxes.append(str(api.create_container(_image(testbed), command=["true"], labels={RUN_LABEL: run_id},
                                                  host_config=host_config)["Id"]))
        assert api.inspect_volume(free)["Labels"] is None  # the engine's own, made for the container
        api.remove_container(boxes.pop(0), force=True)
        report = reaper.reap_dead_runs(run_id, engine=docker_client, slot_dirs=False)
        assert free in report.volumes
        assert used not in report.volumes
        assert used in _volume_names(docker_client)
    finally:
        for box in boxes:
            api.remove_container(box, force=True)
        for name in (free, used):
            with contextlib.suppress(docker.errors.NotFound):
                api.remove_volume(name)
    assert not {free, used} & _volume_names(docker_client)


def run_ours(task: Task, archive: Path, testbed: Testbed, tmp_path: Path, *, reruns: bool,
             blob_dir: Path | None = None, **settings: Any) -> EvaluationOutcome:
    """tests.test_evaluation_parity's, under this module's own run label (its leftovers are checked)."""
    instance = task.load_instance()
    blobs = resolve_blobs(task, get_active_branches(instance), blob_dir=blob_dir or testbed.blob_dir,
                          cache_dir=tmp_path / "cache")
    with environment_engine() as engine:
        image = ensure_image(task, pull="never", engine=engine)
        # Its own run: its grader volumes removed after it, and nothing of it left (evaluate_swept checks).
        return evaluate_swept(task, archive, blobs=blobs, image=image.id, workdir=tmp_path, engine=engine,
                              run_id=f"{TEST_RUN}-{uuid.uuid4().hex[:8]}",
                              settings=EvalSettings(cpus=2, reruns=reruns, **settings))


# compile.sh's survivor: rewrites the container's keep-alive (the process with the earliest start, which a stop of
# "everything but the container's command" spares) through /proc/PID/mem into an execve of SURVIVOR, keeping its pid
# and start time. Root in the container may write another root process's memory (no CAP_SYS_PTRACE needed).
INJECTOR = b"""import os, signal, struct, sys
script = sys.argv[1].encode()
def start(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[19])
me = os.getpid()
found = []
for name in os.listdir("/proc"):
    if name.isdigit() and int(name) not in (1, me):
        try:
            found.append((start(int(name)), int(name)))
        except OSError:
            pass
target = min(found)[1]
with open(f"/proc/{target}/syscall") as f:
    addr = int(f.read().split()[-1], 16) - 2  # its blocked syscall instruction: re-run after a stop
p_sh = addr + 64
p_script = p_sh + 8
p_argv = (p_script + len(script) + 8) & ~7
code = (b"\\x48\\xbf" + struct.pack("<Q", p_sh) + b"\\x48\\xbe" + struct.pack("<Q", p_argv) + b"\\x31\\xd2"
        + b"\\xb8\\x3b\\x00\\x00\\x00\\x0f\\x05")  # execve("/bin/sh", argv, NULL)
blob = code.ljust(64, b"\\x90") + b"/bin/sh\\0" + script + b"\\0"
blob = blob.ljust(p_argv - addr, b"\\0") + struct.pack("<QQQ", p_sh, p_script, 0)
fd = os.open(f"/proc/{target}/mem", os.O_RDWR)
os.pwrite(fd, blob, addr)
os.close(fd)
os.kill(target, signal.SIGSTOP)
os.kill(target, signal.SIGCONT)
"""
# Waits for the install step (pip running, or its files replayed), then keeps a force-pass plugin and a .pth loading it
# in site-packages: after every scan of the compile container, before its commit.
SURVIVOR = (b"while [ ! -e /opt/programbench-stashed-executable-do-not-modify ]; do sleep 0.01; done\n"
            b"until grep -qs 'pip[3]' /proc/[0-9]*/cmdline || ls -d /usr/local/lib/python3*/dist-packages/"
            b"pytest_rerunfailures* >/dev/null 2>&1; do sleep 0.01; done\n"
            b"while :; do cp /workspace/pbforce.txt " + SITE.encode() + b"/pbforce.py;"
            b" echo 'import os; os.environ[\"PYTEST_PLUGINS\"] = \"pbforce\"' > " + SITE.encode()
            + b"/zz-pbforce.pth; sleep 0.05; done\n")


def test_a_process_the_stop_spared_never_reaches_grading(testbed: Testbed, tmp_path: Path, docker_client: Any,
                                                          one_branch: Any) -> None:
    """The /proc/PID/mem survivor: compile.sh turns the compile container's keep-alive into its own program (same
    pid, same start time, so the stop after compile.sh spares it); once the install step runs it writes a force-pass
    plugin and a .pth loading it into site-packages. When the install step ran in the compile container (the old
    construction) `echo nope` passed 1.0 unflagged; now that container is frozen and removed after the hash step and
    the install step runs in a fresh one: the survivor never writes, `echo nope` scores its 0, and the install
    record, made in a container of the task's image, never holds its files: an honest wrong program later gets the
    score it gets officially. Both on one-branch copies (the survivor acts once per evaluation, not per branch; rpn's
    branch is the one where its wrong program fails a test)."""
    src = tmp_path / "src"
    src.mkdir()
    compile_sh = NOPE_COMPILE + b"python3 pbinject.py /workspace/pbsurvive.sh\n"
    archive = pack(src, tmp_path / "survivor.tar.gz", extra={"compile.sh": compile_sh, "pbinject.py": INJECTOR,
                                                            "pbsurvive.sh": SURVIVOR, "pbforce.txt": FORCE_PASS})
    records = tmp_path / "records"
    catlike, _instance, catlike_blobs = one_branch(CATLIKE)
    outcome = run_ours(catlike, archive, testbed, tmp_path / "a", reruns=True, install_cache=str(records),
                       blob_dir=catlike_blobs)
    assert outcome.infra_error is None
    assert outcome.score == 0.0, (outcome.score, outcome.integrity_flags)
    for record in records.glob("*/files.tar"):
        assert b"pbforce" not in record.read_bytes()
    # An honest wrong program of the same image, replaying that record: its official statuses.
    rpn, _instance, rpn_blobs = one_branch(RPN)
    honest = run_ours(rpn, pack_wrong_rpn(testbed, tmp_path), testbed, tmp_path / "b", reruns=False,
                      install_cache=str(records), blob_dir=rpn_blobs)
    assert honest.score < 1.0
    assert honest.integrity_flags == []


def pack_wrong_rpn(testbed: Testbed, tmp_path: Path) -> Path:
    wrong = testbed.bad / RPN / "wrong"
    return pack(wrong, tmp_path / "wrong.tar.gz")


BLANKS_PROFILE = b"\necho 'head -c 614400 /dev/zero | tr \"\\\\0\" \" \"' > /etc/profile.d/zz-blanks.sh\n"


def _shim_submission(testbed: Testbed, tmp_path: Path, *, program: Path, extra: bytes = b"") -> Path:
    """A program (rpn's good or partly wrong one) whose compile.sh also puts a `stat` and a `find` that print one
    line on stderr in /usr/local/bin, and plants a look-alike wheel where the harness used to copy its own
    (``extra``: more of compile.sh, after that)."""
    shims = (b"for t in stat find; do printf '#!/bin/sh\\necho shim >&2\\n' > /usr/local/bin/$t;"
             b" chmod +x /usr/local/bin/$t; done\n"
             b"{ mkdir -p /tmp/pytest-programbench-wheels && echo fake > "
             b"/tmp/pytest-programbench-wheels/pytest_rerunfailures-16.4-1-py3-none-any.whl; } 2>/dev/null || true\n")
    tmp_path.mkdir(parents=True, exist_ok=True)
    compile_sh = (program / "compile.sh").read_bytes().rstrip(b"\n") + b"\n" + shims + extra
    return pack(program, tmp_path / "shims.tar.gz", drop=("compile.sh",), extra={"compile.sh": compile_sh})


def test_the_harness_checks_with_its_own_tools(testbed: Testbed, tmp_path: Path, docker_client: Any,
                                               official_with_wheels: None, one_branch: Any) -> None:
    """A `stat` and a `find` on the container's PATH that print one line on stderr: the harness's checks (the
    timeout-retry plugin read back, .git looked at, the wheels) never run them, so the good program scores as
    officially (reruns on for both), and a partly wrong program (rpn's `wrong`: a failing test, rerun) with the same
    look-alike wheel at the old fixed path scores what it does officially (the wheels are a read-only mount; the old
    path is never read). (It was `echo nope`, its fifteen tests failing, each rerun twice a second apart: the
    reruns are exercised by one failing test as well.)

    The good program's compile.sh also leaves a login profile printing 600 KiB of blanks before every step: the
    official parses the hash step's whole output (its first word is the hash); ours reads those steps whole too,
    never the cap's marker (what test_a_hash_step_whose_output_is_huge_is_parsed_whole asserted on its own
    evaluations: one pair of evaluations holds both).

    On a one-branch copy of rpn (the branch where its wrong program fails a test), official and ours: the tools,
    the wheels and the hash are met once per evaluation, not per branch."""
    task, instance, blob_dir = one_branch(RPN)
    good = _shim_submission(testbed, tmp_path / "good", program=testbed.solutions / RPN, extra=BLANKS_PROFILE)
    official = run_official(instance, good)
    ours = run_ours(task, good, testbed, tmp_path / "ours", reruns=True, blob_dir=blob_dir)
    assert ours.infra_error is None
    assert ours.reruns, ours.reruns_reason
    assert statuses(ours.result) == statuses(official)  # type: ignore[arg-type]
    assert ours.score == official_score(official, instance) == 1.0
    # The huge hash step, parsed whole by both.
    assert official.executable_hash is not None
    assert len(official.executable_hash) == 64
    assert ours.executable_hash == official.executable_hash
    assert ours.result is not None
    assert ours.result.test_branch_errors == official.test_branch_errors == {}
    wrong = _shim_submission(testbed, tmp_path / "wrong", program=testbed.bad / RPN / "wrong")
    official_wrong = run_official(instance, wrong)
    ours_wrong = run_ours(task, wrong, testbed, tmp_path / "ours-wrong", reruns=True, blob_dir=blob_dir)
    assert ours_wrong.reruns, ours_wrong.reruns_reason
    assert statuses(ours_wrong.result) == statuses(official_wrong)  # type: ignore[arg-type]
    assert ours_wrong.score == official_score(official_wrong, instance) < 1.0


def test_a_batched_step_keeps_its_output_read_as_docker_exec_does(testbed: Testbed, docker_client: Any,
                                                                  tmp_path: Path) -> None:
    """A job a step started that holds the step's output and prints 3 s after the step ended: under `docker exec`
    (measured here with the CLI) it lives on; in a batch it must too (it used to die of SIGPIPE once the batch's
    readers were killed 2 s after the step)."""
    env = SdkContainerEnvironment(image=_image(testbed), cwd="/tmp", engine=docker_client, cpus=1,
                                  labels={RUN_LABEL: TEST_RUN}, network_mode="none", lifetime=300)
    try:
        job = "(sleep 3; echo late; touch /tmp/{0}-alive) & echo started"
        subprocess.run(["docker", "exec", env.container_id, "bash", "-lc", job.format("exec")], check=True,
                       capture_output=True, timeout=60)
        env.run_steps([Step("first", job.format("batch"), 20), Step("second", "echo two", 20)])
        first = env.execute(job.format("batch"))
        assert first["returncode"] == 0
        assert first["output"].startswith("started")
        time.sleep(4)
        found = env.execute("ls /tmp")["output"].split()
        assert "exec-alive" in found  # docker exec's own behaviour
        assert "batch-alive" in found
    finally:
        env.cleanup()
