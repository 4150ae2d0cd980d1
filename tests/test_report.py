"""report.html: written at session end, self-contained, and what a real browser (Debian's headless Chromium) shows
is summary.json's numbers. The screenshot is written next to the report it checked."""

from __future__ import annotations

import datetime
import html
import json
import re
import shlex
import shutil
import subprocess
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from programbench.utils.load_data import get_active_branches, get_ignored_tests, load_all_instances

from pytest_programbench.results.report import render
from pytest_programbench.results.summary import RunSummary, TaskRecord, task_cost, token_totals, tokens_line
from tests.conftest import Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"
TUIISH = "pbfix__tuiish.7e1a0b2"
NOIMAGE = "pbfix__noimage.1111111"
NOSUB = "pbfix__nosub.2222222"  # selected, no submission: deselected with a note


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    browser = shutil.which("chromium")
    assert browser is not None, "Debian's chromium is required (apt-get install -y chromium)"
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=300, check=True)


def text_of(dom: str, element_id: str) -> str:
    match = re.search(rf'<(\w+)[^>]*\bid="{re.escape(element_id)}"[^>]*>(.*?)</\1>', dom, re.S)
    assert match is not None, f"#{element_id} is not in the page"
    return html.unescape(re.sub(r"<[^>]+>", "", match.group(2))).strip()


def attr_of(dom: str, element_id: str, name: str) -> str:
    match = re.search(rf'<[^>]*\bid="{re.escape(element_id)}"[^>]*>', dom)
    assert match is not None, f"#{element_id} is not in the page"
    value = re.search(rf'\b{name}="([^"]*)"', match.group(0))
    assert value is not None, f"#{element_id} has no {name}"
    return html.unescape(value.group(1))


def expected_failing(run_dir: Path, tasks_dir: Path, iid: str) -> dict[str, list[str]]:
    """Computed apart from the report: the official result's non-passed tests of active branches, not ignored."""
    instance = next(i for i in load_all_instances(tasks_dir) if i["instance_id"] == iid)
    active, ignored = set(get_active_branches(instance)), get_ignored_tests(instance)
    result = json.loads((run_dir / iid / f"{iid}.eval.json").read_text())
    out: dict[str, list[str]] = {}
    for test in result["test_results"]:
        if test["status"] != "passed" and test["branch"] in active \
                and f"{test['branch']}/{test['name']}" not in ignored:
            out.setdefault(test["branch"], []).append(test["name"])
    return out


def scored_failing(run_dir: Path, tasks_dir: Path, iid: str) -> tuple[dict[str, list[dict[str, Any]]], Counter[str]]:
    """The failing scored tests by branch, each as eval.json has it, and how many tests each branch scores."""
    instance = next(i for i in load_all_instances(tasks_dir) if i["instance_id"] == iid)
    active, ignored = set(get_active_branches(instance)), get_ignored_tests(instance)
    result = json.loads((run_dir / iid / f"{iid}.eval.json").read_text())
    scored = [t for t in result["test_results"]
              if t["branch"] in active and f"{t['branch']}/{t['name']}" not in ignored]
    failing: dict[str, list[dict[str, Any]]] = {}
    for test in scored:
        if test["status"] != "passed":
            failing.setdefault(test["branch"], []).append(test)
    return failing, Counter(t["branch"] for t in scored)


