"""--pb-gold N through real sessions: the reference evaluated as its own submission on a fixture task with one test
the reference never passes and one it passes on every other run (testbed/gold_tasks/pbfix__coin.c0112ab), whose
task.yaml lists the reference's sha256 in eval_clean_hashes as 161 of the 200 real tasks do; the ledger read back with
--pb-gold-ledger and --pb-ignore-flaky on a normal run; a gold run whose reference does not build is an error."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shlex
import shutil
import tarfile
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.conftest import TESTBED, Testbed
from tests.docs_text import fenced, section

# users_defaults: the docs' commands run as written
pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.users_defaults]

COIN = "pbfix__coin.c0112ab"
BRANCH = "7a11ed5eed00"
IMPOSSIBLE = f"{BRANCH}/tests.test_coin.test_version_two"
FLAKY = f"{BRANCH}/tests.test_coin.test_every_other_run"
STEADY = f"{BRANCH}/tests.test_coin.test_joins_words"
N = 6




IMAGE = "programbench/pbfix_1776_coin.c0112ab"


def reference_sha256(docker_client: Any, image: str) -> str:
    """sha256 of the image's /workspace/executable, read out of a created (never started) container."""
    container = docker_client.containers.create(image, ["true"], network_mode="none",
                                                labels={"pytest-programbench.testbed-check": "1"})
    try:
        stream, _stat = container.get_archive("/workspace/executable")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.extractfile("executable")
            assert member is not None
            return hashlib.sha256(member.read()).hexdigest()
    finally:
        container.remove(force=True)


def test_the_readme_commands_gold_ledger_and_attempts(pytester: pytest.Pytester, testbed: Testbed,
                                                      docker_client: Any) -> None:
    """The docs' commands as written, in a directory whose pytest.ini points at the gold fixture task: --pb-gold 6
    finds exactly the impossible and the flaky test with the right ceiling; then gold run 1's submission (an odd run:
    the flaky test fails) evaluated in 3 attempts with the ledger read back and --pb-ignore-flaky."""
    # The real case: the official deletes every submitted file with the reference's bytes before compile.sh.
    reference = reference_sha256(docker_client, f"{IMAGE}:task_cleanroom_v6")
    task_yaml = yaml.safe_load((TESTBED / "gold_tasks" / COIN / "task.yaml").read_text())
    assert task_yaml["eval_clean_hashes"] == [reference], "task.yaml's eval_clean_hashes is not the image's reference"
    pytester.makeini(f"""
        [pytest]
        addopts = -p no:cacheprovider -rA --junitxml=junit.xml
        pb_tasks_dir = {TESTBED / "gold_tasks"}
        pb_blob_dir = {testbed.blob_dir}
        pb_filter = {COIN}
        pb_cpus = 2
        pb_progress = off
    """)
    commands = [shlex.split(c) for c in fenced(section("attempts.md", "Attempts, and the reference's own noise"))]
    assert [c[:2] for c in commands] == [["pytest", "--pb-gold"], ["pytest", "--pb-submissions"]], commands
    gold = pytester.runpytest_subprocess(*commands[0][1:], timeout=900)
    run_dir = pytester.path / "pb-runs" / "gold"
    # Every gold run is scored and passes as an item: the hash check's flag is recorded, not a failure.
    gold.assert_outcomes(passed=N)
    assert gold.ret == pytest.ExitCode.OK
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
    # Each gold run: the reference's bytes behind a header and the compile.sh that restores them, in gold/<n>/<id>/;
    # the official's hash clean-up ran and removed nothing, and what was built is the reference.
    with tarfile.open(run_dir / "gold" / "3" / COIN / "submission.tar.gz") as tar:
        assert sorted(tar.getnames()) == [".pb-gold-run", "compile.sh", "reference.gold"]
    for n in range(1, N + 1):
        eval_json = json.loads((run_dir / "gold" / str(n) / COIN / f"{COIN}.eval.json").read_text())
        assert eval_json["executable_hash"] == reference
        clean_up = [step for step in eval_json["log"] if step["step"] == "remove_hashed_files"]
        assert len(clean_up) == 1, eval_json["log"]
        assert "removed" not in clean_up[0]["output"], clean_up
    gold.stdout.fnmatch_lines(["*= programbench gold ledger =*", f"  impossible: {IMPOSSIBLE} (0/{N})*",
                               f"  flaky: {FLAKY} ({N // 2}/{N})*"])

    # The ledger read back on a normal run: gold run 1's submission (odd: 1/3) in 3 attempts, the ceiling beside
    # each score, --pb-ignore-flaky's score beside the official one (which the verdict and the headline keep).
    candidate = pytester.path / "runs" / "candidate" / COIN
    candidate.mkdir(parents=True)
    shutil.copy(run_dir / "gold" / "1" / COIN / "submission.tar.gz", candidate / "submission.tar.gz")
    normal = pytester.runpytest_subprocess(*commands[1][1:], timeout=900)
    normal.assert_outcomes(failed=3)  # 1/3 is below --pb-min-score 1.0 (and the hash check flags it)
    summary = json.loads(next((pytester.path / "pb-runs").glob("2*/summary.json")).read_text())  # not gold/
    task = summary["tasks"][COIN]
    assert task["score"] == pytest.approx(1 / 3, abs=1e-6)
    assert summary["headline"]["mean_over_selection"] == pytest.approx(1 / 3, abs=1e-6)
    for attempt in ("1", "2", "3"):
        assert task["attempts"][attempt]["gold_ceiling"] == pytest.approx(0.5)
        assert task["attempts"][attempt]["score_ignoring_gold_flaky"] == pytest.approx(1.0)
    assert (task["gold_ceiling"], task["score_ignoring_gold_flaky"]) == (pytest.approx(0.5), pytest.approx(1.0))
    cases = list(ET.parse(pytester.path / "junit.xml").getroot().iter("testcase"))
    assert len(cases) == 3
    for case in cases:
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert float(props["gold_ceiling"]) == pytest.approx(0.5)
        assert float(props["score"]) == pytest.approx(1 / 3)
    # The ceiling beside the score in the terminal summary and in report.html's table.
    normal.stdout.fnmatch_lines(["score against the gold ceiling (--pb-gold-ledger):",
                                 f"  {COIN}: score 0.333 of gold ceiling 0.500, 1.000 ignoring the ledger's "
                                 "impossible and flaky tests"])
    page = (next((pytester.path / "pb-runs").glob("2*/summary.json")).parent / "report.html").read_text()
    row = re.search(rf'<tr data-task="{re.escape(COIN)}">.*?</tr>', page, re.S)
    assert row is not None
    assert re.search(r'<td class="num ceiling" data-sort="0.5">0.5000<br>.*?ignoring flaky 1.0000</span></td>',
                     row.group(0), re.S), row.group(0)

    # A comparison the ledger explains: the odd run against gold run 2's submission (even: the flaky test passes),
    # two finished runs compared with the ledger: the one flip is marked flaky.
    odd_run = next((pytester.path / "pb-runs").glob("2*/summary.json")).parent
    even = pytester.path / "runs" / "even" / COIN
    even.mkdir(parents=True)
    shutil.copy(run_dir / "gold" / "2" / COIN / "submission.tar.gz", even / "submission.tar.gz")
    even_run = pytester.path / "pb-runs" / "even"
    pytester.runpytest_subprocess("--pb-submissions", str(even.parent), "--pb-output", str(even_run), timeout=900)
    compared = pytester.runpytest_subprocess("--pb-compare", f"{odd_run},{even_run}", "--pb-gold-ledger",
                                             str(run_dir / "gold-ledger.json"), timeout=300)
    assert compared.ret == pytest.ExitCode.OK, compared.stdout.str()[-3000:]
    row = json.loads((even_run / "compare.json").read_text())["tasks"][COIN]
    assert row["pass_to_fail"] == []
    assert [(f["test"], f["flaky"]) for f in row["fail_to_pass"]] == [(FLAKY, True)]


