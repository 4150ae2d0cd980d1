"""``--pb-compare``: the docs' commands run as written: two real evaluate-only runs of the fixture tasks that differ in
one task (its submission the ``wrong`` variant), compared at the end of the second run, then as two finished runs, then
the second packaged and verified by the official CLI; the flips, the delta, the interval and the p-value recomputed
here from the runs' own files; ``--pb-max-regression`` fails the session on the regression and passes on the
improvement and on equal runs; compare.html as headless Chromium shows it."""

from __future__ import annotations

import fnmatch
import html
import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from programbench.utils.load_data import get_active_branches, get_ignored_tests, load_all_instances
from scipy.stats import bootstrap

from pytest_programbench.results import compare, statistics
from tests import official_catalogue
from tests.conftest import Testbed
from tests.docs_text import fenced, section
from tests.session_defaults import KEEP_AUDIT
from tests.shared_runs import FinishedRun, made_once, session_env
from tests.test_report import attr_of, chromium

# users_defaults: the docs' commands run as written
pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.users_defaults]

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"




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
    return pytester.runpytest_subprocess(*args, timeout=300)


DOCS_RUNS = "compare-docs-two-runs"
COMMANDS = "commands.json"  # the docs' commands the made-once run ran before its last session: command, ret, output


def docs_commands() -> list[str]:
    # The page's first section only; its "Against ..." subsection is test_compare_foreign.py's.
    return fenced(section("comparing.md", "Comparing runs, and a leaderboard entry", subsections=False))


def docs_runs(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed) -> tuple[FinishedRun, list[tuple[str, Any]]]:
    """The docs' commands run as written, made once per suite run (tests/shared_runs.py) for the tests that read
    them (this module's, and test_viewer.py's index of the two runs), in a directory whose pytest.ini points at the
    test bed (two of its tasks; ``pb_min_score = 0.5``, so the partly wrong task passes its item and the regression
    gate alone fails a session), with ``runs/baseline`` the good submissions and ``runs/candidate`` the same but one
    task's the wrong variant. The sessions keep the audit on (the user's default, as ``users_defaults`` has it). Made
    up to its last ``pytest`` command; each command's result, in order; the commands after it (``programbench submit
    verify``) are the reader's to run, on its copy. Each reader works on its own copy."""
    extra = {KEEP_AUDIT: "1", official_catalogue.ENV: str(testbed.tasks_dir)}  # --pb-package's official package_run
    commands = docs_commands()
    last = max(i for i, command in enumerate(commands) if shlex.split(command)[0] == "pytest")

    def prepare(place: Path) -> list[str]:
        runs = testbed.submissions.parent
        for name, catlike in (("baseline", "good"), ("candidate", "wrong")):
            shutil.copytree(runs / "good" / RPN, place / "runs" / name / RPN)
            shutil.copytree(runs / catlike / CATLIKE, place / "runs" / name / CATLIKE)
        (place / "pytest.ini").write_text(textwrap.dedent(f"""
            [pytest]
            addopts = -p no:cacheprovider -p tests.official_catalogue
            pb_tasks_dir = {testbed.tasks_dir}
            pb_blob_dir = {testbed.blob_dir}
            pb_filter = {CATLIKE}|{RPN}
            pb_pull = never
            pb_cpus = 2
            pb_min_score = 0.5
        """))
        done: list[dict[str, Any]] = []
        for command in commands[:last]:
            words = shlex.split(command)
            if words[0] == "pytest":
                ran = subprocess.run([sys.executable, "-m", "pytest", *words[1:]], cwd=place,
                                     env={**session_env(place), **extra}, capture_output=True, text=True,
                                     timeout=900, check=False)
            else:
                assert words[0] == "programbench", command
                ran = official_catalogue.run_cli(words[1:], cwd=place, tasks_dir=testbed.tasks_dir,
                                                 blob_dir=testbed.blob_dir)
            done.append({"command": command, "ret": ran.returncode, "stdout": ran.stdout, "stderr": ran.stderr})
        (place / COMMANDS).write_text(json.dumps(done))
        return shlex.split(commands[last])[1:]

    made = made_once(tmp_path_factory, DOCS_RUNS, prepare, env=extra)
    earlier = json.loads((made.place / COMMANDS).read_text()) if (made.place / COMMANDS).is_file() else []
    results: list[tuple[str, Any]] = [
        (c["command"], pytest.RunResult(c["ret"], c["stdout"].splitlines(), c["stderr"].splitlines(), 0.0)
         if shlex.split(c["command"])[0] == "pytest" else subprocess.CompletedProcess([], c["ret"], c["stdout"],
                                                                                      c["stderr"]))
        for c in earlier]
    return made, [*results, (commands[last], made.result())]


