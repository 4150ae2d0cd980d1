"""Isolation by construction (issue 38): what the grader brings is in place before any submission code runs, nothing
the submission ran survives into grading, the harness checks with its own tools, and batched steps read as
``docker exec`` does. Each attack or parity case is rebuilt through the real pipeline, against the official
``programbench eval`` where it has a score to compare.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from programbench.utils.load_data import get_active_branches

from pytest_programbench import RUN_LABEL
from pytest_programbench.engine import docker_engine
from pytest_programbench.engine.container import Container
from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.engine.images import ensure_image
from pytest_programbench.evaluation import harness_material, integrity
from pytest_programbench.evaluation.container_layer import SdkContainerEnvironment
from pytest_programbench.evaluation.evaluation import EvalSettings, EvaluationOutcome, evaluate
from pytest_programbench.evaluation.step_batch import Step
from pytest_programbench.tasks.blobs import resolve_blobs
from pytest_programbench.tasks.catalogue import Task
from tests.conftest import Testbed
from tests.proxy_support import environment_engine
from tests.test_evaluation_integrity import NOPE_COMPILE
from tests.test_evaluation_parity import (
    CATLIKE,
    RPN,
    instances,
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
__all__ = ["official_blob_dir", "official_with_wheels"]  # fixtures
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


def run_ours(task: Task, archive: Path, testbed: Testbed, tmp_path: Path, *, reruns: bool,
             **settings: Any) -> EvaluationOutcome:
    """tests.test_evaluation_parity's, under this module's own run label (its leftovers are checked)."""
    instance = task.load_instance()
    blobs = resolve_blobs(task, get_active_branches(instance), blob_dir=testbed.blob_dir,
                          cache_dir=tmp_path / "cache")
    with environment_engine() as engine:
        image = ensure_image(task, pull="never", engine=engine)
        return evaluate(task, archive, blobs=blobs, image=image.id, labels=Labels(TEST_RUN),
                        settings=EvalSettings(cpus=2, reruns=reruns, **settings), workdir=tmp_path, engine=engine)


def _no_leftovers(docker_client: Any) -> None:
    """What the evaluations of these tests made is gone (their grader volumes are the run's: swept here)."""
    harness_material.remove_grader_volumes(docker_client, TEST_RUN)
    assert _leftovers(docker_client, TEST_RUN) == []


def test_a_process_the_stop_spared_never_reaches_grading(testbed: Testbed, tmp_path: Path, docker_client: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The /proc/PID/mem survivor: a process of compile.sh that the stop spares (here the stop does nothing, as the
    rewritten keep-alive `sleep` made it spare the attacker) waits for the official hash step and then writes a
    force-pass plugin and a .pth loading it into site-packages. Either it wrote before the compile container was
    frozen (then that is flagged) or it died with the container: `echo nope` never passes unflagged, and the install
    record, made in a container of the task's image, never holds its files: an honest wrong program later gets the
    score it gets officially."""
    monkeypatch.setattr(SdkContainerEnvironment, "stop_processes", lambda self, **_: 0)
    writer = (
        "(while [ ! -e /opt/programbench-stashed-executable-do-not-modify ]; do sleep 0.01; done;"
        f" while true; do cp pbforce.txt {SITE}/pbforce.py;"
        f" echo 'import os; os.environ[\"PYTEST_PLUGINS\"] = \"pbforce\"' > {SITE}/zz-pbforce.pth;"
        " sleep 0.05; done) >/dev/null 2>&1 </dev/null &\n").encode()
    src = tmp_path / "src"
    src.mkdir()
    archive = pack(src, tmp_path / "survivor.tar.gz", extra={"compile.sh": NOPE_COMPILE + writer,
                                                            "pbforce.txt": FORCE_PASS})
    records = tmp_path / "records"
    outcome = run_ours(tasks(testbed)[CATLIKE], archive, testbed, tmp_path / "a", reruns=True,
                       install_cache=str(records))
    assert outcome.infra_error is None
    kinds = {f.kind for f in outcome.integrity_flags}
    assert outcome.score < 1.0 or integrity.CHANGED_AFTER_COMPILE in kinds, (outcome.score, kinds)
    for record in records.glob("*/files.tar"):
        assert b"pbforce" not in record.read_bytes()
    # An honest wrong program of the same image, replaying that record: its official statuses.
    honest = run_ours(tasks(testbed)[RPN], pack_wrong_rpn(testbed, tmp_path), testbed, tmp_path / "b",
                      reruns=False, install_cache=str(records))
    assert honest.score < 1.0
    assert honest.integrity_flags == []
    _no_leftovers(docker_client)


def pack_wrong_rpn(testbed: Testbed, tmp_path: Path) -> Path:
    wrong = testbed.bad / RPN / "wrong"
    return pack(wrong, tmp_path / "wrong.tar.gz")


def _shim_submission(testbed: Testbed, tmp_path: Path, *, program: Path | None) -> Path:
    """A program (the good rpn, or `echo nope`) whose compile.sh also puts a `stat` and a `find` that print one line
    on stderr in /usr/local/bin, and plants a look-alike wheel where the harness used to copy its own."""
    shims = (b"for t in stat find; do printf '#!/bin/sh\\necho shim >&2\\n' > /usr/local/bin/$t;"
             b" chmod +x /usr/local/bin/$t; done\n"
             b"{ mkdir -p /tmp/pytest-programbench-wheels && echo fake > "
             b"/tmp/pytest-programbench-wheels/pytest_rerunfailures-16.4-1-py3-none-any.whl; } 2>/dev/null || true\n")
    tmp_path.mkdir(parents=True, exist_ok=True)
    if program is None:
        src = tmp_path / "nope-src"
        src.mkdir()
        return pack(src, tmp_path / "nope-shims.tar.gz", extra={"compile.sh": NOPE_COMPILE + shims})
    compile_sh = (program / "compile.sh").read_bytes().rstrip(b"\n") + b"\n" + shims
    return pack(program, tmp_path / "shims.tar.gz", drop=("compile.sh",), extra={"compile.sh": compile_sh})


def test_the_harness_checks_with_its_own_tools(testbed: Testbed, tmp_path: Path, docker_client: Any,
                                               official_with_wheels: None) -> None:
    """A `stat` and a `find` on the container's PATH that print one line on stderr: the harness's checks (the
    timeout-retry plugin read back, .git looked at, the wheels) never run them, so the good program scores as
    officially (reruns on for both), and `echo nope` with a look-alike wheel at the old fixed path scores what it
    does officially (the wheels are a read-only mount; the old path is never read)."""
    instance = instances(testbed)[RPN]
    good = _shim_submission(testbed, tmp_path / "good", program=testbed.solutions / RPN)
    official = run_official(instance, good)
    ours = run_ours(tasks(testbed)[RPN], good, testbed, tmp_path / "ours", reruns=True)
    assert ours.infra_error is None
    assert ours.reruns, ours.reruns_reason
    assert statuses(ours.result) == statuses(official)  # type: ignore[arg-type]
    assert ours.score == official_score(official, instance) == 1.0
    nope = _shim_submission(testbed, tmp_path / "nope", program=None)
    official_nope = run_official(instance, nope)
    ours_nope = run_ours(tasks(testbed)[RPN], nope, testbed, tmp_path / "ours-nope", reruns=True)
    assert ours_nope.score == official_score(official_nope, instance) < 1.0
    assert ours_nope.reruns, ours_nope.reruns_reason
    _no_leftovers(docker_client)


def test_a_hash_step_whose_output_is_huge_is_parsed_whole(testbed: Testbed, tmp_path: Path, docker_client: Any,
                                                          official_blob_dir: None) -> None:
    """A login profile printing 600 KiB of blanks before every step: the official parses the hash step's whole
    output (its first word is the hash); ours reads those steps whole too, never the cap's marker."""
    instance = instances(testbed)[RPN]
    profile = (b"\necho 'head -c 614400 /dev/zero | tr \"\\\\0\" \" \"' > /etc/profile.d/zz-blanks.sh\n")
    compile_sh = (testbed.solutions / RPN / "compile.sh").read_bytes().rstrip(b"\n") + profile
    archive = pack(testbed.solutions / RPN, tmp_path / "blanks.tar.gz", drop=("compile.sh",),
                   extra={"compile.sh": compile_sh})
    official = run_official(instance, archive)
    ours = run_ours(tasks(testbed)[RPN], archive, testbed, tmp_path / "ours", reruns=False)
    assert official.executable_hash is not None
    assert len(official.executable_hash) == 64
    assert ours.executable_hash == official.executable_hash
    assert ours.result is not None
    assert ours.result.test_branch_errors == official.test_branch_errors == {}
    assert ours.score == official_score(official, instance) == 1.0
    _no_leftovers(docker_client)


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
