"""``--pb-compare``: two real evaluate-only runs of the fixture tasks that differ in one task (its submission the
``wrong`` variant), compared at the end of the second run and then as two finished runs; the flips, the delta, the
interval and the p-value recomputed here from the runs' own files; ``--pb-max-regression`` fails the session on
the regression and passes on equal runs; compare.html as headless Chromium shows it."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from programbench.utils.load_data import get_active_branches, get_ignored_tests, load_all_instances
from scipy.stats import bootstrap

from pytest_programbench.results import statistics
from tests.conftest import Testbed
from tests.test_report import attr_of, chromium

pytestmark = pytest.mark.usefixtures("clean_env")

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"


def evaluate(pytester: pytest.Pytester, testbed: Testbed, submissions: Path, run_dir: Path,
             *extra: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-submissions", str(submissions), "--pb-filter", f"{CATLIKE}|{RPN}", "--pb-pull", "never",
        "--pb-cpus", "2", "--pb-output", str(run_dir), "-n", "2", *extra, timeout=900)


def counted_statuses(run_dir: Path, tasks_dir: Path, iid: str) -> dict[str, str]:
    """The statuses of the tests that count (active branches, ignored left out), read here from the eval.json."""
    instance = next(i for i in load_all_instances(tasks_dir) if i["instance_id"] == iid)
    active, ignored = set(get_active_branches(instance)), get_ignored_tests(instance)
    result = json.loads((run_dir / iid / f"{iid}.eval.json").read_text())
    return {f"{t['branch']}/{t['name']}": t["status"] for t in result["test_results"]
            if t["branch"] in active and f"{t['branch']}/{t['name']}" not in ignored}


def score(statuses: dict[str, str]) -> float:
    return sum(s == "passed" for s in statuses.values()) / len(statuses)


def compare_finished(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=300)


def test_two_runs_differing_in_one_task(pytester: pytest.Pytester, testbed: Testbed, tmp_path: Path) -> None:
    runs = testbed.submissions.parent
    mixed = pytester.mkdir("mixed")
    shutil.copytree(runs / "good" / RPN, mixed / RPN)
    shutil.copytree(runs / "wrong" / CATLIKE, mixed / CATLIKE)
    base, new = pytester.path / "base", pytester.path / "new"

    evaluate(pytester, testbed, testbed.submissions, base).assert_outcomes(passed=2)
    # --pb-min-score 0.5: the partly wrong task passes its item, so the regression gate alone fails the session.
    second = evaluate(pytester, testbed, mixed, new, "--pb-min-score", "0.5", "--pb-compare", str(base),
                      "--pb-max-regression", "0.1")
    second.assert_outcomes(passed=2)
    assert second.ret == pytest.ExitCode.TESTS_FAILED
    second.stdout.fnmatch_lines(["*= programbench compare =*",
                                 "programbench: regression: the 95% CI of the mean score difference reaches *"])
    result: dict[str, Any] = json.loads((new / "compare.json").read_text())

    # By hand, from the two runs' files: what flipped, each task's delta.
    before = {iid: counted_statuses(base, testbed.tasks_dir, iid) for iid in (CATLIKE, RPN)}
    after = {iid: counted_statuses(new, testbed.tasks_dir, iid) for iid in (CATLIKE, RPN)}
    broke = sorted(t for t, s in before[CATLIKE].items() if s == "passed" and after[CATLIKE].get(t) != "passed")
    assert broke, "the wrong variant fails tests the good one passes"
    assert [f["test"] for f in result["tasks"][CATLIKE]["pass_to_fail"]] == broke
    assert result["tasks"][CATLIKE]["fail_to_pass"] == []
    assert result["tasks"][RPN]["pass_to_fail"] == result["tasks"][RPN]["fail_to_pass"] == []
    assert result["flips"] == {"pass_to_fail": len(broke), "fail_to_pass": 0}
    deltas = {iid: score(after[iid]) - score(before[iid]) for iid in (CATLIKE, RPN)}
    assert deltas[RPN] == 0.0
    assert deltas[CATLIKE] < 0
    for iid, delta in deltas.items():
        assert result["tasks"][iid]["delta"] == pytest.approx(delta, abs=1e-6)

    # The interval: scipy's bootstrap of the per-task differences, the same seed and method; the p-value: every
    # sign pattern of the two differences enumerated here.
    diffs = np.array([deltas[iid] for iid in sorted(deltas)])
    expected = bootstrap((diffs,), np.mean, confidence_level=0.95, n_resamples=statistics.RESAMPLES,
                         method="percentile", rng=np.random.default_rng(statistics.SEED)).confidence_interval
    difference = result["paired"]["difference"]
    assert difference["n"] == result["paired"]["tasks"] == 2
    assert difference["estimate"] == pytest.approx(diffs.mean(), abs=1e-6)
    assert (difference["low"], difference["high"]) == (pytest.approx(expected.low, abs=1e-6),
                                                        pytest.approx(expected.high, abs=1e-6))
    assert difference["low"] < -0.1  # the gate's reason
    assert (difference["method"], difference["resamples"], difference["seed"]) == (
        "percentile (paired)", statistics.RESAMPLES, statistics.SEED)
    observed = abs(diffs.mean())
    patterns = [abs(np.mean(diffs * signs)) for signs in itertools.product((1, -1), repeat=len(diffs))]
    p_value = sum(p >= observed - 1e-12 for p in patterns) / len(patterns)
    assert result["paired"]["permutation_test"]["p_value"] == pytest.approx(p_value)
    assert result["gate"]["failed"] is True
    assert result["only_in_base"] == result["only_in_new"] == []
    summary_new = json.loads((new / "summary.json").read_text())
    assert result["totals"]["task_seconds"]["new"] == pytest.approx(
        sum(t["duration"] for t in summary_new["tasks"].values()), abs=1e-3)

    # The page, as a browser shows it.
    page = new / "compare.html"
    assert not re.search(r'<(script|link|img|iframe)\b[^>]*\b(src|href)="', page.read_text())
    dom = chromium("--dump-dom", page.as_uri(), profile=tmp_path / "chromium").stdout
    assert attr_of(dom, "tasks", "data-sortable") == "yes", "the page's script ran to its end"
    assert float(attr_of(dom, "difference", "data-value")) == difference["estimate"]
    assert float(attr_of(dom, "ci-low", "data-value")) == difference["low"]
    assert float(attr_of(dom, "ci-high", "data-value")) == difference["high"]
    assert float(attr_of(dom, "p-value", "data-value")) == result["paired"]["permutation_test"]["p_value"]
    row = re.search(rf'<tr data-task="{re.escape(CATLIKE)}">.*?</tr>', dom, re.S)
    assert row is not None
    assert re.findall(r'<li data-flip="pass_to_fail">([^<]+)</li>', row.group(0)) == broke
    assert "gate-failed" in attr_of(dom, "gate", "class")

    # Two finished runs, nothing run: the improvement passes the gate, the regression fails it, equal runs pass.
    improved = compare_finished(pytester, "--pb-compare", f"{new},{base}", "--pb-max-regression", "0.1")
    assert improved.ret == pytest.ExitCode.OK, improved.stdout.str()
    improved.stdout.fnmatch_lines(["*= programbench compare =*", f"new  {base}", f"base {new}",
                                   "programbench: --pb-max-regression 0.1: the CI's lower bound * is within it",
                                   f"comparison: {base / 'compare.json'}, {base / 'compare.html'}"])
    assert "collected" not in improved.stdout.str()
    again = compare_finished(pytester, "--pb-compare", str(base), "--pb-compare", str(new), "--pb-max-regression",
                             "0.1")
    assert again.ret == pytest.ExitCode.TESTS_FAILED
    assert json.loads((new / "compare.json").read_text())["paired"] == result["paired"], "same files, same numbers"
    twin = pytester.path / "base-again"
    shutil.copytree(base, twin)
    equal = compare_finished(pytester, "--pb-compare", f"{base},{twin}", "--pb-max-regression", "0.01")
    assert equal.ret == pytest.ExitCode.OK, equal.stdout.str()
    same = json.loads((twin / "compare.json").read_text())
    assert same["paired"]["difference"]["low"] == same["paired"]["difference"]["high"] == 0.0
    assert same["flips"] == {"pass_to_fail": 0, "fail_to_pass": 0}


def test_compare_usage_errors(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Refused before anything runs: a directory that is no run, a gate without a baseline, run options next to two
    finished runs."""
    not_a_run = pytester.mkdir("not-a-run")
    other = pytester.mkdir("other")
    result = compare_finished(pytester, "--pb-compare", f"{not_a_run},{other}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--pb-compare: {not_a_run} is not a finished run directory*"])
    result = compare_finished(pytester, "--pb-compare", f"{not_a_run},{other}", "--pb-agent", "true")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--pb-compare BASE,NEW compares two finished runs and runs nothing: --pb-agent*"])
    result = compare_finished(pytester, "--pb-max-regression", "0.1", "--pb-agent", "true", "--pb-include-fixtures")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--pb-max-regression X needs --pb-compare BASE*"])
    result = compare_finished(pytester, "--pb-compare", str(not_a_run), "--pb-agent", "true", "--pb-include-fixtures")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--pb-compare: {not_a_run} is not a finished run directory*"])


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    """pass@k = 1 - C(n-c, k) / C(n, k): checked against every k-subset of n samples enumerated."""
    for n, c in ((5, 0), (5, 2), (6, 6), (7, 3)):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            assert statistics.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="pass@k needs"):
        statistics.pass_at_k(3, 4, 1)
