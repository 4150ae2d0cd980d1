"""The corrected score beside the official one (results/corrected.py), and ``--pb-score``.

The official scorer compares tests.json names with JUnit names literally (upstream ProgramBench issue #56, PR #61):
where tests.json lists a test without the ``eval.`` prefix the JUnit name carries, the test counts twice. Two tasks
show it here: the bundled ``testorg__calculator.abc1234`` (a correct submission scores 0.5 officially), and the test
bed's catlike with its tests.json names (and ignored tests) stripped of the prefix, so that its JUnit names carry it
while tests.json's do not (``stripped_tasks``). Sessions are real pytest sessions on the test bed; the first tests
check the scoring functions on official results built by the official code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from programbench.eval.eval import EvaluationResult, Evaluator, TestBranchError, TestResult, _process_branch_xml
from programbench.eval.eval_batch import get_branches_to_eval
from programbench.submission import score_instance
from programbench.utils.load_data import (
    get_active_branches,
    get_ignored_branches,
    get_ignored_tests,
    load_all_instances,
)

from pytest_programbench.results.corrected import UPSTREAM, canonical_xml, corrected_score
from pytest_programbench.tasks.catalogue import Catalogue
from tests.conftest import Testbed
from tests.shared_runs import FinishedRun, made_once

CALCULATOR = "testorg__calculator.abc1234"
CALC_BRANCH = "33128f6b8600"
CATLIKE = "pbfix__catlike.c47c47c"
CALC_TESTS = ("test_addition", "test_subtraction", "test_multiplication")
# A correct calculator that is not the reference's bytes (the reference itself raises the reference_executable flag).
CLONE = "#!/bin/bash\n# an independent calculator\ncase \"$2\" in\n  +) echo $(( $1 + $3 ));;\n" \
        "  -) echo $(( $1 - $3 ));;\n  '*') echo $(( $1 * $3 ));;\n  /) echo $(( $1 / $3 ));;\nesac\n"
COMPILE = "#!/bin/bash\ncp calculator.sh executable\nchmod +x executable\n"


# ------------------------------------------------------------------------------------------------- support


def calculator_instance() -> dict[str, Any]:
    return next(i for i in load_all_instances() if i["instance_id"] == CALCULATOR)


def junit(cases: list[tuple[str, str, str | None]]) -> str:
    """A pytest-style JUnit file: (classname, name, failure message or None) per test case."""
    body = "".join(f'<testcase classname="{c}" name="{n}" time="0.1">'
                   + (f'<failure message="{m}">{m}</failure>' if m else "") + "</testcase>" for c, n, m in cases)
    return f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'


def official_result(instance: dict[str, Any], texts: dict[str, list[str]], kept: dict[str, int] | None = None
                    ) -> EvaluationResult:
    """An official result as the official Evaluator builds it: each branch's read attempts in the log (the one at
    ``kept[branch]``, default the last, scored by the official ``_process_branch_xml``)."""
    results: list[TestResult] = []
    log: list[dict[str, Any]] = []
    tests_by_branch = {b: list(instance["branches"][b]["tests"]) for b in texts}
    for branch, attempts in texts.items():
        log += [{"step": "results_read", "branch": branch, "returncode": 0, "output": t} for t in attempts]
        chosen = attempts[(kept or {}).get(branch, -1)]
        parsed, _ = _process_branch_xml(chosen, branch, tests_by_branch, instance["instance_id"],
                                        ignored_tests=get_ignored_tests(instance))
        results += parsed
    return EvaluationResult(test_results=results, test_branches=list(texts), log=log, solution_branch="submission")


def calculator_junit(failing: tuple[str, ...] = ()) -> str:
    return junit([("eval.tests.test_calculator", n, "assert 0 == 12" if n in failing else None) for n in CALC_TESTS])


def stripped_tasks(root: Path, testbed: Testbed) -> Path:
    """The test bed's tasks with catlike's tests.json names (and its ignored tests') stripped of ``eval.``: its JUnit
    names keep the prefix (its runs have /workspace as their rootdir), so the official counts each test twice."""
    tasks = root / "stripped-tasks"
    shutil.copytree(testbed.tasks_dir, tasks)
    path = tasks / CATLIKE / "tests.json"
    data = json.loads(path.read_text())
    for branch in data["branches"].values():
        branch["tests"] = [t.removeprefix("eval.") for t in branch["tests"]]
        for ignored in branch.get("ignored_tests", []):
            ignored["name"] = ignored["name"].removeprefix("eval.")
    path.write_text(json.dumps(data, indent=2))
    return tasks


def regraded_score(eval_json: Path, instance: dict[str, Any]) -> float:
    """programbench's own regrade of a recorded result (``Evaluator(from_existing=...)``, as ``programbench eval``
    re-summarises one) against ``instance``'s tests.json: the score its JUnit texts get with consistent names."""
    existing = EvaluationResult.model_validate_json(eval_json.read_text())
    active = get_active_branches(instance)
    regraded = Evaluator(tests_branches=existing.test_branches,
                         tests_by_branch={b: list(instance["branches"][b]["tests"]) for b in active},
                         ignored_tests=get_ignored_tests(instance), ignored_branches=get_ignored_branches(instance),
                         from_existing=existing).run()
    return regraded.for_branches(active).without_ignored(get_ignored_tests(instance)).score


