"""A packaged run as a leaderboard registry entry, and the leaderboard's own number beside ours.

The registry (ProgramBench/submissions) validates each entry with ``scripts/validate_entries.py``: ``pointer.yaml``
whose ``submission_id`` is the folder's name and which names a ``source``; ``submission.yaml`` whose
``system.model`` and ``system.provider`` are set and not ``TODO`` (the ``headline`` requirement was dropped on
2026-06-18: the compiler uses a fixed instance count); a non-empty ``_stats/score.json`` object; an optional
``_stats/tokens.json`` (``{instance_id: output_tokens}``) fills the leaderboard's tokens column.
``registry_problems`` checks those rules (read from that script); the entry is built the way ``programbench submit
register`` builds it (its ``build_plan`` and ``write_entry``, the git look-ups given). The leaderboard
(``scripts/compile_leaderboard.py``) recomputes each task's score from ``_stats/score.json`` with the registry's
``ignored_tests.json`` struck, over 200 tasks, resolved at 1.0, near-resolved at 0.95: ``recompute`` does that here,
independently of the plugin's code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from programbench.register import build_plan, write_entry
from programbench.submission import score_from_tests
from programbench.submission import test_results_map as per_test_map

from pytest_programbench.results.registry import Provider, infer_provider
from pytest_programbench.tasks.catalogue import Catalogue
from tests import official_catalogue
from tests.conftest import REPO, Testbed
from tests.test_corrected_score import CATLIKE, stripped_tasks

RPN = "pbfix__rpn.0b5e55e"
REGISTRY = "https://github.com/ProgramBench/submissions"
SUBMISSION_ID = "20261127_pytest-programbench_gpt-test"
PLACEHOLDERS = (None, "", "TODO")


def registry_problems(entry: Path) -> list[str]:
    """scripts/validate_entries.py's ``check_entry``: what the registry's CI refuses in ``entry``."""
    problems: list[str] = []
    pointer = entry / "pointer.yaml"
    if not pointer.exists():
        problems.append("missing pointer.yaml")
    else:
        data = yaml.safe_load(pointer.read_text()) or {}
        if data.get("submission_id") != entry.name:
            problems.append(f"pointer.yaml submission_id ({data.get('submission_id')!r}) != folder name")
        if not data.get("source"):
            problems.append("pointer.yaml missing 'source'")
    manifest_path = entry / "submission.yaml"
    if not manifest_path.exists():
        problems.append("missing submission.yaml")
    else:
        manifest = yaml.safe_load(manifest_path.read_text()) or {}
        for dotted in ("system.model", "system.provider"):
            value: Any = manifest
            for key in dotted.split("."):
                value = value.get(key) if isinstance(value, dict) else None
            if value in PLACEHOLDERS:
                problems.append(f"submission.yaml missing/placeholder '{dotted}'")
    score = entry / "_stats" / "score.json"
    if not score.exists():
        problems.append("missing _stats/score.json")
    else:
        data = json.loads(score.read_text())
        if not (isinstance(data, dict) and data):
            problems.append("_stats/score.json is empty or not an object")
    return problems


def register_entry(run_dir: Path, registry_root: Path) -> Path:
    """The entry ``programbench submit register`` would open a PR with (source and commit given: no git here)."""
    plan = build_plan(run_dir, REGISTRY, source="https://github.com/example/" + run_dir.name, commit="0" * 40)
    return write_entry(plan, run_dir, registry_root)


def per_task_scores(score_json: Path, ignore: dict[str, list[str]]) -> dict[str, float]:
    """compile_leaderboard.py's per-task score: passed over the tests not struck (0.0 if none remain)."""
    per_task = {}
    for iid, tests in json.loads(score_json.read_text()).items():
        kept = [passed for name, passed in tests.items() if name not in set(ignore.get(iid, []))]
        per_task[iid] = sum(kept) / len(kept) if kept else 0.0
    return per_task


def recompute(score_json: Path, ignore: dict[str, list[str]], total: int = 200) -> dict[str, float]:
    """compile_leaderboard.py's numbers for an entry: percentages of the benchmark's 200 tasks, one decimal."""
    per_task = per_task_scores(score_json, ignore)
    return {"mean_score": round(100 * sum(per_task.values()) / total, 1),
            "resolved": round(100 * sum(s >= 1.0 for s in per_task.values()) / total, 1),
            "near_resolved": round(100 * sum(s >= 0.95 for s in per_task.values()) / total, 1)}


# ------------------------------------------------------------------------------------------------- provider