@pytest.fixture
def image_without_tail(docker_client: Any) -> Iterator[str]:
    """A tag of the coin image in which compile.sh cannot restore the reference (no ``tail``); ours, removed after."""
    tag = f"pb-test-notail-{uuid.uuid4().hex[:8]}"
    dockerfile = f"FROM {IMAGE}:task_cleanroom_v6\nRUN rm /usr/bin/tail\n".encode()
    docker_client.images.build(fileobj=io.BytesIO(dockerfile), tag=f"{IMAGE}:{tag}", network_mode="none", rm=True,
                               labels={"pytest-programbench.testbed-check": "1"})
    try:
        yield tag
    finally:
        docker_client.images.remove(f"{IMAGE}:{tag}", noprune=False)


def test_a_gold_run_whose_reference_does_not_build_is_an_error(pytester: pytest.Pytester, testbed: Testbed,
                                                               image_without_tail: str) -> None:
    """Compile fails (the image has no ``tail``): each gold run is an error, unscored, in no ledger: never a pass with
    every test declared impossible."""
    run_dir = pytester.path / "gold"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-gold", "2", "--pb-tasks-dir", str(TESTBED / "gold_tasks"),
        "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter", COIN, "--pb-image-tag", image_without_tail,
        "--pb-pull", "never", "--pb-cpus", "2", "--pb-progress", "off", "--pb-output", str(run_dir), timeout=900)
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*--pb-gold: the reference did not reach ./executable (compile_failed*tail*"])
    assert json.loads((run_dir / "gold-ledger.json").read_text())["tasks"] == {}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["headline"]["errors"], summary["headline"]["scored"]) == (1, 0), summary["headline"]
    for n in (1, 2):
        meta = json.loads((run_dir / "gold" / str(n) / COIN / "pb-meta.json").read_text())
        assert meta["state"] == "error", meta
        assert "outcome" not in meta, meta
