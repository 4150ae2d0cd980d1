"""``evaluate``: scores through the official filtering functions, the official pipeline's invariants, where errors
land (scored vs infrastructure), clocks, resources, and that nothing is left behind."""

from __future__ import annotations

import gzip
import itertools
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from programbench.utils.load_data import get_active_branches, get_ignored_branches, get_ignored_tests

from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.engine.images import ensure_image
from pytest_programbench.evaluation import container_layer
from pytest_programbench.evaluation.evaluation import EvalSettings, EvaluationOutcome, evaluate
from pytest_programbench.tasks.blobs import BlobSet, resolve_blobs
from pytest_programbench.tasks.catalogue import Task
from tests.conftest import Testbed
from tests.outcome_support import item_message, item_properties
from tests.proxy_support import environment_engine
from tests.test_evaluation_divergences import custom_rpn, load
from tests.test_evaluation_parity import (
    CATLIKE,
    RPN,
    TUIISH,
    evaluate_swept,
    pack,
    statuses,
    steps,
    submission,
    tasks,
)

pytestmark = pytest.mark.docker

COMPILE_STEPS = ["wipe_workspace", "clear_stale_executable", "seed_git", "compile", "copy_executable",
                 "hash_executable", "install_rerunfailures"]
BRANCH_STEPS = ["restore_executable", "verify_executable_hash", "clean_stale_results", "patch_timeout_method",
                "run_tests", "results_read"]


def _evaluate(task: Task, archive: Path, testbed: Testbed, tmp_path: Path, *, run_id: str | None = None,
              blobs: BlobSet | None = None, image: str | None = None, **settings: Any) -> EvaluationOutcome:
    settings.setdefault("reruns", False)
    settings.setdefault("cpus", 2)
    if blobs is None:
        blobs = resolve_blobs(task, get_active_branches(task.load_instance()), blob_dir=testbed.blob_dir,
                              cache_dir=tmp_path / "cache")
    with environment_engine() as engine:
        return evaluate_swept(task, archive, blobs=blobs, engine=engine, run_id=run_id,
                              image=image or ensure_image(task, pull="never", engine=engine).id,
                              settings=EvalSettings(**settings), workdir=tmp_path)


def _leftovers(docker_client: Any, run_id: str) -> tuple[list[Any], list[Any], list[Any]]:
    filters = {"label": [f"pytest-programbench={run_id}"]}
    api = docker_client.api
    return (api.containers(all=True, filters=filters), api.images(filters=filters),
            (api.volumes(filters=filters) or {}).get("Volumes") or [])


@pytest.mark.parametrize(("instance_id", "variant"), [(CATLIKE, "dummy"), (CATLIKE, "wrong"), (RPN, "dummy"),
                                                      (TUIISH, "wrong")])
def test_score_is_the_official_filtered_score(testbed: Testbed, tmp_path: Path, instance_id: str,
                                              variant: str) -> None:
    task = tasks(testbed)[instance_id]
    instance = task.load_instance()
    outcome = _evaluate(task, submission(testbed, variant, instance_id), testbed, tmp_path)
    result = outcome.result
    assert result is not None
    active = get_active_branches(instance)
    ignored_tests = get_ignored_tests(instance)
    # eval.json keeps everything (ignored tests included); the ignored branch is never run.
    assert result.test_branches == active
    assert not set(get_ignored_branches(instance)) & {t.branch for t in result.test_results}
    assert {t.full_name for t in result.test_results} >= {n for n in ignored_tests if n.split("/")[0] in active}
    filtered = result.for_branches(active).without_ignored(ignored_tests)
    assert outcome.score == filtered.score
    assert outcome.n_passed == sum(t.status == "passed" for t in filtered.test_results)
    assert outcome.n_tests == len(filtered.test_results)
    assert outcome.n_tests == sum(len(instance["branches"][b]["tests"]) for b in active) - len(
        [n for n in ignored_tests if n.split("/")[0] in active])
    if variant == "dummy":
        # The dummy passes the dummy_pass tests, which are ignored: the official filter drops them.
        passed_ignored = [t for t in result.test_results if t.full_name in ignored_tests and t.is_resolved]
        assert passed_ignored
        assert outcome.score == 0.0
    failing = {b for b in outcome.failing_branches}
    assert failing == {t.branch for t in filtered.test_results if not t.is_resolved}
    assert all(len(v) <= 3 for v in outcome.failing_branches.values())
    message = item_message(outcome, task)
    assert f"score {outcome.score:.4f} ({outcome.n_passed}/{outcome.n_tests} tests passed)" in message
    for branch in failing:
        count = sum(t.branch == branch and not t.is_resolved for t in filtered.test_results)
        total = sum(t.branch == branch for t in filtered.test_results)
        assert f"branch {branch}: {count} of {total} tests failing" in message