def test_report_in_a_real_browser_shows_the_summary(pytester: pytest.Pytester, testbed: Testbed,
                                                    tmp_path: Path) -> None:
    tasks = pytester.mkdir("tasks")
    subs = pytester.mkdir("subs")
    for iid in (RPN, CATLIKE, TUIISH):
        shutil.copytree(testbed.tasks_dir / iid, tasks / iid)
    shutil.copytree(testbed.tasks_dir / CATLIKE, tasks / NOIMAGE, ignore=shutil.ignore_patterns("Dockerfile"))
    shutil.copytree(testbed.tasks_dir / RPN, tasks / NOSUB, ignore=shutil.ignore_patterns("Dockerfile"))
    runs = testbed.submissions.parent
    shutil.copytree(runs / "good" / RPN, subs / RPN)
    shutil.copytree(runs / "wrong" / CATLIKE, subs / CATLIKE)
    shutil.copytree(runs / "good" / TUIISH, subs / TUIISH)
    shutil.copytree(runs / "good" / CATLIKE, subs / NOIMAGE)
    run_dir = pytester.path / "run"
    args = ["-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks), "--pb-blob-dir", str(testbed.blob_dir),
            "--pb-filter", "pbfix__", "--pb-submissions", str(subs), "--pb-pull", "never", "--pb-infra-retries", "0",
            "--pb-output", str(run_dir), "--pb-cpus", "2"]
    # Without xdist the note on tasks without a submission follows the collection; under -n 2 it is there too.
    listed = pytester.runpytest_subprocess(*args, "--co")
    note = f"programbench: 1 selected tasks have no submission in {subs} and were deselected: {NOSUB}"
    assert note in listed.outlines, listed.stdout.str()[-3000:]
    before = time.time()
    result = pytester.runpytest_subprocess(*args, "-n", "2", timeout=900)
    after = time.time()
    result.assert_outcomes(passed=2, failed=1, errors=1)
    assert note in result.outlines, result.stdout.str()[-3000:]
    report = run_dir / "report.html"
    result.stdout.fnmatch_lines([f"report: {report}"])
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    head = summary["headline"]
    page = report.read_text()
    # Self-contained: no external script, style, image or font.
    assert not re.search(r'<(script|link|img|iframe)\b[^>]*\b(src|href)="', page)
    assert "http://" not in page
    assert "https://" not in page

    profile = tmp_path / "chromium-profile"
    shot = run_dir / "report.png"
    chromium("--window-size=1280,1800", f"--screenshot={shot}", report.as_uri(), profile=profile)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000
    dom = chromium("--dump-dom", report.as_uri(), profile=profile).stdout

    assert attr_of(dom, "tasks", "data-sortable") == "yes", "the page's script ran to its end"
    assert float(attr_of(dom, "mean-over-scored", "data-value")) == head["mean_over_scored"]
    assert float(attr_of(dom, "mean-over-selection", "data-value")) == head["mean_over_selection"]
    assert text_of(dom, "mean-over-scored") == f"{head['mean_over_scored']:.4f}"
    assert text_of(dom, "mean-over-selection") == f"{head['mean_over_selection']:.4f}"
    assert head["mean_over_scored"] != head["mean_over_selection"], "an error makes the two means differ"
    assert text_of(dom, "counts") == f"{head['passed']} / {head['failed']} / {head['errors']}" == "2 / 1 / 1"
    assert text_of(dom, "resolved") == str(head["resolved"])

    # Both means' 95% intervals drawn as error bars: the summary's bounds, placed on the bar's own 0..1 axis, with
    # the method and resample count beside them; one attempt per task: over tasks only, said.
    for name in ("mean-over-scored", "mean-over-selection"):
        ci = head[f"{name.replace('-', '_')}_ci"]
        svg = re.search(rf'<svg[^>]*\bid="ci-{name}".*?</svg>', dom, re.S)
        assert svg is not None, name
        assert (float(attr_of(dom, f"ci-{name}", "data-low")), float(attr_of(dom, f"ci-{name}", "data-high"))) \
            == (ci["low"], ci["high"])
        lines = {cls: tuple(map(float, xs)) for cls, *xs in re.findall(
            r'<line class="(\w+)" x1="([-\d.]+)" y1="[\d.]+" x2="([-\d.]+)"', svg.group(0))}
        zero, one = lines["axis"]
        assert lines["range"] == (pytest.approx(zero + (one - zero) * ci["low"], abs=0.01),
                                  pytest.approx(zero + (one - zero) * ci["high"], abs=0.01)), (name, lines, ci)
        assert text_of(dom, f"ci-text-{name}") == (
            f"95% CI [{ci['low']:.4f}, {ci['high']:.4f}] · bootstrap percentile, {ci['resamples']} resamples, seed "
            f"{ci['seed']} · over {ci['n']} tasks (one attempt per task: the interval is over tasks only)")
    assert head["mean_over_scored_ci"]["low"] < head["mean_over_scored_ci"]["high"], "a bar with a length"
    assert "the intervals are over tasks only" in text_of(dom, "ci-note")

    rows = re.findall(r'<tr data-task="([^"]+)">.*?<td class="outcome-(\w+)">', dom, re.S)
    assert dict(rows) == {iid: row["outcome"] for iid, row in summary["tasks"].items()}
    for iid, row in summary["tasks"].items():
        if row["score"] is not None:
            assert re.search(rf'<tr data-task="{re.escape(iid)}">.*?>{row["score"]:.4f}</td>', dom, re.S)
    assert f'href="{CATLIKE}/{CATLIKE}.eval.json"' in dom
    assert (run_dir / CATLIKE / f"{CATLIKE}.eval.json").is_file()

    # The failed task's panel: its failing tests by branch, as the official result says.
    failing = expected_failing(run_dir, tasks, CATLIKE)
    assert failing, "the wrong submission fails some tests"
    panel = re.search(rf'<details[^>]*id="task-{re.escape(CATLIKE)}".*?</details>', dom, re.S)
    assert panel is not None
    shown = {branch: re.findall(r"<li><code>([^<]+)</code>", block)
             for branch, block in re.findall(r'<div class="branch" data-branch="([^"]+)">(.*?)</div>',
                                             panel.group(0), re.S)}
    assert {b: [html.unescape(n) for n in names] for b, names in shown.items()} == failing
    assert "pbfix_1776_noimage" in text_of(dom, f"task-{NOIMAGE}")  # the error's reason

    # Every failing scored test with its assertion's message, escaped as text.
    scored, _ = scored_failing(run_dir, tasks, CATLIKE)
    for branch, block in re.findall(r'<div class="branch" data-branch="([^"]+)">(.*?)</div>', panel.group(0), re.S):
        messages = [html.unescape(m) for m in re.findall(r'<pre class="msg">(.*?)</pre>', block, re.S)]
        assert messages == [t["extra"]["message"] for t in scored[branch]], branch
    assert all(messages), "the wrong submission's failures all say something"

    # When, how long, what command, which versions; the evaluation's time per task.
    started = datetime.datetime.strptime(text_of(dom, "started"), "%Y-%m-%d %H:%M:%S UTC").replace(
        tzinfo=datetime.UTC).timestamp()
    assert int(before) - 1 <= started <= after
    assert text_of(dom, "started") == time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(summary["started"]))
    hours, minutes, seconds = map(int, text_of(dom, "duration").split(":"))
    assert hours * 3600 + minutes * 60 + seconds == int(summary["updated"] - summary["started"])
    assert 0 < summary["updated"] - summary["started"] <= after - before
    command = text_of(dom, "command")
    assert command.startswith("pytest ")
    assert [w for w in shlex.split(command)[1:] if not w.startswith("--basetemp=")] == [*args, "-n", "2"], command
    versions = text_of(dom, "versions")
    assert f"pytest-programbench {version('pytest-programbench')} · programbench {version('programbench')}" in versions
    evaluation = summary["tasks"][CATLIKE]["timings"]["evaluation"]
    assert evaluation > 0
    assert re.search(rf'<tr data-task="{re.escape(CATLIKE)}">.*?<td class="num" data-sort="{evaluation}">'
                     rf'{int(evaluation) // 3600}:{int(evaluation) // 60 % 60:02d}:{int(evaluation) % 60:02d}</td>',
                     dom, re.S)

    # The distribution: a bin's bar is stacked by outcome, and the failed task's part is not the passed green.
    bins: dict[str, dict[str, str]] = {}
    for chunk in dom.partition('class="hist-labels"')[0].split('<div class="col"')[1:]:
        label = re.search(r'data-bin="([^"]+)"', chunk)
        assert label is not None, chunk
        bins[label.group(1)] = dict(re.findall(r'<div class="bar (\w+)" data-count="(\d+)"', chunk))
    catlike_bin = f"{int(summary['tasks'][CATLIKE]['score'] * 10) / 10:.1f}"
    assert [parts for label, parts in bins.items() if label.startswith(catlike_bin)] == [{"failed": "1"}]
    assert bins["1.0 (resolved)"] == {"passed": "2"}
    assert bins["error / not run"] == {"other": "1"}
    css = dict(re.findall(r"\.hist \.bar\.(\w+) \{ background: #([0-9a-f]{6}); \}", page))
    red, green, _ = (int(css["failed"][i:i + 2], 16) for i in (0, 2, 4))
    assert red > 1.5 * green, css
    assert css["failed"] != css["passed"]

    # The item's message: per branch the count, the first three with their assertion's first line, "+N more";
    # the harness's INFO log is in the task's directory, not under the failure.
    out = result.stdout.str()
    for branch, tests in scored.items():
        _, totals = scored_failing(run_dir, tasks, CATLIKE)
        lines = [f"branch {branch}: {len(tests)} of {totals[branch]} tests failing",
                 *(f"  {t['name']} ({t['status']}): {t['extra']['message'].splitlines()[0]}" for t in tests[:3])]
        if len(tests) > 3:
            lines.append(f"  +{len(tests) - 3} more")
        result.stdout.fnmatch_lines([re.sub(r"([*?[])", r"[\1]", line) for line in lines])
    assert any(len(tests) > 3 for tests in scored.values()), "a branch with more failing tests than shown"
    assert "Captured log" not in out
    assert "verdict: score" in (run_dir / CATLIKE / "harness.log").read_text()

    # A link to a sorted table: by score, descending.
    sorted_dom = chromium("--dump-dom", report.as_uri() + "#sort=-score", profile=profile).stdout
    order = re.findall(r'<tr data-task="([^"]+)">', sorted_dom)
    scores = [summary["tasks"][iid]["score"] if summary["tasks"][iid]["score"] is not None else -1 for iid in order]
    assert scores == sorted(scores, reverse=True)  # the source order (by id) is not: 0.6, error, 1.0, 1.0


