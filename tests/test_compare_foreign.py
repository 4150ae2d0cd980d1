"""``--pb-compare`` and ``--pb-report`` on runs that are not ours: the docs' commands run as written on the test bed.

``runs/theirs`` (the test bed's correct submissions of catlike and rpn) is evaluated by the official CLI itself
(``programbench eval``, pointed at the test bed's tasks by tests/official_catalogue.py), then packaged by
``programbench submit package`` and built into a registry entry the way ``programbench submit register`` builds one
(``build_plan``/``write_entry``); ``runs/mine`` (the ``wrong`` variants) and ``runs/same`` (the correct ones again) are
evaluated by our ``--pb-submissions``. catlike's tests.json names lack the ``eval.`` prefix its JUnit names carry
(test_corrected_score.stripped_tasks), so its official score (0.5) is not its corrected one (1.0): both scores are
checked across the kinds. Every expectation is computed here from the runs' own files (tests.json, eval.json,
score.json) with programbench's functions, apart from the plugin's code.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from programbench.eval.eval import EvaluationResult
from programbench.submission import score_from_tests
from programbench.utils.load_data import get_active_branches, get_ignored_tests, load_all_instances

from pytest_programbench.results import compare, foreign_runs
from tests import official_catalogue
from tests.conftest import GUARD_PLUGIN, MACHINE_CACHE, REPO, SESSION_DEFAULTS_PLUGIN, Testbed
from tests.docs_text import fenced, section
from tests.session_defaults import KEEP_AUDIT
from tests.test_corrected_score import stripped_tasks
from tests.test_leaderboard_entry import per_task_scores, recompute, register_entry
from tests.test_report import attr_of, chromium, text_of

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"
TASKS = (CATLIKE, RPN)
OFFICIAL_KIND = "a programbench eval output directory (<id>/<id>.eval.json)"
ENTRY_KIND = "a leaderboard entry or packaged submission (_stats/score.json)"
OURS_KIND = "a pytest-programbench run directory"
# Tasks of programbench's own catalogue: an entry's ids count only when they are the benchmark's.
X, Y, Z = "abishekvashok__cmatrix.5c082c6", "agourlay__zip-password-finder.704700d", "ajeetdsouza__zoxide.67ca1bc"


def readme_commands() -> list[str]:
    return fenced(section("comparing.md", "Against a `programbench eval` run or a leaderboard entry"))


@dataclass
class Done:
    """A command's exit status, output and, where it compared, the compare.json it wrote."""

    returncode: int
    out: str
    compared: dict[str, Any] | None = None


@dataclass
class Flow:
    root: Path
    tasks: Path
    official: Path  # the official CLI's output as it wrote it (copied before packaging)
    ignore: dict[str, list[str]]
    done: dict[str, Done] = field(default_factory=dict)

    def path(self, rel: str) -> Path:
        return (self.root / rel).resolve()

    def instance(self, iid: str) -> dict[str, Any]:
        return next(i for i in load_all_instances(self.tasks) if i["instance_id"] == iid)

    def statuses(self, run_dir: Path, iid: str) -> dict[str, str]:
        """The official scope's statuses, from the result by programbench's own filter."""
        instance = self.instance(iid)
        result = EvaluationResult.model_validate_json((run_dir / iid / f"{iid}.eval.json").read_bytes())
        scoped = result.for_branches(get_active_branches(instance)).without_ignored(get_ignored_tests(instance))
        return {t.full_name: t.status for t in scoped.test_results}