def calculator_submission(root: Path, script: str) -> Path:
    """A submissions directory holding a calculator submission (calculator.sh + compile.sh)."""
    src = root / "calc-src"
    src.mkdir(parents=True)
    for name, text in (("calculator.sh", script), ("compile.sh", COMPILE)):
        (src / name).write_text(text)
        (src / name).chmod(0o755)
    out = root / "subs" / CALCULATOR
    out.mkdir(parents=True)
    with tarfile.open(out / "submission.tar.gz", "w:gz") as tar:
        tar.add(src, arcname=".")
    return root / "subs"


def properties(junit_xml: Path, name: str) -> dict[str, str]:
    root = ET.parse(junit_xml).getroot()
    case = next(c for c in root.iter("testcase") if c.get("name") == name)
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def summary(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return data


def session_args(testbed: Testbed, subs: Path, run_dir: Path, *args: str) -> list[str]:
    return ["-p", "no:cacheprovider", "--pb-blob-dir", str(testbed.blob_dir), "--pb-include-fixtures",
            "--pb-submissions", str(subs), "--pb-output", str(run_dir), "--pb-cpus", "2", "--pb-pull", "never",
            "--junitxml", str(run_dir.parent / f"{run_dir.name}.xml"), *args]


def session(pytester: pytest.Pytester, testbed: Testbed, subs: Path, run_dir: Path, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*session_args(testbed, subs, run_dir, *args), timeout=900)


# ------------------------------------------------------------------------------------- the scoring itself


def test_the_corrected_score_is_the_official_scoring_on_canonical_names() -> None:
    instance = calculator_instance()
    result = official_result(instance, {CALC_BRANCH: [calculator_junit()]})
    corrected = corrected_score(result, instance)
    assert (corrected.official_score, corrected.official_passed, corrected.official_tests) == (0.5, 3, 6)
    assert (corrected.score, corrected.n_passed, corrected.n_tests) == (1.0, 3, 3)
    assert corrected.counted_twice == tuple(f"{CALC_BRANCH}/tests.test_calculator.{n}" for n in CALC_TESTS)
    assert corrected.tests == {f"{CALC_BRANCH}/eval.tests.test_calculator.{n}": "passed" for n in CALC_TESTS}
    assert UPSTREAM in corrected.note()
    assert "0.5000 (3/6)" in corrected.note()
    assert "1.0000 (3/3)" in corrected.note()


def test_a_real_failure_stays_in_both_scores() -> None:
    instance = calculator_instance()
    result = official_result(instance, {CALC_BRANCH: [calculator_junit(failing=("test_multiplication",))]})
    corrected = corrected_score(result, instance)
    assert (corrected.official_passed, corrected.official_tests) == (2, 6)
    assert (corrected.n_passed, corrected.n_tests) == (2, 3)
    assert corrected.tests[f"{CALC_BRANCH}/eval.tests.test_calculator.test_multiplication"] == "failure"


def test_consistent_names_give_the_official_score_unchanged() -> None:
    instance = calculator_instance()
    plain = junit([("tests.test_calculator", n, None) for n in CALC_TESTS])  # what tests.json lists
    corrected = corrected_score(official_result(instance, {CALC_BRANCH: [plain]}), instance)
    assert not corrected.differs
    assert corrected.note() == ""
    assert corrected.counted_twice == ()
    assert (corrected.score, corrected.n_tests) == (1.0, 3)


def test_branch_errors_and_their_not_run_are_the_officials() -> None:
    instance = calculator_instance()
    result = EvaluationResult(
        test_branches=[CALC_BRANCH],
        test_branch_errors={CALC_BRANCH: [TestBranchError(error_code="run_tests_failed", error_details="")]},
        test_results=[TestResult(name=n, branch=CALC_BRANCH, status="not_run", extra={"error_code": "run_tests_failed"})
                      for n in instance["branches"][CALC_BRANCH]["tests"]])
    corrected = corrected_score(result, instance)
    assert (corrected.score, corrected.n_tests, corrected.official_tests) == (0.0, 3, 3)
    assert not corrected.differs
    assert corrected.counted_twice == ()


def test_the_attempt_the_official_kept_is_the_one_corrected() -> None:
    """A crash retry reads the branch twice; the official keeps the attempt with more useful tests, which need not
    be the last: the corrected score replays the one that gives the official's own entries."""
    instance = calculator_instance()
    full = calculator_junit()
    short = junit([("eval.tests.test_calculator", "test_addition", None)])
    result = official_result(instance, {CALC_BRANCH: [full, short]}, kept={CALC_BRANCH: 0})
    assert corrected_score(result, instance).n_tests == 3  # the kept attempt's three tests, not the last one's one


def test_a_result_without_its_junit_text_keeps_the_official_entries() -> None:
    instance = calculator_instance()
    result = official_result(instance, {CALC_BRANCH: [calculator_junit()]}).model_copy(update={"log": []})
    corrected = corrected_score(result, instance)
    assert corrected.unreplayed == (CALC_BRANCH,)
    assert corrected.notes
    assert (corrected.n_passed, corrected.n_tests) == (3, 6)


def test_an_ignored_test_the_official_scored_under_its_prefixed_name(tmp_path: Path, testbed: Testbed) -> None:
    tasks = stripped_tasks(tmp_path, testbed)
    catalogue = {t.instance_id: t for t in Catalogue.load([tasks])}
    stripped = catalogue[CATLIKE].load_instance()
    original = {t.instance_id: t for t in Catalogue.load([testbed.tasks_dir])}[CATLIKE].load_instance()
    branch = "8d2e4b6f0a13"  # two ignored tests
    names = original["branches"][branch]["tests"]
    text = junit([(n.rpartition(".")[0], n.rpartition(".")[2], None) for n in names])
    corrected = corrected_score(official_result(stripped, {branch: [text]}), stripped)
    reference = official_result(original, {branch: [text]})
    scoped = reference.for_branches([branch]).without_ignored(get_ignored_tests(original))
    assert (corrected.score, corrected.n_tests) == (scoped.score, len(scoped))
    assert sorted(t.partition("/")[2] for t in corrected.counted_ignored) == sorted(
        t.partition("/")[2] for t in get_ignored_tests(original))


# PR #57's rule on top of the canonical names (upstream, open): the four cases, official and corrected side by side.
PLAIN = "tests.test_calculator"  # the names tests.json lists (no eval.): only the unlisted records differ


def test_a_passing_record_tests_json_does_not_list_is_dropped() -> None:
    """1.2.5 counts it, so an extra passing item raises the score: a real failure plus a stray pass is 3/4 officially,
    2/3 corrected."""
    instance = calculator_instance()
    text = junit([*((PLAIN, n, "assert 0 == 12" if n == "test_multiplication" else None) for n in CALC_TESTS),
                  ("tests.test_stray", "test_extra_item", None)])
    corrected = corrected_score(official_result(instance, {CALC_BRANCH: [text]}), instance)
    assert (corrected.official_passed, corrected.official_tests) == (3, 4)
    assert (corrected.n_passed, corrected.n_tests) == (2, 3)
    assert corrected.counted_unlisted == (f"{CALC_BRANCH}/tests.test_stray.test_extra_item",)
    assert "tests.test_stray.test_extra_item" not in " ".join(corrected.tests)
    assert "PR #57" in corrected.note()


def test_an_unlisted_record_that_did_not_pass_stays() -> None:
    """Only passes are dropped: an unlisted failure counts in both (it is the run's own failure)."""
    instance = calculator_instance()
    text = junit([*((PLAIN, n, None) for n in CALC_TESTS), ("tests.test_stray", "test_broken", "assert False")])
    corrected = corrected_score(official_result(instance, {CALC_BRANCH: [text]}), instance)
    assert (corrected.official_passed, corrected.official_tests) == (3, 4)
    assert (corrected.n_passed, corrected.n_tests) == (3, 4)
    assert corrected.counted_unlisted == ()
    assert not corrected.differs


def test_pytest_breakage_markers_stay() -> None:
    """pytest.internal and a collection error's record (an empty classname) are what a broken run shows: kept, so a
    broken run is never lifted to a pass."""
    instance = calculator_instance()
    text = ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
            '<testcase classname="" name="tests.test_calculator"><error message="collection failure">'
            'ImportError</error></testcase>'
            '<testcase classname="pytest" name="internal"><error message="internal error">boom</error></testcase>'
            + "".join(f'<testcase classname="{PLAIN}" name="{n}" time="0.1"/>' for n in CALC_TESTS)
            + "</testsuite></testsuites>")
    corrected = corrected_score(official_result(instance, {CALC_BRANCH: [text]}), instance)
    assert (corrected.official_passed, corrected.official_tests) == (3, 5)
    assert (corrected.n_passed, corrected.n_tests) == (3, 5)
    assert corrected.counted_unlisted == ()


