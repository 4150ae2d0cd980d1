"""--pb-attempts K through real sessions: a seeded stochastic agent, pass@k and the interval recomputed by hand from
the recorded outcomes, Ctrl-C and a resume that fills only the missing attempts; node ids, -k and JUnit."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.results.summary import RunSummary, TaskRecord
from tests.conftest import TESTBED, Testbed
from tests.test_report import attr_of, chromium, text_of

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"
# Three attempts of two tasks (six evaluations): the seed draws rpn good, wrong, wrong and catlike wrong, good, good,
# so each task has a pass@k that grows with k and the interval a spread within each task.
K = 3
SEED = "h9-attempts-1"
# Seeded per task and attempt (PB_ATTEMPT): the known-good solution or the `wrong` variant (a partial score).
STOCHASTIC = (
    f'h=$(printf %s "{SEED}-$PB_TASK_ID-$PB_ATTEMPT" | cksum | cut -d" " -f1); '
    'if [ $((h % 2)) -eq 0 ]; then cp -r /pb-testbed/solutions/$PB_TASK_ID/. .; '
    'else cp -r /pb-testbed/bad/$PB_TASK_ID/wrong/. .; fi'
)


def _argv(workdir: Path, testbed: Testbed, *args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-c", str(workdir / "pytest.ini"), "--rootdir", str(workdir),
            "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-cpus", "2", "--junitxml", str(workdir / "junit.xml"), "-rA",
            "--pb-progress", "off", *args]


def _finished(run_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Every attempt's pb-meta.json that says finished, by (task, attempt)."""
    found = {}
    for meta_path in [*run_dir.glob("*/pb-meta.json"), *run_dir.glob("attempts/*/*/pb-meta.json")]:
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError:
            continue
        if meta.get("state") == "finished":
            found[(meta["instance_id"], int(meta.get("attempt", 1)))] = meta
    return found


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 if n - c < k else 1 - math.comb(n - c, k) / math.comb(n, k)