def _env(tasks: Path) -> dict[str, str]:
    """What a test's session gets (conftest's guard, the machine's cache), with the test bed's tasks as the official
    tools' catalogue; no PROGRAMBENCH_* of the developer's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROGRAMBENCH_")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
               PYTEST_PLUGINS=GUARD_PLUGIN, XDG_CACHE_HOME=MACHINE_CACHE, COLUMNS="200",
               **{official_catalogue.ENV: str(tasks)})
    return env


def _pytest(root: Path, env: dict[str, str], words: list[str]) -> Done:
    done = subprocess.run([sys.executable, "-m", "pytest", *words], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    return Done(done.returncode, done.stdout + done.stderr)


def _compare_json(flow: Flow, words: list[str]) -> dict[str, Any] | None:
    """The compare.json a command wrote: in NEW's directory, or with one side in the run's own (--pb-output)."""
    sides = next((w for i, w in enumerate(words) if i and words[i - 1] == "--pb-compare"), None)
    if sides is None:
        return None
    new = sides.split(",")[1] if "," in sides else words[words.index("--pb-output") + 1]
    path = flow.path(new) / "compare.json"
    return json.loads(path.read_text()) if path.is_file() else None


@pytest.fixture(scope="module")
def flow(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Flow:
    root = tmp_path_factory.mktemp("foreign")
    tasks = stripped_tasks(root, testbed)
    runs = testbed.submissions.parent
    for name, variant in (("theirs", "good"), ("mine", "wrong"), ("same", "good")):
        for iid in TASKS:
            shutil.copytree(runs / variant / iid, root / "runs" / name / iid)
    (root / "pytest.ini").write_text(
        f"[pytest]\naddopts = -p no:cacheprovider\npb_tasks_dir = {tasks}\npb_blob_dir = {testbed.blob_dir}\n"
        f"pb_filter = {CATLIKE}|{RPN}\npb_pull = never\npb_cpus = 2\n")
    rpn = {i["instance_id"]: i for i in load_all_instances(tasks)}[RPN]
    rpn_branch = sorted(get_active_branches(rpn))[0]
    ignore = {CATLIKE: ["8d2e4b6f0a13/eval.tests.test_options.test_number_lines"],
              RPN: [f"{rpn_branch}/{rpn['branches'][rpn_branch]['tests'][0]}"]}
    (root / "registry").mkdir()
    (root / "registry" / "ignored_tests.json").write_text(json.dumps(ignore))
    flow = Flow(root, tasks, root / "official-theirs", ignore)
    env = _env(tasks)
    for command in readme_commands():
        words = shlex.split(command)
        if "registry/submissions/theirs" in command and not (root / "registry" / "submissions").exists():
            register_entry(root / "runs" / "theirs", root / "registry")  # what `submit register` commits
        if words[0] == "programbench":
            ran = subprocess.run([sys.executable, "-c", official_catalogue.CLI, *words[1:]], cwd=root,
                                 env={**env, "PROGRAMBENCH_BLOB_DIR": str(testbed.blob_dir),
                                      "PROGRAMBENCH_DOCKER_CPUS": "2"},
                                 capture_output=True, text=True, timeout=900, check=False)
            flow.done[command] = Done(ran.returncode, ran.stdout + ran.stderr)
        else:
            assert words[0] == "pytest", command
            flow.done[command] = _pytest(root, env, words[1:])
            flow.done[command].compared = _compare_json(flow, words[1:])
        if words[:2] == ["programbench", "eval"]:
            shutil.copytree(root / "runs" / "theirs", flow.official)
            # Our run of the same submissions, compared at its end with the official output (a foreign BASE), then
            # again as two finished runs.
            # Not a docs command: the suite's session defaults (the audit off; it adds nothing a comparison reads).
            words = ["--pb-submissions", "runs/same", "--pb-output", "pb-runs/same", "-n", "2", "--pb-compare",
                     flow.official.name]
            flow.done["same"] = _pytest(root, {k: v for k, v in env.items() if k != KEEP_AUDIT}
                                        | {"PYTEST_PLUGINS": f"{GUARD_PLUGIN},{SESSION_DEFAULTS_PLUGIN}"}, words)
            flow.done["same"].compared = _compare_json(flow, words)
            words = ["--pb-compare", f"{flow.official.name},pb-runs/same"]
            flow.done["official,same"] = _pytest(root, env, words)
            flow.done["official,same"].compared = _compare_json(flow, words)
    for base in ("runs/theirs", "registry/submissions/theirs"):  # the package, the entry: against our same run
        words = ["--pb-compare", f"{base},pb-runs/same"]
        flow.done[f"{base},same"] = _pytest(root, env, words)
        flow.done[f"{base},same"].compared = _compare_json(flow, words)
    return flow


def _command(flow: Flow, start: str) -> tuple[str, Done]:
    return next((c, d) for c, d in flow.done.items() if c.startswith(start))


def test_readme_commands_ran(flow: Flow) -> None:
    commands = readme_commands()
    assert [c.split()[0] for c in commands] == ["programbench", "pytest", "pytest", "pytest", "programbench", "pytest",
                                                "pytest"], commands
    for command in commands:
        done = flow.done[command]
        expected = 1 if ("--pb-max-regression" in command or "--pb-submissions" in command) else 0
        assert done.returncode == expected, (command, done.out[-3000:])
    # catlike's official score is 0.5 (its names' defect), below the default --pb-min-score: its item fails
    assert flow.done["same"].returncode == 1, flow.done["same"].out[-3000:]
    assert "1 failed, 1 passed" in flow.done["same"].out


def test_a_run_compared_at_its_end_with_an_official_output(flow: Flow) -> None:
    """``--pb-compare BASE`` of a run, BASE the official CLI's output: the same comparison as the finished runs'."""
    done = flow.done["same"]
    assert "= programbench compare =" in done.out
    assert f"base is {OFFICIAL_KIND}; new is {OURS_KIND}" in done.out
    at_end, finished = done.compared, flow.done["official,same"].compared
    assert at_end is not None
    assert finished is not None
    assert at_end["flips"] == {"pass_to_fail": 0, "fail_to_pass": 0}
    assert at_end["paired"] == finished["paired"]
    assert at_end["tasks"] == finished["tasks"]


def test_the_official_cli_output_equals_our_run_of_the_same_submissions(flow: Flow) -> None:
    """``programbench eval``'s own output against our run of the same submissions: zero flips, zero difference, by
    both scores; the same tests counted on both sides, with the same statuses."""
    done = flow.done["official,same"]
    assert done.returncode == 0, done.out[-3000:]
    result = done.compared
    assert result is not None
    assert f"base is {OFFICIAL_KIND}; new is {OURS_KIND}" in done.out
    assert (result["base"]["kind"], result["new"]["kind"]) == ("official_run", "ours")
    assert result["flips"] == {"pass_to_fail": 0, "fail_to_pass": 0}
    difference = result["paired"]["difference"]
    assert difference["estimate"] == difference["low"] == difference["high"] == 0.0
    assert result["paired"]["tasks"] == 2
    same = flow.path("pb-runs/same")
    for iid in TASKS:
        row = result["tasks"][iid]
        assert row["delta"] == 0.0
        assert flow.statuses(flow.official, iid) == flow.statuses(same, iid), "the same tests, the same statuses"
        assert row["base"]["score_official"] == row["new"]["score_official"]
        assert row["base"]["score_corrected"] == row["new"]["score_corrected"]
        assert row["scope"] == "official"
    catlike = result["tasks"][CATLIKE]["base"]
    assert catlike["score_official"] < catlike["score_corrected"] == 1.0, "the defect, replayed from its log"
    statuses = flow.statuses(flow.official, CATLIKE)
    assert catlike["score_official"] == pytest.approx(
        sum(s == "passed" for s in statuses.values()) / len(statuses), abs=1e-9)
    for basis in ("official", "corrected"):
        scores = result["scores"][basis]
        assert (scores["tasks"], scores["mean_base"]) == (2, scores["mean_new"])
    # What a programbench eval directory does not record is said, not filled in.
    assert {"agent time", "evaluation time", "tokens", "trajectories"} <= set(result["base"]["lacks"])
    assert result["new"]["lacks"] == []
    assert result["totals"]["total_tokens"]["missing"] == ["base"]
    assert result["totals"]["evaluation_seconds"]["base"] is None
    assert "tokens not in this run -> " in done.out
    assert "evaluation not in this run -> " in done.out


def test_the_packaged_official_output_and_its_registry_entry_against_our_run(flow: Flow) -> None:
    """The same output packaged by ``programbench submit package`` (an entry with split eval.json files), and the
    registry entry built from it (score.json only), against our run: zero flips; the leaderboard's numbers are the
    registry's recomputation from score.json; the corrected score only where eval.json files allow it."""
    packaged = flow.done["runs/theirs,same"]
    assert packaged.returncode == 0, packaged.out[-3000:]
    result = packaged.compared
    assert result is not None
    assert f"base is {ENTRY_KIND}; new is {OURS_KIND}" in packaged.out
    assert result["flips"] == {"pass_to_fail": 0, "fail_to_pass": 0}
    assert result["paired"]["difference"]["estimate"] == 0.0
    assert (flow.path("runs/theirs") / CATLIKE / f"{CATLIKE}.eval.log.json").is_file(), "split by the package"
    for iid in TASKS:
        assert result["tasks"][iid]["base"]["score_corrected"] == result["tasks"][iid]["new"]["score_corrected"]
    score_json = flow.path("runs/theirs") / "_stats" / "score.json"
    expected = recompute(score_json, {})
    for side in ("base", "new"):
        assert {k: result["leaderboard"][side][k] for k in expected} == expected

    entry = flow.done["registry/submissions/theirs,same"]
    assert entry.returncode == 0, entry.out[-3000:]
    result = entry.compared
    assert result is not None
    assert not (flow.path("registry/submissions/theirs") / CATLIKE).exists(), "an entry holds no eval.json"
    assert result["flips"] == {"pass_to_fail": 0, "fail_to_pass": 0}
    assert result["paired"]["difference"]["estimate"] == 0.0
    stored = json.loads(score_json.read_text())
    for iid in TASKS:
        row = result["tasks"][iid]
        assert row["base"]["score_official"] == pytest.approx(score_from_tests(stored[iid]), abs=1e-12)
        assert row["base"]["score_corrected"] is None, "not in this run: no eval.json to replay"
        assert row["new"]["score_official"] == row["base"]["score_official"]
    assert "corrected score (no eval.json with its JUnit log)" in result["base"]["lacks"]
    assert "by the corrected score not in both runs" in entry.out
    assert result["scores"]["corrected"]["tasks"] == 0, "the corrected score is compared where both have it"


