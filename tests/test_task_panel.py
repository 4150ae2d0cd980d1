"""What a user reads about one task, through real sessions on the test bed: an agent that asks a scripted model once
(tests/scripted_llm.py, through the relay), calls the reference at /workspace/binary and then writes the catlike
solution. A one-attempt run and a ``--pb-attempts 2`` run (attempt 2 also tries ``-E`` and writes the partly wrong
variant, so the attempts differ), then ``--pb-compare`` of the two (what it writes and prints).

* Attempts keep their numbers: summary.json's row of an attempts run holds each number as the mean over its attempts,
  compare has every delta, report.html in headless Chromium fills every column and lists each attempt.
* The task panel's timeline: the phases, the model request (its tokens) and the call of the reference (its argv).
* Exploration coverage: the hidden tests of catlike pass ``-n`` and ``-E``: the one-attempt run tried ``-n`` (counted)
  and never ``-E`` (named); attempt 2 tried both.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.results import compare
from tests.conftest import GUARD_PLUGIN, MACHINE_CACHE, REPO, SESSION_DEFAULTS_PLUGIN, TESTBED, Testbed
from tests.scripted_llm import ScriptedLLM, Turn
from tests.session_defaults import KEEP_AUDIT
from tests.test_first_hour import RELAY_AGENT
from tests.test_report import chromium, text_of

CATLIKE = "pbfix__catlike.c47c47c"
PROMPT, COMPLETION = 321, 12
PRICE = "2,10"  # USD per million input, output tokens
# The model once, the reference twice with -n (its stdin a pipe), attempt 2 with -E too; then the solution (attempt 2:
# the partly wrong variant).
AGENT = ("python3 /pb-agent/relay_agent.py && printf 'a\\nb\\n' | /workspace/binary -n > /dev/null && "
         "printf 'c\\n' | /workspace/binary -n - > /dev/null && "
         'if [ "${PB_ATTEMPT:-1}" = 2 ]; then /workspace/binary -E < /dev/null > /dev/null 2>&1; '
         "cp -r /pb-testbed/bad/$PB_TASK_ID/wrong/. .; else cp -r /pb-testbed/solutions/$PB_TASK_ID/. .; fi")


@dataclass(frozen=True)
class Runs:
    base: Path  # one attempt
    new: Path  # --pb-attempts 2
    compared: str  # what pytest --pb-compare base,new prints
    profile: Path  # Chromium's profile directory

    def summary(self, run: Path) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((run / "summary.json").read_text())
        return data

    def dom(self, page: Path, *extra: str) -> str:
        return chromium(*extra, "--dump-dom", page.as_uri(), profile=self.profile).stdout


def _env() -> dict[str, str]:
    """The sessions' environment as conftest.py's autouse fixtures make it for a test (they are per test)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROGRAMBENCH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTEST_PLUGINS"] = f"{GUARD_PLUGIN},{SESSION_DEFAULTS_PLUGIN}"
    env.pop(KEEP_AUDIT, None)
    env["XDG_CACHE_HOME"] = MACHINE_CACHE
    return env


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-c", str(cwd / "pytest.ini"), "--rootdir", str(cwd),
                           "-p", "no:cacheprovider", *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed) -> Runs:
    return make_runs(tmp_path_factory.mktemp("task-panel"), testbed)


def make_runs(work: Path, testbed: Testbed) -> Runs:
    """The two sessions and their comparison, in ``work``."""
    (work / "pytest.ini").write_text("[pytest]\n")
    agent_dir = work / "agent"
    agent_dir.mkdir(mode=0o755)
    agent_dir.chmod(0o755)  # the agent user reads it through the mount
    (agent_dir / "relay_agent.py").write_text(RELAY_AGENT)
    (agent_dir / "relay_agent.py").chmod(0o644)
    base, new = work / "base", work / "new"
    common = ["--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter",
              CATLIKE, "--pb-pull", "never", "--pb-cpus", "2", "--pb-progress", "off", "--pb-agent", AGENT,
              "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-agent-mount", f"{agent_dir}:/pb-agent",
              "--pb-token-price", PRICE, "--pb-min-score", "0.5"]
    with ScriptedLLM([Turn("I will write the solution.", "true", PROMPT, COMPLETION)]) as llm:
        first = _pytest(work, *common, "--pb-model-endpoint", llm.base_url, "--pb-output", str(base))
        assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
        second = _pytest(work, *common, "--pb-model-endpoint", llm.base_url, "--pb-output", str(new),
                         "--pb-attempts", "2", "-n", "2")
        assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
        assert len(llm.requests) == 3, "once per attempt"
    # What `pytest --pb-compare BASE,NEW` writes and prints (its front door, results/compare.py's write, called here:
    # test_compare.py runs that command as the docs write it).
    written = compare.write(base, new)
    assert written.gate_failure == ""
    return Runs(base, new, "\n".join(written.lines()), work / "chromium")


