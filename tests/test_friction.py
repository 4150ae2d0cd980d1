"""A newcomer's first hour (issue 43): each rough edge met on a fresh machine, through the real session or script
that shows it. A refusal gives a hint the user can paste; a session where nothing asked for tasks says so; a run that
could only fail or do nothing is a usage error naming the option; a step that did nothing exits non-zero."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TESTBED, Testbed
from tests.shared_runs import good_rpn_run
from tests.test_report import chromium, text_of

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CALCULATOR = "testorg__calculator.abc1234"
HINT_SOCKET = "/run/pb-testbed.sock"


def _setup(copy: Path, tag: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PB_TESTBED_REPLACE"}
    return subprocess.run(["bash", str(copy / "setup.sh")], capture_output=True, text=True, timeout=600,
                          env={**env, "PB_PYTHON": sys.executable, "PB_TESTBED_IMAGE_TAG": tag})


def _stop_engine(pidfile: Path, data_root: Path, exec_root: Path) -> None:
    """The dockerd the hint started, by its pid (nothing else), and its roots."""
    if pidfile.is_file():
        pid = int(pidfile.read_text().strip())
        os.kill(pid, 15)
        for _ in range(60):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
    for root in (data_root, exec_root):
        shutil.rmtree(root, ignore_errors=True)


def test_setup_refusal_gives_lines_that_start_an_engine_of_its_own(docker_client: Any, tmp_path: Path) -> None:
    """testbed/setup.sh (the main job's first step) refuses an engine holding a foreign image of a test-bed name; its
    hint holds the two lines that start an engine of its own, pasted here as they are: a second dockerd answers on
    the socket the hint exports. The variable that allows replacing is named too."""
    if Path(HINT_SOCKET).exists():
        pytest.fail(f"{HINT_SOCKET} exists: another engine started from the hint is running", pytrace=False)
    copy = tmp_path / "testbed"
    shutil.copytree(TESTBED, copy, ignore=shutil.ignore_patterns(".state", "__pycache__"))
    tag = f"pbtest-{uuid.uuid4().hex[:8]}"
    calculator = f"programbench/{CALCULATOR.replace('__', '_1776_')}:{tag}"
    # Listed by name: a listing of every image gets each one after the list, and other tests remove theirs meanwhile.
    base = docker_client.images.list(name="pb-testbed-base")[0]
    base.tag(calculator)  # no test-bed label: another process's image
    try:
        refused = _setup(copy, tag)
    finally:
        docker_client.images.remove(calculator)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    lines = refused.stderr.splitlines()
    start = lines.index("Give the test bed an engine of its own: paste these two lines, then run this script again "
                        "in the same shell:")
    pasted = [line.strip() for line in lines[start + 1:start + 3]]
    assert pasted[1] == f"export DOCKER_HOST=unix://{HINT_SOCKET}"
    assert f"Or replace another checkout's images on this engine: PB_TESTBED_REPLACE=1 bash {copy}/setup.sh" in lines
    assert lines[-1].endswith("ERROR: nothing was changed")

    roots = re.findall(r"--(?:data|exec)-root (\S+)", pasted[0])
    pidfile = Path(re.findall(r"--pidfile (\S+)", pasted[0])[0])
    try:
        answered = subprocess.run(
            ["bash", "-c", "\n".join([*pasted, "for i in $(seq 60); do docker version -f '{{.Server.Version}}' "
                                      "2>/dev/null && exit 0; sleep 1; done; exit 1"])],
            capture_output=True, text=True, timeout=120)
        assert answered.returncode == 0, answered.stderr + Path("/var/log/pb-testbed-dockerd.log").read_text()[-2000:]
        assert answered.stdout.strip()
    finally:
        _stop_engine(pidfile, Path(roots[0]), Path(roots[1]))


def test_a_session_that_asked_for_no_task_says_so_in_one_line(pytester: pytest.Pytester) -> None:
    """With the plugin installed beside another suite, ``--co -q`` and ``-k pandoc`` that select nothing say why no
    task is there; a session that collects its own tests hears nothing of us."""
    pytester.makepyfile(test_other="def test_a():\n    pass\n")
    for args in (["--co", "-q"], ["-k", "pandoc"], ["--co", "-q", "-k", "pandoc"]):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
        hints = [line for line in result.outlines if line.startswith("programbench:")]
        if "-k" in args:
            assert hints == ["programbench: no tasks collected, none was asked for: any --pb-* option (e.g. "
                             "--pb-language go), a programbench::<id> argument or ini pb_enable = true selects them"]
        else:
            assert hints == [], result.outlines
    empty = pytester.mkdir("empty")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--co", "-q", str(empty))
    assert [line for line in result.outlines if line.startswith("programbench: no tasks collected")], result.outlines


def _no_solution_tasks(pytester: pytest.Pytester, testbed: Testbed) -> Path:
    """The rpn task (its image is the test bed's) in a tasks dir with no known-good solution beside it."""
    tasks = pytester.mkdir("tasks")
    shutil.copytree(testbed.tasks_dir / RPN, tasks / RPN)
    return tasks


def test_reference_agent_without_a_known_good_solution_is_refused(pytester: pytest.Pytester,
                                                                 testbed: Testbed) -> None:
    """``--pb-agent reference`` replays each task's known-good solution. On a task with none, preflight says so in a
    row, and a run stops at the first sandbox with that reason (an error, not a score), nothing evaluated."""
    tasks = _no_solution_tasks(pytester, testbed)
    common = ["-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks), "--pb-blob-dir", str(testbed.blob_dir),
              "--pb-pull", "never", "--pb-filter", RPN, "--pb-agent", "reference"]
    pre = pytester.runpytest_subprocess(*common, "--pb-preflight", "--pb-output", str(pytester.path / "pre"),
                                        timeout=300)
    assert pre.ret != 0
    out = pre.stdout.str()
    assert "1 of 1 selected tasks have no known-good solution for `reference` to replay" in out, out[-3000:]
    assert RPN in out.split("no known-good solution", 1)[1]

    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(*common, "--pb-output", str(run_dir), timeout=600)
    out = result.stdout.str()
    result.assert_outcomes(errors=1)
    assert "programbench: stopping: --pb-agent reference: no known-good solution for " + RPN in out, out[-3000:]
    assert not (run_dir / RPN / f"{RPN}.eval.json").exists()


def test_submissions_of_unknown_tasks_name_the_forgotten_tasks_dir(pytester: pytest.Pytester,
                                                                  testbed: Testbed) -> None:
    """Submissions of the user's own tasks without ``--pb-tasks-dir``: a usage error naming the option, not an
    empty run (exit 5, an empty report, the cause in a warning)."""
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-submissions", str(testbed.submissions),
                                           "--pb-output", str(run_dir), timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "holds tasks that are not in the catalogue" in err, err
    assert RPN in err
    assert "tasks of your own need --pb-tasks-dir DIR" in err
    assert not run_dir.exists()


def test_package_that_packaged_nothing_fails_the_session(pytester: pytest.Pytester, testbed: Testbed) -> None:
    """``--pb-package`` on a run of tasks that are not the benchmark's: the session exits non-zero with the reason,
    though its one task passed (a CI step must not go green)."""
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-pull", "never", "--pb-filter", RPN, "--pb-submissions", str(testbed.submissions),
        "--pb-output", str(pytester.path / "run"), "--pb-package", timeout=600)
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["programbench: --pb-package packaged nothing: programbench's package_run: No "
                                 "packageable instances found under * (it packages ProgramBench's own benchmark "
                                 "tasks only, *)"])


