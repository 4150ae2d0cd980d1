"""Live progress: phases published by the workers, the controller's view (lines, in place on a terminal, -q, off),
summary.json's in-flight tasks, slow engine calls said once."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.engine import docker_engine
from pytest_programbench.results.progress import (
    HISTORY,
    Counts,
    InFlight,
    LogTap,
    Publisher,
    Snapshot,
    TokenMeter,
    eta,
    progress_dir,
    read_snapshot,
    render,
)
from tests.conftest import TESTBED, Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"
TUIISH = "pbfix__tuiish.7e1a0b2"

# Waits for /pb-gate/go (created by the test once it has seen the agents in flight), then writes its answer.
GATED_AGENT = (
    "while [ ! -e /pb-gate/go ]; do sleep 0.2; done; "
    "case $PB_TASK_ID in "
    "pbfix__rpn*) cp -r /pb-testbed/solutions/pbfix__rpn.0b5e55e/. . ;; "
    "pbfix__catlike*) cp -r /pb-testbed/bad/$PB_TASK_ID/wrong/. . ;; "
    "esac"
)


def wait_for(what: str, condition: Callable[[], Any], proc: subprocess.Popen[bytes] | None = None,
             limit: float = 300.0) -> Any:
    """Poll a condition; the limit is a backstop that fails the test, not a timing under test."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = condition()
            if value:
                return value
            pytest.fail(f"the session ended (exit {proc.returncode}) before {what}")
        time.sleep(0.1)
    pytest.fail(f"gave up waiting for {what}")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def session_args(testbed: Testbed, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir),
            "--pb-blob-dir", str(testbed.blob_dir), "--pb-pull", "never", "--pb-cpus", "2",
            "--pb-output", str(run_dir), *extra]


# -- without an engine ----------------------------------------------------------------------------------------


def test_log_tap_reads_phases_and_leaves_what_pytest_sees_unchanged(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("pytest_programbench")
    before = (logger.level, logger.propagate)
    publisher = Publisher(tmp_path, "gw7")
    publisher.task_started(RPN)
    tap = LogTap(publisher)
    tap.install()
    try:
        # The evaluation's own progress records, exactly as container_layer logs them.
        logger.info("[%s] compile (compile.sh, no network, %d s clock)", RPN, 900)
        assert read_json(publisher.path)["phase"] == "compile"  # type: ignore[index]
        logger.info("[%s] %s %d/%d: %s%s", RPN, "branch", 2, 3, "tests/b", "")
        assert read_json(publisher.path)["phase"] == "branch 2/3"  # type: ignore[index]
        logger.info("[%s] %s %d/%d: %s%s", RPN, "audit", 1, 3, "tests/a", " (serial retry)")
        assert read_json(publisher.path)["phase"] == "audit 1/3 (serial retry)"  # type: ignore[index]
        logging.getLogger("pytest_programbench.engine.images").info("building an image")
        logging.getLogger("pytest_programbench.engine.docker_engine").warning("engine trouble")
    finally:
        tap.uninstall()
    # INFO stayed below the (unchanged) WARNING threshold; the warning went through once.
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("pytest_programbench.engine.docker_engine", "WARNING", "engine trouble")]
    assert (logger.level, logger.propagate) == before
    history = [json.loads(line)["phase"] for line in (tmp_path / HISTORY).read_text().splitlines()]
    assert history == ["starting", "compile", "branch 2/3", "audit 1/3 (serial retry)"]


def test_slow_engine_call_is_said_once_naming_the_call(caplog: pytest.LogCaptureFixture) -> None:
    state = docker_engine.EngineHealth(slow_call=30.0)
    cid = "ab" * 32
    state.timed("POST", f"http+docker://localhost/v1.43/containers/{cid}/start", 31.0)
    state.timed("POST", f"http+docker://localhost/v1.43/containers/{'cd' * 32}/start", 45.0)  # same call
    state.timed("POST", "http+docker://localhost/v1.43/containers/create", 29.0)  # fast enough
    state.timed("POST", f"http+docker://localhost/v1.43/exec/{cid}/start", 600.0)  # waits on purpose
    state.timed("POST", f"http+docker://localhost/v1.43/containers/{cid}/wait", 600.0)
    slow = [r for r in caplog.records if hasattr(r, "pb_slow_call")]
    assert [(r.pb_slow_call, r.getMessage()) for r in slow] == [
        ("POST /containers/{id}/start",
         "slow Docker engine call: POST /containers/{id}/start took 31.0 s (said once per call)")]


