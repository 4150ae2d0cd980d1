"""Issue 30 §5: the speed shortcuts give the official result, or differ only as README's table says.

The step batch: each case is a submission whose login profile (written by its compile.sh into /etc/profile.d, so
every later ``bash -lc`` step sources it) once made the batched steps (evaluation/step_batch.py) differ from one
exec per step. Each is evaluated by ``programbench eval``'s own code (``eval_batch._evaluate_instance``), by ours with
the batch and by ours without it (``PYTEST_PROGRAMBENCH_STEP_BATCH=0``): the same score, error code, per-test
statuses, executable hash and, for every step, the same return code (and the same output for the steps the batch
runs). The profile lies outside /workspace, so ours raises an integrity flag: the score is still the official one.

The made-ahead branch container: older when its tests start, a documented difference; the switch restores the
official's. The wheel directory's clean-up: no login shell (the official runs none there).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from programbench.eval.eval import EvaluationResult
from programbench.utils import blob_store
from programbench.utils.load_data import get_active_branches

from pytest_programbench.core.environment import PREFETCH, QUICK_ACKS, STEP_BATCH
from pytest_programbench.engine.images import ensure_image
from pytest_programbench.evaluation.evaluation import EvalSettings, EvaluationOutcome, _reruns_reason
from pytest_programbench.evaluation.rerunfailures import RerunWheels
from pytest_programbench.tasks.blobs import resolve_blobs
from pytest_programbench.tasks.catalogue import Task
from tests.conftest import Testbed
from tests.outcome_support import item_message
from tests.proxy_support import environment_engine
from tests.test_evaluation_divergences import (
    GOOD_COMPILE,
    custom_rpn,
    load,
    rpn_archive,
    run_official_cli,
    run_ours,
    with_profile_script,
)
from tests.test_evaluation_parity import evaluate_swept, official_wheels_mounted, statuses

BRANCH = "4d3c2b1a0f9e"  # one active branch: the cases are about the steps around it, not about the tests
# The steps the batch runs (container_layer.SdkEvaluator._batch_from): their outputs are compared too.
BATCHED = {"clear_stale_executable", "seed_git", "copy_executable", "hash_executable", "restore_executable",
           "verify_executable_hash", "clean_stale_results", "patch_timeout_method", "install_pytest_timeout_retry"}


def step_view(result: EvaluationResult) -> list[tuple[str, Any, str]]:
    """Each step's name and return code, and the output of those the batch runs (the others' holds timings, or,
    for pip, the official's network errors where ours has no index)."""
    return [(str(e["step"]), e.get("returncode"), str(e.get("output", "")) if e["step"] in BATCHED else "")
            for e in result.log]


@pytest.mark.docker
@pytest.mark.parametrize(
    ("profile", "score"),
    [
        # An exec returns about 2 s after its process exits, whoever holds its output; the batch waited for the
        # holder, patch_timeout_method (10 s clock) timed out, the teardown killed the container: 0 for 1.0.
        pytest.param("sleep 11 &", 1.0, id="profile-leaves-a-child-holding-the-output"),
        # Each exec leads its own session; in the batch `kill 0` killed the driver: copy_executable_failed, 0.
        pytest.param("trap 'trap \"\" TERM; kill 0' EXIT", 1.0, id="exit-trap-kills-its-process-group"),
        # Printed before sha256sum's line: the first word is the recorded executable_hash ("SHLVL=1" officially;
        # the batch's steps ran at SHLVL 2).
        pytest.param("echo SHLVL=$SHLVL", 1.0, id="profile-prints-shlvl"),
    ],
)
def test_batched_steps_score_as_the_official(testbed: Testbed, official_blobs: Any, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, profile: str, score: float) -> None:
    root = custom_rpn(testbed, tmp_path / "task", active=[BRANCH])
    task, instance = load(root)
    archive = rpn_archive(testbed, tmp_path / "s.tar.gz", with_profile_script(profile))
    official_blobs(root / "blobs")
    summary, official = run_official_cli(instance, archive, tmp_path / "official")
    assert official is not None, summary
    assert summary.score == score, summary
    outcomes: dict[str, EvaluationOutcome] = {}
    for batch in ("1", "0"):
        monkeypatch.setenv(STEP_BATCH.name, batch)
        (work := tmp_path / f"ours-{batch}").mkdir()
        outcomes[batch] = run_ours(task, archive, root / "blobs", work)
    for batch, outcome in outcomes.items():
        assert outcome.infra_error is None, outcome.infra_error
        assert outcome.result is not None
        assert (outcome.score, outcome.error_code) == (summary.score, summary.error_code), (
            batch, item_message(outcome, task))
        assert statuses(outcome.result) == statuses(official)
        assert outcome.executable_hash == official.executable_hash, batch
        assert step_view(outcome.result) == step_view(official), batch
        assert [f.kind for f in outcome.integrity_flags], "the profile outside /workspace is flagged"
    if profile.startswith("echo SHLVL"):
        assert official.executable_hash == "SHLVL=1"


