"""The viewer (issue 43) in Debian's headless Chromium, at 1,300 px and on a narrow window: what a reader's browser
lays out, measured by a script appended to a copy of the page (the page itself is left as written), with a
screenshot beside it for a person to look at."""

from __future__ import annotations

import html
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

from pytest_programbench.agents import agent_presets
from pytest_programbench.results import compare
from pytest_programbench.results.report import render
from pytest_programbench.results.summary import RunSummary, TaskRecord
from tests.conftest import TESTBED, Testbed
from tests.scripted_models import ScriptedModels, Step
from tests.shared_runs import FinishedRun, good_rpn_run
from tests.test_compare import docs_runs
from tests.test_compare_page import _run
from tests.test_report import attr_of, chromium

RPN = "pbfix__rpn.0b5e55e"
WIDE, NARROW = 1300, 500  # Chromium's headless window is at least 500 px wide
# The longest ids of the benchmark, each with two flags and a failing test: the widest rows a run has.
LONG_IDS = ["wintermute-cell__ngrrram.8ea13c3", "tree-sitter__tree-sitter.5e23cca", "yassinebridi__serpl.c48a9d7"]
FLAGS = ["reads_hidden_tests", "conftest_in_submission"]

MEASURE = """<script>addEventListener("load", function () {
  var out = {page: document.documentElement.scrollWidth, inner: innerWidth};
  document.querySelectorAll("[data-measure]").forEach(function (el) {
    out[el.getAttribute("data-measure")] = {width: Math.round(el.scrollWidth), box: el.clientWidth,
                                            left: Math.round(el.getBoundingClientRect().left)};
  });
  document.body.setAttribute("data-measured", JSON.stringify(out));
});</script></body>"""


def measured(page: Path, width: int, marks: dict[str, str], profile: Path) -> dict[str, Any]:
    """The page at ``width`` px: the document's scroll width, the window's, and for each CSS selector in ``marks``
    its element's scroll width, client width and left edge. A screenshot goes next to the page."""
    text = page.read_text()
    for name, selector in marks.items():
        text = text.replace("</body>", f'<script>document.querySelector({json.dumps(selector)})'
                                       f'.setAttribute("data-measure", {json.dumps(name)});</script></body>', 1)
    copy = page.with_name(f"{page.stem}.measure-{width}.html")
    copy.write_text(text.replace("</body>", MEASURE, 1))
    dom = chromium(f"--window-size={width},900", "--dump-dom", copy.as_uri(), profile=profile).stdout
    found = re.search(r'data-measured="([^"]*)"', dom)
    assert found is not None, "the measuring script did not run"
    chromium(f"--window-size={width},1400", f"--screenshot={page.with_name(f'{page.stem}-{width}.png')}",
             page.as_uri(), profile=profile)
    value: dict[str, Any] = json.loads(html.unescape(found.group(1)))
    return value


def _wide_run(root: Path) -> Path:
    run = root / "run"
    records = []
    for i, iid in enumerate(LONG_IDS):
        (run / iid).mkdir(parents=True)
        failing = {"name": "tests.test_x.test_a_rather_long_test_name_here", "branch": "b1", "status": "failure",
                   "extra": {"message": "AssertionError: " + "x" * 300}}
        (run / iid / f"{iid}.eval.json").write_text(json.dumps({"test_results": [failing]}))
        records.append(TaskRecord(iid, "rust", "hard", outcome="failed", score=0.5 + i / 10))
    header = {"run_id": "r", "run_dir": str(run), "plugin_version": "0", "programbench_version": "1.2.5"}
    data = RunSummary(run / "summary.json", header, records).as_dict()
    for iid in LONG_IDS:
        data["tasks"][iid]["integrity_flags"] = FLAGS
    (run / "report.html").write_text(render(run, data, lambda _iid: None))
    return run / "report.html"


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_the_task_table_fits_the_page(tmp_path: Path, width: int) -> None:
    """The widest rows a run has: at 1,300 px the table fits the page with nothing to scroll; on a narrow window the
    page still does not scroll sideways, the table scrolls in its own box and the task column stays at its left."""
    page = _wide_run(tmp_path)
    size = measured(page, width, {"wrap": "#tasks-wrap", "task": "#tasks td.task-id"}, tmp_path / "chromium")
    assert size["page"] <= size["inner"], size
    wrap = size["wrap"]
    if width == WIDE:
        assert wrap["width"] <= wrap["box"], size  # nothing hidden to the right
    else:
        assert wrap["width"] > wrap["box"], size  # the rest is a scroll away, inside the table's box
        assert size["task"]["left"] >= 0


