"""compare.html as headless Chromium lays it out at 1400 px: no horizontal overflow (the evaluation-time column
is on the page), scores printed as scores, test names left-aligned, the difference bar with an axis."""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path
from typing import Any

from pytest_programbench.core.run_identity import RUN_MARKER
from pytest_programbench.results import compare
from pytest_programbench.results.summary import RunSummary, TaskRecord
from tests.test_report import attr_of, chromium

# What a page's script measures, written into the DOM so that --dump-dom carries it out.
MEASURE = """<script>
(function () {
  var root = document.documentElement, li = document.querySelector("ul.flips li");
  var last = document.querySelector("#tasks tbody tr td:last-child").getBoundingClientRect();
  var evaluation = document.querySelector("#tasks thead th[data-key='evaluation']").getBoundingClientRect();
  document.body.setAttribute("data-measured", JSON.stringify({
    scrollWidth: root.scrollWidth, clientWidth: root.clientWidth, lastRight: last.right,
    evaluationRight: evaluation.right, flipAlign: getComputedStyle(li).textAlign,
    ticks: Array.prototype.map.call(document.querySelectorAll("#ci-axis [data-tick]"), function (t) {
      return [t.getAttribute("data-tick"), Math.round(t.getBoundingClientRect().left)]; }),
    bar: (function (b) { return [Math.round(b.left), Math.round(b.right)]; })(
      document.querySelector(".ci").getBoundingClientRect())}));
})();
</script>"""

MINUS = "\u2212"  # the page's minus sign
LONG = "eval.tests.test_a_module_with_a_rather_long_name.TestAClassOfTests.test_something_quite_specific_and_long"


def _run(run_dir: Path, scores: dict[str, tuple[int, int]], seconds: float, flips_pass: bool) -> None:
    """A finished one-attempt run: per task an eval.json of ``passed/total`` tests (long names), its timings,
    tokens and coverage in pb-meta's shape."""
    records = []
    for iid, (passed, total) in scores.items():
        task_dir = run_dir / iid
        task_dir.mkdir(parents=True)
        tests = [{"branch": "b0123456789a", "name": f"{LONG}_{i}", "status": "passed" if (i < passed) == flips_pass
                  or (i >= 6 and i < passed) else "failure"} for i in range(total)]
        (task_dir / f"{iid}.eval.json").write_text(json.dumps({"test_results": tests}))
        relay = {"input_tokens": 120_000, "output_tokens": 3_456, "total_tokens": 123_456}
        meta = {"timings": {"agent": seconds, "evaluation": seconds / 10}, "relay": relay,
                "coverage": {"total": 4, "covered": 2 if flips_pass else 3, "tried": ["-a", "-b"], "never_tried": []}}
        records.append(TaskRecord(iid, "c", "easy", outcome="failed", score=passed / total, meta=meta,
                                  properties={"n_passed": passed, "n_tests": total}))
    (run_dir / RUN_MARKER).write_text(json.dumps({"run_id": run_dir.name, "settings": {}}))
    header = {"run_id": run_dir.name, "run_dir": str(run_dir), "plugin_version": "0", "programbench_version": "1"}
    (run_dir / "summary.json").write_text(json.dumps(RunSummary(run_dir / "summary.json", header, records).as_dict()))


def test_compare_page_fits_1400_px_with_scores_names_and_an_axis(tmp_path: Path) -> None:
    tasks = {f"pbfix__task{i}.{i:07d}": (7, 11) for i in range(3)}
    long_dir = tmp_path / ("a-run-directory-with-a-long-name-" * 4).rstrip("-")
    _run(long_dir / "base", tasks, 6.0, True)
    _run(long_dir / "new", {k: (5, 11) for k in tasks}, 65.6, False)
    written = compare.write(long_dir / "base", long_dir / "new")
    result: dict[str, Any] = written.result
    assert result["flips"]["pass_to_fail"] > 0
    assert result["flips"]["fail_to_pass"] > 0
    page = written.html_path.read_text()
    assert "0.6363636363636364" not in page
    assert "0.45454545454545453" not in page
    probe = tmp_path / "compare-measured.html"
    probe.write_text(page.replace("</body>", MEASURE + "\n</body>"))
    shutil.copy(written.html_path, tmp_path / "compare.html")
    dom = chromium("--window-size=1400,1000", "--dump-dom", probe.as_uri(), profile=tmp_path / "chromium").stdout
    found = re.search(r'<body[^>]*\bdata-measured="([^"]*)"', dom)
    assert found is not None, "the probe ran"
    measured = json.loads(html.unescape(found.group(1)))
    assert measured["clientWidth"] >= 1300, measured
    assert measured["scrollWidth"] <= measured["clientWidth"], f"the page overflows at 1400 px: {measured}"
    assert measured["evaluationRight"] <= measured["clientWidth"], measured
    assert measured["lastRight"] <= measured["clientWidth"], measured
    assert measured["flipAlign"] in ("left", "start"), measured
    # The scores as the report prints them.
    row = re.search(r'<tr data-task="pbfix__task0.0000000">(.*?)</tr>', dom, re.S)
    assert row is not None
    assert re.findall(r'<span class="score">([^<]*)</span>', row.group(1)) == ["0.6364", "0.4545"]
    # The difference bar has an axis: -1 at its left end, 0 in the middle, +1 at its right end, and a caption.
    ticks = dict(measured["ticks"])
    left, right = measured["bar"]
    assert list(ticks) == [f"{MINUS}1", f"{MINUS}0.5", "0", "+0.5", "+1"]
    assert abs(ticks[f"{MINUS}1"] - left) <= 2
    assert abs(ticks["0"] - (left + right) / 2) <= 30
    assert ticks["+1"] < right
    assert ticks["+1"] > (left + right) / 2
    assert f"mean score difference, new {MINUS} base" in dom
    # Totals are numbers as a reader writes them; the coverage line says who explored more.
    assert re.search(r'<tr data-total="total_tokens"><td>total tokens</td><td class="num" data-side="base">'
                     r"370,368</td>", dom)
    assert attr_of(dom, "explored", "data-fewer") == "0"
    assert attr_of(dom, "explored", "data-more") == "3"