def test_tokens_and_cost_reach_summary_terminal_and_report(tmp_path: Path) -> None:
    relay = {"requests": 3, "input_tokens": 1_000_000, "output_tokens": 200_000, "total_tokens": 1_200_000}
    metered = TaskRecord(RPN, "c", "easy", outcome="passed", score=1.0, meta={"relay": relay})
    traj = TaskRecord(CATLIKE, "c", "easy", outcome="failed", score=0.5, meta={"relay": relay})
    (tmp_path / CATLIKE).mkdir()
    (tmp_path / CATLIKE / f"{CATLIKE}.traj.json").write_text(
        json.dumps({"info": {"model_stats": {"instance_cost": 0.75}}}))
    unmetered = TaskRecord(TUIISH, "c", "medium", outcome="failed", score=0.0)
    price = (2.0, 10.0)  # USD per million input, output tokens
    for rec in (metered, traj, unmetered):
        rec.cost_usd = task_cost(tmp_path, rec, price)
    assert metered.cost_usd == pytest.approx(2.0 + 2.0)
    assert traj.cost_usd == 0.75, "the agent's own account wins"
    assert unmetered.cost_usd is None
    totals = token_totals([metered, traj, unmetered])
    assert (totals["input_tokens"], totals["output_tokens"], totals["tasks_with_tokens"]) == (2_000_000, 400_000, 2)
    assert totals["cost_usd"] == pytest.approx(4.75)
    assert tokens_line(totals) == ("tokens: 2,000,000 in, 400,000 out, 2,400,000 total (2 tasks metered)   "
                                   "cost: $4.7500 (2 tasks)")
    assert task_cost(tmp_path, metered, None) is None

    header = {"run_id": "r", "run_dir": str(tmp_path), "plugin_version": "0", "programbench_version": "1.2.5"}
    summary = RunSummary(tmp_path / "summary.json", header,
                         [metered, traj, unmetered])
    data = summary.as_dict()
    assert data["tokens"]["cost_usd"] == pytest.approx(4.75)
    page = render(tmp_path, data, lambda _iid: None)
    assert re.search(rf'<tr data-task="{RPN}">.*?>1,200,000</td>.*?>\$4\.0000</td>', page, re.S)
    assert re.search(rf'<tr data-task="{TUIISH}">.*?>-</td>\s*<td[^>]*>-</td>', page, re.S)
    assert '<span id="cost">$4.7500</span>' in page