# Every word of the compare page's table headers, sides, numbers and totals on one line: a word broken over two lines
# ("fail→p / ass") has client rectangles at two heights.
BROKEN_WORDS = """<script>addEventListener("load", function () {
  var broken = [], checked = 0;
  document.querySelectorAll("#tasks thead th, #tasks td.side, #tasks td.num, #totals th, #totals td").forEach(
    function (cell) {
      var walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT), node;
      while ((node = walker.nextNode())) {
        var re = /\\S+/g, m;
        while ((m = re.exec(node.data))) {
          var range = document.createRange();
          range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length);
          var tops = {};
          Array.prototype.forEach.call(range.getClientRects(), function (r) {
            if (r.width) tops[Math.round(r.top)] = 1;
          });
          checked++;
          if (Object.keys(tops).length > 1) broken.push(m[0]);
        }
      }
    });
  document.body.setAttribute("data-words", JSON.stringify({checked: checked, broken: broken,
    page: document.documentElement.scrollWidth, inner: innerWidth}));
});</script></body>"""


def _compared(root: Path) -> tuple[Path, Path, Path]:
    """Two finished runs of three tasks with flips (tests/test_compare_page.py's), each with its report.html."""
    tasks = {f"pbfix__task{i}.{i:07d}": (7, 11) for i in range(3)}
    base, new = root / "runs" / "base", root / "runs" / "new"
    _run(base, tasks, 6.0, True)
    _run(new, {k: (5, 11) for k in tasks}, 65.6, False)
    for run in (base, new):
        data = json.loads((run / "summary.json").read_text())
        for row in data["tasks"].values():  # _run's coverage is compare's part of it: the report's is fuller
            for key, value in (("sources", 0), ("calls", None), ("notes", [])):
                (row.get("coverage") or {}).setdefault(key, value)
        (run / "report.html").write_text(render(run, data, lambda _iid: None))
    written = compare.write(base, new)
    assert written.pair_html is not None
    return base, new, written.pair_html


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_the_compare_page_breaks_no_word(tmp_path: Path, width: int) -> None:
    """compare.html at 1,300 px and on a narrow window: no word of the task table's headers, sides and numbers, or
    of the totals, is broken over two lines; the page does not scroll sideways (the task table scrolls in its box);
    the totals are named as a reader names them, never by compare.json's keys."""
    _, new, _ = _compared(tmp_path)
    page = new / "compare.html"
    probe = page.with_name(f"compare.words-{width}.html")
    probe.write_text(page.read_text().replace("</body>", BROKEN_WORDS, 1))
    dom = chromium(f"--window-size={width},900", "--dump-dom", probe.as_uri(), profile=tmp_path / "chromium").stdout
    chromium(f"--window-size={width},1400", f"--screenshot={new / f'compare-{width}.png'}", page.as_uri(),
             profile=tmp_path / "chromium")
    found = re.search(r'data-words="([^"]*)"', dom)
    assert found is not None, "the probe did not run"
    words = json.loads(html.unescape(found.group(1)))
    assert words["checked"] > 50, words
    assert words["broken"] == [], words
    assert words["page"] <= words["inner"], words
    totals = [html.unescape(t) for t in re.findall(r'<tr data-total="[^"]+"><td>([^<]*)</td>', dom)]
    assert "total tokens" in totals
    assert "agent time (s)" in totals
    assert [t for t in totals if "_" in t] == [], totals


def test_each_comparison_is_kept_and_links_into_both_reports(tmp_path: Path) -> None:
    """``--pb-compare`` against a second base keeps the first comparison (a page per pair beside compare.html, the
    latest); each page links to both runs' report.html and from each task to its panel there."""
    base, new, first = _compared(tmp_path)
    kept = first.read_text()
    other = tmp_path / "runs" / "other"
    shutil.copytree(base, other)
    second = compare.write(other, new).pair_html
    assert second is not None
    assert second != first
    assert first.read_text() == kept
    assert (new / "compare.html").read_text() == second.read_text()
    dom = chromium("--dump-dom", first.as_uri(), profile=tmp_path / "chromium").stdout
    for side, run in (("base", base), ("new", new)):
        href = attr_of(dom, f"{side}-report", "href")
        assert (first.parent / unquote(urlparse(href).path)).resolve() == run / "report.html", href
        links = re.findall(rf'<a class="task-report" data-side="{side}" href="([^"]+)"', dom)
        assert len(links) == 3
        for link in links:
            target = urlparse(html.unescape(link))
            assert (first.parent / unquote(target.path)).resolve() == run / "report.html"
            assert f'id="{target.fragment}"' in (run / "report.html").read_text()