def test_a_branch_that_lists_no_tests_keeps_its_passing_records() -> None:
    """26 non-ignored branches ship "tests": []: without the guard every passing record of theirs would go."""
    instance = calculator_instance()
    instance["branches"][CALC_BRANCH]["tests"] = []
    text = junit([(PLAIN, n, "assert 0 == 12" if n == "test_addition" else None) for n in CALC_TESTS])
    corrected = corrected_score(official_result(instance, {CALC_BRANCH: [text]}), instance)
    assert (corrected.official_passed, corrected.official_tests) == (2, 3)
    assert (corrected.n_passed, corrected.n_tests) == (2, 3)
    assert corrected.counted_unlisted == ()


TUIISH = "pbfix__tuiish.7e1a0b2"
UNLISTED = "eval.tests.test_screen.test_j_moves_selection"  # taken out of its branch's tests.json list


def unlisted_tasks(root: Path, testbed: Testbed) -> Path:
    """The test bed's tasks with tuiish's first branch no longer listing one of its tests (its JUnit record is then
    unlisted) and its second branch listing none (as 26 real branches ship)."""
    tasks = root / "unlisted-tasks"
    shutil.copytree(testbed.tasks_dir, tasks)
    path = tasks / TUIISH / "tests.json"
    data = json.loads(path.read_text())
    first, second = data["branches"].values()
    first["tests"].remove(UNLISTED)
    second["tests"] = []
    path.write_text(json.dumps(data, indent=2))
    return tasks