def test_invariants_fresh_container_per_branch_hash_rechecked_one_entry_per_step(
    docker_client: Any, testbed: Testbed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tuple[str, str]] = []
    original = container_layer.SdkContainerEnvironment.__init__

    def recording(self: Any, **kwargs: Any) -> None:
        original(self, **kwargs)
        made.append((kwargs["image"], self.container_id))

    monkeypatch.setattr(container_layer.SdkContainerEnvironment, "__init__", recording)
    run_id = f"pb-test-{uuid.uuid4().hex[:8]}"
    task = tasks(testbed)[RPN]
    outcome = _evaluate(task, submission(testbed, "good", RPN), testbed, tmp_path, run_id=run_id)
    result = outcome.result
    assert result is not None
    assert outcome.score == 1.0
    branches = result.test_branches
    assert len(branches) == 3

    # One log entry per official step, in the official order.
    assert steps(result) == COMPILE_STEPS + BRANCH_STEPS * len(branches)

    # A fresh container per branch (plus the compile container), never reused; branches run on the commit.
    ids = [cid for _, cid in made]
    assert len(ids) == len(set(ids)) == 1 + len(branches)
    assert made[0][0] == ensure_image(task, pull="never", engine=docker_client).id
    assert {image for image, _ in made[1:]} == {made[1][0]}
    assert made[1][0].startswith(f"programbench-compiled/{RPN}:")
    reads = [e for e in result.log if e["step"] == "results_read"]
    assert [e["branch"] for e in reads] == branches
    read_ids = {str(e["command"]).split()[2].split(":")[0] for e in reads}
    assert read_ids == set(ids[1:])

    # The executable hash is re-checked in every branch container.
    checks = [e for e in result.log if e["step"] == "verify_executable_hash"]
    assert len(checks) == len(branches)
    assert all(str(e["output"]).split()[0] == result.executable_hash for e in checks)

    # Nothing is left: containers and the committed image are gone.
    assert _leftovers(docker_client, run_id) == ([], [], [])