def test_model_retries_waits_and_budget_reach_the_report(tmp_path: Path) -> None:
    """Each task's relay retries and seconds waited are a column (the waits for the run's limits beside them), the
    run's totals and --pb-budget's spent and projected (relay/spend.py) a line under the headline."""
    from pytest_programbench.relay.spend import SPEND_DIR, RunBudget

    limited = TaskRecord(RPN, "c", "easy", outcome="passed", score=1.0, meta={"relay": {
        "requests": 2, "retries": 3, "retry_wait_s": 12.4, "slot_wait_s": 1.0, "rate_wait_s": 4.2}})
    calm = TaskRecord(CATLIKE, "c", "easy", outcome="failed", score=0.5, meta={"relay": {"requests": 1, "retries": 0}})
    unmetered = TaskRecord(TUIISH, "c", "medium", outcome="failed", score=0.0)
    (tmp_path / SPEND_DIR).mkdir()
    (tmp_path / SPEND_DIR / f"{RPN}.json").write_text(json.dumps({"usd": 0.0123}))
    budget = RunBudget(tmp_path / SPEND_DIR, 0.05)
    budget.stopped = True
    header = {"run_id": "r", "run_dir": str(tmp_path), "plugin_version": "0", "programbench_version": "1.2.5"}
    data = RunSummary(tmp_path / "summary.json", header, [limited, calm, unmetered], budget=budget).as_dict()
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", render(tmp_path, data, lambda _iid: None))))
    assert ("Model API: 3 retries (12 s waited) · 5 s waited for the run's limits · budget $0.0123 of $0.05 "
            "(projected $0.0123); it stopped the run") in text
    assert f"{RPN} c easy passed 1.0000 - - - - - 3 (12 s waited) · 5 s for the run's limits " in text
    assert f"{CATLIKE} c easy failed 0.5000 - - - - - 0 " in text
    assert f"{TUIISH} c medium failed 0.0000 - - - - - - " in text