HOSTILE_TEXT = "Probing <script>document.body.id='owned'</script> the reference."
HOSTILE_OUTPUT = '<img src=x onerror="document.title=1">'
# The agent waits, once the solution is in, until the test has read live.html while it runs (the test creates
# /pb-gate/go), at most 300 s: as long as the property needs.
GATE_WAIT = "i=0; while [ ! -e /pb-gate/go ] && [ $i -lt 1500 ]; do sleep 0.2; i=$((i + 1)); done"
TRANSCRIPT_STEPS = (
    Step(HOSTILE_TEXT, f'/workspace/binary 1 2 +; echo "binary exited $?"; echo \'{HOSTILE_OUTPUT}\'', 1200, 40, 500),
    Step("Copying the solution.", f"cp -r /pb-testbed/solutions/{RPN}/. /workspace/src/; {GATE_WAIT}", 1500, 60,
         1100),
    Step("Done: the solution is in /workspace/src.", None, 1700, 25, 1400),
)


@dataclass(frozen=True)
class Followed:
    """The followed session: its run directory, and per width live.html as Chromium showed it while it ran."""

    run_dir: Path
    running: dict[int, str]


@pytest.fixture(scope="module")
def followed(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed) -> Followed:
    """A real session: claude-code, steered by the scripted model server through the relay, probes the reference
    (its output carrying markup), copies the solution in, waits until the test has read live.html while it runs (at
    both widths, dumped and screenshotted in headless Chromium) and says done. One session for the transcript's tests
    and the live page's."""
    parsed = agent_presets.parse("claude-code")
    assert parsed is not None
    agent_presets.ensure_installed(*parsed)
    root = tmp_path_factory.mktemp("claude-run")
    run_dir = root / "run"
    gate = root / "gate"
    gate.mkdir()
    gate.chmod(0o755)
    profile = root / "chromium"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROGRAMBENCH_")}
    page = run_dir / "live.html"
    running: dict[int, str] = {}
    out = root / "session.out"
    with ScriptedModels(TRANSCRIPT_STEPS) as server, out.open("w") as sink:
        with subprocess.Popen(
                [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir),
                 "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2",
                 "--pb-agent", "claude-code", "--pb-model", "scripted-model", "--pb-model-endpoint", server.base_url,
                 "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-agent-mount", f"{gate}:/pb-gate",
                 "--pb-agent-timeout", "600", "--pb-output", str(run_dir)],
                cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT) as proc:
            try:
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline and proc.poll() is None:
                    if page.is_file() and f"{RPN}" in page.read_text() and " agent " in page.read_text():
                        break
                    time.sleep(0.5)
                for width in (WIDE, NARROW):
                    running[width] = chromium(f"--window-size={width},900", "--dump-dom", page.as_uri(),
                                              profile=profile).stdout
                    chromium(f"--window-size={width},900", f"--screenshot={run_dir / f'live-running-{width}.png'}",
                             page.as_uri(), profile=profile)
            finally:
                (gate / "go").touch()  # the page has been read while running at both widths: the agent may end
                proc.wait(timeout=900)
        sent = server.sent.output_tokens
    assert proc.returncode == 0, out.read_text()[-5000:]
    (run_dir / "sent-output-tokens").write_text(str(sent))
    return Followed(run_dir, running)


