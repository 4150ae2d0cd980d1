"""report.html: written at session end, self-contained, and what a real browser (Debian's headless Chromium) shows
is summary.json's numbers. The screenshot is written next to the report it checked."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
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


def test_report_in_a_real_browser_shows_the_summary(pytester: pytest.Pytester, testbed: Testbed,
                                                    tmp_path: Path) -> None:
    tasks = pytester.mkdir("tasks")
    subs = pytester.mkdir("subs")
    for iid in (RPN, CATLIKE, TUIISH):
        shutil.copytree(testbed.tasks_dir / iid, tasks / iid)
    shutil.copytree(testbed.tasks_dir / CATLIKE, tasks / NOIMAGE, ignore=shutil.ignore_patterns("Dockerfile"))
    runs = testbed.submissions.parent
    shutil.copytree(runs / "good" / RPN, subs / RPN)
    shutil.copytree(runs / "wrong" / CATLIKE, subs / CATLIKE)
    shutil.copytree(runs / "good" / TUIISH, subs / TUIISH)
    shutil.copytree(runs / "good" / CATLIKE, subs / NOIMAGE)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", "pbfix__", "--pb-submissions", str(subs), "--pb-pull", "never", "--pb-infra-retries", "0",
        "--pb-output", str(run_dir), "--pb-cpus", "2", "-n", "2", timeout=900)
    result.assert_outcomes(passed=2, failed=1, errors=1)
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