def _two_level_by_hand(samples: list[list[float]], seed: int, resamples: int, chunk: int) -> tuple[float, float]:
    """The documented two-level bootstrap written out resample by resample (the same random draws, in order)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    width = max(map(len, samples))
    means: list[float] = []
    while len(means) < resamples:
        b = min(chunk, resamples - len(means))
        tasks = rng.integers(0, len(samples), size=(b, len(samples)))
        uniforms = rng.random((b, len(samples), width))
        for r in range(b):
            task_means = []
            for slot, t in enumerate(tasks[r]):
                own = samples[t]
                picked = [own[int(uniforms[r, slot, j] * len(own))] for j in range(len(own))]
                task_means.append(sum(picked) / len(picked))
            means.append(sum(task_means) / len(task_means))
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def test_attempts_stochastic_agent_interrupted_and_resumed(tmp_path: Path, testbed: Testbed) -> None:
    from pytest_programbench.results import attempts, statistics

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run_dir = tmp_path / "run"
    first = _argv(tmp_path, testbed, "-n", "2", "--pb-filter", f"{RPN}|{CATLIKE}", "--pb-attempts", str(K),
                  "--pb-agent", STOCHASTIC, "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-output",
                  str(run_dir))
    out = tmp_path / "first.txt"
    with out.open("wb") as handle:
        proc = subprocess.Popen(first, cwd=tmp_path, stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        # Ctrl-C once some attempts finished and not all: the rest is what the resume must fill.
        deadline = time.monotonic() + 600
        # (three: under -n 2 one of them is a later attempt, whose reuse the resume must find in attempts/<n>/)
        while len(_finished(run_dir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    before = _finished(run_dir)
    assert 3 <= len(before) < 2 * K, out.read_text()[-3000:]
    assert any(a > 1 for _, a in before), before

    resumed = subprocess.run(_argv(tmp_path, testbed, "-n", "2", "--pb-resume", str(run_dir)), cwd=tmp_path,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode in (0, 1), resumed.stdout[-4000:]
    after = _finished(run_dir)
    assert set(after) == {(t, a) for t in (RPN, CATLIKE) for a in range(1, K + 1)}, resumed.stdout[-3000:]
    # Only the missing attempts ran again: a finished one kept its pb-meta.json of the first session (reused).
    first_id = next(iter(before.values()))["run_id"]
    assert {key for key, meta in after.items() if meta["run_id"] == first_id} == set(before)
    assert all(after[key]["outcome"] == before[key]["outcome"] for key in before)
    for (task, attempt), _ in after.items():
        task_dir = run_dir / task if attempt == 1 else run_dir / "attempts" / str(attempt) / task
        assert (task_dir / "submission.tar.gz").is_file()
        assert (task_dir / f"{task}.eval.json").is_file()

    # The stochastic agent's outcomes, as recorded: mixed, so pass@k and the interval have something to estimate.
    scores = {t: [float(after[(t, a)]["outcome"]["score"]) for a in range(1, K + 1)] for t in (RPN, CATLIKE)}
    flat = [s for v in scores.values() for s in v]
    assert 1.0 in flat, scores
    assert any(s < 1.0 for s in flat), scores
    summary = json.loads((run_dir / "summary.json").read_text())
    head = summary["headline"]
    for task, values in scores.items():
        row = summary["tasks"][task]
        c = sum(s >= 1.0 for s in values)  # --pb-min-score 1.0: passed is resolved
        assert row["pass_at_k"] == {str(k): round(_pass_at_k(K, c, k), 6) for k in range(1, K + 1)}
        assert row["resolved_at_k"] == row["pass_at_k"]
        assert row["best"] == max(values)
        assert row["mean"] == round(sum(values) / K, 6)
        assert sorted(row["attempts"]) == [str(a) for a in range(1, K + 1)]
    for k in range(1, K + 1):
        by_hand = sum(_pass_at_k(K, sum(s >= 1.0 for s in v), k) for v in scores.values()) / 2
        assert head["pass_at_k"][str(k)] == round(by_hand, 6)
    means = [sum(scores[t][a] for t in scores) / 2 for a in range(K)]
    assert head["attempt_means"] == [round(m, 6) for m in means]
    spread = math.sqrt(sum((m - sum(means) / K) ** 2 for m in means) / (K - 1))
    assert head["std_across_attempts"] == pytest.approx(spread, abs=1e-6)
    ci = head["mean_over_selection_ci"]
    low, high = _two_level_by_hand([scores[t] for t in sorted(scores)], statistics.SEED, statistics.RESAMPLES,
                                   attempts.CHUNK)
    assert (ci["low"], ci["high"]) == (round(low, 6), round(high, 6))
    assert ci["estimate"] == pytest.approx(sum(flat) / len(flat), abs=1e-6)
    assert ci["resamples"] == statistics.RESAMPLES
    assert "attempts within each" in ci["method"]
    assert "attempts resampled within each task" in ci["over"]
    assert "pass@k (unbiased, mean over tasks)" in resumed.stdout

    # report.html in a browser: the two-level interval as the selection mean's error bar, and per task its mean over
    # the attempts with their range and pass@K, resolved@K, as recorded.
    dom = chromium("--dump-dom", (run_dir / "report.html").as_uri(), profile=tmp_path / "chromium").stdout
    assert (float(attr_of(dom, "ci-mean-over-selection", "data-low")),
            float(attr_of(dom, "ci-mean-over-selection", "data-high"))) == (ci["low"], ci["high"])
    assert "two-level: tasks resampled, then attempts within each drawn task" in \
        text_of(dom, "ci-text-mean-over-selection")
    assert text_of(dom, "pass-at-k").startswith(f"pass@k (unbiased, mean over tasks): k=1 {head['pass_at_k']['1']:.3f}")
    for task, values in scores.items():
        cell = re.search(rf'<tr data-task="{re.escape(task)}">.*?<td class="attempts"([^>]*)>', dom, re.S)
        assert cell is not None, task
        shown = dict(re.findall(r'data-([\w-]+)="([^"]*)"', cell.group(1)))
        c = sum(s >= 1.0 for s in values)
        assert (float(shown["min"]), float(shown["max"]), shown["k"]) == (min(values), max(values), str(K)), shown
        assert float(shown["mean"]) == pytest.approx(sum(values) / K, abs=1e-6)
        assert float(shown["pass-at-k"]) == float(shown["resolved-at-k"]) == pytest.approx(_pass_at_k(K, c, K))
    assert "standard deviation across attempts" in \
        resumed.stdout

    # JUnit: one test case per attempt, named as the node id, with its attempt; the headline as suite properties.
    root = ET.parse(tmp_path / "junit.xml").getroot()
    names = sorted(c.get("name", "") for c in root.iter("testcase"))
    assert names == sorted(f"{t}[attempt-{a}]" for t in (RPN, CATLIKE) for a in range(1, K + 1))
    suite_props = {p.get("name"): p.get("value") for p in root.iter("property")
                   if (p.get("name") or "").startswith("programbench_")}
    assert suite_props["programbench_mean_over_selection_ci_low"] == str(ci["low"])
    assert suite_props["programbench_pass_at_1"] == str(head["pass_at_k"]["1"])


def test_attempt_node_ids_and_keywords(tmp_path: Path, testbed: Testbed) -> None:
    """An attempt named as a node id selects it alone; ``-k attempt-3`` each task's third (collection only)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    common = ["--co", "-q", "--pb-attempts", "3", "--pb-submissions", str(testbed.submissions), "--pb-filter",
              f"{RPN}|{CATLIKE}"]

    def listed(*args: str) -> list[str]:
        proc = subprocess.run(_argv(tmp_path, testbed, *common, *args), cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return sorted(line for line in proc.stdout.splitlines() if line.startswith("programbench::"))

    assert listed(f"programbench::{RPN}[attempt-2]") == [f"programbench::{RPN}[attempt-2]"]
    assert listed(f"programbench::{RPN}") == [f"programbench::{RPN}[attempt-{a}]" for a in (1, 2, 3)]
    assert listed("-k", "attempt-3") == sorted(f"programbench::{t}[attempt-3]" for t in (RPN, CATLIKE))


def test_a_tasks_row_is_its_mean_over_the_attempts(tmp_path: Path) -> None:
    """summary.json's row of a task under --pb-attempts (``RunSummary.task_rows``): the score is the mean over the
    scored attempts (an attempt that errored is left out, not counted as 0); passed when every scored attempt
    passed, failed when one did not; without one scored, error when one errored, else not run."""
    attempts = {
        "pbrow__mixed.0000000": [("passed", 1.0), ("failed", 0.5), ("error", None)],
        "pbrow__passed.0000000": [("passed", 1.0), ("error", None), ("passed", 1.0)],
        "pbrow__failed.0000000": [("failed", 0.25), ("failed", 0.5), ("failed", 0.0)],
        "pbrow__errored.0000000": [("error", None), ("", None), ("error", None)],
        "pbrow__not_run.0000000": [("", None), ("", None), ("", None)],
    }
    records = [TaskRecord(iid, "c", "easy", outcome=outcome, score=score, key=f"{iid}[attempt-{n}]", attempt=n)
               for iid, runs in attempts.items() for n, (outcome, score) in enumerate(runs, 1)]
    summary = RunSummary(tmp_path / "summary.json", {"run_id": "x"}, records, attempts=3)
    rows = {row.instance_id: (row.outcome, row.score) for row in summary.task_rows()}
    assert rows == {
        "pbrow__mixed.0000000": ("failed", 0.75),
        "pbrow__passed.0000000": ("passed", 1.0),
        "pbrow__failed.0000000": ("failed", 0.25),
        "pbrow__errored.0000000": ("error", None),
        "pbrow__not_run.0000000": ("", None),
    }
    assert {iid: (row["outcome"], row["score"]) for iid, row in summary.as_dict()["tasks"].items()} == {
        **{iid: row for iid, row in rows.items() if row[0]}, "pbrow__not_run.0000000": ("not_run", None)}