def test_failing_test_messages_are_text_and_bounded(tmp_path: Path) -> None:
    """Hidden tests quote the submission's output: a message with markup is text on the page (in a real browser), a
    huge one is cut saying where the rest is, control characters are escaped; the item's message shows the first
    line of each, and the count past the first three."""
    from pytest_programbench.results.verdict import DETAIL_MAX, TaskOutcome, failure_message

    run = tmp_path / "run"
    (run / CATLIKE).mkdir(parents=True)
    hostile = '<img src=x onerror="document.title=1">\x1b[2J</pre><script>document.body.id="owned"</script>\nmore'
    huge = "assert " + "x" * 100_000
    results: list[dict[str, Any]] = [{"name": f"t{i}", "branch": "b1", "status": "failure", "extra": {"message": m}}
               for i, m in enumerate([hostile, huge, "assert 1 == 2", "assert 3 == 4"])]
    results.append({"name": "ok", "branch": "b1", "status": "passed", "extra": {}})
    (run / CATLIKE / f"{CATLIKE}.eval.json").write_text(json.dumps({"test_results": results}))
    header = {"run_id": "r", "run_dir": str(run), "plugin_version": "0", "programbench_version": "1.2.5"}
    record = TaskRecord(CATLIKE, "c", "easy", outcome="failed", score=0.2)
    report = run / "report.html"
    report.write_text(render(run, RunSummary(run / "summary.json", header, [record]).as_dict(), lambda _iid: None))
    dom = chromium("--dump-dom", report.as_uri(), profile=tmp_path / "chromium-profile").stdout
    assert "<img" not in dom
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None
    assert body.group(0) == "<body>", "the message's script did not run"
    messages = [html.unescape(m) for m in re.findall(r'<pre class="msg">(.*?)</pre>', dom, re.S)]
    escaped = hostile.replace("\x1b", "\\x1b")
    assert messages == [escaped, huge[:DETAIL_MAX] + f" [... {len(huge) - DETAIL_MAX:,} more characters in eval.json]",
                        "assert 1 == 2", "assert 3 == 4"]

    outcome = TaskOutcome(CATLIKE, 0.2, 1, 5, tests={f"b1/{t['name']}": str(t["status"]) for t in results})
    text = failure_message(outcome, 1.0, flagged=False, task_dir=run / CATLIKE)
    assert text.splitlines()[1:6] == [
        "branch b1: 4 of 5 tests failing",
        f"  t0 (failure): {escaped.splitlines()[0]}",
        f"  t1 (failure): {huge[:197]}...",
        "  t2 (failure): assert 1 == 2",
        "  +1 more",
    ]


