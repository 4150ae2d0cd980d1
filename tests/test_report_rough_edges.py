"""report.html's rough edges (issue 32 §4): the failure text inside the report does not send the reader to the report,
and a run that metered no tokens shows no "0 tokens (0 tasks metered)" card."""

from __future__ import annotations

import re
from pathlib import Path

from pytest_programbench.results.report import render
from pytest_programbench.results.summary import RunSummary, TaskRecord
from pytest_programbench.results.verdict import PANEL_POINTER

HEADER = {"run_id": "r", "plugin_version": "0", "programbench_version": "1"}
REASON = "\n".join(["score 0.5000 (1/2) below --pb-min-score 1.0", "branch b: 1 of 2 tests failing",
                    "  t (failure): assert 1 == 2", PANEL_POINTER, "run directory: /x"])


def _page(run: Path, records: list[TaskRecord]) -> str:
    data = RunSummary(run / "summary.json", {**HEADER, "run_dir": str(run)}, records).as_dict()
    return render(run, data, lambda _iid: None)


def test_the_failure_text_in_the_report_does_not_point_at_the_report(tmp_path: Path) -> None:
    record = TaskRecord("t__a.0", "c", "easy", outcome="failed", score=0.5, reasons=[REASON])
    page = _page(tmp_path, [record])
    reason = re.search(r'<pre class="reason">(.*?)</pre>', page, re.S)
    assert reason is not None
    assert reason.group(1).splitlines() == ["score 0.5000 (1/2) below --pb-min-score 1.0",
                                            "branch b: 1 of 2 tests failing", "  t (failure): assert 1 == 2",
                                            "run directory: /x"]
    assert "report.html" not in page.split('<h2>Per task</h2>')[1].split("<script>")[0]


def test_no_tokens_card_when_nothing_was_metered(tmp_path: Path) -> None:
    evaluate_only = _page(tmp_path, [TaskRecord("t__a.0", "c", "easy", outcome="passed", score=1.0)])
    assert 'id="tokens"' not in evaluate_only
    assert "tasks metered" not in evaluate_only
    metered = _page(tmp_path, [TaskRecord("t__a.0", "c", "easy", outcome="passed", score=1.0, meta={
        "relay": {"input_tokens": 10, "output_tokens": 2, "total_tokens": 12}})])
    assert re.search(r'<div class="big" id="tokens">12</div>\s*<div class="label">tokens \(1 tasks metered\)',
                     metered)