def test_snapshot_eta_and_tokens(tmp_path: Path) -> None:
    publisher = Publisher(tmp_path, "gw0")
    publisher.task_started(RPN)
    publisher.phase(RPN, "agent")
    dead = progress_dir(tmp_path) / "gw9.json"  # a crashed worker's file: its pid is gone
    dead.write_text(json.dumps({"worker": "gw9", "pid": 2 ** 22 + 12345, "task": CATLIKE, "phase": "agent"}))
    requests = tmp_path / RPN / "model-requests.jsonl"
    requests.parent.mkdir()
    requests.write_text(json.dumps({"usage": {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120}})
                        + "\n" + '{"usage": {"total_tok')  # a line being written
    meter = TokenMeter(tmp_path)
    snapshot = read_snapshot(tmp_path, meter)
    assert [(f.task, f.worker, f.phase, f.tokens) for f in snapshot.in_flight] == [(RPN, "gw0", "agent", 120)]
    with requests.open("a") as handle:
        handle.write('ens": 1000}}\n')
    assert read_snapshot(tmp_path, meter).in_flight[0].tokens == 1120

    flights = [InFlight("a", "gw0", "agent", 30.0, 10.0), InFlight("b", "gw1", "compile", 90.0, 5.0)]
    counts = Counts(selected=10, passed=2, failed=1, errors=1, durations=(60.0, 60.0, 60.0))
    snap = Snapshot(flights, {}, workers=2)
    # 4 queued x 60 s + (60 - 30) s + 0 s left of the running ones, over 2 workers.
    assert eta(counts, snap) == pytest.approx((4 * 60 + 30) / 2)
    assert eta(Counts(10, 0, 0, 0, ()), snap) is None
    assert render(Counts(10, 0, 0, 0, ()), snap, 5.0, quiet=False)[0].endswith("| ETA after the first task")
    full = render(counts, snap, 125.0, quiet=False)
    assert full[0] == ("programbench 4/10: 2 passed, 1 failed, 1 errors | 2 running, 4 queued | 0:02:05 elapsed "
                       "| ETA 0:02:15")
    assert full[1:] == ["  [gw0] a  agent 0:00:10  (task 0:00:30)", "  [gw1] b  compile 0:00:05  (task 0:01:30)"]
    quiet = render(counts, snap, 125.0, quiet=True)
    assert len(quiet) == 1
    assert quiet[0].endswith("| a agent 0:00:10, b compile 0:00:05")


# -- real sessions on the test bed ----------------------------------------------------------------------------


@pytest.mark.users_defaults  # rpn passes: its audit shows as phases of its own
def test_lines_under_xdist_show_in_flight_phases_summary_and_slow_calls(tmp_path: Path, testbed: Testbed,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    gate.chmod(0o755)
    run_dir = tmp_path / "run"
    out = tmp_path / "out.txt"
    monkeypatch.setenv("PB_SLOW_ENGINE_CALL", "0")  # every engine call is "slow": each is said once
    args = session_args(testbed, run_dir, "--pb-filter", "pbfix__(rpn|catlike)", "--pb-agent", GATED_AGENT,
                        "--pb-agent-mount", f"{gate}:/pb-gate", "--pb-agent-mount", f"{TESTBED}:/pb-testbed",
                        "-n", "2", "--pb-progress", "lines:0.3")
    with out.open("wb") as sink:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT)
    try:
        def both_agents() -> dict[str, Any] | None:
            data = read_json(run_dir / "summary.json") or {}
            flying = data.get("in_flight") or {}
            return flying if {k: v["phase"] for k, v in flying.items()} == {RPN: "agent", CATLIKE: "agent"} \
                else None

        flying = wait_for("both agents in flight in summary.json", both_agents, proc)
        assert {v["worker"] for v in flying.values()} == {"gw0", "gw1"}
        assert all(v["task_elapsed"] >= v["phase_elapsed"] >= 0 for v in flying.values())
        tasks = read_json(run_dir / "summary.json")["tasks"]  # type: ignore[index]
        assert (tasks[RPN]["phase"], tasks[CATLIKE]["phase"]) == ("agent", "agent")

        line = re.compile(r"^  \[gw[01]\] (pbfix__\S+)  agent \d+:\d\d:\d\d  \(task \d+:\d\d:\d\d\)$", re.M)
        wait_for("a progress line per task in its agent phase",
                 lambda: {m.group(1) for m in line.finditer(out.read_text(errors="replace"))} == {RPN, CATLIKE},
                 proc)
        assert re.search(r"^programbench 0/2: 0 passed, 0 failed, 0 errors \| 2 running, 0 queued \| "
                         r"\d+:\d\d:\d\d elapsed \| ETA after the first task$", out.read_text(), re.M)
        (gate / "go").touch()
        assert proc.wait(timeout=600) == 1  # catlike's wrong answer fails
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert text.count("programbench: slow Docker engine call: POST /containers/create took") == 1, text
    # Every phase of a task, in order, from the pipeline, the evaluation and the item.
    history = [json.loads(raw) for raw in (run_dir / HISTORY).read_text().splitlines()]
    rpn = [h["phase"] for h in history if h["task"] == RPN]
    expected = ["starting", "task", "blobs", "image", "sandbox", "agent", "pack", "evaluation", "compile",
                "branch 1/3", "branch 2/3", "branch 3/3", "verdict", "finished"]
    assert [p for p in rpn if p in expected] == expected, rpn
    # rpn passes, so its hidden-test audit runs two of its three branches again: each once its official run is in
    # (beside the official's next branch when it is sure to be sampled), all before the verdict.
    audits = [p for p in rpn[rpn.index("branch 1/3") + 1:rpn.index("verdict")] if p.startswith("audit ")]
    assert sorted(audits) == ["audit 1/2", "audit 2/2"], rpn
    final = read_json(run_dir / "summary.json")
    assert final is not None
    assert final["in_flight"] == {}
    assert not progress_dir(run_dir).exists()
    assert "report: " + str(run_dir / "report.html") in text