@pytest.fixture(scope="module")
def claude_run(followed: Followed) -> Path:
    """The followed session's run directory."""
    return followed.run_dir


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_the_transcript_of_a_real_attempt(claude_run: Path, width: int, tmp_path: Path) -> None:
    """transcript.html of a real attempt, in headless Chromium: the prompt, each model call with its text and tool
    calls and their output, the reference's call in between, tokens and time per step; the agent's markup shown as
    text (no element, no script run); the page as wide as the window; the report links to it."""
    page = claude_run / RPN / "transcript.html"
    dom = chromium(f"--window-size={width},900", "--dump-dom", page.as_uri(), profile=tmp_path / "chromium").stdout
    assert re.search(r"<body>", dom), "a script of the agent's ran"
    assert "<img" not in dom
    assert "<title>Transcript" in dom
    sources = re.findall(r'<li class="step [a-z]+" data-step="\d+" data-source="([a-z]+)"', dom)
    assert sources[0] == "user"
    assert sources.count("agent") == len(TRANSCRIPT_STEPS)
    assert "system" in sources[sources.index("agent"):], sources  # the reference's call, after the first model call
    text = html.unescape(re.sub(r"<[^>]+>", "", dom))
    assert HOSTILE_TEXT in text
    assert HOSTILE_OUTPUT in text
    assert "binary exited 0" in text
    assert '/workspace/binary called: ["/workspace/binary", "1", "2", "+"]' in text
    sent = int((claude_run / "sent-output-tokens").read_text())
    out = [int(n.replace(",", "")) for n in re.findall(r'<span class="tokens">tokens [\d,]+ in, ([\d,]+) out', dom)]
    assert sum(out) == sent
    assert len(re.findall(r'<span class="took">[\d.]+ s to the next step</span>', dom)) >= len(TRANSCRIPT_STEPS)
    size = measured(page, width, {"steps": "#steps"}, tmp_path / "chromium")
    assert size["page"] <= size["inner"], size
    assert 'href="pbfix__rpn.0b5e55e/transcript.html"' in (claude_run / "report.html").read_text()