@pytest.fixture
def official_blobs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Points the official evaluator at a blob directory (``PROGRAMBENCH_BLOB_DIR``, read at import)."""
    def use(blob_dir: Path) -> None:
        monkeypatch.setenv("PROGRAMBENCH_BLOB_DIR", str(blob_dir))
        monkeypatch.setattr(blob_store, "BLOB_LOCAL_DIR", str(blob_dir))
    return use


# --------------------------------------------------------------------------------------------- the made-ahead container

AGE_TEST = '''import os
import time

import pytest


def parent_and_start(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19]) / os.sysconf("SC_CLK_TCK")


def test_container_is_young():
    """The container's age when the test run started: from pid 1's start to that of the exec running the tests
    (the ancestor whose parent is outside the container), so pytest's own start-up on a loaded host does not count."""
    pid = os.getpid()
    while True:
        parent, started = parent_and_start(pid)
        if parent in (0, 1):
            break
        pid = parent
    age = started - parent_and_start(1)[1]
    print(f"container age {age:.1f} s")
    assert age < 10
'''
# In the first branch only: it runs while the second branch's container is made ahead, which is then older than the
# age test's 10 s when its own tests start. (The second branch needs no wait: nothing is made ahead of it.)
SLOW_TEST = '''

@pytest.mark.timeout(60)
def test_takes_a_while():
    time.sleep(14)
'''
AGE_NAME = "tests.test_aaa_age.test_container_is_young"
SLOW_NAME = "tests.test_aaa_age.test_takes_a_while"


@pytest.mark.docker
def test_the_made_ahead_container_is_older_as_documented(testbed: Testbed, official_blobs: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """README: the next branch's container, made ready while the branch before it runs, is older when its tests
    start; a program reading its container's age scores differently, and PYTEST_PROGRAMBENCH_PREFETCH=0 restores the
    official's. Two branches, each a test of the container's age when its tests started (under 10 s); the first also
    a test taking 14 s, the time its next branch's container made ahead waits."""
    first, second = branches = ["0b5e55e01a2b", "4d3c2b1a0f9e"]
    root = custom_rpn(testbed, tmp_path / "task", active=branches, extra_tests={
        first: ("test_aaa_age.py", AGE_TEST + SLOW_TEST, [AGE_NAME, SLOW_NAME]),
        second: ("test_aaa_age.py", AGE_TEST, [AGE_NAME])})
    instance = load(root)[1]
    assert get_active_branches(instance) == branches  # evaluated in this order: the slow one first
    official_blobs(root / "blobs")
    official, outcomes = official_then_ours_by_switch(testbed, root, tmp_path, monkeypatch, PREFETCH.name)
    made_ahead = get_active_branches(instance)[1]  # the first branch's container is made at its turn
    ahead, at_its_turn = outcomes["1"].result, outcomes["0"].result
    assert ahead is not None
    assert at_its_turn is not None
    assert statuses(at_its_turn) == statuses(official)
    assert {t for t, status in statuses(ahead).items() if status != "passed"} == {f"{made_ahead}/{AGE_NAME}"}
    seen = {"official": ages(official), "made at its turn": ages(at_its_turn), "made ahead": ages(ahead)}
    assert len(seen["made ahead"]) == 2, seen
    assert max(seen["official"] + seen["made at its turn"]) < 10 <= seen["made ahead"][1], seen


# --------------------------------------------------------------------------------------------- quick ACKs

ACK_TEST = '''from pathlib import Path


def test_acks_are_the_kernels():
    found = Path("/proc/sys/net/ipv4/tcp_pingpong_thresh").read_text().strip()
    print(f"pingpong threshold {found}")
    assert found == "1"