def _meta(run: Path, attempt: int = 1) -> dict[str, Any]:
    task_dir = run / CATLIKE if attempt == 1 else run / "attempts" / str(attempt) / CATLIKE
    data: dict[str, Any] = json.loads((task_dir / "pb-meta.json").read_text())
    return data


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# -------------------------------------------------------------------------------------- attempts keep their numbers


def test_an_attempts_run_keeps_every_number_as_the_mean_over_attempts(runs: Runs) -> None:
    row = runs.summary(runs.new)["tasks"][CATLIKE]
    attempts = [row["attempts"][n] for n in ("1", "2")]
    metas = [_meta(runs.new, 1), _meta(runs.new, 2)]
    assert attempts[0]["score"] == 1.0
    assert attempts[1]["score"] < 1.0, "the attempts differ"
    # Each number the one-attempt run's row has, here the mean over the two attempts' own.
    for phase in ("sandbox", "agent", "pack", "evaluation"):
        assert row["timings"][phase] == pytest.approx(_mean([m["timings"][phase] for m in metas]), abs=1e-3), phase
        assert all(a["timings"][phase] == m["timings"][phase] for a, m in zip(attempts, metas, strict=True))
    assert row["n_passed"] == _mean([a["n_passed"] for a in attempts])
    assert row["n_tests"] == attempts[0]["n_tests"] == attempts[1]["n_tests"]
    assert row["tokens"]["total_tokens"] == PROMPT + COMPLETION == attempts[0]["tokens"]["total_tokens"]
    assert row["cost_usd"] == pytest.approx(_mean([a["cost_usd"] for a in attempts]))
    assert row["cost_usd"] == pytest.approx((PROMPT * 2 + COMPLETION * 10) / 1e6)
    assert row["duration"] == pytest.approx(_mean([a["duration"] for a in attempts]), abs=1e-3)
    assert row["coverage"]["covered"] == 1.5
    assert row["coverage"]["by_attempt"] == [1, 2]
    # Nothing the one-attempt row fills is empty here.
    single = runs.summary(runs.base)["tasks"][CATLIKE]
    for key, value in single.items():  # every number (the agent's exit status is each attempt's own)
        if isinstance(value, int | float | dict) and value != {} and key != "agent_exit":
            assert isinstance(row.get(key), type(value) if isinstance(value, dict) else int | float), key


def test_compare_of_a_one_attempt_run_and_an_attempts_run_has_every_delta(runs: Runs) -> None:
    result = json.loads((runs.new / "compare.json").read_text())
    task = result["tasks"][CATLIKE]
    base, new = runs.summary(runs.base)["tasks"][CATLIKE], runs.summary(runs.new)["tasks"][CATLIKE]
    for phase in ("agent", "evaluation"):
        assert task[f"{phase}_seconds_delta"] == pytest.approx(new["timings"][phase] - base["timings"][phase],
                                                               abs=1e-2)
        assert result["totals"][f"{phase}_seconds"]["new"] == pytest.approx(new["timings"][phase], abs=1e-2)
    assert task["tokens_delta"] == 0
    assert task["cost_delta"] == pytest.approx(new["cost_usd"] - base["cost_usd"])
    assert result["totals"]["total_tokens"] == {"base": PROMPT + COMPLETION, "new": PROMPT + COMPLETION,
                                                "delta": 0, **({"missing": []} if "missing" in
                                                               result["totals"]["total_tokens"] else {})}
    out = runs.compared
    times = re.search(r"agent ([\d.]+) s -> ([\d.]+) s; evaluation ([\d.]+) s -> ([\d.]+) s", out)
    assert times is not None, out[-3000:]
    assert all(float(t) > 0 for t in times.groups()), times.group(0)
    # Did the new agent explore more? One task, 1 of 2 options tried before, 1.5 of 2 (the mean) now.
    assert task["coverage"] == {"total": 2, "base": 1, "new": 1.5, "delta": 0.5, "newly_tried": ["-E"],
                                "no_longer_tried": []}
    assert ("options the hidden tests pass, tried by the agent: 1/2 (50%) -> 1.5/2 (75%); over the 1 task(s) both "
            "measured, 1 explored more, 0 less, 0 as much") in out