def test_each_next_branch_is_made_ready_while_the_branch_before_it_runs(
        testbed: Testbed, tmp_path: Path, docker_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Branches 2 and 3 of rpn get the container made ahead (started, tests copied in, the steps before the tests
    run, the timeout-retry plugin copied in) while the branch before them runs; the first gets a fresh one. The
    results are those of containers made when asked for (prefetch off), and those of three branch workers; nothing
    is left. (The branch workers' comparison was a test of its own against a fourth, serial, evaluation.)"""
    task = tasks(testbed)[RPN]
    archive = submission(testbed, "wrong", RPN)
    parallel_run = f"pb-test-{uuid.uuid4().hex[:8]}"
    parallel = _evaluate(task, archive, testbed, tmp_path, run_id=parallel_run, branch_workers=3)  # reruns off
    assert _leftovers(docker_client, parallel_run) == ([], [], [])
    warmed: list[tuple[str, str]] = []  # (branch, container id) made ready ahead
    tested: list[tuple[str, str, float]] = []  # (branch, container id, when its run_tests ended)
    ready_at: dict[str, float] = {}
    warm, run_step = container_layer.SdkEvaluator._warm, container_layer.SdkEvaluator._run_step

    def spy_warm(self: Any, image: str, branch: str) -> Any:
        container = warm(self, image, branch)
        warmed.append((branch, container.container_id))
        ready_at[branch] = time.monotonic()
        return container

    def spy_step(self: Any, command: str, *, env: Any, step_name: str, **kwargs: Any) -> Any:
        result = run_step(self, command, env=env, step_name=step_name, **kwargs)
        if step_name == "run_tests":
            tested.append((self._current.branch, env.container_id, time.monotonic()))
        return result

    plugins: list[str] = []  # the timeout-retry plugin copied in ahead, per container
    copy_plugin = container_layer.SdkEvaluator._copy_timeout_retry_plugin

    def spy_plugin(container: Any) -> None:
        copy_plugin(container)
        plugins.append(container.container_id)

    monkeypatch.setattr(container_layer.SdkEvaluator, "_copy_timeout_retry_plugin", staticmethod(spy_plugin))
    monkeypatch.setattr(container_layer.SdkEvaluator, "_warm", spy_warm)
    monkeypatch.setattr(container_layer.SdkEvaluator, "_run_step", spy_step)
    run_id = f"pb-test-{uuid.uuid4().hex[:8]}"
    ahead = _evaluate(task, archive, testbed, tmp_path, run_id=run_id, reruns=True)
    branches = [b for b, _, _ in tested]
    assert len(branches) == 3
    assert [b for b, _ in warmed] == branches[1:]
    assert [c for _, c in warmed] == [c for _, c, _ in tested[1:]]
    assert plugins == [c for _, c in warmed]  # and their tests ran with it (the results below)
    # Each was ready before the branch before it had finished its tests.
    for (_, _, before_ended), (branch, _, _) in itertools.pairwise(tested):
        assert ready_at[branch] < before_ended
    # Steps from the made-ahead containers are in the log in the official order, once each.
    assert steps(ahead.result) == COMPILE_STEPS + 3 * [*BRANCH_STEPS[:4], "install_pytest_timeout_retry",
                                                       *BRANCH_STEPS[4:]]
    monkeypatch.setenv("PYTEST_PROGRAMBENCH_PREFETCH", "0")
    warmed.clear()
    asked = _evaluate(task, archive, testbed, tmp_path, reruns=True)
    assert warmed == []
    assert statuses(ahead.result) == statuses(asked.result) == statuses(parallel.result)
    assert ahead.score == asked.score == parallel.score < 1.0
    assert _leftovers(docker_client, run_id) == ([], [], [])


def test_compile_clock(testbed: Testbed, tmp_path: Path, docker_client: Any) -> None:
    archive = pack(testbed.solutions / RPN, tmp_path / "slow.tar.gz", drop=("compile.sh",),
                   extra={"compile.sh": b"#!/bin/sh\nsleep 900 &\nsleep 900\n"})
    run_id = f"pb-test-{uuid.uuid4().hex[:8]}"
    outcome = _evaluate(tasks(testbed)[RPN], archive, testbed, tmp_path, run_id=run_id, compile_timeout=3)
    assert outcome.infra_error is None
    assert outcome.error_code == "compile_failed"
    assert outcome.timeouts == ["compile"]
    assert outcome.clock_fired == "compile"
    assert outcome.score == 0.0
    entry = next(e for e in outcome.result.log if e["step"] == "compile")  # type: ignore[union-attr]
    assert entry["exception_info"] == "Command timed out after 3s"
    assert entry["wall_time"] < 450  # the step ended with its clock, not with the background sleep (900 s)
    assert "clock fired: compile" in item_message(outcome, tasks(testbed)[RPN])
    assert _leftovers(docker_client, run_id) == ([], [], [])


def test_test_clock(testbed: Testbed, tmp_path: Path) -> None:
    """The hanging test trips pytest-timeout inside (10 s); a 6 s branch clock fires first and is named. On a copy
    of catlike with one branch active, the one holding the hanging test (the other passes everything)."""
    hanging = "8d2e4b6f0a13"  # test_streams_before_eof
    task = load(custom_rpn(testbed, tmp_path / "task", active=[hanging], source=CATLIKE), CATLIKE)[0]
    blobs = resolve_blobs(task, [hanging], blob_dir=tmp_path / "task" / "blobs", cache_dir=tmp_path / "cache")
    outcome = _evaluate(task, submission(testbed, "hang", CATLIKE), testbed, tmp_path, blobs=blobs,
                        test_timeout=6, branch_retries=0)
    assert outcome.infra_error is None
    assert outcome.clock_fired == "test"
    hung = [t for t in outcome.timeouts if t.startswith("test:")]
    assert hung
    for entry in hung:
        branch = entry.split(":", 1)[1]
        assert branch in outcome.failing_branches
    assert outcome.score < 1.0


def test_output_is_capped_in_the_log(testbed: Testbed, tmp_path: Path) -> None:
    """One branch of rpn (a copy, the others ignored): the cap is on each step's log entry, compile's here."""
    task = load(custom_rpn(testbed, tmp_path / "task", active=["0b5e55e01a2b"]))[0]
    blobs = resolve_blobs(task, get_active_branches(task.load_instance()), blob_dir=tmp_path / "task" / "blobs",
                          cache_dir=tmp_path / "cache")
    archive = pack(testbed.solutions / RPN, tmp_path / "loud.tar.gz", drop=("compile.sh",),
                   extra={"compile.sh": (testbed.solutions / RPN / "compile.sh").read_bytes()
                          + b"\nhead -c 3000000 /dev/zero | tr '\\0' y\n"})
    outcome = _evaluate(task, archive, testbed, tmp_path, blobs=blobs, output_cap=10_000)
    entry = next(e for e in outcome.result.log if e["step"] == "compile")  # type: ignore[union-attr]
    assert "bytes of stdout omitted from this log" in entry["output"]
    assert len(entry["output"]) < 25_000
    reads = [e for e in outcome.result.log if e["step"] == "results_read"]  # type: ignore[union-attr]
    assert reads
    assert all("omitted from this log" not in e["output"] for e in reads)
    assert all(e["output"].startswith("<?xml") for e in reads)
    assert outcome.score == 1.0


# --------------------------------------------------------------------------------------------- where errors land


def test_missing_archive_is_scored_zero_not_infra(testbed: Testbed, tmp_path: Path) -> None:
    outcome = _evaluate(tasks(testbed)[RPN], tmp_path / "absent.tar.gz", testbed, tmp_path)
    assert outcome.infra_error is None
    assert outcome.error_code == "no_submission"
    assert outcome.score == 0.0
    assert outcome.n_tests > 0
    assert outcome.result is not None
    assert {t.status for t in outcome.result.test_results} == {"not_run"}


@pytest.mark.parametrize("kind", ["not-gzip", "truncated", "gzip-not-tar"])
def test_unreadable_archive_is_scored_zero_with_the_problem_named(testbed: Testbed, tmp_path: Path,
                                                                  kind: str) -> None:
    good = submission(testbed, "good", RPN)
    bad = tmp_path / "submission.tar.gz"
    if kind == "not-gzip":
        with tarfile.open(bad, "w") as tar:
            tar.add(str(testbed.solutions / RPN / "compile.sh"), arcname="compile.sh")
    elif kind == "truncated":
        bad.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    else:
        bad.write_bytes(gzip.compress(b"plain text, not a tar archive" * 50))
    outcome = _evaluate(tasks(testbed)[RPN], bad, testbed, tmp_path)
    assert outcome.infra_error is None
    assert outcome.error_code == "invalid_submission_archive"
    assert outcome.score == 0.0
    assert str(bad) in (outcome.error_details or "")


def test_missing_image_is_an_infra_error(testbed: Testbed, tmp_path: Path) -> None:
    outcome = _evaluate(tasks(testbed)[RPN], submission(testbed, "good", RPN), testbed, tmp_path,
                        image="programbench/absent:task_cleanroom_v6")
    assert outcome.infra_error is not None
    assert "could not start the compile container" in outcome.infra_error
    assert outcome.result is None


def test_unresolved_blob_is_an_infra_error(testbed: Testbed, tmp_path: Path) -> None:
    task = tasks(testbed)[RPN]
    blobs = resolve_blobs(task, get_active_branches(task.load_instance()), blob_dir=testbed.blob_dir,
                          cache_dir=tmp_path / "cache")
    partial = BlobSet(blobs.instance_id, blobs.directory, dict(list(blobs.sha256.items())[:1]), blobs.source)
    outcome = _evaluate(task, submission(testbed, "good", RPN), testbed, tmp_path, blobs=partial)
    assert outcome.infra_error is not None
    assert "hidden tests not resolved" in outcome.infra_error


def test_unreachable_engine_is_an_infra_error(testbed: Testbed, tmp_path: Path) -> None:
    import docker

    task = tasks(testbed)[RPN]
    blobs = resolve_blobs(task, get_active_branches(task.load_instance()), blob_dir=testbed.blob_dir,
                          cache_dir=tmp_path / "cache")
    dead = docker.DockerClient(base_url=f"unix://{tmp_path}/no.sock", version="1.41")
    outcome = evaluate(task, submission(testbed, "good", RPN), blobs=blobs, image="sha256:0", labels=Labels("x"),
                       settings=EvalSettings(cpus=1, reruns=False), workdir=tmp_path, engine=dead)
    assert outcome.infra_error is not None
    assert "engine" in outcome.infra_error.lower()


def test_properties_are_plain_builtins(testbed: Testbed, tmp_path: Path) -> None:
    outcome = _evaluate(tasks(testbed)[RPN], submission(testbed, "compile_error", RPN), testbed, tmp_path)
    props = item_properties(outcome, tasks(testbed)[RPN])
    assert {"score", "n_passed", "n_tests", "error_code", "executable_hash", "failed_branches", "compile_seconds",
            "test_seconds"} <= set(props)
    assert all(isinstance(v, str | int | float | bool) for v in props.values())
    import json

    json.dumps(outcome.meta())
    assert outcome.meta()["reruns"] == "off"
