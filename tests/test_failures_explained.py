"""Failures that explain themselves: the task id as the failure header, the agent's exit status and clock, the
agent.log tail and the run directory in the message and in JUnit, one reason per error line, a session that stops
when the agent command does not exist, and the options that go with it. Real pytest sessions on the test bed.
"""

from __future__ import annotations

import html
import re
import secrets
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.pytest_layer.options import SECTIONS
from tests.conftest import Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"
FIXTURES = (CATLIKE, RPN, "pbfix__tuiish.7e1a0b2")
TAG = "task_cleanroom_v6"
# Prints 30 numbered lines and exits 3: the message must show the last 20 and the status.
CHATTY_AGENT = "i=1; while [ $i -le 30 ]; do echo agent-line-$i; i=$((i+1)); done; exit 3"


def _args(tasks_dir: Path, blob_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks_dir), "--pb-blob-dir", str(blob_dir),
            "--pb-pull", "never", "--pb-cpus", "2", "--pb-output", str(run_dir),
            "--junitxml", str(run_dir.parent / "junit.xml"), *extra]


def _cases(junit: Path) -> dict[str, ET.Element]:
    return {case.attrib["name"]: case for case in ET.parse(junit).getroot().iter("testcase")}


def _properties(case: ET.Element) -> dict[str, str]:
    return {p.attrib["name"]: p.attrib["value"] for p in case.iter("property")}


# ---------------------------------------------------------------------------------------------- the message


def test_failure_is_headed_by_the_task_and_explains_itself(pytester: pytest.Pytester, testbed: Testbed,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest cuts the short summary's reason at the terminal's width (80 columns in a pipe), after a node id
    # whose length depends on where the test runs: wide enough that the whole first line of the reason fits.
    monkeypatch.setenv("COLUMNS", "400")
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        *_args(testbed.tasks_dir, testbed.blob_dir, run_dir, "--pb-filter", RPN, "--pb-agent", CHATTY_AGENT),
        timeout=600)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "_ test session _" not in out, "the failure header is the task id"
    task_dir = run_dir / RPN
    result.stdout.fnmatch_lines([
        f"*_ {RPN} _*",
        "score 0.0000 (0/* tests passed), below --pb-min-score 1",
        "agent: exit status 3 after * s",
        f"run directory: {task_dir}",
        "last 20 lines of agent.log:",
        "  agent-line-11",
        "  agent-line-30",
    ])
    assert "agent-line-10\n" not in out, "only the last 20 lines"
    # pytest's short summary: the reason's first line, whole, once (not the id again, not the agent.log tail).
    summary = [line for line in out.splitlines() if line.startswith("FAILED ")]
    assert len(summary) == 1, out[-3000:]
    _, sep, reason = summary[0].partition(f"programbench::{RPN} - ")
    assert sep, summary
    assert reason == "score 0.0000 (0/15 tests passed), below --pb-min-score 1", summary

    # The harness's INFO log is in the task's directory, not repeated under the failure.
    assert "Captured log" not in out
    assert "verdict: score" in (task_dir / "harness.log").read_text()
    # The report names the agent as the header does.
    page = (run_dir / "report.html").read_text()
    versions = re.search(r'<div class="muted" id="versions">(.*?)</div>', page, re.S)
    assert versions is not None
    assert f"agent {CHATTY_AGENT!r}" in html.unescape(re.sub(r"<[^>]+>", "", versions.group(1)))

    case = _cases(run_dir.parent / "junit.xml")[RPN]
    props = _properties(case)
    assert (props["language"], props["difficulty"], props["run_dir"], props["task_dir"]) == (
        "c", "easy", str(run_dir), str(task_dir))
    system_out = case.find("system-out")
    assert system_out is not None
    assert (system_out.text or "").splitlines() == ["last 20 lines of agent.log:",
                                                    *(f"agent-line-{i}" for i in range(11, 31))]


def test_infrastructure_error_line_gives_the_reason_once(pytester: pytest.Pytester, testbed: Testbed) -> None:
    tasks = pytester.mkdir("tasks")
    noimage = "pbfix__noimage.1111111"
    shutil.copytree(testbed.tasks_dir / CATLIKE, tasks / noimage, ignore=shutil.ignore_patterns("Dockerfile"))
    blobs = pytester.mkdir("blobs")
    shutil.copytree(testbed.blob_dir / CATLIKE, blobs / noimage)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*_args(tasks, blobs, run_dir, "--pb-filter", noimage, "--pb-agent",
                                                  "true"), timeout=600)
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([f"*ERROR at setup of {noimage}*",
                                 "infrastructure error after 2 attempt(s): *programbench/pbfix_1776_noimage*",
                                 f"run directory: {run_dir / noimage}"])
    # The programbench summary's errors line: the id once, then the whole first sentence.
    error_lines = [line for line in out.splitlines() if line.startswith(f"  {noimage}: ")]
    assert len(error_lines) == 1, out[-3000:]
    assert not error_lines[0].startswith(f"  {noimage}: {noimage}"), "the id once, not again before the reason"
    assert error_lines[0].startswith(f"  {noimage}: infrastructure error after 2 attempt(s): "), error_lines
    assert not error_lines[0].endswith(":"), "a whole sentence, not a cut one"
    props = _properties(_cases(run_dir.parent / "junit.xml")[noimage])
    assert (props["language"], props["task_dir"]) == ("c", str(run_dir / noimage))