def _cells(table_row: str) -> list[str]:
    """A table row's cells as the reader sees their text."""
    return [" ".join(html.unescape(re.sub(r"<[^>]+>", " ", c)).split())
            for c in re.findall(r"<td[^>]*>(.*?)</td>", table_row, re.S)]


def test_the_report_of_an_attempts_run_fills_every_column(runs: Runs) -> None:
    report = runs.new / "report.html"
    dom = runs.dom(report)
    header = re.search(r'<table id="tasks"[^>]*>.*?<thead>(.*?)</thead>', dom, re.S)
    assert header is not None
    names = [html.unescape(re.sub(r"<[^>]+>", "", h)).strip() for h in re.findall(r"<th[^>]*>(.*?)</th>",
                                                                                  header.group(1), re.S)]
    row = re.search(rf'<tr data-task="{re.escape(CATLIKE)}">(.*?)</tr>', dom, re.S)
    assert row is not None
    cells = dict(zip(names, _cells(row.group(1)), strict=True))
    summary = runs.summary(runs.new)["tasks"][CATLIKE]
    for name in ("score", "over attempts", "tests", "agent time", "eval time", "tokens", "cost", "model retries",
                 "options tried"):
        assert cells[name] not in ("", "-"), (name, cells)
    assert cells["tests"] == f"{summary['n_passed']:g}/{summary['n_tests']:g}"
    assert cells["tokens"] == f"{PROMPT + COMPLETION:,}"
    assert cells["options tried"] == "1.5/2"
    panel = re.search(rf'<details[^>]*id="task-{re.escape(CATLIKE)}".*?</details>\s*(?=<details class="task"|<p)',
                      dom, re.S)
    assert panel is not None
    summary_line = text_of(dom, f"task-{CATLIKE}").splitlines()[0]
    tests = f"{summary['n_passed']:g}/{summary['n_tests']:g}"
    assert f"score {summary['score']:.4f} ({tests} tests; each the mean over 2 attempts)" in summary_line, summary_line
    assert " (-)" not in summary_line
    # Each attempt's own numbers, every column filled.
    table = re.search(r'<table class="attempts">.*?<thead>(.*?)</thead>(.*?)</table>', panel.group(0), re.S)
    assert table is not None
    columns = [html.unescape(re.sub(r"<[^>]+>", "", h)).strip() for h in re.findall(r"<th[^>]*>(.*?)</th>",
                                                                                    table.group(1), re.S)]
    rows = re.findall(r'<tr data-attempt="(\d)">(.*?)</tr>', table.group(2), re.S)
    assert [n for n, _ in rows] == ["1", "2"]
    for n, body in rows:
        shown = dict(zip(columns, _cells(body), strict=True))
        attempt = summary["attempts"][n]
        assert shown["score"] == f"{attempt['score']:.4f}"
        assert shown["tests"] == f"{attempt['n_passed']}/{attempt['n_tests']}"
        assert shown["options tried"] == f"{n}/2"
        for name in ("agent time", "eval time", "tokens", "cost", "model retries", "agent exit"):
            assert shown[name] not in ("", "-"), (n, name, shown)
    # And a timeline per attempt.
    assert 'id="timeline-pbfix__catlike.c47c47c-attempt-1"' in dom
    assert 'id="timeline-pbfix__catlike.c47c47c-attempt-2"' in dom


# ------------------------------------------------------------------------------------------------------ timeline