def test_our_wrong_run_against_the_officials_correct_one(flow: Flow) -> None:
    """Our run of the wrong submissions against the official output of the correct ones: the flips counted here from
    the two results; by the registry's ignore map, its struck tests left out of the flips and the scores the
    leaderboard's; the regression gate against the registry entry fails."""
    command, done = _command(flow, "pytest --pb-compare runs/theirs,pb-runs/mine")
    assert "--pb-registry-ignore" not in command
    result = done.compared
    assert result is not None
    assert f"base is {OFFICIAL_KIND}; new is {OURS_KIND}" in done.out
    mine = flow.path("pb-runs/mine")
    total = 0
    for iid in TASKS:
        before, after = flow.statuses(flow.official, iid), flow.statuses(mine, iid)
        broke = sorted(t for t, s in before.items() if s == "passed" and after.get(t) != "passed")
        mended = sorted(t for t, s in after.items() if s == "passed" and before.get(t) != "passed")
        row = result["tasks"][iid]
        assert [f["test"] for f in row["pass_to_fail"]] == broke
        assert [f["test"] for f in row["fail_to_pass"]] == mended
        assert broke, f"{iid}: the wrong variant fails tests the correct one passes"
        total += len(broke)

        def score(statuses: dict[str, str]) -> float:
            return sum(s == "passed" for s in statuses.values()) / len(statuses)

        assert row["delta"] == pytest.approx(score(after) - score(before), abs=1e-6)
    assert result["flips"] == {"pass_to_fail": total, "fail_to_pass": 0}

    # By the registry's ignore map (the package's score.json against ours): the struck tests flip on neither side.
    command, struck = _command(flow, "pytest --pb-compare runs/theirs,pb-runs/mine --pb-registry-ignore")
    board = struck.compared
    assert board is not None
    assert board["compared_by"] == "leaderboard"
    assert "compared by the leaderboard's scores" in struck.out
    stored = json.loads((flow.path("runs/theirs") / "_stats" / "score.json").read_text())
    theirs = per_task_scores(flow.path("runs/theirs") / "_stats" / "score.json", flow.ignore)
    for iid in TASKS:
        flipped = {f["test"] for f in board["tasks"][iid]["pass_to_fail"]}
        assert flipped == {f["test"] for f in result["tasks"][iid]["pass_to_fail"]} - set(flow.ignore[iid])
        mine_map = {t: s == "passed" for t, s in flow.statuses(mine, iid).items()}
        kept = [v for t, v in mine_map.items() if t not in flow.ignore[iid]]
        assert board["tasks"][iid]["delta"] == pytest.approx(sum(kept) / len(kept) - theirs[iid], abs=1e-6)
        assert set(stored[iid]) == set(mine_map), "the same tests in both per-test maps"
    assert any(set(flow.ignore[iid]) & {f["test"] for f in result["tasks"][iid]["pass_to_fail"]} for iid in TASKS), \
        "the ignore map strikes a test that flipped"
    assert board["leaderboard"]["base"]["struck"] == 2
    expected = recompute(flow.path("runs/theirs") / "_stats" / "score.json", flow.ignore)
    assert {k: board["leaderboard"]["base"][k] for k in expected} == expected

    # The gate against the registry entry: "not worse than entry X" fails.
    _, gated = _command(flow, "pytest --pb-compare registry/submissions/theirs,pb-runs/mine")
    assert gated.returncode == 1
    assert re.search(r"programbench: regression: the 95% CI of the mean score difference reaches -", gated.out)
    assert f"base is {ENTRY_KIND}; new is {OURS_KIND}" in gated.out


