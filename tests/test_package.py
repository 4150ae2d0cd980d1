"""``--pb-package``: a real run (an agent that calls a scripted model through the relay, then writes a good or a
partly wrong solution) packaged at its end, and the result checked by the official CLI (``programbench submit verify``,
tier 0, and tier 1 re-evaluating a task with programbench's own evaluator); what the official tool leaves as TODO
filled from the run's records; ``pytest --pb-resume RUN_DIR --pb-package`` packages a finished run again.

The official tools know only programbench's packaged tasks; tests/official_catalogue.py points them at the test
bed's tasks (their code unchanged), since the benchmark's own tasks cannot run offline here."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests import official_catalogue
from tests.conftest import REPO, TESTBED, Testbed
from tests.scripted_llm import ScriptedLLM, Turn
from tests.test_first_hour import RELAY_AGENT

pytestmark = pytest.mark.usefixtures("clean_env")

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"
SECRET = "hunter2-not-for-the-submission"
# Both tasks call the model once; catlike gets the partly wrong variant, rpn the good solution.
AGENT = ("python3 /pb-agent/relay_agent.py && if [ \"$PB_TASK_ID\" = " + CATLIKE + " ]; then "
         "cp -r /pb-testbed/bad/$PB_TASK_ID/wrong/. .; else cp -r /pb-testbed/solutions/$PB_TASK_ID/. .; fi")
PROMPT, COMPLETION = 123, 45
PRICE_IN, PRICE_OUT = 1.0, 2.0


def official(testbed: Testbed, *args: str) -> subprocess.CompletedProcess[str]:
    """The official CLI (``programbench ...``) with the test bed's tasks as its catalogue."""
    return official_catalogue.run_cli(list(args), cwd=REPO, tasks_dir=testbed.tasks_dir, blob_dir=testbed.blob_dir)


@pytest.fixture
def llm() -> Iterator[ScriptedLLM]:
    with ScriptedLLM([Turn("I will write the solution.", "true", PROMPT, COMPLETION)]) as server:
        yield server