class Tmux:
    """A real terminal: a tmux server of the test's own (its socket in tmp_path), one pane of a fixed size."""

    WIDTH, HEIGHT = 200, 40  # -q's one line (status and tasks) fits

    def __init__(self, tmp_path: Path) -> None:
        tmux = shutil.which("tmux")
        assert tmux is not None, "Debian's tmux is required (apt-get install -y tmux; scripts/test-suite.sh does)"
        self.base = [tmux, "-S", str(tmp_path / "tmux.sock"), "-f", "/dev/null"]

    def start(self, args: list[str], cwd: Path) -> None:
        # The session's exit status is printed after it, and the pane stays open to be read.
        command = f"cd {shlex.quote(str(cwd))} && {shlex.join(args)}; echo \"[pb-exit $?]\"; exec sleep 3600"
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
        subprocess.run([*self.base, "new-session", "-d", "-s", "pb", "-x", str(self.WIDTH), "-y", str(self.HEIGHT),
                        command], check=True, env=env)

    def screen(self) -> str:
        """What the pane shows now."""
        return self._capture()

    def history(self) -> list[str]:
        """Everything the pane ever showed, scrolled-off lines included, as the terminal laid it out."""
        return [line for line in self._capture("-S", "-").splitlines() if line.strip()]

    def _capture(self, *extra: str) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", "pb", *extra], check=True,
                              capture_output=True, text=True).stdout

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    terminal = Tmux(tmp_path)
    try:
        yield terminal
    finally:
        terminal.close()


AGENT_CLOCK = re.compile(r"(pbfix__\S+) +agent (\d+:\d\d:\d\d)")
TASK_LINE = re.compile(r"^ +\[(gw\d+|controller)\] ", re.M)
STATUS = re.compile(r"programbench \d+/2: .*\| ETA ")