def test_pr57_rules_in_a_session_official_and_corrected_side_by_side(tmp_path: Path,
                                                                     calculator_official: FinishedRun) -> None:
    """The correct tuiish on the task built above (in the shared session below, beside the calculator): the official
    counts the unlisted record's pass (6 tests in its first branch); the corrected drops it (5), and keeps every
    passing record of the branch that lists none."""
    made = calculator_official.copy(tmp_path / "made")
    tasks, run_dir = made / "unlisted-tasks", made / "official"
    calculator_official.result().assert_outcomes(passed=1, failed=1)  # tuiish passed; the calculator, below
    assert summary(run_dir)["tasks"][TUIISH]["outcome"] == "passed"
    props = properties(made / "official.xml", TUIISH)
    official, corrected = int(props["n_tests_official"]), int(props["n_tests_corrected"])
    assert (float(props["score_official"]), float(props["score_corrected"])) == (1.0, 1.0)
    assert official == corrected + 1, props
    outcome = json.loads((run_dir / TUIISH / "pb-meta.json").read_text())["outcome"]
    assert [t.partition("/")[2] for t in outcome["counted_unlisted"]] == [UNLISTED]
    second = list(json.loads((tasks / TUIISH / "tests.json").read_text())["branches"])[1]
    kept = [t for t, status in outcome["tests_corrected"].items() if t.startswith(f"{second}/")]
    assert kept, outcome["tests_corrected"]  # the branch that lists nothing keeps its passes
    assert all(outcome["tests_corrected"][t] == "passed" for t in kept)
    assert "PR #57" in props["score_note"]


def test_canonical_xml_renames_only_the_prefix() -> None:
    text = junit([("eval.tests.t", "a", None), ("tests.t", "b", None), ("eval", "c", None), ("", "eval.d", None)])
    names = [(c.get("classname"), c.get("name")) for c in ET.fromstring(canonical_xml(text)).iter("testcase")]
    assert names == [("tests.t", "a"), ("tests.t", "b"), ("", "c"), ("", "d")]


# ------------------------------------------------------------------------------------------ real sessions


pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture(scope="session")
def calculator_official(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed) -> FinishedRun:
    """The correct calculator scored the official way (``official/``, ``official.xml``), in one session with the
    correct tuiish on the test bed's tasks with its tests.json changed (``unlisted-tasks/``, ``unlisted_tasks``): one
    session per suite run, read by the three tests that read it, each on its own copy (one resumes it, one compares a
    run with it, one reads tuiish's PR #57 numbers)."""

    def prepare(place: Path) -> list[str]:
        subs = calculator_submission(place, CLONE)
        shutil.copytree(testbed.submissions / TUIISH, subs / TUIISH)
        tasks = unlisted_tasks(place, testbed)
        return session_args(testbed, subs, place / "official", "--pb-tasks-dir", str(tasks), "--pb-filter",
                            f"testorg__|{TUIISH}")

    return made_once(tmp_path_factory, "corrected-score-calculator-official-and-unlisted-tuiish", prepare)


def test_calculator_official_half_corrected_full_and_resume_never_reruns_it(pytester: pytest.Pytester,
                                                                          calculator_official: FinishedRun) -> None:
    """A correct calculator: official 0.5 (each test counted twice), corrected 1.0; the item fails by the official
    score and its message names the defect; a resume reuses it where ``programbench eval`` would run it again."""
    calculator_official.copy(pytester.path / "made")
    run_dir = pytester.path / "made" / "official"
    result = calculator_official.result()
    result.assert_outcomes(failed=1, passed=1)  # the calculator; tuiish (test_pr57_rules_...) passed
    result.stdout.fnmatch_lines([
        f"*_ {CALCULATOR} _*",
        "score 0.5000 (3/6 tests passed), below --pb-min-score 1",
        "official score 0.5000 (3/6), corrected 1.0000 (3/3): the official scorer compares tests.json names with "
        f"JUnit names literally*({UPSTREAM}); the official score decides (--pb-score)",
        "*official and corrected scores differ on 1 task(s)*issue #56*",
    ])
    assert "integrity flags" not in result.stdout.str(), "the clone is not the reference"
    props = properties(run_dir.parent / "official.xml", CALCULATOR)
    assert (float(props["score"]), float(props["score_official"]), float(props["score_corrected"])) == (0.5, 0.5, 1.0)
    assert (props["score_basis"], props["counted_twice"], props["n_tests_corrected"]) == ("official", "3", "3")
    assert "issue #56" in props["score_note"]
    row = summary(run_dir)["tasks"][CALCULATOR]
    assert (row["score"], row["score_official"], row["score_corrected"], row["counted_twice"]) == (0.5, 0.5, 1.0, 3)
    scores = summary(run_dir)["headline"]["scores"]
    assert scores["differing"] == [CALCULATOR]
    assert scores["corrected"]["mean_over_selection"] == 1.0
    report = (run_dir / "report.html").read_text()
    assert 'class="score-note"' in report
    assert "issue #56" in report
    assert "tests.test_calculator.test_addition" in report
    eval_json = run_dir / CALCULATOR / f"{CALCULATOR}.eval.json"
    assert score_instance(eval_json, calculator_instance()) == 0.5  # the official's own number, unchanged

    # programbench eval's own resume would evaluate the finished branch again (its names never match)...
    instance = calculator_instance()
    again = get_branches_to_eval(eval_json=eval_json, all_test_branches=[CALC_BRANCH],
                                 tests_by_branch={CALC_BRANCH: instance["branches"][CALC_BRANCH]["tests"]},
                                 ignored_tests=get_ignored_tests(instance))
    assert again == [CALC_BRANCH]
    # ...ours reuses the finished task: nothing is evaluated again.
    before = eval_json.stat().st_mtime_ns
    resumed = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-resume", str(run_dir), timeout=600)
    resumed.assert_outcomes(failed=1, passed=1)
    resumed.stdout.fnmatch_lines(["*result reused from the resumed run*"])
    assert eval_json.stat().st_mtime_ns == before
    # Another --pb-score changes verdicts: a resume with it is refused, naming it.
    refused = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-resume", str(run_dir), "--pb-score",
                                            "corrected", timeout=600)
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*refusing to resume*score_basis: None -> 'corrected' (--pb-score)*"])


