"""Parity, in-process: the official ``Evaluator`` (docker CLI) and ours (official Evaluator on the SDK layer, through
``evaluate``) on the same engine, images and submissions must give identical per-test statuses and scores.

The official side runs as ``programbench eval`` would (``PROGRAMBENCH_BLOB_DIR`` → ``get_blob_dir``, fixture
instance dicts, ``docker_cpus=2``). On this offline engine its ``pip3 install pytest-rerunfailures==16.4`` fails, so
reruns are off there; ours runs with reruns off for those cases (``EvalSettings(reruns=False)``). The ``reruns``
cases give the official side the same wheels through ``DOCKER_RUN_ARGS`` (a read-only mount plus ``PIP_NO_INDEX``),
as it would get them from PyPI with internet, and compare with ours with reruns on.

Helpers here are shared by the other ``test_evaluation_*`` files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import shutil
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from programbench.eval.eval import EvaluationResult, Evaluator
from programbench.utils.load_data import (
    get_active_branches,
    get_ignored_branches,
    get_ignored_tests,
    load_all_instances,
)

from pytest_programbench import RUN_LABEL as ENGINE_RUN_LABEL
from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.engine.images import ensure_image
from pytest_programbench.evaluation import harness_material
from pytest_programbench.evaluation.evaluation import EvalSettings, EvaluationOutcome, evaluate
from pytest_programbench.evaluation.rerunfailures import CONTAINER_WHEEL_DIR, ensure_wheels
from pytest_programbench.tasks.blobs import resolve_blobs
from pytest_programbench.tasks.catalogue import Task, load_packaged, load_tasks_dir
from tests.conftest import Testbed
from tests.proxy_support import environment_engine

pytestmark = pytest.mark.docker

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"
TUIISH = "pbfix__tuiish.7e1a0b2"
CALCULATOR = "testorg__calculator.abc1234"
RUN_LABEL = "pb-test-evaluation"


# --------------------------------------------------------------------------------------------- shared helpers


def instances(testbed: Testbed) -> dict[str, dict[str, Any]]:
    """Official instance dicts: the fixture tasks plus the packaged calculator."""
    found = {i["instance_id"]: i for i in load_all_instances(testbed.tasks_dir)}
    for inst in load_all_instances():
        found.setdefault(inst["instance_id"], inst)
    return found


def tasks(testbed: Testbed) -> dict[str, Task]:
    found = {t.instance_id: t for t in load_tasks_dir(testbed.tasks_dir)}
    for task in load_packaged():
        found.setdefault(task.instance_id, task)
    return found


def submission(testbed: Testbed, variant: str, instance_id: str) -> Path:
    path = testbed.submissions.parent / variant / instance_id / "submission.tar.gz"
    assert path.is_file(), f"test bed submission missing: {path}"
    return path


def pack(src: Path, out: Path, extra: dict[str, bytes] | None = None, drop: tuple[str, ...] = (),
         modes: dict[str, int] | None = None) -> Path:
    """A submission archive from a directory, with files added or dropped."""
    with tarfile.open(out, "w:gz") as tar:
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src).as_posix()
            if rel in drop or path.is_dir():
                continue
            tar.add(str(path), arcname=f"./{rel}")
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            info.mode = (modes or {}).get(name, 0o755 if name.endswith(".sh") else 0o644)
            tar.addfile(info, io.BytesIO(data))
    return out


def reference_bytes(docker_client: Any, image: str) -> bytes:
    """The reference binary of a task image (read as root from a created, never started, container)."""
    container = docker_client.api.create_container(image, command=["true"], labels={RUN_LABEL: "reference"},
                                                   host_config=docker_client.api.create_host_config(
                                                       network_mode="none"))
    try:
        stream, _ = docker_client.api.get_archive(container["Id"], "/workspace/executable")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.getmembers()[0]
            f = tar.extractfile(member)
            assert f is not None
            return f.read()
    finally:
        docker_client.api.remove_container(container["Id"], force=True)


def run_official(instance: dict[str, Any], archive: Path, *, docker_cpus: int = 2) -> EvaluationResult:
    """The official evaluator exactly as ``programbench eval`` builds it (eval_batch._evaluate_instance)."""
    from programbench.utils.blob_store import get_blob_dir

    instance_id = instance["instance_id"]
    active = get_active_branches(instance)
    branches = instance.get("branches", {})
    evaluator = Evaluator(
        image_name=instance["image_name"],
        solution_branch="submission",
        submission_archive=archive,
        blob_dir=get_blob_dir(instance_id),
        tests_branches=active,
        remove_hashes=instance.get("eval_clean_hashes", []),
        image_tag="task_cleanroom_v6",
        tests_by_branch={b: branches[b]["tests"] for b in active if b in branches},
        ignored_tests=get_ignored_tests(instance),
        ignored_branches=get_ignored_branches(instance),
        instance_id=instance_id,
        docker_cpus=docker_cpus,
    )
    return evaluator.run()


def run_ours(task: Task, archive: Path, testbed: Testbed, tmp_path: Path, *, reruns: bool, strict: bool = False,
             blob_dir: Path | None = None, **settings: Any) -> EvaluationOutcome:
    instance = task.load_instance()
    blobs = resolve_blobs(task, get_active_branches(instance), blob_dir=blob_dir or testbed.blob_dir,
                          cache_dir=tmp_path / "cache")
    with environment_engine() as engine:
        image = ensure_image(task, pull="never", engine=engine)
        return evaluate_swept(task, archive, blobs=blobs, image=image.id, workdir=tmp_path, engine=engine,
                              settings=EvalSettings(cpus=2, reruns=reruns, strict=strict, **settings))


def leftovers(docker_client: Any, run_id: str) -> list[str]:
    """What the engine still holds of a run: its containers, images and volumes."""
    api = docker_client.api
    label = {"label": f"{ENGINE_RUN_LABEL}={run_id}"}
    found = [str(c["Id"])[:12] for c in api.containers(all=True, filters=label)]
    found += [str(i["Id"])[:19] for i in api.images(filters=label)]
    found += [str(v["Name"]) for v in (api.volumes(filters=label) or {}).get("Volumes") or []]
    return found


def evaluate_swept(task: Task, archive: Path, *, engine: Any, run_id: str | None = None,
                   **kwargs: Any) -> EvaluationOutcome:
    """``evaluate`` under a run of its own; its grader volumes (the run's: a session's sweep removes them) removed
    after it, and nothing of it left on the engine."""
    run = run_id or f"{RUN_LABEL}-{uuid.uuid4().hex[:8]}"
    try:
        outcome = evaluate(task, archive, labels=Labels(run), engine=engine, **kwargs)
    finally:
        harness_material.remove_grader_volumes(engine, run)
    assert leftovers(engine, run) == []
    return outcome


def official_score(result: EvaluationResult, instance: dict[str, Any]) -> float:
    return float(result.for_branches(get_active_branches(instance)).without_ignored(get_ignored_tests(instance)).score)


def statuses(result: EvaluationResult) -> dict[str, str]:
    out: dict[str, str] = {}
    for test in result.test_results:
        assert test.full_name not in out, f"duplicate result for {test.full_name}"
        out[test.full_name] = test.status
    return out


def steps(result: EvaluationResult) -> list[str]:
    return [str(e["step"]) for e in result.log]


def assert_parity(official: EvaluationResult, outcome: EvaluationOutcome, instance: dict[str, Any]) -> None:
    assert official.log, "the official evaluator produced no log"
    assert official.test_results, "the official evaluator produced no results"
    assert outcome.infra_error is None, outcome.infra_error
    ours = outcome.result
    assert ours is not None
    assert statuses(ours) == statuses(official)
    assert outcome.score == official_score(official, instance)
    assert ours.error_code == official.error_code
    assert {b: [e.error_code for e in es] for b, es in ours.test_branch_errors.items()} == {
        b: [e.error_code for e in es] for b, es in official.test_branch_errors.items()}
    assert ours.executable_hash == official.executable_hash
    assert steps(ours) == steps(official)
    assert ours.test_branches == official.test_branches
    assert ours.solution_branch == official.solution_branch
    # An honest run never trips the JUnit cross-check (reruns, crashed workers and their serial retry, hangs).
    assert [f for f in outcome.integrity_flags if f.kind == "results_mismatch"] == []


def with_clean_hash(task: Task, instance: dict[str, Any], digest: str) -> tuple[Task, dict[str, Any]]:
    """A test copy of the task whose task.yaml lists ``digest`` in eval_clean_hashes."""
    raw = {**task.raw, "eval_clean_hashes": [digest]}
    return (dataclasses.replace(task, eval_clean_hashes=(digest,), raw=raw),
            {**instance, "eval_clean_hashes": [digest]})


@pytest.fixture
def official_blob_dir(testbed: Testbed, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PROGRAMBENCH_BLOB_DIR`` as the official CLI reads it (at import of blob_store)."""
    from programbench.utils import blob_store

    monkeypatch.setenv("PROGRAMBENCH_BLOB_DIR", str(testbed.blob_dir))
    monkeypatch.setattr(blob_store, "BLOB_LOCAL_DIR", str(testbed.blob_dir))