def test_the_report_of_an_official_run_directory_in_a_browser(flow: Flow) -> None:
    """``pytest --pb-report runs/theirs`` (before it was packaged): report.html, as headless Chromium shows it, holds
    each task's official and corrected score as the official result gives them, and says what the run lacks."""
    _, done = _command(flow, "pytest --pb-report runs/theirs")
    assert "runs/theirs is a programbench eval output directory" in done.out
    page = flow.path("runs/theirs") / "report.html"
    dom = chromium("--dump-dom", page.as_uri(), profile=flow.root / "chromium").stdout
    assert attr_of(dom, "kind", "data-kind") == "official_run"
    assert "tokens" in text_of(dom, "kind")
    assert "not in this run" in text_of(dom, "kind")
    scores = {}
    for iid in TASKS:
        statuses = flow.statuses(flow.official, iid)
        scores[iid] = sum(s == "passed" for s in statuses.values()) / len(statuses)
        row = re.search(rf'<tr data-task="{re.escape(iid)}">(.*?)</tr>', dom, re.S)
        assert row is not None
        assert f"{scores[iid]:.4f}" in row.group(1)
        assert f"{sum(s == 'passed' for s in statuses.values())}/{len(statuses)}" in row.group(1)
    panel = re.search(rf'id="task-{re.escape(CATLIKE)}".*?</details>', dom, re.S)
    assert panel is not None
    shown = dict(re.findall(r'class="score-(official|corrected)">([\d.]+)<', panel.group(0)))
    assert shown == {"official": f"{scores[CATLIKE]:.4f}", "corrected": "1.0000"}
    assert float(attr_of(dom, "mean-over-scored", "data-value")) == pytest.approx(
        sum(scores.values()) / len(scores), abs=1e-6)


