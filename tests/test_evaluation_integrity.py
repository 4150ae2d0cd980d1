"""Integrity beyond the official evaluator, end to end on the test bed.

The conftest exploit: a submission whose program prints ``nope`` ships a ``conftest.py`` at the workspace root that
turns every test report into a pass. The official evaluator scores it as fully resolved. Ours keeps the official
score, raises the flag, and under ``--pb-strict`` removes the file before the hidden tests run, so the score is what
the program deserves.

Every evaluation here runs one branch of its task (a copy under the same id and image, the other branches ignored):
what is flagged, neutralised or scored is decided once per evaluation, not per branch (issue 40: each branch more
only added containers). The conftest cases use catlike (rpn's branches carry an ``eval/pytest.ini``, which keeps a
workspace-root ``conftest.py`` out of their pytest run).
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.evaluation import integrity
from tests.conftest import Testbed
from tests.outcome_support import item_message
from tests.test_evaluation_divergences import one_branch, run_ours
from tests.test_evaluation_parity import (
    CATLIKE,
    RPN,
    assert_parity,
    official_score,
    pack,
    reference_bytes,
    run_official,
    statuses,
)

pytestmark = pytest.mark.docker

__all__ = ["one_branch"]  # a fixture shared with the divergence tests

NOPE_COMPILE = b"#!/bin/sh\nprintf '#!/bin/sh\\necho nope\\n' > executable\nchmod +x executable\n"
EXPLOIT_CONFTEST = b'''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
'''


def _nope(tmp_path: Path, **extra: bytes) -> Path:
    src = tmp_path / "nope-src"
    src.mkdir(parents=True)
    (src / "README").write_text("prints nope\n")
    return pack(src, tmp_path / "nope.tar.gz", extra={"compile.sh": NOPE_COMPILE, **extra})


def test_conftest_exploit_official_passes_it_we_flag_it(tmp_path: Path, one_branch: Any) -> None:
    task, instance, blob_dir = one_branch(CATLIKE)
    archive = _nope(tmp_path, **{"conftest.py": EXPLOIT_CONFTEST})
    official = run_official(instance, archive)
    outcome = run_ours(task, archive, blob_dir, tmp_path)

    # The official evaluator scores `echo nope` as fully resolved; ours agrees on the score ...
    assert_parity(official, outcome, instance)
    assert outcome.score == 1.0
    # ... and raises the flag, so the item can never pass silently.
    kinds = {(f.kind, f.path) for f in outcome.integrity_flags}
    assert (integrity.PYTEST_CONFIG, "conftest.py") in kinds
    assert ("integrity flags: pytest_config: conftest.py configures the hidden pytest run"
            in item_message(outcome, task))


def test_conftest_exploit_under_strict_scores_what_the_program_deserves(tmp_path: Path, one_branch: Any) -> None:
    task, instance, blob_dir = one_branch(CATLIKE)
    # What `echo nope` deserves: the official score of the same program without the conftest.
    deserved = run_official(instance, _nope(tmp_path / "plain"))
    exploit = _nope(tmp_path / "exploit", **{"conftest.py": EXPLOIT_CONFTEST})
    strict = run_ours(task, exploit, blob_dir, tmp_path, strict=True)
    assert strict.neutralised == ["conftest.py"]
    assert (integrity.PYTEST_CONFIG, "conftest.py") in {(f.kind, f.path) for f in strict.integrity_flags}
    assert strict.result is not None
    assert statuses(strict.result) == statuses(deserved)
    assert strict.score == official_score(deserved, instance)
    assert strict.score < 1.0
    assert "--pb-strict neutralised before the hidden tests: conftest.py" in item_message(strict, task)


def test_conftest_written_by_compile_sh_is_flagged_and_neutralised(tmp_path: Path, one_branch: Any) -> None:
    task, _instance, blob_dir = one_branch(CATLIKE)
    compile_sh = NOPE_COMPILE + b"cat > conftest.py <<'EOF'\n" + EXPLOIT_CONFTEST + b"EOF\n"
    src = tmp_path / "src"
    src.mkdir()
    archive = pack(src, tmp_path / "s.tar.gz", extra={"compile.sh": compile_sh})
    flagged = run_ours(task, archive, blob_dir, tmp_path / "flagged")
    assert flagged.score == 1.0
    assert (integrity.PYTEST_CONFIG, "conftest.py") in {(f.kind, f.path) for f in flagged.integrity_flags}
    strict = run_ours(task, archive, blob_dir, tmp_path / "strict", strict=True)
    assert strict.neutralised == ["conftest.py"]
    assert strict.score < 1.0


def test_compile_changes_outside_workspace_are_flagged(testbed: Testbed, tmp_path: Path, one_branch: Any) -> None:
    task, _instance, blob_dir = one_branch(RPN)
    compile_sh = (testbed.solutions / RPN / "compile.sh").read_bytes() + (
        b"\nmkdir -p /root/.cache/ok && echo cache > /root/.cache/ok/x\n"
        b"echo 'import os' > /usr/lib/python3/dist-packages/zz-evil.pth\n"
        b"echo 'export PYTEST_ADDOPTS=-q' >> /etc/profile\n"
        b"echo scratch > /tmp/scratch\n")
    archive = pack(testbed.solutions / RPN, tmp_path / "s.tar.gz", drop=("compile.sh",),
                   extra={"compile.sh": compile_sh})
    outcome = run_ours(task, archive, blob_dir, tmp_path)
    outside = [f for f in outcome.integrity_flags if f.kind == integrity.COMPILE_OUTSIDE]
    assert len(outside) == 1
    assert "/usr/lib/python3/dist-packages/zz-evil.pth" in outside[0].detail
    assert "/etc/profile" in outside[0].detail
    assert "/root/.cache" not in outside[0].detail
    assert "/tmp/scratch" not in outside[0].detail


def test_clean_submission_has_no_flags(testbed: Testbed, tmp_path: Path, one_branch: Any) -> None:
    task, _instance, blob_dir = one_branch(RPN)
    archive = pack(testbed.solutions / RPN, tmp_path / "s.tar.gz")
    outcome = run_ours(task, archive, blob_dir, tmp_path, reruns=True)
    assert outcome.score == 1.0
    assert outcome.integrity_flags == []
    assert outcome.reference_hash is not None


def test_reference_rebuilt_at_compile_time_is_flagged(docker_client: Any, testbed: Testbed, tmp_path: Path,
                                                      one_branch: Any) -> None:
    """The gold binary smuggled past eval_clean_hashes (base64) scores 1.0 officially; we flag it."""
    task, instance, blob_dir = one_branch(RPN)
    gold = reference_bytes(docker_client, f"{task.image_name}:task_cleanroom_v6")
    src = tmp_path / "src"
    src.mkdir()
    archive = pack(src, tmp_path / "gold.tar.gz", extra={
        "compile.sh": b"#!/bin/sh\nset -e\nbase64 -d blob.b64 > executable\nchmod +x executable\n",
        "blob.b64": base64.b64encode(gold),
    })
    official = run_official(instance, archive)
    outcome = run_ours(task, archive, blob_dir, tmp_path)
    assert_parity(official, outcome, instance)
    assert outcome.executable_hash == hashlib.sha256(gold).hexdigest()
    assert outcome.reference_hash == outcome.executable_hash
    assert [f.kind for f in outcome.integrity_flags] == [integrity.REFERENCE_EXECUTABLE]