@pytest.fixture
def official_with_wheels(official_blob_dir: None) -> Iterator[None]:
    """Give the official evaluator the rerunfailures wheels it would get from PyPI with internet."""
    with official_wheels_mounted():
        yield


@contextlib.contextmanager
def official_wheels_mounted() -> Iterator[None]:
    """Every container the official evaluator starts meanwhile gets the rerunfailures wheels, read-only, and pip is
    pointed at them: what it would fetch from PyPI with internet."""
    from programbench import constants

    wheels = ensure_wheels()
    if not wheels.available:
        pytest.fail(f"the rerunfailures wheels are needed for this test: {wheels.reason}", pytrace=False)
    extra = ["-v", f"{wheels.directory}:{CONTAINER_WHEEL_DIR}:ro", "-e", "PIP_NO_INDEX=1",
             "-e", f"PIP_FIND_LINKS={CONTAINER_WHEEL_DIR}"]
    constants.DOCKER_RUN_ARGS.extend(extra)
    try:
        yield
    finally:
        del constants.DOCKER_RUN_ARGS[-len(extra):]


# --------------------------------------------------------------------------------------------- parity cases


# The cases run on a copy of their task with one branch active: the one where the submission goes wrong (and
# passes other tests). Their other branches pass every test, which correct-catlike's two branches (with the ignored
# third) already compare (issue 40: containers fewer).
CASE_BRANCH = {
    (RPN, "wrong"): "0b5e55e01a2b",  # `1 4 /` gives 0
    (CATLIKE, "killer"): "3f9c1a7e2b40",  # test_word_boom: the program SIGKILLs its xdist worker
    (CATLIKE, "hang"): "8d2e4b6f0a13",  # test_streams_before_eof waits for output held until EOF
}