def _filter_run(root: Path) -> Path:
    """Three tasks that differ in language, difficulty, outcome, flags and failing tests; the report rendered."""
    run = root / "run"
    failing = {"name": "tests.test_wrap.test_wraps_long_lines", "branch": "b1", "status": "failure",
               "extra": {"message": "AssertionError: expected the line wrapped at 80\nsecond line"}}
    (run / CATLIKE).mkdir(parents=True)
    (run / CATLIKE / f"{CATLIKE}.eval.json").write_text(json.dumps({"test_results": [failing]}))
    records = [TaskRecord(RPN, "c", "easy", outcome="passed", score=1.0),
               TaskRecord(CATLIKE, "go", "easy", outcome="failed", score=0.5),
               TaskRecord(TUIISH, "c", "medium", outcome="failed", score=0.0,
                          meta={"evaluation": {"integrity_flags": [{"kind": "reads_hidden_tests", "path": ""}]}})]
    header = {"run_id": "r", "run_dir": str(run), "plugin_version": "0", "programbench_version": "1.2.5"}
    data = RunSummary(run / "summary.json", header, records).as_dict()
    data["tasks"][TUIISH]["integrity_flags"] = ["reads_hidden_tests"]
    (run / "report.html").write_text(render(run, data, lambda _iid: None))
    return run / "report.html"


def _shown(dom: str) -> list[str]:
    rows = re.findall(r'<tr data-task="([^"]+)"([^>]*)>', dom)
    return [task for task, attributes in rows if " hidden" not in attributes]


@pytest.mark.parametrize(("link", "shown"), [
    ("", [RPN, CATLIKE, TUIISH]),
    ("#filter=outcome=failed", [CATLIKE, TUIISH]),
    ("#filter=outcome=failed&language=c", [TUIISH]),
    ("#filter=flag=reads_hidden_tests", [TUIISH]),
    ("#filter=flag=-", [RPN, CATLIKE]),
    ("#filter=q=wrapped%2080", [CATLIKE]),  # words of a failing test's message, in any order
    ("#filter=q=LINES%20wraps", [CATLIKE]),  # ... and of its name, any case
    ("#filter=difficulty=medium&q=nothing-matches", []),
])
def test_the_report_filters_tasks_in_a_real_browser(tmp_path: Path, link: str, shown: list[str]) -> None:
    """Search and filters over the task table (language, difficulty, outcome, flags, the text of failing tests), set
    by a link a reader can share; the count says how many show, and a task's panel hides with its row."""
    report = _filter_run(tmp_path)
    dom = chromium("--dump-dom", report.as_uri() + link, profile=tmp_path / "chromium-profile").stdout
    assert 'id="filters" data-ready="yes"' in dom  # the page's script ran to its end
    assert sorted(_shown(dom)) == sorted(shown)
    assert text_of(dom, "filter-count") == f"{len(shown)} of 3 tasks"
    panels = re.findall(r'<details class="task" id="task-([^"]+)"([^>]*)>', dom)
    assert sorted(task for task, attributes in panels if " hidden" not in attributes) == sorted(shown)
