"""Agents end to end: real sandboxes, real proxies, real evaluation, real pytest sessions."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TESTBED, Testbed
from tests.secret_scan import assert_secret_nowhere
from tests.shared_runs import FinishedRun, made_once
from tests.task_copies import task_copies

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"


def run_agent(pytester: pytest.Pytester, testbed: Testbed, agent: str, *args: str,
              task: str = RPN, out: str = "run") -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", task, "--pb-agent", agent, "--pb-agent-mount", f"{TESTBED}:/pb-testbed",
        "--pb-output", str(pytester.path / out), "--pb-cpus", "2", "--junitxml", str(pytester.path / "junit.xml"),
        *args, timeout=900,
    )


def properties(where: pytest.Pytester | Path, task: str) -> dict[str, str]:
    root = ET.parse((where if isinstance(where, Path) else where.path) / "junit.xml").getroot()
    case = next(c for c in root.iter("testcase") if c.get("name") == task)
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def outcome(place: Path, task: str) -> str:
    """The item's outcome in the session's JUnit XML: passed, failure, error or skipped."""
    case = next(c for c in ET.parse(place / "junit.xml").getroot().iter("testcase") if c.get("name") == task)
    return next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")


def official_info(run_dir: Path, tasks_dir: Path) -> str:
    """``programbench info`` itself, told where our fixture tasks live (it only knows its packaged ones)."""
    code = (
        "import sys; from pathlib import Path\n"
        "import programbench.utils.load_data as ld\n"
        f"ld.load_all_instances.__defaults__ = (Path({str(tasks_dir)!r}),)\n"
        "from programbench.cli.main import app\n"
        f"app(['info', {str(run_dir)!r}], standalone_mode=False)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


SCRIPTED = (
    # Check what the agent is given, probe the reference through the proxy like an agent would, then write a solution
    # from what it learned. One chain: the solution is written only when every check held, so each one decides the
    # outcome (a failed check leaves /workspace/src empty: scored 0).
    'test "$(id -u)" != 0 && test -z "$(ls -A /workspace/src)" && test -f "$PB_PROMPT_FILE" && '
    'grep -q "/workspace/binary" "$PB_PROMPT_FILE" && '
    'printf "2 3 +\\n" | /workspace/binary > probe.txt && grep -qx 5 probe.txt && rm probe.txt && '
    f"cp -r /pb-testbed/solutions/{RPN}/. ."
)


def wrapping_agent(target: str) -> str:
    """An agent whose compile.sh writes an executable that execs ``target`` (it passes its own check)."""
    return (f"printf '#!/bin/sh\\nprintf \"#!/bin/sh\\\\nexec {target} \\\\\"\\\\$@\\\\\"\\\\n\" > executable"
            "\\nchmod +x executable\\n' > compile.sh && chmod +x compile.sh && sh compile.sh && "
            'test "$(printf "2 3 +\\n" | ./executable)" = 5')


SECRET = "s3cr3t-value"
# Agents of the same options, one per copy of rpn, in one session (-n 2): each case is its own item's. The session's
# agent runs each case's command by the task id the sandbox gives it (so every case checks PB_TASK_ID: a wrong one
# runs none of them, exit 3).
SAME_OPTIONS = {
    "scripted": SCRIPTED,
    "wrapper": wrapping_agent("/workspace/binary"),
    "crash": "echo dying >&2; kill -SEGV $$",
    "secrets": ('test "$(printf %s "$PB_TEST_SECRET" | tr a-z A-Z)" = S3CR3T-VALUE && test "$PLAIN" = yes && '
                'test "$PB_BINARY" = /workspace/binary && '
                f'cp -r /pb-testbed/solutions/{RPN}/. .'),
}


@dataclass(frozen=True)
class Agents:
    """The reader's copy of the shared session (``place``: junit.xml, run/, tasks/), the case ids, the session."""

    place: Path
    ids: dict[str, str]
    run: FinishedRun


@pytest.fixture(scope="module")
def agents_session(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed,
                   docker_client: Any) -> tuple[FinishedRun, dict[str, str]]:
    with contextlib.ExitStack() as stack:
        def prepare(place: Path) -> list[str]:
            ids = stack.enter_context(task_copies(place, testbed, docker_client, dict.fromkeys(SAME_OPTIONS, RPN),
                                                  prefix="pbagents"))
            (place / "ids.json").write_text(json.dumps(ids))
            # The agent of each copy, chosen by the task id the sandbox gives it.
            agent = "case \"$PB_TASK_ID\" in " + " ".join(
                f"{ids[name]}) {command} ;;" for name, command in SAME_OPTIONS.items()) + " *) exit 3 ;; esac"
            org = ids["scripted"].partition("__")[0]  # the copies' own org: the catalogue's tasks are not run
            return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(place / "tasks"), "--pb-blob-dir",
                    str(place / "blobs"), "--pb-filter", f"{org}__", "--pb-pull", "never", "--pb-agent", agent,
                    "--pb-agent-mount",
                    f"{TESTBED}:/pb-testbed", "--pb-output", str(place / "run"), "--pb-cpus", "2", "--junitxml",
                    str(place / "junit.xml"), "--pb-agent-env", "PB_TEST_SECRET", "--pb-agent-env", "PLAIN=yes",
                    "-n", "2"]

        made = made_once(tmp_path_factory, "agents-of-the-same-options", prepare,
                         env={"PB_TEST_SECRET": SECRET})
    return made, json.loads((made.place / "ids.json").read_text())


