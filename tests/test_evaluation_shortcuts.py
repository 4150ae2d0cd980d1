"""Issue 30 §5: the speed shortcuts give the official result. Each case is a submission whose login profile (written
by its compile.sh into /etc/profile.d, so every later ``bash -lc`` step sources it) once made the batched steps
(evaluation/step_batch.py) differ from one exec per step. Each is evaluated by ``programbench eval``'s own code
(``eval_batch._evaluate_instance``), by ours with the batch and by ours without it
(``PYTEST_PROGRAMBENCH_STEP_BATCH=0``): the same score, error code, per-test statuses, executable hash and, for every
step, the same return code (and the same output for the steps the batch runs). The profile lies outside /workspace,
so ours raises an integrity flag: the score is still the official one.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from programbench.eval.eval import EvaluationResult
from programbench.utils import blob_store

from pytest_programbench.evaluation.evaluation import EvaluationOutcome, _reruns_reason
from pytest_programbench.evaluation.rerunfailures import RerunWheels
from pytest_programbench.evaluation.step_batch import ENV_STEP_BATCH
from tests.conftest import Testbed
from tests.outcome_support import item_message
from tests.test_evaluation_divergences import (
    custom_rpn,
    load,
    rpn_archive,
    run_official_cli,
    run_ours,
    with_profile_script,
)
from tests.test_evaluation_parity import statuses

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
        monkeypatch.setenv(ENV_STEP_BATCH, batch)
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
