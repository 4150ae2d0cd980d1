"""Resume without retyping: ``--pb-resume DIR`` alone reuses the run's recorded settings, an explicit option that
changes a result's meaning is refused, and the command a session prints when it did not finish is the one that
resumes it. Real sessions under ``-n 2`` on the test bed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import GUARD_PLUGIN, MACHINE_CACHE, REPO, TESTBED, Testbed

# users_defaults: a run made outside the suite's session defaults (finished_run) is resumed with the same settings
pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.users_defaults]

RPN = "pbfix__rpn.0b5e55e"
# rpn without Dockerfile or image: errors until the image is tagged. An id of this process's own, so that the tag is
# its own too (another session on the shared engine never sees, nor untags, it).
COPY = f"pbresume__rpn2.{uuid.uuid4().hex[:7]}"
TAG = "task_cleanroom_v6"
RESUME_LINE = "to resume (finished tasks are kept): "
# On the host: counts its runs per task, then puts rpn's solution into the sandbox (both tasks pass with it).
COUNTING_AGENT = (
    'n=$(cat "$COUNTS/$PB_TASK_ID" 2>/dev/null || echo 0); echo $((n + 1)) > "$COUNTS/$PB_TASK_ID"; '
    f'tar -C {TESTBED}/solutions/{RPN} -c . | $PB_SANDBOX_EXEC "tar -x -C /workspace/src"'
)


@pytest.fixture
def copy_image(docker_client: Any) -> Iterator[str]:
    """The copy's image reference; whatever the test tagged there is untagged at the end."""
    from programbench.constants import image_name_from_instance_id

    ref = f"{image_name_from_instance_id(COPY)}:{TAG}"
    yield ref
    if docker_client.images.list(name=ref):
        docker_client.api.remove_image(ref)  # the tag only: rpn's image keeps its own


def _count(counts: Path, task: str) -> int:
    path = counts / task
    return int(path.read_text()) if path.exists() else 0


def _resume_args(out: str) -> list[str]:
    lines = [line for line in out.splitlines() if line.startswith(RESUME_LINE)]
    assert len(lines) == 1, out[-3000:]
    words = shlex.split(lines[0].removeprefix(RESUME_LINE))
    assert words[0] == "pytest"
    return words[1:]


def test_resume_alone_reuses_the_recorded_settings(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any,
                                                   copy_image: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tasks = pytester.mkdir("tasks")
    shutil.copytree(testbed.tasks_dir / RPN, tasks / COPY, ignore=shutil.ignore_patterns("Dockerfile"))
    counts = pytester.mkdir("counts")
    monkeypatch.setenv("COUNTS", str(counts))
    run_dir = pytester.path / "run"
    first = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-tasks-dir", str(tasks),
        "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter", "pbfix__rpn|pbresume__", "--pb-pull", "never",
        "--pb-agent", COUNTING_AGENT, "--pb-agent-on-host", "--pb-agent-timeout", "300", "--pb-cpus", "2",
        "--pb-infra-retries", "0", "--pb-output", str(run_dir), timeout=600)
    first.assert_outcomes(passed=1, errors=1)
    # The header names the agent by what was typed (cut), not by its kind.
    first.stdout.fnmatch_lines(["programbench agent: 'n=$(cat \"$COUNTS/$PB_TASK_ID\" 2>/dev/null*...' (on the host)"])
    assert (_count(counts, RPN), _count(counts, COPY)) == (1, 0)
    resume_args = _resume_args(first.stdout.str())
    assert resume_args[:2] == ["--pb-resume", str(run_dir)]
    assert [a for a in resume_args if a.startswith("--pb-")] == ["--pb-resume"], "the record has the --pb-* options"
    assert resume_args[resume_args.index("-n"):][:2] == ["-n", "2"], "what the record lacks is kept"
    recorded = json.loads((run_dir / "summary.json").read_text())["settings"]

    # An option given now that changes what a result means is refused, naming the option.
    changed = pytester.runpytest_subprocess(*resume_args, "--pb-agent-timeout", "99", timeout=300)
    assert changed.ret == pytest.ExitCode.USAGE_ERROR
    changed.stderr.fnmatch_lines(["*--pb-resume: refusing to resume*agent_timeout: 300 -> 99 (--pb-agent-timeout)*"])

    docker_client.images.get(f"programbench/pbfix_1776_rpn.0b5e55e:{TAG}").tag(copy_image)
    second = pytester.runpytest_subprocess(*resume_args, timeout=600)
    second.assert_outcomes(passed=2)
    second.stdout.fnmatch_lines(["programbench: resuming with the run's recorded settings*",
                                 "*2 workers*"])
    assert RESUME_LINE not in second.stdout.str(), "a finished run prints no resume command"
    assert (_count(counts, RPN), _count(counts, COPY)) == (1, 1), "only the errored task ran again"
    data = json.loads((run_dir / "summary.json").read_text())
    where = ("output", "resume")  # the run directory, given once with --pb-output, then with --pb-resume
    assert {k: v for k, v in data["settings"].items() if k not in where} == {
        k: v for k, v in recorded.items() if k not in where}, "the same settings: selection, agent, clocks, retries"
    assert {iid: task["outcome"] for iid, task in data["tasks"].items()} == {RPN: "passed", COPY: "passed"}