# ---------------------------------------------------------------------------------------------- agent not found


@dataclass(frozen=True)
class Copies:
    tasks_dir: Path
    blob_dir: Path
    ids: list[str]

    @property
    def only_these(self) -> list[str]:
        """The selection of just the copies (not the packaged tasks)."""
        return ["--pb-filter", self.ids[0].split("__", 1)[0] + "__"]


@pytest.fixture
def six_tasks(tmp_path: Path, testbed: Testbed, docker_client: Any) -> Iterator[Copies]:
    """Two copies of each fixture task under ids of this test alone, their images extra tags of the fixtures'."""
    from programbench.constants import image_name_from_instance_id

    org = f"pbstop{secrets.token_hex(3)}"
    copies = Copies(tmp_path / "tasks", tmp_path / "blobs", [])
    tags: list[str] = []
    try:
        for fixture in FIXTURES:
            name, _, commit = fixture.split("__", 1)[1].rpartition(".")
            image = docker_client.images.get(f"{image_name_from_instance_id(fixture)}:{TAG}")
            for k in range(2):
                new_id = f"{org}__{name}{k}.{commit}"
                (copies.tasks_dir / new_id).mkdir(parents=True)
                for meta in ("task.yaml", "tests.json"):
                    shutil.copy2(testbed.tasks_dir / fixture / meta, copies.tasks_dir / new_id / meta)
                shutil.copytree(testbed.blob_dir / fixture, copies.blob_dir / new_id)
                repository = image_name_from_instance_id(new_id)
                image.tag(repository, TAG)
                tags.append(f"{repository}:{TAG}")
                copies.ids.append(new_id)
        yield copies
    finally:
        for tag in tags:
            docker_client.api.remove_image(tag)  # the tag only: the fixture image keeps its own


def test_missing_agent_stops_the_session_under_xdist(pytester: pytest.Pytester, six_tasks: Copies) -> None:
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        *_args(six_tasks.tasks_dir, six_tasks.blob_dir, run_dir, *six_tasks.only_these, "--pb-agent",
               "no-such-agent", "-n", "2", "-v"),
        timeout=600)
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([
        "programbench schedule: longest first to idle workers (-n without --dist*",
        "scheduling tests via LongestFirstScheduling",
        "*programbench: stopping: --pb-agent 'no-such-agent': 'no-such-agent' is not found in the sandbox of *",
    ])
    ran = _cases(run_dir.parent / "junit.xml")
    # Each worker's first sandbox asks before its agent runs: every task that started is an error, none is scored,
    # nothing is evaluated (workers may finish the task they already hold).
    assert 1 <= len(ran) < len(six_tasks.ids), sorted(ran)
    assert all(case.find("error") is not None and "agent_exit" not in _properties(case) for case in ran.values())
    assert not list(run_dir.rglob("*.eval.json")), "no evaluation ran"


def test_keep_going_runs_every_task(pytester: pytest.Pytester, six_tasks: Copies) -> None:
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        *_args(six_tasks.tasks_dir, six_tasks.blob_dir, run_dir, *six_tasks.only_these, "--pb-agent",
               "no-such-agent", "-n", "2", "--dist", "load", "--pb-keep-going"), timeout=600)
    result.assert_outcomes(failed=len(six_tasks.ids))
    assert "stopping" not in result.stdout.str()
    assert "using --dist worksteal" not in result.stdout.str(), "an explicit --dist is kept"
    # Each task's agent ran and was scored: the failure leads with the exit status and its reading, agent.log too.
    ran = _cases(run_dir.parent / "junit.xml")
    assert len(ran) == len(six_tasks.ids), sorted(ran)
    for name, case in ran.items():
        failure = case.find("failure")
        assert failure is not None, name
        text = (failure.text or "").strip()
        assert text.startswith("agent exited 127: command not found"), text[:500]
    for iid in six_tasks.ids:
        assert "not found" in (run_dir / iid / "agent.log").read_text(), iid


def test_agents_not_running_stop_a_serial_session(pytester: pytest.Pytester, six_tasks: Copies) -> None:
    """The command exists (the first sandbox's check passes) but every agent exits 127: the first three stop it."""
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        *_args(six_tasks.tasks_dir, six_tasks.blob_dir, run_dir, *six_tasks.only_these, "--pb-agent",
               "sh -c no-such-tool"), timeout=600)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(["*Interrupted: programbench: stopping: the agent of each of the first 3 tasks "
                                 "exited 127 (127: command not found)*"])


# ---------------------------------------------------------------------------------------------- usage, --help


def test_agent_and_submissions_together_are_a_usage_error(pytester: pytest.Pytester, testbed: Testbed) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir),
                                           "--pb-agent", "true", "--pb-submissions", str(testbed.submissions))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--pb-agent and --pb-submissions exclude each other*"])


def test_help_groups_the_options_from_an_unrelated_directory(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    headers = [line for line in done.stdout.splitlines() if line.startswith("ProgramBench ")]
    assert headers == [f"ProgramBench {name} (pytest-programbench):" for name in SECTIONS]
    section = done.stdout.split("ProgramBench model (pytest-programbench):")[1].split("\n\n")[0]
    assert "--pb-model-endpoint" in section
    assert "--pb-agent " not in section