def _on_a_tty(args: list[str], cwd: Path, timeout: float = 600) -> str:
    """A session whose stdout is a terminal (as a user's is): what it wrote, carriage returns and all."""
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))  # a terminal's size: rows, columns
    env = {**os.environ, "COLUMNS": "160", "LINES": "50"}
    with subprocess.Popen([sys.executable, "-m", "pytest", *args], stdin=subprocess.DEVNULL, stdout=sub,
                          stderr=sub, cwd=cwd, env=env) as proc:
        os.close(sub)
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the session ended: the terminal's other side is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(main)
        proc.wait(timeout=60)
    return b"".join(chunks).decode(errors="replace")


def test_the_deselection_line_is_short_and_on_its_own_line(pytester: pytest.Pytester, testbed: Testbed) -> None:
    """An evaluate-only run of one submission over the whole catalogue (202 tasks deselected) under ``-n 2`` on a
    terminal: the note names three tasks and counts the rest, and starts a line of its own, after xdist's status line
    (which ends in a carriage return). The live progress view (the default on a terminal) draws pytest's unfinished
    line itself; off here, so the line is pytest's and xdist's alone."""
    subs = pytester.mkdir("subs")
    shutil.copytree(testbed.submissions / RPN, subs / RPN)
    out = _on_a_tty(["-p", "no:cacheprovider", "-n", "2", "--pb-tasks-dir", str(testbed.tasks_dir),
                     "--pb-blob-dir", str(testbed.blob_dir), "--pb-pull", "never", "--pb-submissions", str(subs),
                     "--pb-output", str(pytester.path / "run"), "--pb-progress", "off"], pytester.path)
    # What the terminal shows of each line: the text after its last carriage return, colours left out.
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in plain.split("\n")]
    notes = [line for line in shown if "have no submission in" in line]
    assert len(notes) == 1, out[-3000:]
    assert notes[0].startswith("programbench: 202 selected tasks have no submission in "), repr(notes[0])
    assert notes[0].endswith("(+199 more; --pb-require-all makes a missing one an error)"), notes[0]
    assert len(notes[0]) < 300 + len(str(subs)), len(notes[0])
    assert "1 passed" in out, out[-3000:]


def test_a_corrupt_submission_is_named_as_the_user_passed_it(pytester: pytest.Pytester, testbed: Testbed) -> None:
    """``--pb-submissions DIR`` whose archive is not gzip: the failure names DIR's file, not the run directory's
    copy of it (the user fixes the one they passed)."""
    subs = pytester.mkdir("my-submissions")
    (subs / RPN).mkdir()
    (subs / RPN / "submission.tar.gz").write_bytes(b"\x00garbage" * 64)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-pull", "never", "--pb-filter", RPN, "--pb-submissions", str(subs), "--pb-output", str(run_dir),
        timeout=600)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    mine = subs / RPN / "submission.tar.gz"
    assert f"invalid_submission_archive: {mine} is not gzip-compressed (the evaluator unpacks it with tar -xzf)" \
        in out, out[-3000:]
    assert str(run_dir / RPN / "submission.tar.gz") not in out