@pytest.mark.parametrize(("settings", "expected"), [
    # The registry's spelling where its leaderboard has a logo for the provider (compile_leaderboard.py's
    # PROVIDER_LOGOS: "Anthropic", "Google", "OpenAI"), else the name as inferred.
    ({"model": "anthropic/claude-x", "model_endpoint": "https://api.openai.com/v1"}, "Anthropic"),
    ({"model": "gemini/gemini-x"}, "Google"),
    ({"model": "gpt-x", "model_endpoint": "https://api.openai.com/v1"}, "OpenAI"),
    ({"model": "claude-x", "model_endpoint": "https://api.anthropic.com"}, "Anthropic"),
    ({"model": "some-model", "model_endpoint": "https://openrouter.ai/api/v1"}, "openrouter"),
    ({"model": "m", "model_endpoint": "https://generativelanguage.googleapis.com/v1beta/openai"}, "Google"),
    ({"model": "m", "model_endpoint": "https://llm.example.com/v1"}, "example"),
    ({"model": "m", "model_endpoint": "http://127.0.0.1:8080/v1", "agent": "codex@0.169.0"}, "OpenAI"),
    ({"model": "m", "agent": "claude-code"}, "Anthropic"),
    ({"model": "m", "model_endpoint": "http://localhost:9/v1", "agent": "python3 agent.py"}, None),
])
def test_the_provider_is_inferred_and_says_from_what(settings: dict[str, Any], expected: str | None) -> None:
    provider = infer_provider(settings)
    assert provider.name == expected
    assert bool(provider.source) == (expected is not None)
    if settings.get("model_endpoint") and expected not in (None, "Anthropic") and "/" not in settings["model"] \
            and "agent" not in settings:
        assert "host" in provider.source


def test_the_checker_refuses_what_the_registry_refuses(tmp_path: Path) -> None:
    entry = tmp_path / "submissions" / SUBMISSION_ID
    (entry / "_stats").mkdir(parents=True)
    (entry / "pointer.yaml").write_text(yaml.safe_dump({"submission_id": "other", "source": ""}))
    (entry / "submission.yaml").write_text(yaml.safe_dump({"system": {"model": "m", "provider": "TODO"}}))
    (entry / "_stats" / "score.json").write_text("{}")
    assert registry_problems(entry) == [
        "pointer.yaml submission_id ('other') != folder name", "pointer.yaml missing 'source'",
        "submission.yaml missing/placeholder 'system.provider'",
        "_stats/score.json is empty or not an object"]
    # No headline block at all is accepted now.
    (entry / "pointer.yaml").write_text(yaml.safe_dump({"submission_id": entry.name, "source": "https://x"}))
    (entry / "submission.yaml").write_text(yaml.safe_dump({"system": {"model": "m", "provider": "OpenAI"}}))
    (entry / "_stats" / "score.json").write_text(json.dumps({"a": {"t": True}}))
    assert registry_problems(entry) == []
    assert infer_provider({}) == Provider(None)


# ------------------------------------------------------------------------------------------ a packaged run


pytestmark = pytest.mark.usefixtures("clean_env")