def test_the_task_panel_shows_a_timeline_of_phases_model_requests_and_calls(runs: Runs) -> None:
    # Built when the item ended (the session's end reads it), for every attempt.
    for task_dir in (runs.base / CATLIKE, runs.new / CATLIKE, runs.new / "attempts" / "2" / CATLIKE):
        saved = json.loads((task_dir / "timeline.json").read_text())
        assert (saved["requests"], saved["calls"]) == (1, 3 if "attempts" in task_dir.parts else 2), task_dir
    report = runs.base / "report.html"
    dom = runs.dom(report)
    # the timeline closes after its last window's details, the panel's last block
    block = re.search(rf'<details class="timeline" id="timeline-{re.escape(CATLIKE)}">(.*?)</details>\s*</details>',
                      dom, re.S)
    assert block is not None, "the task panel has its timeline"
    timeline = block.group(1)
    assert re.search(r'<span class="n-requests">1</span> model request', timeline)
    assert re.search(r'<span class="n-calls">2</span> call\(s\) of the reference', timeline)
    phases = [html.unescape(p) for p in re.findall(r'<tr class="lvl\d" data-phase="([^"]+)">', timeline)]
    meta = _meta(runs.base)
    branches = [f"branch {b}" for b in sorted(meta["blobs"]["sha256"])]
    for name in ("sandbox", "agent", "pack", "evaluation", "compile", *branches):
        assert name in phases, (name, phases)
    assert phases.index("sandbox") < phases.index("agent") < phases.index("pack") < phases.index("evaluation") \
        < phases.index("compile") < min(phases.index(b) for b in branches)
    request = re.search(r'<li class="request">(.*?)</li>', timeline, re.S)
    assert request is not None
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", request.group(1))).split())
    assert re.fullmatch(rf"\+0:00:\d\d request POST /\S*chat/completions → 200 · [\d.]+ s · {PROMPT + COMPLETION} "
                        r"tokens · 0 retries · held 0.0 s", text), text
    calls = [" ".join(html.unescape(re.sub(r"<[^>]+>", " ", c)).split())
             for c in re.findall(r'<li class="call">(.*?)</li>', timeline, re.S)]
    assert len(calls) == 2, calls
    assert re.fullmatch(r"\+0:00:\d\d call /workspace/binary -n → exit 0 · [\d.]+ s", calls[0]), calls
    assert re.fullmatch(r"\+0:00:\d\d call /workspace/binary -n - → exit 0 · [\d.]+ s", calls[1]), calls


# ------------------------------------------------------------------------------------------------------ coverage


def test_coverage_names_the_options_never_tried_and_counts_those_tried(runs: Runs) -> None:
    base = runs.summary(runs.base)
    row = base["tasks"][CATLIKE]["coverage"]
    assert (row["total"], row["covered"], row["never_tried"], row["tried"]) == (2, 1, ["-E"], ["-n"])
    assert row["calls"] == 2
    assert row["sources"] >= 2, "every Python source of the active branches parsed"
    assert base["coverage"] == {"tasks": 1, "covered": 1, "total": 2, "fraction": 0.5, "mean_fraction": 0.5}
    attempt_two = _meta(runs.new, 2)["coverage"]
    assert (attempt_two["covered"], attempt_two["never_tried"]) == (2, [])
    dom = runs.dom(runs.base / "report.html")
    assert text_of(dom, "coverage") == "1/2"
    panel = re.search(rf'<details[^>]*id="task-{re.escape(CATLIKE)}".*?<details class="coverage"[^>]*>(.*?)</details>',
                      dom, re.S)
    assert panel is not None
    never = re.search(r'<ul class="options never-tried">(.*?)</ul>', panel.group(1), re.S)
    tried = re.search(r'<ul class="options tried">(.*?)</ul>', panel.group(1), re.S)
    assert never is not None
    assert tried is not None
    assert re.findall(r"<code>([^<]+)</code>", never.group(1)) == ["-E"]
    assert re.findall(r"<code>([^<]+)</code>", tried.group(1)) == ["-n"]
    assert re.search(r'<b class="covered">1</b> of <b class="total">2</b> tried by the agent', panel.group(1))