@pytest.fixture(scope="module")
def indexed_runs(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed) -> tuple[FinishedRun, list[int]]:
    """Two real evaluate-only sessions into one directory, ``pb-runs/`` (``baseline``: the good submissions of catlike
    and rpn; then ``candidate``: catlike's partly wrong one, compared with the first): docs/comparing.md's commands as
    test_compare.py runs them, made once per suite run (tests/shared_runs.py) and read here by each width on its own
    copy. With each session's exit status, in order."""
    made, done = docs_runs(tmp_path_factory, testbed)
    return made, [result.ret for command, result in done if shlex.split(command)[0] == "pytest"]


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_the_index_lists_the_runs_and_compares_any_two(indexed_runs: tuple[FinishedRun, list[int]], tmp_path: Path,
                                                       width: int) -> None:
    """Two real evaluate-only sessions into one directory (the good submissions, then one task's partly wrong one),
    the second compared with the first: index.html there lists both, newest first, with their means, links to each
    report and to the comparison, and for two runs a link picks, the command that compares them."""
    made_run, rets = indexed_runs
    finished = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
    assert rets, "the docs' sessions ran"
    assert all(ret in finished for ret in rets), rets
    made = made_run.place / "pb-runs"  # the directory the sessions wrote: the command names it
    root = made_run.copy(tmp_path / "indexed") / "pb-runs"
    means = {name: json.loads((root / name / "summary.json").read_text())["headline"]["mean_over_scored"]
             for name in ("baseline", "candidate")}
    assert means["baseline"] == 1.0
    assert means["candidate"] < 1.0
    page = root / "index.html"
    dom = chromium(f"--window-size={width},900", "--dump-dom", page.as_uri() + "#compare=baseline,candidate",
                   profile=tmp_path / "chromium").stdout
    assert 'id="pick" data-ready="yes"' in dom
    assert re.findall(r'<tr data-run="([^"]+)">', dom) == ["candidate", "baseline"]
    for name in ("baseline", "candidate"):
        row = re.search(rf'<tr data-run="{name}">(.*?)</tr>', dom, re.S)
        assert row is not None
        assert f'<a class="report" href="{name}/report.html">' in row.group(1)
        shown = re.search(r'data-key="mean_over_scored">([^<]*)<', row.group(1))
        assert shown is not None
        assert shown.group(1) == f"{means[name]:.4f}"
    comparisons = re.findall(r'<a class="comparison" href="([^"]+)"', dom)
    assert len(comparisons) == 1
    assert (root / html.unescape(comparisons[0])).is_file()
    command = html.unescape(re.sub(r"<[^>]+>", "", re.search(r'<pre id="compare-command">(.*?)</pre>', dom,
                                                              re.S).group(1)))  # type: ignore[union-attr]
    assert command == f"pytest --pb-compare {made / 'baseline'},{made / 'candidate'}"
    size = measured(page, width, {"runs": "#runs"}, tmp_path / "chromium")
    assert size["page"] <= size["inner"], size


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_a_running_session_is_followed_in_live_html(followed: Followed, tmp_path: Path, width: int) -> None:
    """A real session whose agent runs until the page is read (the ``followed`` claude-code session, shared by both
    widths and the transcript's tests): live.html, opened in headless Chromium at this width while it runs, reloads
    itself and shows the task in flight in its agent phase; once the session ends it says so, stops reloading and
    links the report."""
    run_dir = followed.run_dir
    page = run_dir / "live.html"
    dom = followed.running[width]
    assert (run_dir / f"live-running-{width}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r'<meta http-equiv="refresh" content="\d+">', dom)
    assert 'data-state="running"' in dom
    progress = html.unescape(re.sub(r"<[^>]+>", "", re.search(r'<pre id="progress">(.*?)</pre>', dom,
                                                               re.S).group(1)))  # type: ignore[union-attr]
    assert "1 running" in progress, progress
    assert RPN in progress
    assert " agent " in progress, progress
    size = measured(page, width, {"progress": "#progress"}, tmp_path / "chromium")
    assert size["page"] <= size["inner"], size
    done = chromium("--dump-dom", page.as_uri(), profile=tmp_path / "chromium").stdout
    assert 'data-state="finished"' in done
    assert "http-equiv" not in done
    assert '<a href="report.html">' in done
    assert (run_dir / "report.html").is_file()


SEGMENTS = """<script>addEventListener("load", function () {
  var bar = document.querySelector(".phasebar"), out = [];
  document.querySelectorAll("details").forEach(function (d) { d.open = true; });
  bar.querySelectorAll(".seg.lvl1").forEach(function (s) {
    var r = s.getBoundingClientRect();
    out.push([s.getAttribute("data-phase"), getComputedStyle(s).backgroundColor, Math.round(r.left),
              Math.round(r.right)]);
  });
  document.body.setAttribute("data-segments", JSON.stringify(out));
});</script></body>"""


def test_the_timeline_bar_has_labels_an_axis_a_legend_and_branches_apart(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, testbed: Testbed) -> None:
    """A real evaluate-only run of a task with three branches (the shared good rpn run, tests/shared_runs.py, read on
    a copy): its timeline bar labels each segment, has an axis from 0 to the task's span and a legend, and two
    adjacent segments of the evaluation row never share a colour."""
    done = good_rpn_run(tmp_path_factory, testbed.tasks_dir, testbed.blob_dir, testbed.submissions)
    done.result().assert_outcomes(passed=1)
    run_dir = done.copy(tmp_path / "good-rpn") / "run"
    page = run_dir / "report.html"
    text = page.read_text()
    bar = re.search(r'<div class="phasebar"[^>]*>(.*?)</div>\s*<div class="phase-axis">(.*?)</div>\s*'
                    r'<div class="phase-legend">(.*?)</div>', text, re.S)
    assert bar is not None, "the bar, its axis and its legend, in that order"
    labels = re.findall(r'data-phase="([^"]+)"[^>]*>([^<]*)</div>', bar.group(1))
    assert labels
    assert all(name == label for name, label in labels), labels
    assert "agent" in bar.group(3)
    assert "evaluation" in bar.group(3)
    probe = page.with_name("report.segments.html")
    probe.write_text(text.replace("</body>", SEGMENTS, 1))
    dom = chromium(f"--window-size={WIDE},900", "--dump-dom", probe.as_uri(), profile=tmp_path / "chromium").stdout
    found = re.search(r'data-segments="([^"]*)"', dom)
    assert found is not None
    segments = json.loads(html.unescape(found.group(1)))
    assert len([s for s in segments if s[0].startswith("branch ")]) == 3, segments
    for before, after in itertools.pairwise(segments):
        if abs(after[2] - before[3]) <= 2:  # adjacent on the screen
            assert before[1] != after[1], (before, after)
    chromium(f"--window-size={WIDE},1400", f"--screenshot={run_dir / 'timeline-1300.png'}", probe.as_uri(),
             profile=tmp_path / "chromium")