# ------------------------------------------------------------------------------------------------- bad input


def _entry(path: Path, score: Any) -> Path:
    (path / "_stats").mkdir(parents=True)
    (path / "_stats" / "score.json").write_text(json.dumps(score))
    return path


def _compare(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=300)


def test_bad_input_is_a_one_line_usage_error(pytester: pytest.Pytester) -> None:
    """Each bad side is refused with one line naming what is wrong. What the front doors decide is
    results/compare.py's ``write`` and results/foreign_runs.py's ``report`` (front_doors.py passes their error on as
    the usage error ``--pb-compare: ...`` / ``--pb-report: ...``): every case through them here, and one case of each
    door through a real session, which shows that error as pytest's one ``ERROR:`` line."""
    good = _entry(pytester.path / "good", {X: {"b/t1": True, "b/t2": False}, Y: {"b/t": True}})
    nothing = pytester.mkdir("nothing")
    (nothing / "some-folder").mkdir()
    pending = pytester.mkdir("pending")
    (pending / "a__x.1").mkdir()
    (pending / "a__x.1" / "submission.tar.gz").write_bytes(b"")
    cases = {
        str(nothing): f"{nothing} is not a finished run directory: none of a pytest-programbench run directory "
                      "(pb-run.json), a programbench eval output directory (<id>/<id>.eval.json), a leaderboard entry "
                      "or packaged submission (_stats/score.json)",
        str(pending): f"{pending} is not a finished run directory: * it holds 1 submission(s) no one evaluated yet *",
        str(_entry(pytester.path / "legacy", {"a__x.1": 0.5})):
            "*legacy/_stats/score.json is not a map of maps {instance_id: {test: passed}}: a legacy "
            "{instance_id: score} map, which has no per-test results",
        str(_entry(pytester.path / "listed", [{"a__x.1": {}}])):
            "*listed/_stats/score.json is not a map of maps {instance_id: {test: passed}}: it is list",
        str(_entry(pytester.path / "counts", {"a__x.1": {"b/t": 1}})):
            "*counts/_stats/score.json is not a map of maps *: 1 task(s) map to something else than {test: passed} "
            "(a__x.1)",
        str(_entry(pytester.path / "apart", {Z: {"b/t": True}})):
            f"*{pytester.path / 'good'} and {pytester.path / 'apart'} have no task in common (base: {X}, {Y}; "
            f"new: {Z})",
    }
    for other, message in cases.items():  # what `pytest --pb-compare GOOD,OTHER` is refused with
        with pytest.raises(compare.CompareError) as refused:
            compare.write(Path(str(good)), Path(other))
        assert "\n" not in str(refused.value), other
        assert fnmatch.fnmatch(f"ERROR: --pb-compare: {refused.value}", f"ERROR: --pb-compare: {message}"), (
            str(refused.value), message)
    result = _compare(pytester, "--pb-compare", f"{good},{nothing}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    errors = [line for line in result.stderr.lines if line.strip()]
    assert len(errors) == 1, errors
    assert re.fullmatch(r"ERROR: --pb-compare: .*", errors[0])
    result.stderr.fnmatch_lines([f"ERROR: --pb-compare: {cases[str(nothing)]}"])
    # --pb-report: our own run is not its business; a foreign directory of unknown tasks has nothing to score.
    ours = pytester.mkdir("ours")
    (ours / "pb-run.json").write_text("{}")
    result = _compare(pytester, "--pb-report", str(ours))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --pb-report: {ours} is a pytest-programbench run directory: its "
                                 "report.html is written by the run itself*"])
    unknown = pytester.mkdir("unknown")
    (unknown / "a__x.1").mkdir()
    (unknown / "a__x.1" / "a__x.1.eval.json").write_text("{}")
    with pytest.raises(foreign_runs.ForeignRunError) as refused_report:  # `pytest --pb-report UNKNOWN` there
        foreign_runs.report(unknown, tasks_dirs=(), ignore_file=None, runs_beside=[pytester.path / "pb-runs"])
    assert "\n" not in str(refused_report.value)
    assert fnmatch.fnmatch(f"ERROR: --pb-report: {refused_report.value}",
                           f"ERROR: --pb-report: {unknown}: none of its 1 instance(s) is a task the catalogue knows*: "
                           "a__x.1"), str(refused_report.value)