def test_the_readme_commands_two_runs_differing_in_one_task(pytester: pytest.Pytester, testbed: Testbed,
                                                            tmp_path: Path,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    made, done = docs_runs(tmp_path_factory, testbed)
    # The reader's own copy; the commands after the made run's last session run there, as written.
    root = made.copy(pytester.path / "docs")
    commands = docs_commands()
    for command in commands[len(done):]:
        words = shlex.split(command)
        assert words[0] == "programbench", command
        done.append((command, official_catalogue.run_cli(words[1:], cwd=root, tasks_dir=testbed.tasks_dir,
                                                         blob_dir=testbed.blob_dir)))
    assert [c for c, _ in done] == commands
    assert [c.split()[0] for c, _ in done] == ["pytest"] * 4 + ["programbench"], [c for c, _ in done]
    (_, first), (_, second), (_, finished), (_, packaged), (_, verified) = done
    # The sessions printed the made run's paths; the files are read (and later written) on the copy.
    made_base, made_new = made.place / "pb-runs" / "baseline", made.place / "pb-runs" / "candidate"
    base, new = root / "pb-runs" / "baseline", root / "pb-runs" / "candidate"
    first.assert_outcomes(passed=2)
    assert first.ret == pytest.ExitCode.OK
    second.assert_outcomes(passed=2)
    assert second.ret == pytest.ExitCode.TESTS_FAILED, "the regression gate alone fails the session"
    second.stdout.fnmatch_lines(["*= programbench compare =*",
                                 "programbench: regression: the 95% CI of the mean score difference reaches *"])
    result: dict[str, Any] = json.loads((new / "compare.json").read_text())
    # Two finished runs: nothing collected, the same numbers; no gate asked, so no failure.
    assert finished.ret == pytest.ExitCode.OK, finished.stdout.str()
    finished.stdout.fnmatch_lines(["*= programbench compare =*", f"new  {made_new}", f"base {made_base}",
                                   f"comparison: {made_new / 'compare.json'}, {made_new / 'compare.html'}"])
    assert "collected" not in finished.stdout.str()
    assert json.loads((new / "compare.json").read_text())["paired"] == result["paired"], "same files, same numbers"
    # The package of the finished run (its recorded --pb-compare gate is re-done and fails again), verified.
    packaged.assert_outcomes(passed=2)
    packaged.stdout.fnmatch_lines([f"packaged 2 task(s) in {made_new}*"])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "Tier-0: 2/2 checks consistent" in verified.stdout

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
    # sign pattern of the differences enumerated here.
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
    evaluation_seconds = sum(json.loads((new / iid / "pb-meta.json").read_text())["timings"]["evaluation"]
                             for iid in (CATLIKE, RPN))
    assert result["totals"]["evaluation_seconds"]["new"] == pytest.approx(evaluation_seconds, abs=1e-2)
    assert evaluation_seconds > 1, "the resumed session's reuse does not replace the evaluation's time"

    # The headline's intervals in summary.json and the terminal: bootstrap over the tasks' scores (one attempt each).
    scores = np.array([summary_new["tasks"][iid]["score"] for iid in sorted(summary_new["tasks"])])
    head_ci = bootstrap((scores,), np.mean, confidence_level=0.95, n_resamples=statistics.RESAMPLES,
                        method="percentile", rng=np.random.default_rng(statistics.SEED)).confidence_interval
    ci = summary_new["headline"]["mean_over_scored_ci"]
    assert (ci["low"], ci["high"]) == (pytest.approx(head_ci.low, abs=1e-6), pytest.approx(head_ci.high, abs=1e-6))
    assert ci["estimate"] == pytest.approx(scores.mean(), abs=1e-6)
    assert ci["low"] < ci["estimate"] < ci["high"]
    assert (ci["n"], ci["over"]) == (2, statistics.OVER_TASKS)
    assert summary_new["headline"]["mean_over_selection_ci"] == ci, "no errors: the two means are the same"
    second.stdout.fnmatch_lines([f"mean over scored tasks:  {ci['estimate']:.3f}, 95% CI [{ci['low']:.3f}, "
                                 f"{ci['high']:.3f}] (2 scored)",
                                 f"  95% CI: bootstrap percentile, {statistics.RESAMPLES} resamples, seed "
                                 f"{statistics.SEED}, over 2 tasks (one attempt per task:*"])

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

    # The other way round the improvement passes the gate; equal runs pass it.
    improved = compare_finished(pytester, "--pb-compare", str(new), "--pb-compare", str(base),
                                "--pb-max-regression", "0.1")
    assert improved.ret == pytest.ExitCode.OK, improved.stdout.str()
    improved.stdout.fnmatch_lines(["*= programbench compare =*", f"new  {base}", f"base {new}",
                                   "programbench: --pb-max-regression 0.1: the CI's lower bound * is within it",
                                   f"comparison: {base / 'compare.json'}, {base / 'compare.html'}"])
    twin = pytester.path / "baseline-again"
    shutil.copytree(base, twin)
    # What `pytest --pb-compare BASE,TWIN --pb-max-regression 0.01` decides (the front door's exit status is the
    # gate's: the session above passes it, the docs' candidate run fails it).
    equal = compare.write(base, twin, max_regression=0.01)
    assert equal.gate_failure == "", equal.lines()
    assert fnmatch.filter(equal.lines(), "programbench: --pb-max-regression 0.01: the CI's lower bound * is within it")
    same = json.loads((twin / "compare.json").read_text())
    assert same["paired"]["difference"]["low"] == same["paired"]["difference"]["high"] == 0.0
    assert same["flips"] == {"pass_to_fail": 0, "fail_to_pass": 0}


def test_compare_usage_errors(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Refused before anything runs: a directory that is no run, a gate without a baseline, run options next to two
    finished runs."""
    not_a_run = pytester.mkdir("not-a-run")
    other = pytester.mkdir("other")
    # What `pytest --pb-compare NOT_A_RUN,OTHER` is refused with (test_compare_foreign.py's usage-error test shows
    # that refusal as the session's one ERROR: line).
    with pytest.raises(compare.CompareError, match=f"^{re.escape(str(not_a_run))} is not a finished run directory"):
        compare.write(not_a_run, other)
    result = compare_finished(pytester, "--pb-compare", f"{not_a_run},{other}", "--pb-agent", "true")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--pb-compare BASE,NEW compares two finished runs and runs nothing: --pb-agent*"])
    result = compare_finished(pytester, "--pb-report", str(not_a_run), "--pb-agent", "true")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--pb-report DIR writes the report of a finished run and runs nothing: --pb-agent "
                                 "cannot go with it*"])
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


def test_intervals_say_what_they_are_over() -> None:
    one = statistics.mean_interval({"b": [0.0], "a": [1.0], "c": [0.5]})
    assert one is not None
    assert (one.over, one.method, one.resamples, one.n) == (statistics.OVER_TASKS, "percentile", 9999, 3)
    assert one.low < one.estimate == 0.5 < one.high
    several = statistics.mean_interval({"a": [1.0, 0.0], "b": [0.5, 1.0]})
    assert several is not None
    assert (several.over, several.estimate) == (statistics.OVER_TASK_MEANS, 0.625)
    assert statistics.mean_interval({"a": [1.0]}) is None, "no interval from one task"
    same = statistics.mean_interval({"a": [1.0], "b": [1.0]})
    assert same is not None
    assert (same.low, same.high) == (1.0, 1.0)
    assert statistics.paired_difference({"a": 1.0}, {"a": 0.0}) is None


def test_constant_samples_need_no_scipy() -> None:
    """A session's first summary (every task still 0) and a run against itself: intervals without importing scipy
    (a second at every session's start, in the controller, before any task was handed out)."""
    script = ("import sys\n"
              "from pytest_programbench.results import statistics as s\n"
              "i = s.mean_interval({'a': [0.0], 'b': [0.0], 'c': [0.0]})\n"
              "d = s.paired_difference({'a': 1.0, 'b': 0.5}, {'a': 1.0, 'b': 0.5})\n"
              "assert (i.low, i.high, d.low, d.high) == (0.0, 0.0, 0.0, 0.0), (i, d)\n"
              "assert 'scipy' not in sys.modules and 'numpy' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_the_paired_interval_resamples_tasks_not_runs() -> None:
    """Tasks differ far more than runs do on one task: the paired interval is scipy's bootstrap of the per-task
    differences (the same seed), much narrower than resampling each run's scores apart would give."""
    base = {"a": 0.1, "b": 0.4, "c": 0.9, "d": 0.6, "e": 0.3}
    new = {"a": 0.15, "b": 0.4, "c": 0.95, "d": 0.7, "e": 0.3}
    diffs = np.array([new[t] - base[t] for t in sorted(base)])
    expected = bootstrap((diffs,), np.mean, confidence_level=0.95, n_resamples=statistics.RESAMPLES,
                         method="percentile", rng=np.random.default_rng(statistics.SEED)).confidence_interval
    interval = statistics.paired_difference(base, new)
    assert interval is not None
    assert (interval.low, interval.high) == (pytest.approx(expected.low), pytest.approx(expected.high))
    assert interval.low >= 0.0, "every task improved or held: the paired interval stays at or above 0"
    test = statistics.paired_permutation_test(base, new)
    assert test is not None
    assert (test.exact, test.resamples) == (True, 2 ** 5)
    observed = abs(diffs.mean())
    patterns = [abs(np.mean(diffs * signs)) for signs in itertools.product((1, -1), repeat=len(diffs))]
    assert test.p_value == pytest.approx(sum(p >= observed - 1e-12 for p in patterns) / len(patterns))


def _attempts_run(run_dir: Path, tasks: dict[str, list[dict[str, str]]]) -> None:
    """A finished --pb-attempts run directory as a session leaves it: each attempt's eval.json where it is written
    (``<id>/``, ``attempts/<n>/<id>/``), summary.json by RunSummary from the attempts' records, pb-run.json."""
    from pytest_programbench.core.run_identity import RUN_MARKER
    from pytest_programbench.core.task_key import TaskKey
    from pytest_programbench.results.summary import RunSummary, TaskRecord

    records = []
    attempts = max(len(runs) for runs in tasks.values())
    for iid, runs in tasks.items():
        for n, statuses in enumerate(runs, 1):
            key = TaskKey(iid, n=n, single=False)
            key.task_dir(run_dir).mkdir(parents=True)
            (key.task_dir(run_dir) / f"{iid}.eval.json").write_text(json.dumps({"test_results": [
                {"branch": test.split("/")[0], "name": test.split("/")[1], "status": status}
                for test, status in statuses.items()]}))
            records.append(TaskRecord(iid, "c", "easy", outcome="failed", score=score(statuses), key=key.name,
                                      attempt=n))
    (run_dir / RUN_MARKER).write_text(json.dumps({"run_id": run_dir.name, "settings": {}}))
    header = {"run_id": run_dir.name, "run_dir": str(run_dir), "plugin_version": "0", "programbench_version": "1"}
    (run_dir / "summary.json").write_text(json.dumps(
        RunSummary(run_dir / "summary.json", header, records, attempts=attempts).as_dict()))


def test_compare_over_attempts_uses_every_attempt(tmp_path: Path) -> None:
    """Two --pb-attempts runs (3 and 4 attempts) compared from their files: a test flips when its majority outcome
    over the attempts changes, not attempt 1's; a task's delta is the difference of its means over the attempts."""
    from pytest_programbench.results import compare

    p, f = "passed", "failure"
    # b/steady: attempt 1 fails in new alone (attempt 1's flip), mostly passes in both: no flip.
    # b/broke: 3/3 -> 1/4; b/tie: 2/3 -> 2/4 (a tie is not a majority): pass->fail; b/mended: 1/3 -> 3/4.
    base = {"t1": [{"b/steady": p, "b/broke": p, "b/tie": p, "b/mended": f},
                   {"b/steady": p, "b/broke": p, "b/tie": f, "b/mended": p},
                   {"b/steady": f, "b/broke": p, "b/tie": p, "b/mended": f}],
            "t2": [{"b/x": p, "b/y": f}, {"b/x": p, "b/y": p}, {"b/x": f, "b/y": f}]}
    new = {"t1": [{"b/steady": f, "b/broke": f, "b/tie": p, "b/mended": p},
                  {"b/steady": p, "b/broke": p, "b/tie": f, "b/mended": p},
                  {"b/steady": p, "b/broke": f, "b/tie": p, "b/mended": f},
                  {"b/steady": p, "b/broke": f, "b/tie": f, "b/mended": p}],
           "t2": [{"b/x": p, "b/y": p}, {"b/x": p, "b/y": f}, {"b/x": p, "b/y": f}, {"b/x": p, "b/y": f}]}
    _attempts_run(tmp_path / "base", base)
    _attempts_run(tmp_path / "new", new)
    written = compare.write(tmp_path / "base", tmp_path / "new")
    result = written.result
    row = result["tasks"]["t1"]
    assert [(r["test"], r["base"], r["new"]) for r in row["pass_to_fail"]] == [
        ("b/broke", "3/3 passed", "1/4 passed"), ("b/tie", "2/3 passed", "2/4 passed")]
    assert [(r["test"], r["base_passes"], r["new_passes"]) for r in row["fail_to_pass"]] == [("b/mended", 1, 3)]
    assert result["tasks"]["t2"]["pass_to_fail"] == result["tasks"]["t2"]["fail_to_pass"] == []
    assert result["flips"] == {"pass_to_fail": 2, "fail_to_pass": 1}

    def mean(runs: list[dict[str, str]]) -> float:
        return sum(map(score, runs)) / len(runs)

    for iid, runs in base.items():
        assert result["tasks"][iid]["delta"] == pytest.approx(mean(new[iid]) - mean(runs), abs=1e-6)
    diffs = np.array([mean(new[t]) - mean(base[t]) for t in sorted(base)])
    expected = bootstrap((diffs,), np.mean, confidence_level=0.95, n_resamples=statistics.RESAMPLES,
                         method="percentile", rng=np.random.default_rng(statistics.SEED)).confidence_interval
    difference = result["paired"]["difference"]
    assert (difference["low"], difference["high"]) == (pytest.approx(expected.low, abs=1e-6),
                                                        pytest.approx(expected.high, abs=1e-6))
    assert difference["over"] == "tasks both runs scored (each task's mean over its attempts)"
    assert result["method"] == {"attempts": {"base": 3, "new": 4}, "text": compare.OVER_ATTEMPTS}
    page = html.unescape(written.html_path.read_text())
    assert f"Compared: {compare.OVER_ATTEMPTS}." in page
    assert 'b/broke <span class="muted">(3/3 → 1/4)</span>' in page
    assert any(line.startswith("attempts per task: base 3, new 4: per task the mean") for line in written.lines())