'''
ACK_NAME = "tests.test_aaa_acks.test_acks_are_the_kernels"


@pytest.mark.docker
def test_quick_acks_are_visible_as_documented(testbed: Testbed, official_blobs: Any, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/evaluation.md: evaluation containers set the delayed-ACK threshold of their network namespace; a program
    reading it scores differently, and PYTEST_PROGRAMBENCH_QUICK_ACKS=0 restores the official's (the kernel's)."""
    root = custom_rpn(testbed, tmp_path / "task", active=[BRANCH],
                      extra_tests={BRANCH: ("test_aaa_acks.py", ACK_TEST, [ACK_NAME])})
    official_blobs(root / "blobs")
    official, outcomes = official_then_ours_by_switch(testbed, root, tmp_path, monkeypatch, QUICK_ACKS.name)
    quick_acks, kernels = outcomes["1"].result, outcomes["0"].result
    assert quick_acks is not None
    assert kernels is not None
    assert statuses(kernels) == statuses(official)
    assert {t for t, status in statuses(quick_acks).items() if status != "passed"} == {f"{BRANCH}/{ACK_NAME}"}
    assert "pingpong threshold 255" in str([e["output"] for e in quick_acks.log if e["step"] == "run_tests"])


def official_then_ours_by_switch(testbed: Testbed, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  switch: str) -> tuple[EvaluationResult, dict[str, EvaluationOutcome]]:
    """The good rpn submission on the task copy at ``root``: the official's result (it must score 1.0), then ours
    with the environment switch ``switch`` on ("1") and off ("0")."""
    task, instance = load(root)
    archive = rpn_archive(testbed, tmp_path / "s.tar.gz", GOOD_COMPILE)
    summary, official = run_official_cli(instance, archive, tmp_path / "official")
    assert official is not None, summary
    assert summary.score == 1.0, statuses(official)
    outcomes: dict[str, EvaluationOutcome] = {}
    for value in ("1", "0"):
        monkeypatch.setenv(switch, value)
        (work := tmp_path / f"ours-{value}").mkdir()
        outcomes[value] = run_ours(task, archive, root / "blobs", work)
    return official, outcomes


def ages(result: EvaluationResult) -> list[float]:
    """The container ages the age test printed (pytest -rA shows a passed test's output; a failed one's too)."""
    return [float(line.split()[2]) for e in result.log if e["step"] == "run_tests"
            for line in str(e["output"]).splitlines() if line.startswith("container age ")]


# --------------------------------------------------------------------------------------------- the wheel directory

LOGINS_TEST = '''from pathlib import Path


def test_login_shells_so_far_are_even():
    assert len(Path("/root/.pb-logins").read_text().splitlines()) % 2 == 0
'''


def run_ours_with_reruns(task: Task, archive: Path, blob_dir: Path, work: Path) -> EvaluationOutcome:
    instance = task.load_instance()
    blobs = resolve_blobs(task, get_active_branches(instance), blob_dir=blob_dir, cache_dir=work / "cache")
    with environment_engine() as client:
        image = ensure_image(task, pull="never", engine=client)
        return evaluate_swept(task, archive, blobs=blobs, image=image.id, workdir=work, engine=client,
                              settings=EvalSettings(cpus=2, reruns=True))


@pytest.fixture
def official_wheels() -> Iterator[None]:
    """The rerunfailures wheels for the official evaluator, as it would get them from PyPI with internet."""
    with official_wheels_mounted():
        yield


@pytest.mark.docker
def test_the_wheel_directory_leaves_without_a_login_shell(testbed: Testbed, official_blobs: Any,
                                                          official_wheels: None, tmp_path: Path) -> None:
    """The official runs no shell between install_rerunfailures and the commit; our clean-up of the wheel directory
    ran one login shell more (``bash -lc rm -rf``), which a profile counting its logins and a hidden test reading
    the count (its parity) tell apart."""
    root = custom_rpn(testbed, tmp_path / "task", active=[BRANCH], extra_tests={
        BRANCH: ("test_logins.py", LOGINS_TEST, ["tests.test_logins.test_login_shells_so_far_are_even"])})
    task, instance = load(root)
    archive = rpn_archive(testbed, tmp_path / "s.tar.gz", with_profile_script("echo login >> /root/.pb-logins"))
    official_blobs(root / "blobs")
    summary, official = run_official_cli(instance, archive, tmp_path / "official")
    assert official is not None, summary
    assert [e["returncode"] for e in official.log if e["step"] == "install_rerunfailures"] == [0]
    (work := tmp_path / "ours").mkdir()
    outcome = run_ours_with_reruns(task, archive, root / "blobs", work)
    assert outcome.reruns, outcome.reruns_reason
    assert outcome.result is not None
    assert statuses(outcome.result) == statuses(official)
    assert (outcome.score, outcome.error_code) == (summary.score, summary.error_code)


def reruns_reason(returncode: int, output: str) -> str:
    install = {"step": "install_rerunfailures", "returncode": returncode, "output": output}
    evaluator = SimpleNamespace(result=SimpleNamespace(log=[install]))
    return _reruns_reason(cast(Any, evaluator), RerunWheels(Path("/wheels"), wheels=("w.whl",)))


def test_reruns_reason_says_what_the_official_would_do() -> None:
    """Ours installs from the host's wheels only; the official reaches PyPI. Only a missing pip3 fails there too
    (issue 30 §5: the reason said "the official run would fail the same way" of every failure)."""
    assert reruns_reason(0, "") == ""
    missing = reruns_reason(127, "bash: line 1: pip3: command not found")
    assert missing.startswith("no pip3 in this image (the official's install fails the same way)")
    offline = reruns_reason(1, "ERROR: No matching distribution found for pytest>=7.4")
    assert "from this host's wheels (offline, --no-index)" in offline
    assert "`programbench eval` installs it from PyPI, where it can succeed" in offline
    assert "same way" not in offline