# ------------------------------------------------------------------ every setting that changes a result, refused
# Per field of run_record.RESULT_SETTINGS (and --pb-agent-env's names): options that give it another value than the
# base run's below. ``{template}`` and ``{subs}`` are files the fixture makes. Evaluate-only is another agent: the
# recorded --pb-agent is cleared with an empty one (else "--pb-agent and --pb-submissions exclude each other").
CHANGES: dict[str, tuple[str, ...]] = {
    "agent": ("--pb-agent", "false"),
    "agent_setup": ("--pb-agent-setup", "true"),
    "agent_on_host": ("--pb-agent-on-host",),
    "agent_timeout": ("--pb-agent-timeout", "99"),
    "prompt_template": ("--pb-prompt-template", "{template}"),
    "model": ("--pb-model", "another-model"),
    "model_endpoint": ("--pb-model-endpoint", "http://127.0.0.1:9/v1"),
    "model_allow_server_tools": ("--pb-model-allow-server-tools",),
    "submissions": ("--pb-submissions", "{subs}", "--pb-agent", ""),
    "image_tag": ("--pb-image-tag", "another-tag"),
    "cpus": ("--pb-cpus", "1"),
    "memory": ("--pb-memory", "1g"),
    "branch_workers": ("--pb-branch-workers", "2"),
    "branch_retries": ("--pb-branch-retries", "0"),
    "compile_timeout": ("--pb-compile-timeout", "100"),
    "test_timeout": ("--pb-test-timeout", "100"),
    "strict": ("--pb-strict",),
    "sandbox_cpus": ("--pb-sandbox-cpus", "1"),
    "sandbox_memory": ("--pb-sandbox-memory", "1g"),
    "model_failures_scored": ("--pb-model-failures-scored",),
    "agent_replay": ("--pb-agent-replay", "{subs}"),
    "agent_env": ("--pb-agent-env", "PB_RESUME_EXTRA=1"),
}


def test_every_result_setting_has_a_refusal_case() -> None:
    from pytest_programbench.core.run_identity import RESULT_SETTINGS

    assert set(CHANGES) == {*RESULT_SETTINGS, "agent_env"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed) -> dict[str, Path]:
    """One cheap finished run for every refusal: a copy of rpn whose image does not exist (--pb-pull never), so its
    one task errors at once, nothing started. A refusal happens before anything runs, so the run is shared."""
    root = tmp_path_factory.mktemp("refusals")
    task = f"pbrefuse__rpn.{uuid.uuid4().hex[:7]}"
    shutil.copytree(testbed.tasks_dir / RPN, root / "tasks" / task, ignore=shutil.ignore_patterns("Dockerfile"))
    (root / "template.j2").write_text("Rebuild {{ task.instance_id }}.\n")
    (root / "subs").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROGRAMBENCH_", "PYTEST_"))}
    env.update(PYTHONPATH=str(REPO), PYTEST_PLUGINS=GUARD_PLUGIN, XDG_CACHE_HOME=MACHINE_CACHE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pb-tasks-dir", str(root / "tasks"),
         "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter", task, "--pb-pull", "never", "--pb-agent", "true",
         "--pb-agent-timeout", "300", "--pb-cpus", "2", "--pb-infra-retries", "0", "--pb-output", str(root / "run")],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert "1 error" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    return {"run": root / "run", "template": root / "template.j2", "subs": root / "subs"}


def _changed(field: str, finished_run: dict[str, Path]) -> list[str]:
    values = {"template": str(finished_run["template"]), "subs": str(finished_run["subs"])}
    return [arg.format(**values) for arg in CHANGES[field]]


def _refusal(run_dir: Path, field: str) -> str:
    from pytest_programbench.pytest_layer.run_record import flag_of

    return (f"*--pb-resume: refusing to resume {run_dir}, its configuration differs: *"
            f"{field}: * -> * ({flag_of(field)})*")


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_resume_refuses_a_changed_result_setting(field: str, finished_run: dict[str, Path],
                                                  pytester: pytest.Pytester) -> None:
    """Asked of the check every session makes before anything runs (``RunState.from_config``: the recorded settings
    under the given ones, the run's fingerprint compared): refused, naming the field and its option, the run as it
    was. The wiring (exit status 4, the line): test_a_refused_resume_is_a_usage_error_and_changes_nothing."""
    from pytest_programbench.pytest_layer.run_state import RunState

    run_dir = finished_run["run"]
    record = (run_dir / "pb-run.json").read_text()
    config = pytester.parseconfig("-p", "no:cacheprovider", "--pb-resume", str(run_dir),
                                  *_changed(field, finished_run))
    with pytest.raises(pytest.UsageError) as refused:
        RunState.from_config(config)
    assert fnmatch.fnmatchcase(str(refused.value), _refusal(run_dir, field)), str(refused.value)
    assert (run_dir / "pb-run.json").read_text() == record, "a refused resume leaves the run as it was"


def test_a_refused_resume_is_a_usage_error_and_changes_nothing(finished_run: dict[str, Path],
                                                               pytester: pytest.Pytester) -> None:
    """One real session proves the wiring of every refusal above: exit status 4, the refusal on stderr, the run's
    files as they were."""
    run_dir = finished_run["run"]
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-resume", str(run_dir),
                                           *_changed("cpus", finished_run), timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, "\n".join(result.outlines[-30:] + result.errlines[-30:])
    result.stderr.fnmatch_lines([_refusal(run_dir, "cpus")])
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before, "nothing written"