@pytest.fixture
def agents(agents_session: tuple[FinishedRun, dict[str, str]], tmp_path: Path) -> Agents:
    made, ids = agents_session
    # The whole session: scripted and secrets passed, the wrapper and the crash failed, nothing an error.
    made.result().assert_outcomes(passed=2, failed=2)
    return Agents(made.copy(tmp_path / "agents"), ids, made)


def test_scripted_agent_passes_and_programbench_info_agrees(agents: Agents) -> None:
    scripted = agents.ids["scripted"]
    props = properties(agents.place, scripted)
    assert outcome(agents.place, scripted) == "passed"
    assert float(props["score"]) == 1.0
    assert props["agent_exit"] == "0"
    assert props["clock_fired"] == ""
    run_dir = agents.place / "run"
    calls = [json.loads(line) for line in (run_dir / scripted / "binary-calls.jsonl").read_text().splitlines()]
    assert calls, "the agent's probe went through the proxy and was recorded"
    assert calls[0]["argv"] == ["/workspace/binary"]
    assert calls[0]["exit"] == 0
    info = official_info(run_dir, agents.place / "tasks")
    assert any(scripted in line and "✅" in line for line in info.splitlines()), info


@pytest.mark.parametrize("target", ["/workspace/binary", "/workspace/executable"])
def test_compile_sh_wrapping_the_reference_fails_at_evaluation(request: pytest.FixtureRequest, testbed: Testbed,
                                                               target: str) -> None:
    if target == "/workspace/binary":  # the options of the shared session: its copy there
        shared: Agents = request.getfixturevalue("agents")
        props = properties(shared.place, shared.ids["wrapper"])
        assert outcome(shared.place, shared.ids["wrapper"]) == "failure"
        assert props["agent_exit"] == "0"
        assert float(props["score"]) < 0.5
        return
    pytester: pytest.Pytester = request.getfixturevalue("pytester")
    agent = wrapping_agent(target)
    # At evaluation a wrapper of /workspace/executable is /workspace/executable: it execs itself for ever, so every
    # hidden test hangs (and burns a core) until a clock: the branch clock, short here and not retried, instead of
    # each test's 10 s timeout times its reruns (5 minutes). A timed-out branch scores its tests 0 all the same.
    result = run_agent(pytester, testbed, agent, "--pb-test-timeout", "10", "--pb-branch-retries", "0")
    result.assert_outcomes(failed=1)
    props = properties(pytester, RPN)
    assert props["agent_exit"] == "1"
    assert float(props["score"]) < 0.5


def test_agent_timeout_evaluates_partial_work(pytester: pytest.Pytester, testbed: Testbed) -> None:
    agent = "cp -r /pb-testbed/solutions/$PB_TASK_ID/. . && sleep 600"
    result = run_agent(pytester, testbed, agent, "--pb-agent-timeout", "15")
    result.assert_outcomes(passed=1)
    props = properties(pytester, RPN)
    assert props["clock_fired"] == "agent"
    assert float(props["score"]) == 1.0
    assert 13 <= float(props["agent_seconds"]) < 120
    meta = json.loads((pytester.path / "run" / RPN / "pb-meta.json").read_text())
    assert meta["agent"]["timed_out"] is True


def test_agent_crash_is_scored_not_an_error(agents: Agents) -> None:
    crash = agents.ids["crash"]
    props = properties(agents.place, crash)
    assert outcome(agents.place, crash) == "failure"
    assert float(props["score"]) == 0.0
    assert props["error_code"] == "compile_failed"
    assert "dying" in (agents.place / "run" / crash / "agent.log").read_text()


def test_agent_env_and_secrets(agents: Agents) -> None:
    """Its agent passes only when the secret, the plain value and its own task id reach it; the secret is nowhere in
    what the session wrote or printed (the whole session's: four agents)."""
    props = properties(agents.place, agents.ids["secrets"])
    assert outcome(agents.place, agents.ids["secrets"]) == "passed"
    assert float(props["score"]) == 1.0
    assert props["agent_exit"] == "0"
    assert_secret_nowhere(SECRET, run_dir=agents.place / "run", junit=agents.place / "junit.xml",
                          result=agents.run.result())


