"""results/timeline.py and its place in report.html, from files a run writes, without a session: a six-hour agent's
thousands of requests and calls stay a bounded page, grouped and counted; text from the sandbox is escaped; a run
without recorded phases falls back on progress.jsonl (a session's timeline is checked by tests/test_task_panel.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from pytest_programbench.results import timeline
from pytest_programbench.results.report import render
from pytest_programbench.results.summary import RunSummary, TaskRecord
from tests.conftest import REPO
from tests.test_report import chromium

sys.path.insert(0, str(REPO / "bench"))
import bench_report

HEADER = {"run_id": "r", "plugin_version": "0", "programbench_version": "1"}


def _page(run: Path, records: list[TaskRecord]) -> str:
    data = RunSummary(run / "summary.json", {**HEADER, "run_dir": str(run)}, records).as_dict()
    return render(run, data, lambda _iid: None)


def test_a_long_agent_is_grouped_counted_and_bounded(tmp_path: Path) -> None:
    record = bench_report.write_task(tmp_path / "t__a.0", "t__a.0", 5_000, 20_000)
    built = timeline.build(tmp_path / "t__a.0", events_max=1_500)
    assert built is not None
    assert (built["requests"], built["calls"]) == (5_000, 20_000)
    assert len(built["groups"]) <= timeline.GROUPS_MAX
    assert built["width"] == "0:30:00", "six hours in windows of a round width"
    assert built["shown"] == 1_500
    assert built["left_out"] == 23_500
    assert sum(len(g["rows"]) + g["more_requests"] + g["more_calls"] for g in built["groups"]) == 25_000
    assert sum(g["requests"] for g in built["groups"]) == 5_000
    assert built["retries"] == len(range(0, 5_000, 97))
    assert built["held"] == 2.0 * built["retries"]
    assert built["failed_calls"] == len(range(0, 20_000, 501)), "killed by a signal"
    names = [p["name"] for p in built["phases"]]
    assert names[:5] == ["sandbox", "agent", "pack", "evaluation", "compile"]
    assert names[5:] == [f"branch b{i:02d}" for i in range(10)]
    agent = built["phases"][1]
    assert (agent["offset"], agent["duration"], agent["left"]) == ("0:00:05", "6:00:00", 0.02)
    page = _page(tmp_path, [record])
    assert page.count('<li class="request') + page.count('<li class="call') == 1_500
    assert len(page.encode()) < 400_000, len(page.encode())


def test_the_page_budget_is_shared_by_every_timeline(tmp_path: Path) -> None:
    records = [bench_report.write_task(tmp_path / f"t__{i}.0", f"t__{i}.0", 400, 1_600) for i in range(40)]
    page = _page(tmp_path, records)
    rows = page.count('<li class="request') + page.count('<li class="call')
    assert rows == timeline.PAGE_EVENTS == 40 * (timeline.PAGE_EVENTS // 40)
    left_out = sum(int(n) for n in re.findall(r'<span class="left-out">(\d+)</span>', page))
    assert rows + left_out == 40 * 2_000


def test_saved_when_the_attempt_ended_and_trimmed_to_the_page(tmp_path: Path) -> None:
    """The pipeline saves each attempt's timeline (timeline.json) when it ends; the report trims it to its share,
    the same as building it with that share, and no longer reads the logs."""
    task = tmp_path / "t__s.0"
    record = bench_report.write_task(task, "t__s.0", 700, 2_800)
    timeline.save(task)
    for budget in (40, 333, 1_500):
        built = timeline.build(task, events_max=budget)
        assert built is not None
        assert timeline.trim(json.loads((task / timeline.SAVED).read_text()), budget) == {"version": 1, **built}
    (task / timeline.MODEL_REQUESTS).unlink()
    (task / timeline.BINARY_CALLS).unlink()
    loaded = timeline.load(task, events_max=100)
    assert loaded is not None
    assert (loaded["requests"], loaded["calls"], loaded["shown"]) == (700, 2_800, 100)
    page = _page(tmp_path, [record])
    assert page.count('<li class="request') + page.count('<li class="call') == timeline.ATTEMPT_EVENTS_MAX
    (task / timeline.SAVED).write_text("{not json")
    assert timeline.load(task, events_max=100) is not None, "phases only, from pb-meta.json: built again"


def test_text_from_the_sandbox_is_escaped(tmp_path: Path) -> None:
    task = tmp_path / "t__x.0"
    task.mkdir()
    hostile = '<img src=x onerror="document.title=1">\x1b]0;owned\x07'
    (task / "binary-calls.jsonl").write_text(json.dumps({
        "argv": ["/workspace/binary", hostile, "\u202e"], "time": "2026-11-27T09:00:00Z", "exit": None,
        "signal": None, "error": "</code><script>document.body.id='owned'</script>", "duration_s": 0.5}) + "\n")
    (task / "model-requests.jsonl").write_text(json.dumps({
        "started_at": "2026-11-27T09:00:01.500+00:00", "method": "POST", "path": "/v1/<b>x</b>", "status": 500,
        "total_s": 1.0, "usage": None, "error": "upstream \x1b[31mred", "retries": [{}, {}], "retry_wait_s": 3,
        "slot_wait_s": 1, "rate_wait_s": 0}) + "\n")
    page = _page(tmp_path, [TaskRecord("t__x.0", "c", "easy", outcome="failed", score=0.0)])
    assert "<img" not in page
    assert "<script>document" not in page
    assert "\x1b" not in page
    assert "\u202e" not in page
    report_path = tmp_path / "report.html"
    report_path.write_text(page)
    dom = chromium("--dump-dom", report_path.as_uri(), profile=tmp_path / "chromium").stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None
    assert body.group(0) == "<body>", "nothing from the sandbox ran"
    call = re.search(r'<li class="call failed">(.*?)</li>', dom, re.S)
    request = re.search(r'<li class="request failed">(.*?)</li>', dom, re.S)
    assert call is not None
    assert request is not None
    assert r"\x1b]0;owned\x07" in call.group(1)
    assert r"\u202e" in call.group(1)
    assert "no status (&lt;/code&gt;&lt;script&gt;" in call.group(1)
    assert "&lt;img src=x" in call.group(1)
    assert "500 (upstream \\x1b[31mred) · 1.0 s · <span class=\"tokens\">0</span> tokens · 2 retries · held 4.0 s" \
        in request.group(1)


def test_without_recorded_phases_the_run_history_gives_them(tmp_path: Path) -> None:
    task = tmp_path / "t__p.0"
    task.mkdir()
    (task / "pb-meta.json").write_text(json.dumps({"instance_id": "t__p.0", "timings": {"agent": 3.0}}))
    lines = [(100.0, "starting"), (100.5, "sandbox"), (102.0, "agent"), (105.0, "pack"), (105.5, "evaluation"),
             (106.0, "compile"), (108.0, "branch 1/2"), (110.0, "branch 2/2"), (113.0, "verdict"),
             (113.1, "finished")]
    (tmp_path / "progress.jsonl").write_text("".join(
        json.dumps({"at": at, "worker": "gw0", "task": "t__p.0", "phase": phase}) + "\n" for at, phase in lines)
        + json.dumps({"at": 101.0, "worker": "gw1", "task": "t__other.0", "phase": "agent"}) + "\n")
    built = timeline.build(task, events_max=10, progress=timeline.progress_lines(tmp_path)["t__p.0"])
    assert built is not None
    assert [(p["name"], p["seconds"], p["level"]) for p in built["phases"]] == [
        ("sandbox", 1.5, 0), ("agent", 3.0, 0), ("pack", 0.5, 0), ("evaluation", 0.5, 0), ("compile", 2.0, 1),
        ("branch 1/2", 2.0, 1), ("branch 2/2", 3.0, 1)]
    assert timeline.build(tmp_path / "t__none.0", events_max=10) is None, "nothing recorded: no timeline"