def test_report_of_an_official_directory_needs_no_tasks_dir(pytester: pytest.Pytester, testbed: Testbed,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """``pytest --pb-report runs/theirs`` beside a run of ours (in pb-runs/, as a run without --pb-output goes: the
    shared good rpn run, tests/shared_runs.py, copied there) reads the test bed's tasks from that run's record, as
    ``--pb-compare`` does, with no ``--pb-tasks-dir``; the page's footer says it was generated from the directory's
    own files, which hold no summary.json."""
    made = good_rpn_run(tmp_path_factory, testbed.tasks_dir, testbed.blob_dir, testbed.submissions)
    made.result().assert_outcomes(passed=1)
    mine = pytester.path / "pb-runs" / "mine"
    shutil.copytree(made.place / "run", mine, symlinks=True)
    theirs = pytester.path / "runs" / "theirs" / RPN
    theirs.mkdir(parents=True)
    for name in (f"{RPN}.eval.json", "submission.tar.gz"):
        shutil.copyfile(mine / RPN / name, theirs / name)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-report", "runs/theirs", timeout=300)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    assert "1 task(s) scored, mean official score 1.000" in result.stdout.str()
    page = theirs.parent / "report.html"
    dom = chromium("--dump-dom", page.as_uri(), profile=pytester.path / "chromium").stdout
    assert text_of(dom, "generated-from") == ("Generated by --pb-report from the run's own files (it has no "
                                              "summary.json); every number above is computed from them.")
    assert not (theirs.parent / "summary.json").exists()


INTERRUPT_FIRST_TASK = """
def pytest_runtest_setup(item):
    raise KeyboardInterrupt  # Ctrl-C as the first task starts: nothing scored
"""


def test_after_ctrl_c_with_nothing_scored_no_mean_reads_as_measured(pytester: pytest.Pytester,
                                                                     testbed: Testbed) -> None:
    """A session interrupted before its first verdict: the terminal and report.html say nothing was scored, never
    "mean over the selection: 0.000, 95% CI [0.000, 0.000] (unscored count 0)"."""
    pytester.makepyfile(interrupt_plugin=INTERRUPT_FIRST_TASK)  # a plugin: a conftest's hooks stop at its folder
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "interrupt_plugin", "--pb-tasks-dir", str(testbed.tasks_dir),
        "--pb-blob-dir", str(testbed.blob_dir), "--pb-pull", "never", "--pb-filter", "pbfix__(rpn|catlike)",
        "--pb-submissions", str(testbed.submissions),
        "--pb-output", str(run_dir), timeout=300)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    lines = result.stdout.lines
    assert "mean over the selection: - (nothing scored: 2 selected, none scored yet)" in lines, lines[-30:]
    assert not [line for line in lines if "95% CI [0.000, 0.000]" in line]
    dom = chromium("--dump-dom", (run_dir / "report.html").as_uri(), profile=pytester.path / "chromium").stdout
    assert text_of(dom, "mean-over-selection") == "-"
    assert text_of(dom, "mean-over-selection-label") == ("mean over the selection: nothing scored (2 selected, none "
                                                         "scored yet)")


def test_with_attempts_resolved_and_tests_say_they_are_means(pytester: pytest.Pytester, testbed: Testbed) -> None:
    """``--pb-attempts 2``, attempt 1 the known-good solution and attempt 2 a partly wrong one: pass@1 is 0.5 and the
    table's resolved is 0; the terminal and the report say the task's score and tests are means over its attempts
    and what resolved counts."""
    agent = ('if [ "$PB_ATTEMPT" = 1 ]; then cp -r /pb-testbed/solutions/$PB_TASK_ID/. .; '
             'else cp -r /pb-testbed/bad/$PB_TASK_ID/wrong/. .; fi')
    catlike = "pbfix__catlike.c47c47c"
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-pull", "never", "--pb-filter", catlike, "--pb-attempts", "2", "--pb-agent", agent,
        "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-cpus", "2", "--pb-output", str(run_dir), "-n", "2",
        timeout=900)
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=1)
    assert "pass@k (unbiased, mean over tasks): k=1 0.500" in out, out[-3000:]
    assert ("with 2 attempts per task, a task's score and tests are the means over its attempts: resolved and ≥0.95 "
            "count tasks whose mean reached 1.0 and 0.95 (every attempt); pass@k and resolved@k below count any "
            "of k") in result.stdout.lines
    dom = chromium("--dump-dom", (run_dir / "report.html").as_uri(), profile=pytester.path / "chromium").stdout
    assert text_of(dom, "resolved") == "0"
    assert "a task's score is the mean over its 2 attempts, so it counts tasks resolved in every attempt" \
        in text_of(dom, "resolved-label")
