"""--pb-gold N through real sessions: the reference evaluated as its own submission on a fixture task with one test
the reference never passes and one it passes on every other run (testbed/gold_tasks/pbfix__coin.c0112ab); the
ledger read back with --pb-gold-ledger and --pb-ignore-flaky on a normal run."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import TESTBED, Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

COIN = "pbfix__coin.c0112ab"
BRANCH = "7a11ed5eed00"
IMPOSSIBLE = f"{BRANCH}/tests.test_coin.test_version_two"
FLAKY = f"{BRANCH}/tests.test_coin.test_every_other_run"
STEADY = f"{BRANCH}/tests.test_coin.test_joins_words"
N = 6


def _run(workdir: Path, testbed: Testbed, *args: str) -> subprocess.CompletedProcess[str]:
    (workdir / "pytest.ini").write_text("[pytest]\n")
    argv = [sys.executable, "-m", "pytest", "-c", str(workdir / "pytest.ini"), "--rootdir", str(workdir),
            "-p", "no:cacheprovider", "--pb-tasks-dir", str(TESTBED / "gold_tasks"), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-cpus", "2", "--pb-filter", COIN, "--pb-progress", "off", "-rA",
            "--junitxml", str(workdir / "junit.xml"), *args]
    return subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=900)


def test_gold_ledger_finds_the_impossible_and_the_flaky_test(tmp_path: Path, testbed: Testbed) -> None:
    run_dir = tmp_path / "gold-run"
    gold = _run(tmp_path, testbed, "-n", "2", "--pb-gold", str(N), "--pb-output", str(run_dir))
    # Every gold run is scored and passes as an item: the hash check's flag is recorded, not a failure.
    assert gold.returncode == 0, gold.stdout[-4000:]
    assert f"{N} passed" in gold.stdout
    ledger = json.loads((run_dir / "gold-ledger.json").read_text())
    assert ledger["gold_runs"] == N
    assert set(ledger["tasks"]) == {COIN}
    entry = ledger["tasks"][COIN]
    assert entry["tests"] == {STEADY: {"passes": N, "runs": N}, FLAKY: {"passes": N // 2, "runs": N},
                              IMPOSSIBLE: {"passes": 0, "runs": N}}
    assert [row["test"] for row in entry["impossible"]] == [IMPOSSIBLE]
    assert [row["test"] for row in entry["flaky"]] == [FLAKY]
    assert any("1.0" in m for m in entry["impossible"][0]["messages"]), entry["impossible"]
    assert any("odd" in m for m in entry["flaky"][0]["messages"]), entry["flaky"]
    # The ceiling: runs 2, 4, 6 pass 2 of 3 tests, runs 1, 3, 5 pass 1 of 3.
    assert entry["scores"] == [round(1 / 3, 6) if n % 2 else round(2 / 3, 6) for n in range(1, N + 1)]
    assert entry["ceiling"] == pytest.approx(0.5, abs=1e-6)
    assert all(any("reference_executable" in f for f in flags) for flags in entry["flags"]), entry["flags"]
    ignored = entry["ignore_lists"][BRANCH]["ignored_tests"]
    assert sorted(t["name"] for t in ignored) == sorted(t.split("/", 1)[1] for t in (IMPOSSIBLE, FLAKY))
    assert all(t["reasons"][0]["id"] == "gold_flaky" for t in ignored)
    # Each gold run: the reference's bytes and the installing compile.sh, in gold/<n>/<id>/.
    with tarfile.open(run_dir / "gold" / "3" / COIN / "submission.tar.gz") as tar:
        assert sorted(tar.getnames()) == [".pb-gold-run", "compile.sh", "reference.bin"]
    assert "impossible: " + IMPOSSIBLE in gold.stdout
    assert "flaky: " + FLAKY in gold.stdout

    # The ledger read back: gold run 1's submission (the odd one) evaluated normally, the ceiling beside its score,
    # --pb-ignore-flaky's score beside the official one (which the verdict and the headline keep).
    normal = _run(tmp_path, testbed, "--pb-submissions", str(run_dir / "gold" / "1"), "--pb-output",
                  str(tmp_path / "normal"), "--pb-gold-ledger", str(run_dir / "gold-ledger.json"),
                  "--pb-ignore-flaky")
    assert normal.returncode == 1, normal.stdout[-3000:]  # 1/3 is below --pb-min-score 1.0 (and flagged)
    task = json.loads((tmp_path / "normal" / "summary.json").read_text())["tasks"][COIN]
    assert task["score"] == pytest.approx(1 / 3, abs=1e-6)
    assert task["gold_ceiling"] == pytest.approx(0.5)
    assert task["score_ignoring_gold_flaky"] == pytest.approx(1.0)
    case = next(ET.parse(tmp_path / "junit.xml").getroot().iter("testcase"))
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert float(props["gold_ceiling"]) == pytest.approx(0.5)
    assert float(props["score"]) == pytest.approx(1 / 3)