def test_pb_score_corrected_passes_the_calculator_and_keeps_a_real_failure(pytester: pytest.Pytester,
                                                                          testbed: Testbed,
                                                                          calculator_official: FinishedRun) -> None:
    """``--pb-score corrected``: the correct calculator passes; catlike with stripped tests.json names and a partly
    wrong submission fails by its corrected score, which is the score it gets with consistent names, and its
    failing tests are in both scores; the headline and --pb-min-mean follow the corrected score."""
    tasks = stripped_tasks(pytester.path, testbed)
    subs = calculator_submission(pytester.path, CLONE)
    # The calculator alone, by the official score: what the run is compared with (the shared run, on a copy).
    calculator_official.result().assert_outcomes(failed=1, passed=1)
    base = calculator_official.copy(pytester.path / "made") / "official"
    shutil.copytree(testbed.submissions.parent / "wrong" / CATLIKE, subs / CATLIKE)
    run_dir = pytester.path / "corrected"
    result = session(pytester, testbed, subs, run_dir, "--pb-tasks-dir", str(tasks), "--pb-filter",
                     f"testorg__|{CATLIKE}", "--pb-score", "corrected", "--pb-min-mean", "0.7", "--pb-compare",
                     str(base))
    result.assert_outcomes(passed=1, failed=1)
    # --pb-compare carries both scores, and says which decided each run.
    compared = json.loads((run_dir / "compare.json").read_text())
    row = compared["tasks"][CALCULATOR]
    assert (row["base"]["score"], row["base"]["score_official"], row["base"]["score_corrected"]) == (0.5, 0.5, 1.0)
    assert (row["new"]["score"], row["new"]["score_official"], row["new"]["score_corrected"]) == (1.0, 0.5, 1.0)
    assert compared["scores"]["basis"] == {"base": "official", "new": "corrected"}
    assert (compared["scores"]["official"]["mean_new"], compared["scores"]["corrected"]["mean_new"]) == (0.5, 1.0)
    result.stdout.fnmatch_lines(["by the official score 0.500 -> 0.500, by the corrected score 1.000 -> 1.000 "
                                 "(upstream ProgramBench issue #56); the official score decided the base run, the "
                                 "corrected score the new one"])
    assert re.search(r"official 0\.50* · corrected 1\.00*<", (run_dir / "compare.html").read_text())
    rows = summary(run_dir)["tasks"]
    calc, cat = rows[CALCULATOR], rows[CATLIKE]
    assert (calc["outcome"], calc["score"], calc["score_official"], calc["score_basis"]) == (
        "passed", 1.0, 0.5, "corrected")
    eval_json = run_dir / CATLIKE / f"{CATLIKE}.eval.json"
    consistent = {t.instance_id: t for t in Catalogue.load([testbed.tasks_dir])}[CATLIKE].load_instance()
    assert cat["score_corrected"] == pytest.approx(regraded_score(eval_json, consistent), abs=1e-9)
    assert cat["score_official"] == pytest.approx(score_instance(eval_json, {
        t.instance_id: t for t in Catalogue.load([tasks])}[CATLIKE].load_instance()), abs=1e-9)
    assert cat["score_official"] < cat["score_corrected"] < 1.0
    assert cat["score"] == cat["score_corrected"]
    assert cat["outcome"] == "failed"
    props = properties(run_dir.parent / "corrected.xml", CATLIKE)
    assert float(props["score"]) == cat["score_corrected"]
    assert props["score_basis"] == "corrected"
    assert int(props["n_passed_corrected"]) < int(props["n_tests_corrected"])
    # The tests that really fail fail in both scores (the official adds not_run twins and scores ignored tests).
    outcome = json.loads((run_dir / CATLIKE / "pb-meta.json").read_text())["outcome"]
    failing = {t: s for t, s in outcome["tests_corrected"].items() if s != "passed"}
    assert failing
    assert failing == {t: s for t, s in outcome["tests"].items()
                                   if s not in ("passed", "not_run") and t not in outcome["counted_ignored"]}
    assert len(outcome["counted_twice"]) == int(props["n_tests_corrected"])
    assert outcome["counted_ignored"]
    result.stdout.fnmatch_lines([f"*_ {CATLIKE} _*", f"score {cat['score_corrected']:.4f} (*), below --pb-min-score 1",
                                 "official score *the corrected score decides (--pb-score)",
                                 "branch *: * of * tests failing", "  eval.tests.* (failure)*"])
    head = summary(run_dir)["headline"]
    assert head["mean_over_selection"] == pytest.approx((1.0 + cat["score_corrected"]) / 2, abs=1e-6)
    assert head["scores"]["official"]["mean_over_selection"] < 0.7 <= head["mean_over_selection"]
    assert "below --pb-min-mean" not in result.stdout.str()
    assert os.path.exists(run_dir / "report.html")