def test_a_packaged_run_is_an_entry_the_registry_accepts_with_the_leaderboards_number(
        pytester: pytest.Pytester, testbed: Testbed, monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluate-only run packaged (the model named without a provider prefix; its endpoint's host says openai),
    registered the way ``programbench submit register`` does, passes the registry's rules; the leaderboard number
    it prints equals the registry's recomputation from ``_stats/score.json`` with the ignore map; the package keeps
    the official per-test map (catlike's tests.json names lack the JUnit's prefix: its official score is not its
    corrected one); packaging again on resume keeps the run's own command and dates."""
    tasks = stripped_tasks(pytester.path, testbed)
    monkeypatch.setenv(official_catalogue.ENV, str(tasks))  # the sessions' package_run sees the test bed's tasks
    subs = pytester.mkdir("subs")
    shutil.copytree(testbed.submissions.parent / "wrong" / CATLIKE, subs / CATLIKE)
    shutil.copytree(testbed.submissions / RPN, subs / RPN)
    rpn = {t.instance_id: t for t in Catalogue.load([tasks])}[RPN].load_instance()
    rpn_branch = sorted(rpn["branches"])[0]
    ignore = {CATLIKE: ["8d2e4b6f0a13/eval.tests.test_options.test_number_lines",
                        "8d2e4b6f0a13/tests.test_options.test_number_lines"],
              RPN: [f"{rpn_branch}/{rpn['branches'][rpn_branch]['tests'][0]}"]}
    ignore_file = pytester.path / "ignored_tests.json"
    ignore_file.write_text(json.dumps(ignore))
    run_dir = pytester.path / SUBMISSION_ID
    common = ["-p", "no:cacheprovider", "-p", "tests.official_catalogue", "--pb-registry-ignore", str(ignore_file),
              "--pb-package"]
    result = pytester.runpytest_subprocess(
        *common, "--pb-tasks-dir", str(tasks), "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter",
        f"{CATLIKE}|{RPN}", "--pb-submissions", str(subs), "--pb-output", str(run_dir), "--pb-cpus", "2",
        "--pb-pull", "never", "--pb-model", "gpt-test", "--pb-model-endpoint", "https://api.openai.com/v1",
        timeout=900)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*= programbench leaderboard =*", "leaderboard number (the registry's "
                                 "recomputation: 2 packaged task(s) over 200, 3 test(s) struck by "
                                 "ignored_tests.json): mean *", "*= programbench package =*",
                                 "*system.provider=?OpenAI (inferred from the model endpoint's host api.openai.com)?*"])

    # The registry's rules, on the entry as `programbench submit register` builds it.
    entry = register_entry(run_dir, pytester.path / "registry")
    assert entry.name == SUBMISSION_ID
    assert registry_problems(entry) == []
    manifest = yaml.safe_load((run_dir / "submission.yaml").read_text())
    # An evaluate-only run metered no tokens: no _stats/tokens.json, and the package says why.
    assert not (run_dir / "_stats" / "tokens.json").exists()
    result.stdout.fnmatch_lines([f"output tokens not metered (no model relay, or no usage in its answers), so not in "
                                 f"_stats/tokens.json: {CATLIKE}, {RPN}"])
    assert (manifest["system"]["model"], manifest["system"]["provider"]) == ("gpt-test", "OpenAI")
    assert "api.openai.com" in manifest["harness"]["provider_source"]
    assert manifest["headline"]["n_instances_total"] == len(list(tasks.iterdir()))  # no longer required: harmless
    assert manifest["headline"]["n_instances_attempted"] == 2
    assert official_catalogue.run_cli(["submit", "verify", str(run_dir)], cwd=REPO, tasks_dir=tasks,
                                      blob_dir=testbed.blob_dir).returncode == 0

    # Our leaderboard number is the registry's recomputation from _stats/score.json with the ignore map.
    score_json = run_dir / "_stats" / "score.json"
    board = json.loads((run_dir / "summary.json").read_text())["leaderboard"]
    expected = recompute(score_json, ignore)
    assert {k: board[k] for k in expected} == expected
    assert f"mean {expected['mean_score']}%, resolved {expected['resolved']}%, near-resolved " \
           f"{expected['near_resolved']}%" in result.stdout.str()
    assert board["scores"] == pytest.approx(per_task_scores(score_json, ignore), abs=1e-12)
    assert per_task_scores(score_json, {}) != per_task_scores(score_json, ignore), "the ignore map counts"
    assert 'id="leaderboard"' in (run_dir / "report.html").read_text()

    # The package holds the official per-test map: catlike's official score (tests counted twice), not the corrected.
    stored = json.loads(score_json.read_text())
    catlike = {t.instance_id: t for t in Catalogue.load([tasks])}[CATLIKE].load_instance()
    assert stored[CATLIKE] == per_test_map(run_dir / CATLIKE / f"{CATLIKE}.eval.json", catlike)
    row = json.loads((run_dir / "summary.json").read_text())["tasks"][CATLIKE]
    assert score_from_tests(stored[CATLIKE]) == pytest.approx(row["score_official"], abs=1e-9)
    assert row["score_official"] < row["score_corrected"]

    # Packaging again on resume keeps the run's command line and dates, the packaging time apart.
    first = manifest["harness"]
    assert "--pb-submissions" in first["command"]
    resumed = pytester.runpytest_subprocess(*common, "--pb-resume", str(run_dir), timeout=600)
    resumed.assert_outcomes(passed=1, failed=1)
    text = (run_dir / "submission.yaml").read_text()
    assert text.count("\nheadline:") == 1
    assert text.count("\nharness:") == 1
    again = yaml.safe_load(text)["harness"]
    assert (again["command"], again["started"], again["finished"]) == (first["command"], first["started"],
                                                                      first["finished"])
    assert again["packaged"] >= first["packaged"] >= first["finished"]
    assert next(s["command"] for s in again["sessions"]) == first["command"]
    assert "--pb-resume" in again["sessions"][1]["command"]
    assert registry_problems(register_entry(run_dir, pytester.path / "registry")) == []