def test_instances_one_side_lacks_are_listed(pytester: pytest.Pytester) -> None:
    """Two entries sharing one task of three: the paired comparison is over that one, the others are named."""
    base = _entry(pytester.path / "base", {X: {"b/t1": True, "b/t2": False}, Y: {"b/t": True}})
    new = _entry(pytester.path / "new", {X: {"b/t1": False, "b/t2": True}, Z: {"b/t": True}})
    result = _compare(pytester, "--pb-compare", f"{base},{new}")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines([f"base is {ENTRY_KIND}; new is {ENTRY_KIND}",
                                 "by the official score 0.500 -> 0.500, by the corrected score not in both runs *",
                                 f"only in base: {Y}", f"only in new: {Z}",
                                 "tokens not in this run -> not in this run; cost not in this run -> not in this run; "
                                 "agent not in this run -> not in this run; *"])
    compared = json.loads((new / "compare.json").read_text())
    assert (compared["only_in_base"], compared["only_in_new"]) == ([Y], [Z])
    assert [f["test"] for f in compared["tasks"][X]["pass_to_fail"]] == ["b/t1"]
    assert [f["test"] for f in compared["tasks"][X]["fail_to_pass"]] == ["b/t2"]
    assert compared["paired"]["tasks"] == 1
    assert compared["leaderboard"]["base"] == {"mean_score": 0.8, "resolved": 0.5, "near_resolved": 0.5, "tasks": 2,
                                               "struck": 0}