def test_a_run_packaged_and_verified_by_the_official_cli(pytester: pytest.Pytester, testbed: Testbed,
                                                         monkeypatch: pytest.MonkeyPatch, llm: ScriptedLLM) -> None:
    monkeypatch.setenv(official_catalogue.ENV, str(testbed.tasks_dir))  # the sessions' in-process package_run
    agent_dir = pytester.mkdir("agent")
    (agent_dir / "relay_agent.py").write_text(RELAY_AGENT)
    agent_dir.chmod(0o755)
    (agent_dir / "relay_agent.py").chmod(0o644)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "tests.official_catalogue", "--pb-tasks-dir", str(testbed.tasks_dir),
        "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter", f"{CATLIKE}|{RPN}", "--pb-pull", "never",
        "--pb-cpus", "2", "--pb-output", str(run_dir), "--pb-agent", AGENT, "--pb-model", "scripted-org/scripted",
        "--pb-model-endpoint", llm.base_url, "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-agent-mount",
        f"{agent_dir}:/pb-agent", "--pb-agent-env", f"PB_SOME_TOKEN={SECRET}", "--pb-token-price",
        f"{PRICE_IN},{PRICE_OUT}", "--pb-package", "-n", "2", timeout=900)
    assert len(llm.requests) == 2
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*= programbench package =*", f"packaged 2 task(s) in {run_dir}*"])

    verified = official(testbed, "submit", "verify", str(run_dir))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "Tier-0: 2/2 checks consistent" in verified.stdout
    # Tier 1: programbench's own evaluator rebuilds the partly wrong task from its submission.tar.gz and scores it
    # as our run did.
    tier1 = official(testbed, "submit", "verify", str(run_dir), "--tier1", "--filter", CATLIKE)
    assert tier1.returncode == 0, tier1.stdout + tier1.stderr
    assert "Tier-1: 1/1 checks consistent" in tier1.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["tasks"][CATLIKE]["score"] < 1

    # What the official tool leaves as TODO.
    text = (run_dir / "submission.yaml").read_text()
    assert SECRET not in text, "an --pb-agent-env value never reaches the submission"
    manifest = yaml.safe_load(text)
    assert manifest["system"]["agent"] == AGENT
    assert manifest["system"]["model"] == "scripted-org/scripted"
    assert manifest["system"]["provider"] == "scripted-org"
    assert manifest["submitter"]["name"] == "TODO", "no run knows who submits it"
    harness = manifest["harness"]
    assert harness["version"] == version("pytest-programbench")
    assert harness["programbench_version"] == version("programbench")
    assert harness["model_endpoint"] == llm.base_url
    assert harness["model_server_tools"] == "refused"  # the cleanroom relay: provider-side tools were refused
    assert harness["trajectories"] == {iid: f"{iid}/agent.log" for iid in (CATLIKE, RPN)}
    assert "--pb-package" in harness["command"]
    assert "PB_SOME_TOKEN=..." in harness["command"]
    record = json.loads((run_dir / "pb-run.json").read_text())
    assert harness["run_id"] == record["run_id"]
    assert harness["started"] <= harness["finished"]
    stats = run_dir / "_stats"
    assert set(json.loads((stats / "score.json").read_text())) == {CATLIKE, RPN}
    assert json.loads((stats / "calls.json").read_text()) == {CATLIKE: 1, RPN: 1}
    # The registry's tokens column: the output tokens the relay metered, per task.
    assert json.loads((stats / "tokens.json").read_text()) == {CATLIKE: COMPLETION, RPN: COMPLETION}
    expected_cost = round((PROMPT * PRICE_IN + COMPLETION * PRICE_OUT) / 1e6, 6)
    assert json.loads((stats / "cost.json").read_text()) == {CATLIKE: expected_cost, RPN: expected_cost}
    # The shipped script recomputes them from the run's files.
    written = {name: (stats / f"{name}.json").read_text() for name in ("calls", "cost", "tokens")}
    for name in written:
        (stats / f"{name}.json").unlink()
    rerun = subprocess.run([sys.executable, str(run_dir / "_scripts" / "pb_stats.py"), str(run_dir)],
                           capture_output=True, text=True, timeout=60, check=True)
    assert rerun.stdout.splitlines() == ["_stats/calls.json: 2 tasks", "_stats/cost.json: 2 tasks",
                                         "_stats/tokens.json: 2 tasks"]
    assert {name: (stats / f"{name}.json").read_text() for name in written} == written

    # The official package again keeps the filled system fields and drops our block; --pb-resume RUN_DIR
    # --pb-package (nothing left to run) writes it again.
    again = official(testbed, "submit", "package", str(run_dir))
    assert again.returncode == 0, again.stdout + again.stderr
    manifest = yaml.safe_load((run_dir / "submission.yaml").read_text())
    assert "harness" not in manifest
    assert manifest["system"]["agent"] == AGENT
    resumed = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "tests.official_catalogue",
                                            "--pb-resume", str(run_dir), "--pb-package", "--pb-agent-env",
                                            "PB_SOME_TOKEN=again", timeout=600)  # values are never recorded
    resumed.assert_outcomes(passed=1, failed=1)
    resumed.stdout.fnmatch_lines([f"packaged 2 task(s) in {run_dir}*"])
    assert yaml.safe_load((run_dir / "submission.yaml").read_text())["harness"]["trajectories"] == harness[
        "trajectories"]
    assert official(testbed, "submit", "verify", str(run_dir)).returncode == 0


def test_tokens_json_holds_metered_tasks_only_and_the_package_says_which_are_not(tmp_path: Path) -> None:
    """``_stats/tokens.json`` (the registry's tokens column): a task whose relay metered usage is in it; a task run
    without a relay, or whose answers carried no usage, is not (never a 0), and the package's summary names them."""
    from pytest_programbench.results import pb_stats
    from pytest_programbench.results.package import Packaged

    metas = {"a__metered.1": {"relay": {"requests": 3, "requests_with_usage": 3, "output_tokens": 77}},
             "b__no_relay.1": {}, "c__no_usage.1": {"relay": {"requests": 2, "requests_with_usage": 0,
                                                              "output_tokens": None}}}
    (tmp_path / "_stats").mkdir()
    (tmp_path / "_stats" / "score.json").write_text(json.dumps({iid: {} for iid in metas}))
    for iid, meta in metas.items():
        (tmp_path / iid).mkdir()
        (tmp_path / iid / "pb-meta.json").write_text(json.dumps(meta))
    written = pb_stats.write_stats(tmp_path)
    assert written["tokens"] == {"a__metered.1": 77}
    assert json.loads((tmp_path / "_stats" / "tokens.json").read_text()) == {"a__metered.1": 77}
    assert pb_stats.unmetered(tmp_path) == ["b__no_relay.1", "c__no_usage.1"]
    lines = Packaged(tmp_path, list(metas), [], 0.0, 0.0, {}, unmetered=pb_stats.unmetered(tmp_path)).lines()
    assert ("output tokens not metered (no model relay, or no usage in its answers), so not in _stats/tokens.json: "
            "b__no_relay.1, c__no_usage.1") in lines