def test_host_loop_agent_drives_the_sandbox(pytester: pytest.Pytester, testbed: Testbed) -> None:
    # The uid check first: the solution reaches the sandbox only when commands run there as the agent (1777, as
    # PB_AGENT_UID says), so the check decides the outcome.
    agent = ("test \"$($PB_SANDBOX_EXEC 'id -u')\" = 1777 && test \"$PB_AGENT_UID\" = 1777 && "
             f"tar -C {TESTBED}/solutions/$PB_TASK_ID -c . | $PB_SANDBOX_EXEC 'tar -x -C /workspace/src'")
    result = run_agent(pytester, testbed, agent, "--pb-agent-on-host")
    result.assert_outcomes(passed=1)
    assert properties(pytester, RPN)["agent_exit"] == "0"


def test_replay_preset(pytester: pytest.Pytester, testbed: Testbed) -> None:
    empty = pytester.mkdir("nothing-to-replay")
    result = run_agent(pytester, testbed, f"replay:{empty}")
    result.assert_outcomes(failed=1)  # an empty submission: scored 0, the agent's failure
    assert "does not exist; the submission stays empty" in (pytester.path / "run" / RPN / "agent.log").read_text()
    result = run_agent(pytester, testbed, f"replay:{TESTBED / 'solutions'}", out="run2")
    result.assert_outcomes(passed=1)


# An agent on the host that ignores its clock: it prints more than agent.log's default cap, then ignores SIGTERM
# (so do its children, which inherit the ignored signal), detaches one child from its process group, and sleeps far
# past --pb-agent-timeout. Every process of it writes its pid; each is recognisable by its command line (the marker
# in the shell's, 987654 in the sleeps').
CLOCK_IGNORING_HOST_AGENT = (
    'printf "HEAD-MARK\\n"; head -c 73400320 /dev/zero | tr "\\0" x; printf "\\nTAIL-MARK\\n"; trap "" TERM; '
    'echo $$ > "$PIDS/shell"; sleep 987654 & echo $! > "$PIDS/child"; '
    '(while :; do sleep 987654; done) & echo $! > "$PIDS/loop"; '
    # Out of the process group the clock stops: a session of its own.
    'setsid sleep 987654 & echo $! > "$PIDS/detached"; wait; sleep 987654'
)


def _alive(pid: int, markers: tuple[str, ...] = ("HEAD-MARK", "987654")) -> bool:
    """The process is running and is the agent's (a reused pid is someone else's; a zombie is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return state not in ("Z", "X") and any(marker in cmdline for marker in markers)


def test_host_loop_agent_that_ignores_its_clock(pytester: pytest.Pytester, testbed: Testbed,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Its clock fires (the outcome says so), what it left is scored (a failure, not an error), none of its processes
    outlives the window, and agent.log holds the documented default cap (PB_AGENT_LOG_MAX unset: 64 MiB)."""
    from pytest_programbench.sandbox.agent_log import MARKER

    pids = pytester.mkdir("pids")
    monkeypatch.setenv("PIDS", str(pids))
    monkeypatch.delenv("PB_AGENT_LOG_MAX", raising=False)
    result = run_agent(pytester, testbed, CLOCK_IGNORING_HOST_AGENT, "--pb-agent-on-host", "--pb-agent-timeout", "20")
    result.assert_outcomes(failed=1)
    props = properties(pytester, RPN)
    assert props["clock_fired"] == "agent"
    assert float(props["score"]) == 0.0
    result.stdout.fnmatch_lines(["*clock fired: agent*"])
    meta = json.loads((pytester.path / "run" / RPN / "pb-meta.json").read_text())
    assert meta["agent"]["timed_out"] is True
    recorded = {name: int((pids / name).read_text()) for name in ("shell", "child", "loop", "detached")}
    assert not [name for name, pid in recorded.items() if _alive(pid)], recorded
    assert "1 process(es) the agent detached from its process group were killed" in " ".join(meta["agent"]["notes"])
    log = (pytester.path / "run" / RPN / "agent.log").read_bytes()
    cap = 64 << 20
    marker = MARKER.format(limit="64.0 MiB", dropped=10 + 73400320 + 11 - cap, head=cap // 2, tail=cap - cap // 2)
    assert len(log) <= cap + len(marker) + 2, len(log)
    assert log.startswith(b"HEAD-MARK\n")
    assert log.endswith(b"\nTAIL-MARK\n")
    assert f"\n{marker}\n".encode() in log
