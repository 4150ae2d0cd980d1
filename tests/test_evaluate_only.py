"""``--pb-submissions``: real pytest sessions evaluating real submissions on the real engine."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from programbench.eval.eval import EvaluationResult

from tests.conftest import Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"
TUIISH = "pbfix__tuiish.7e1a0b2"


def run(pytester: pytest.Pytester, testbed: Testbed, submissions: Path, *args: str) -> pytest.RunResult:
    return pytester.runpytest(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-submissions", str(submissions), "--pb-output", str(pytester.path / "run"), "--pb-cpus", "2",
        "--junitxml", str(pytester.path / "junit.xml"), *args,
    )


def junit_cases(pytester: pytest.Pytester) -> dict[str, ET.Element]:
    root = ET.parse(pytester.path / "junit.xml").getroot()
    return {case.get("name", ""): case for case in root.iter("testcase")}


def properties(case: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def leaked(docker_client: Any, run_dir: Path) -> list[str]:
    run_id = json.loads((run_dir / "pb-run.json").read_text())["run_id"]
    label = f"pytest-programbench={run_id}"
    containers = docker_client.containers.list(all=True, filters={"label": label})
    images = docker_client.images.list(all=True, filters={"label": label})
    volumes = (docker_client.api.volumes(filters={"label": label}) or {}).get("Volumes") or []
    return [c.id for c in containers] + [i.id for i in images] + [v["Name"] for v in volumes]


def test_good_submissions_pass_with_artifacts(pytester: pytest.Pytester, testbed: Testbed,
                                              docker_client: Any) -> None:
    """catlike's and rpn's good submissions pass with their artifacts; tuiish, selected, has none: it is deselected
    and listed, and a directory that names no known task is ignored with a line that says so."""
    subs = pytester.mkdir("subs")
    for iid in (CATLIKE, RPN):
        shutil.copytree(testbed.submissions / iid, subs / iid)
    (subs / "nobody__nothing.0000000").mkdir()
    (subs / "nobody__nothing.0000000" / "submission.tar.gz").write_bytes(b"")
    result = run(pytester, testbed, subs, "--pb-filter", "pbfix__")
    result.assert_outcomes(passed=2, deselected=1)
    result.stdout.fnmatch_lines([
        f"programbench: 1 selected tasks have no submission in {subs} and were deselected: {TUIISH}",
        "*'nobody__nothing.0000000' is not a known task; ignored*",
    ])
    run_dir = pytester.path / "run"
    for iid in (CATLIKE, RPN):
        task_dir = run_dir / iid
        assert (task_dir / "submission.tar.gz").read_bytes() == (testbed.submissions / iid /
                                                                 "submission.tar.gz").read_bytes()
        raw = json.loads((task_dir / f"{iid}.eval.json").read_text())
        official = EvaluationResult.model_validate(raw)  # the official schema, extra fields forbidden
        assert official.error_code is None
        assert official.executable_hash
        meta = json.loads((task_dir / "pb-meta.json").read_text())
        assert meta["image"]["id"].startswith("sha256:")
        assert set(meta["blobs"]["sha256"]) == set(official.test_branches)
    cases = junit_cases(pytester)
    props = properties(cases[CATLIKE])
    assert float(props["score"]) == 1.0
    assert int(props["n_passed"]) == int(props["n_tests"]) > 0
    assert props["executable_hash"] == json.loads((run_dir / CATLIKE / f"{CATLIKE}.eval.json").read_text())[
        "executable_hash"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["headline"]["passed"] == 2
    assert summary["headline"]["mean_over_selection"] == 1.0
    assert leaked(docker_client, run_dir) == []


def test_require_all_fails_missing_with_score_zero_and_a_compile_error_is_a_failure_not_an_error(
        pytester: pytest.Pytester, testbed: Testbed) -> None:
    """--pb-require-all: catlike, selected with no submission, fails with score 0 (no_submission); rpn's submission,
    present, is evaluated as ever: it does not compile, a failure with score 0 (compile_failed), not an error."""
    only_rpn = pytester.mkdir("only-rpn")
    shutil.copytree(testbed.submissions.parent / "compile_error" / RPN, only_rpn / RPN)
    result = run(pytester, testbed, only_rpn, "--pb-filter", "pbfix__(rpn|catlike)", "--pb-require-all")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([f"*_ {CATLIKE} _*", "score 0.0000 (0/* tests passed)*", "*error code: no_submission*"])
    result.stdout.fnmatch_lines([f"*_ {RPN} _*", "score 0.0000 (0/* tests passed)*", "*error code: compile_failed*"])


def test_missing_image_is_an_error_fast(pytester: pytest.Pytester, testbed: Testbed) -> None:
    tasks = pytester.mkdir("tasks")
    shutil.copytree(testbed.tasks_dir / CATLIKE, tasks / "pbfix__noimage.1111111", ignore=shutil.ignore_patterns(
        "Dockerfile"))
    subs = pytester.mkdir("subs")
    shutil.copytree(testbed.submissions / CATLIKE, subs / "pbfix__noimage.1111111")
    result = pytester.runpytest("-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks), "--pb-submissions",
                                str(subs), "--pb-pull", "never", "--pb-output", str(pytester.path / "run"))
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*programbench/pbfix_1776_noimage.1111111:task_cleanroom_v6*"])


def test_missing_blob_is_an_error(pytester: pytest.Pytester, testbed: Testbed) -> None:
    empty_blobs = pytester.mkdir("blobs")
    tasks = pytester.mkdir("tasks")
    shutil.copytree(testbed.tasks_dir / CATLIKE, tasks / CATLIKE, ignore=shutil.ignore_patterns("tests"))
    result = pytester.runpytest("-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks), "--pb-blob-dir",
                                str(empty_blobs), "--pb-submissions", str(testbed.submissions), "--pb-filter",
                                CATLIKE, "--pb-output", str(pytester.path / "run"))
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*no hidden tests found*"])


def test_min_score_lets_a_partial_submission_pass_min_mean_fails_the_session_and_junit_lists_hidden_tests(
        pytester: pytest.Pytester, testbed: Testbed) -> None:
    result = run(pytester, testbed, testbed.submissions.parent / "wrong", "--pb-filter", CATLIKE,
                 "--pb-min-score", "0.01", "--pb-min-mean", "0.99", "--pb-junit-tests")
    result.assert_outcomes(passed=1)  # the partial submission passes under --pb-min-score 0.01
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*programbench: mean over the selection 0.* is below --pb-min-mean 0.99*"])
    props = properties(junit_cases(pytester)[CATLIKE])
    hidden = {k.removeprefix("test:"): v for k, v in props.items() if k.startswith("test:")}
    assert int(props["n_tests"]) == len(hidden)
    assert sum(v == "passed" for v in hidden.values()) == int(props["n_passed"])
    assert any(v != "passed" for v in hidden.values())


def test_wrong_submission_fails_with_score_and_branches_and_last_failed_reruns_only_it(
        pytester: pytest.Pytester, testbed: Testbed) -> None:
    """A partly wrong submission fails with its score and failing branches; ``--lf`` then re-runs only that task.
    (One first session for both: an evaluation is the costly part.)"""
    mixed = pytester.mkdir("mixed")
    shutil.copytree(testbed.submissions / RPN, mixed / RPN)
    shutil.copytree(testbed.submissions.parent / "wrong" / CATLIKE, mixed / CATLIKE)
    common = ["--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
              "--pb-submissions", str(mixed), "--pb-filter", "pbfix__(rpn|catlike)", "--pb-cpus", "2"]
    first = pytester.runpytest(*common, "--pb-output", str(pytester.path / "run1"),
                               "--junitxml", str(pytester.path / "junit.xml"))
    first.assert_outcomes(passed=1, failed=1)
    first.stdout.fnmatch_lines([f"*_ {CATLIKE} _*", "score 0.* tests passed), below --pb-min-score 1*",
                                "branch *: * of * tests failing", "  eval.tests.* (failure): *"])
    props = properties(junit_cases(pytester)[CATLIKE])
    assert 0.0 < float(props["score"]) < 1.0
    assert props["failed_branches"]
    again = pytester.runpytest(*common, "--pb-output", str(pytester.path / "run2"), "--lf")
    again.assert_outcomes(failed=1, deselected=1)
    assert not (pytester.path / "run2" / RPN).exists()
