"""The viewer (issue 43) in Debian's headless Chromium, at 1,300 px and on a narrow window: what a reader's browser
lays out, measured by a script appended to a copy of the page (the page itself is left as written), with a
screenshot beside it for a person to look at."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.results.report import render
from pytest_programbench.results.summary import RunSummary, TaskRecord
from tests.test_report import chromium

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