def case(testbed: Testbed, instance_id: str, variant: str, root: Path,
         monkeypatch: pytest.MonkeyPatch) -> tuple[Task, dict[str, Any], Path | None]:
    """The task, official instance and blob directory (None: the test bed's) a parity case evaluates."""
    branch = CASE_BRANCH.get((instance_id, variant))
    if branch is not None:
        from tests.test_evaluation_divergences import one_branch_copy  # that module imports this one

        return one_branch_copy(testbed, root, instance_id, monkeypatch, branch=branch)
    return tasks(testbed)[instance_id], instances(testbed)[instance_id], None


@pytest.mark.parametrize(
    ("instance_id", "variant"),
    [
        pytest.param(CATLIKE, "good", id="correct-catlike"),
        # Not tuiish/good: its ignored test_redraws_after_resize races (a SIGWINCH that lands while the good
        # solution is still painting is lost), so its status flips run to run on either evaluator.
        pytest.param(RPN, "wrong", id="partly-wrong"),
        pytest.param(RPN, "compile_error", id="compile-error"),
        pytest.param(CATLIKE, "no_compile_sh", id="no-compile-sh"),
        pytest.param(CATLIKE, "hang", id="hanging-test"),
        pytest.param(CATLIKE, "killer", id="xdist-killer"),
        pytest.param(CALCULATOR, "good", id="calculator"),
    ],
)
def test_parity_with_official(testbed: Testbed, official_blob_dir: None, tmp_path: Path, instance_id: str,
                              variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    task, instance, blob_dir = case(testbed, instance_id, variant, tmp_path / "task", monkeypatch)
    archive = submission(testbed, variant, instance_id)
    official = run_official(instance, archive)
    outcome = run_ours(task, archive, testbed, tmp_path, reruns=False, blob_dir=blob_dir)
    assert_parity(official, outcome, instance)
    if instance_id == CALCULATOR:
        # Its tests.json lacks the `eval.` prefix its JUnit XML has: 3 passed + 3 not_run, on both sides.
        assert outcome.score == 0.5
    if variant == "good" and instance_id != CALCULATOR:
        assert outcome.score == 1.0
    if variant in ("compile_error", "no_compile_sh"):
        assert outcome.error_code == "compile_failed"
        assert outcome.score == 0.0
    if variant in ("hang", "killer"):
        assert 0.0 < outcome.score < 1.0
    if variant == "wrong":
        assert 0.0 < outcome.score < 1.0  # partly: its one branch has passing and failing tests
    if variant == "killer":
        assert any("crashed" in str(t.extra.get("message", "")) for t in official.test_results)


def test_parity_noop_compile_with_shipped_executable(testbed: Testbed, official_blob_dir: None,
                                                     tmp_path: Path) -> None:
    """A stub compile.sh with a prebuilt ./executable in the archive: the official removes it first."""
    archive = pack(testbed.solutions / RPN, tmp_path / "noop.tar.gz", drop=("compile.sh",),
                   extra={"compile.sh": b"#!/bin/sh\ntrue\n", "executable": b"#!/bin/sh\necho 42\n"},
                   modes={"executable": 0o755})
    instance = instances(testbed)[RPN]
    official = run_official(instance, archive)
    outcome = run_ours(tasks(testbed)[RPN], archive, testbed, tmp_path, reruns=False)
    assert_parity(official, outcome, instance)
    assert outcome.error_code == "copy_executable_failed"
    assert outcome.score == 0.0


def test_parity_gold_copy_is_cleaned(docker_client: Any, testbed: Testbed, official_blob_dir: None,
                                     tmp_path: Path) -> None:
    """The reference shipped in the archive: its hash is in eval_clean_hashes, so it is removed before compile."""
    task = tasks(testbed)[RPN]
    gold = reference_bytes(docker_client, f"{task.image_name}:task_cleanroom_v6")
    digest = hashlib.sha256(gold).hexdigest()
    task, instance = with_clean_hash(task, instances(testbed)[RPN], digest)
    archive = pack(testbed.solutions / RPN, tmp_path / "gold.tar.gz", drop=("compile.sh",),
                   extra={"compile.sh": b"#!/bin/sh\nset -e\ncp vendor/gold.bin executable\n", "vendor/gold.bin": gold})
    official = run_official(instance, archive)
    outcome = run_ours(task, archive, testbed, tmp_path, reruns=False)
    assert_parity(official, outcome, instance)
    assert [e["step"] for e in official.log][:2] == ["wipe_workspace", "remove_hashed_files"]
    assert "gold.bin" in str(official.log[1]["output"])
    assert outcome.error_code == "compile_failed"


# No correct fixture submission here: every test passes, nothing is rerun, so it is the same with reruns on or off and
# its parity is test_parity_with_official[correct-catlike]'s. (The calculator stays: the packaged task, its own runner.)
@pytest.mark.parametrize(
    ("instance_id", "variant"),
    [
        pytest.param(RPN, "wrong", id="partly-wrong"),
        pytest.param(CATLIKE, "killer", id="xdist-killer"),
        pytest.param(CALCULATOR, "good", id="calculator"),
    ],
)
def test_parity_with_reruns(testbed: Testbed, official_with_wheels: None, tmp_path: Path, instance_id: str,
                            variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reruns on for both: the official gets the wheels as it would from PyPI, ours from the host cache."""
    task, instance, blob_dir = case(testbed, instance_id, variant, tmp_path / "task", monkeypatch)
    archive = submission(testbed, variant, instance_id)
    official = run_official(instance, archive)
    official_install = [e for e in official.log if e["step"] == "install_rerunfailures"]
    assert official_install[0]["returncode"] == 0, official_install[0]["output"]
    assert "install_pytest_timeout_retry" in steps(official)
    outcome = run_ours(task, archive, testbed, tmp_path, reruns=True, blob_dir=blob_dir)
    assert outcome.reruns, outcome.reruns_reason
    assert_parity(official, outcome, instance)


def test_official_container_runs_without_network_flag(testbed: Testbed, docker_client: Any) -> None:
    """The official ContainerEnvironment runs `docker run` without --network: it works on this bridge=none
    engine (the container gets the default network mode with loopback only)."""
    from programbench.container import ContainerEnvironment

    env = ContainerEnvironment(image=f"{tasks(testbed)[RPN].image_name}:task_cleanroom_v6", cwd="/workspace",
                               timeout=30, cpus=1)
    try:
        r = env.execute("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
        assert r["returncode"] == 0, r
        assert r["output"].split() == ["lo"]
    finally:
        env.cleanup()


def test_shared_helpers_pack(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a").write_text("a")
    (src / "compile.sh").write_text("x")
    out = pack(src, tmp_path / "o.tar.gz", extra={"b": b"b"}, drop=("compile.sh",))
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["./b", "./sub/a"]
    shutil.rmtree(src)