@pytest.mark.parametrize("extra", [[], ["-n", "2", "-q"]], ids=["single-process", "xdist-q"])
def test_live_view_in_a_real_terminal(tmp_path: Path, testbed: Testbed, tmux: Tmux, extra: list[str]) -> None:
    """In a real terminal (tmux), with and without xdist: mid-run the view shows the agent's clock moving and an ETA
    before any task ended; at the end pytest's own lines are intact and nothing of the view is left."""
    gate = tmp_path / "gate"
    gate.mkdir()
    gate.chmod(0o755)
    quiet = "-q" in extra
    args = session_args(testbed, tmp_path / "run", "--pb-filter", "pbfix__(rpn|catlike)", "--pb-agent", GATED_AGENT,
                        "--pb-agent-mount", f"{gate}:/pb-gate", "--pb-agent-mount", f"{TESTBED}:/pb-testbed",
                        "--pb-progress", "auto:0.2", *extra)
    tmux.start(args, tmp_path)
    try:
        def agent_clock() -> tuple[str, str] | None:
            screen = tmux.screen()
            match = AGENT_CLOCK.search(screen)
            if match is None or not re.search(STATUS.pattern + "after the first task", screen):
                return None
            if quiet:  # one line: the status line carries the tasks
                assert not TASK_LINE.search(screen), screen
            return match.group(1), match.group(2)

        task, first = wait_for("the live view with a task in its agent phase", agent_clock)
        wait_for("the agent's clock to move on the terminal", lambda: (agent_clock() or (task, first)) != (task, first))
    finally:
        (gate / "go").touch()
    wait_for("the session's end", lambda: "[pb-exit " in tmux.screen())
    lines = tmux.history()
    text = "\n".join(lines)
    assert lines[-1] == "[pb-exit 1]", text  # catlike's wrong answer fails
    # Nothing of the view is left: no status line, no task line, anywhere in what the terminal kept.
    assert not [line for line in lines if STATUS.search(line) or TASK_LINE.search(line)], text
    # pytest's own lines, whole: the header, the line of outcomes ending at [100%], the short summary, the last line.
    if not quiet:
        assert re.fullmatch(r"=+ test session starts =+", lines[0]), text
    outcomes = r"(programbench )?[.F]{2} +\[100%\]" if not quiet else r"[.F]{2} +\[100%\]"
    assert [line for line in lines if "[100%]" in line and not re.fullmatch(outcomes, line)] == [], text
    assert any(re.fullmatch(outcomes, line) for line in lines), text
    assert any(line.startswith(f"FAILED programbench::{CATLIKE} - score ") for line in lines), text
    final = r"1 failed, 1 passed in [\d.]+s( \([\d:]+\))?"
    assert re.fullmatch(final if quiet else f"=+ {final} =+", lines[-2]), text


def test_lines_without_xdist_appear_during_the_agent_window(tmp_path: Path, testbed: Testbed) -> None:
    """Output to a file without -n: the periodic lines reach it while the agent runs (not the item's captured
    output, which pytest shows with the failure)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    gate.chmod(0o755)
    run_dir = tmp_path / "run"
    out = tmp_path / "out.txt"
    args = session_args(testbed, run_dir, "--pb-filter", "pbfix__catlike", "--pb-agent", GATED_AGENT,
                        "--pb-agent-mount", f"{gate}:/pb-gate", "--pb-agent-mount", f"{TESTBED}:/pb-testbed",
                        "--pb-progress", "auto:0.3")
    with out.open("wb") as sink:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT)
    try:
        line = re.compile(rf"^  \[controller\] {re.escape(CATLIKE)}  agent \d+:\d\d:\d\d  \(task \d+:\d\d:\d\d\)$",
                          re.M)
        wait_for("a progress line in the agent phase", lambda: line.search(out.read_text(errors="replace")), proc)
        assert re.search(r"^programbench 0/1: 0 passed, 0 failed, 0 errors \| 1 running, 0 queued \| "
                         r"\d+:\d\d:\d\d elapsed \| ETA after the first task$", out.read_text(), re.M)
        (gate / "go").touch()
        assert proc.wait(timeout=600) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    failures = text.split("= FAILURES =", 1)[1]
    assert "programbench 0/1" not in failures, failures
    assert f"[controller] {CATLIKE}" not in failures, failures


def test_off_publishes_and_shows_nothing(tmp_path: Path, testbed: Testbed) -> None:
    run_dir = tmp_path / "run"
    args = session_args(testbed, run_dir, "--pb-submissions", str(testbed.submissions), "--pb-filter",
                        "pbfix__rpn", "--pb-progress", "off")
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "programbench 0/1" not in done.stdout
    assert "programbench 1/1" not in done.stdout
    assert not (run_dir / HISTORY).exists()
    assert not progress_dir(run_dir).exists()
    assert (read_json(run_dir / "summary.json") or {}).get("in_flight") == {}


def test_bad_progress_mode_is_a_usage_error(tmp_path: Path, testbed: Testbed) -> None:
    done = subprocess.run(session_args(testbed, tmp_path / "run", "--pb-submissions", str(testbed.submissions),
                                       "--pb-progress", "sometimes"), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--pb-progress: 'sometimes' is not one of: auto, live, lines, off" in done.stderr
