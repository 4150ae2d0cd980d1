"""Chaos: real pytest sessions on a private engine, interrupted, with their engine restarted or their sandbox killed.

Serial phase (see ``test_chaos_engine.py``): every test here drives its own ``dockerd``; the shared engine is only
read from (images are copied out of it once per module).

What must hold, whatever breaks:
- Ctrl-C (SIGINT to the pytest process) during an agent run or during evaluation, with or without xdist: no
  container or image of the run is left, no process of the session survives, every file in the run directory is
  complete or absent (never half-written), and ``--pb-resume`` then completes the run;
- the engine restarted mid-evaluation (during compile.sh, or while a hidden test branch runs): the item passes with
  the right score (after an infrastructure retry) or is an error; never a wrong score;
- the sandbox container killed or removed from outside mid-agent: an error naming the sandbox, not the agent's
  failure;
- stale containers and images of a dead run are reaped at session start; a live run's are not.
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Testbed
from tests.test_chaos_engine import FIXTURE_IMAGES, PrivateEngine, own_engine_module

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("clean_env")]

CATLIKE = "pbfix__catlike.c47c47c"
RUN_LABEL = "pytest-programbench"


@pytest.fixture(scope="module")
def engine(private_engine: PrivateEngine, docker_client: Any) -> Iterator[PrivateEngine]:
    with own_engine_module(private_engine, docker_client) as private:
        yield private


COMPILE_PAUSE = "sleep 8  # pytest-programbench chaos: a compile window long enough to be hit\n"


@pytest.fixture(scope="module")
def slow_submissions(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``hang`` variant (correct but for one test that hangs until run.sh's 10 s timeout: a long branch) whose
    compile.sh first sleeps (a long compile): every phase of its evaluation is a window a test can hit."""
    import io

    root = tmp_path_factory.mktemp("slow-submissions")
    source = testbed.submissions.parent / "hang" / CATLIKE / "submission.tar.gz"
    (root / CATLIKE).mkdir()
    with tarfile.open(source, "r:gz") as tar_in, tarfile.open(root / CATLIKE / "submission.tar.gz", "w:gz") as out:
        for member in tar_in:
            data = tar_in.extractfile(member).read() if member.isfile() else None  # type: ignore[union-attr]
            if member.name.lstrip("./") == "compile.sh" and data is not None:
                head, _, rest = data.partition(b"\n")
                data = head + b"\n" + COMPILE_PAUSE.encode() + rest
                member.size = len(data)
            out.addfile(member, io.BytesIO(data) if data is not None else None)
    return root


@pytest.fixture(scope="module")
def baseline(engine: PrivateEngine, testbed: Testbed, tmp_path_factory: pytest.TempPathFactory,
             slow_submissions: Path) -> dict[str, str]:
    """The score of the slow submission when nothing goes wrong: the only score a disturbed run may report."""
    session = start_session(engine, tmp_path_factory.mktemp("baseline"), testbed, "--pb-filter", CATLIKE,
                            "--pb-submissions", str(slow_submissions))
    assert session.wait(300) == pytest.ExitCode.TESTS_FAILED, session.output()[-3000:]
    outcome, props = session.outcomes()[CATLIKE]
    assert outcome == "failure"
    assert 0 < float(props["score"]) < 1
    return props


# ---------------------------------------------------------------------------------------------- session driver


@dataclass
class Session:
    """One ``pytest`` run in the background, in a session of its own (so nothing it starts can outlive it)."""

    proc: subprocess.Popen[bytes]
    workdir: Path
    run_dir: Path
    out: Path

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise AssertionError(f"the session did not end within {timeout} s:\n{self.output()[-4000:]}") from None

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def interrupt(self) -> None:
        os.kill(self.proc.pid, signal.SIGINT)

    def survivors(self) -> list[str]:
        """Processes still in the session this pytest started (workers, agents, helpers)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                raw = stat.read_text()
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2:].split()
            if int(fields[3]) == self.proc.pid:  # field 6: session id
                found.append(raw[: raw.rindex(")") + 1])
        return found

    def outcomes(self) -> dict[str, tuple[str, dict[str, str]]]:
        root = ET.parse(self.workdir / "junit.xml").getroot()
        result = {}
        for case in root.iter("testcase"):
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcome = kinds[0] if kinds else "passed"
            props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
            result[case.get("name", "")] = (outcome, props)
        return result


def start_session(engine: PrivateEngine, workdir: Path, testbed: Testbed, *args: str, run_dir: Path | None = None,
                  env: dict[str, str] | None = None) -> Session:
    workdir.mkdir(parents=True, exist_ok=True)
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\n")
    run_dir = run_dir or workdir / "run"
    out = workdir / f"out-{time.monotonic_ns()}.txt"
    argv = [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(workdir), "-p", "no:cacheprovider",
            "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
            "--pb-cpus", "2", "--junitxml", str(workdir / "junit.xml"), "-rA", "--log-level=INFO", *args]
    if "--pb-resume" not in args:
        argv += ["--pb-output", str(run_dir)]
    with out.open("wb") as handle:
        # SIGINT as a terminal delivers it, even when this suite was started in the background of a shell (which
        # leaves SIGINT ignored, and exec keeps that): the Ctrl-C tests send it.
        proc = subprocess.Popen(argv, cwd=workdir, env=engine.env(env), stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    return Session(proc, workdir, run_dir, out)


def wait_for_process(engine: PrivateEngine, pattern: str, session: Session, timeout: float = 180) -> dict[str, Any]:
    """The first running container of the engine with a process whose command line contains ``pattern``."""
    api = engine.client().api
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if session.proc.poll() is not None:
                raise AssertionError(f"the session ended before {pattern!r} ran:\n{session.output()[-4000:]}")
            for container in api.containers():
                try:
                    top = api.top(container["Id"])
                except Exception:  # gone meanwhile
                    continue
                if any(pattern in " ".join(proc) for proc in top.get("Processes") or []):
                    return dict(container)
            time.sleep(0.2)
    finally:
        api.close()
    raise AssertionError(f"no container ran {pattern!r} within {timeout} s:\n{session.output()[-4000:]}")


def resume_command(output: str) -> list[str]:
    """The resume command a session printed (the one line saying it)."""
    lines = [line for line in output.splitlines() if line.startswith("to resume (finished tasks are kept): ")]
    assert len(lines) == 1, output[-3000:]
    return shlex.split(lines[0].partition(": ")[2])


def run_id_of(run_dir: Path) -> str:
    return str(json.loads((run_dir / "pb-run.json").read_text())["run_id"])


def leftovers(engine: PrivateEngine, run_id: str | None = None) -> list[str]:
    api = engine.client().api
    try:
        label = f"{RUN_LABEL}={run_id}" if run_id else RUN_LABEL
        containers = [f"container {c['Id'][:12]} {c['Names']} {c['State']}"
                      for c in api.containers(all=True, filters={"label": label})]
        images = [f"image {i['Id'][:19]} {i.get('RepoTags')}" for i in api.images(all=True, filters={"label": label})]
        return containers + images
    finally:
        api.close()


def assert_run_dir_consistent(run_dir: Path) -> list[str]:
    """Every file is complete (parses as what it is) or absent; nothing half-written. Returns the files."""
    files = []
    for path in sorted(run_dir.rglob("*")):
        if not path.is_file():
            continue
        rel = str(path.relative_to(run_dir))
        files.append(rel)
        assert not path.name.endswith((".partial", ".tmp", ".part")), f"half-written file left: {rel}"
        if path.name.endswith(".json"):
            json.loads(path.read_text())
        elif path.name.endswith(".jsonl"):
            for line in path.read_text().splitlines():
                json.loads(line)
        elif path.name.endswith(".tar.gz"):
            with tarfile.open(path, "r:gz") as tar:
                for _member in tar:
                    pass
            with gzip.open(path) as handle:  # the gzip trailer too
                while handle.read(1 << 20):
                    pass
        elif path.name.endswith(".xml"):
            ET.parse(path)
    return files


def task_meta(run_dir: Path, task: str = CATLIKE) -> dict[str, Any] | None:
    path = run_dir / task / "pb-meta.json"
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------------------------------------- Ctrl-C

# Takes long enough to be interrupted, then writes a correct submission (so a resume passes); once the test has made
# the flag file (before a resume) it writes it at once.
SLOW_AGENT = "test -e /pb-flag/go || sleep 25; cp -r /pb-sol/. ."


def slow_agent_args(testbed: Testbed, flag_dir: Path) -> list[str]:
    flag_dir.mkdir(exist_ok=True)
    return ["--pb-filter", CATLIKE, "--pb-agent", SLOW_AGENT,
            "--pb-agent-mount", f"{testbed.solutions / CATLIKE}:/pb-sol", "--pb-agent-mount", f"{flag_dir}:/pb-flag"]


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["single", "xdist"])
def test_ctrl_c_during_agent_run(engine: PrivateEngine, testbed: Testbed, tmp_path: Path, xdist: list[str]) -> None:
    args = [*slow_agent_args(testbed, tmp_path / "flag"), *xdist]
    session = start_session(engine, tmp_path, testbed, *args)
    wait_for_process(engine, "sleep 25", session)
    session.interrupt()
    assert session.wait(120) == pytest.ExitCode.INTERRUPTED, session.output()[-3000:]
    run_id = run_id_of(session.run_dir)
    assert leftovers(engine, run_id) == []
    assert session.survivors() == []
    files = assert_run_dir_consistent(session.run_dir)
    assert f"{CATLIKE}/submission.tar.gz" not in files, "the agent never finished: no submission may exist"
    meta = task_meta(session.run_dir)
    assert meta is not None, f"no pb-meta.json recorded the interruption: {files}"
    assert meta["state"] == "interrupted", meta

    # The command the interrupted session printed resumes it: the --pb-* options come from the run's record.
    printed = resume_command(session.output())
    assert printed[:3] == ["pytest", "--pb-resume", str(session.run_dir)], printed
    assert [a for a in printed[3:] if a.startswith("--pb-")] == [], printed
    assert ("-n" in printed) == bool(xdist), printed
    (tmp_path / "flag" / "go").touch()  # the resumed agent need not be slow
    resumed = start_session(engine, tmp_path, testbed, *printed[1:])
    assert resumed.wait(300) == pytest.ExitCode.OK, resumed.output()[-4000:]
    outcome, props = resumed.outcomes()[CATLIKE]
    assert (outcome, float(props["score"])) == ("passed", 1.0)
    assert leftovers(engine) == []


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["single", "xdist"])
def test_ctrl_c_during_evaluation(engine: PrivateEngine, testbed: Testbed, tmp_path: Path, xdist: list[str],
                                  baseline: dict[str, str], slow_submissions: Path) -> None:
    args = ["--pb-filter", CATLIKE, "--pb-submissions", str(slow_submissions), *xdist]
    session = start_session(engine, tmp_path, testbed, *args)
    wait_for_process(engine, "eval/run.sh", session)  # a hidden test branch is running
    session.interrupt()
    assert session.wait(120) == pytest.ExitCode.INTERRUPTED, session.output()[-3000:]
    run_id = run_id_of(session.run_dir)
    assert leftovers(engine, run_id) == [], "containers and the committed compile image must be gone"
    assert session.survivors() == []
    files = assert_run_dir_consistent(session.run_dir)
    assert f"{CATLIKE}/{CATLIKE}.eval.json" not in files, "an interrupted evaluation has no result"
    meta = task_meta(session.run_dir)
    assert meta is not None, f"no pb-meta.json recorded the interruption: {files}"
    assert meta["state"] == "interrupted", meta

    resumed = start_session(engine, tmp_path, testbed, *args, "--pb-resume", str(session.run_dir))
    assert resumed.wait(300) == pytest.ExitCode.TESTS_FAILED, resumed.output()[-4000:]
    outcome, props = resumed.outcomes()[CATLIKE]
    assert (outcome, props["score"], props["n_passed"]) == ("failure", baseline["score"], baseline["n_passed"])
    assert leftovers(engine) == []


# ---------------------------------------------------------------------------------------------- engine restart


@pytest.mark.parametrize(("moment", "pattern"), [("compile", "sleep 8"), ("branch", "eval/run.sh")])
def test_engine_restart_mid_evaluation_never_gives_a_wrong_score(engine: PrivateEngine, testbed: Testbed,
                                                                 tmp_path: Path, moment: str, pattern: str,
                                                                 baseline: dict[str, str], slow_submissions: Path,
                                                                 record_property: Any) -> None:
    session = start_session(engine, tmp_path, testbed, "--pb-filter", CATLIKE, "--pb-submissions",
                            str(slow_submissions), "--pb-infra-retries", "2")
    wait_for_process(engine, pattern, session)
    engine.restart(down_seconds=1.0)
    session.wait(600)
    outcome, props = session.outcomes()[CATLIKE]
    record_property("chaos_outcome", f"{outcome} score={props.get('score')} "
                                     f"infra_attempt_1={props.get('infra_attempt_1', '')[:200]}")
    assert outcome in ("failure", "error"), session.output()[-4000:]
    if outcome == "failure":  # scored: then exactly as if nothing had happened
        assert (props["score"], props["n_passed"], props["n_tests"]) == (
            baseline["score"], baseline["n_passed"], baseline["n_tests"]), session.output()[-4000:]
        # The restart broke the first attempt; the retry scored it.
        assert "infra_attempt_1" in props, props
        assert "Docker engine" in props["infra_attempt_1"], props["infra_attempt_1"]
    else:  # an error only for the engine's outage, never for anything else, and never scored
        assert "score" not in props, props
        task = json.loads((session.run_dir / "summary.json").read_text())["tasks"][CATLIKE]
        assert (task["outcome"], task["score"]) == ("error", None), task
        reason = task["reasons"][-1]
        assert "infrastructure error" in reason, reason
        assert "Docker engine" in reason, reason
    assert leftovers(engine) == []
    assert_run_dir_consistent(session.run_dir)


def test_engine_restart_mid_agent_is_infrastructure(engine: PrivateEngine, testbed: Testbed, tmp_path: Path) -> None:
    session = start_session(engine, tmp_path, testbed, *slow_agent_args(testbed, tmp_path / "flag"),
                            "--pb-infra-retries", "0")
    wait_for_process(engine, "sleep 25", session)
    engine.restart(down_seconds=1.0)
    session.wait(300)
    outcome, props = session.outcomes()[CATLIKE]
    assert outcome == "error", session.output()[-4000:]
    assert "score" not in props, "the cut stream was scored"
    task = json.loads((session.run_dir / "summary.json").read_text())["tasks"][CATLIKE]
    assert (task["outcome"], task["score"]) == ("error", None), task
    reason = task["reasons"][-1]
    assert "infrastructure error" in reason, reason
    assert "Docker engine" in reason or "sandbox" in reason, reason
    assert leftovers(engine) == []


# ---------------------------------------------------------------------------------------------- sandbox killed


@pytest.mark.parametrize("how", ["kill", "remove"])
def test_sandbox_killed_from_outside_mid_agent_is_an_error(engine: PrivateEngine, testbed: Testbed, tmp_path: Path,
                                                           how: str) -> None:
    session = start_session(engine, tmp_path, testbed, "--pb-filter", CATLIKE, "--pb-agent", "sleep 60",
                            "--pb-infra-retries", "0")
    sandbox = wait_for_process(engine, "sleep 60", session)
    api = engine.client().api
    try:
        if how == "kill":
            api.kill(sandbox["Id"])
        else:
            api.remove_container(sandbox["Id"], force=True)
    finally:
        api.close()
    assert session.wait(180) == pytest.ExitCode.TESTS_FAILED
    outcome, props = session.outcomes()[CATLIKE]
    assert outcome == "error", f"the agent did not fail: the sandbox was lost\n{session.output()[-3000:]}"
    assert "score" not in props
    text = session.output()
    assert f"sandbox container {sandbox['Id'][:12]}" in text, text[-3000:]
    # Whichever check saw it go first: the agent's own command (its exec gone with the container), or the end-of-run
    # checks (a forced removal stops the container before it is gone).
    assert any(lost.format(sandbox["Id"][:12]) in text for lost in (
        "the engine lost the command of sandbox container {} ",
        "sandbox container {} stopped during the agent run", "sandbox container {} disappeared during the agent run",
        "sandbox container {} cannot run a command at the end of the agent run",
        "sandbox container {} stopped answering at the end of the agent run")), text[-3000:]
    assert leftovers(engine) == []


# ---------------------------------------------------------------------------------------------- reaping at start


def _labelled_container(engine: PrivateEngine, labels: dict[str, str]) -> str:
    api = engine.client().api
    try:
        created = api.create_container(FIXTURE_IMAGES[0], command=["sleep", "600"], labels=labels,
                                       host_config=api.create_host_config(network_mode="none"))
        api.start(created["Id"])
        return str(created["Id"])
    finally:
        api.close()


def _exists(engine: PrivateEngine, container_id: str) -> bool:
    from docker.errors import NotFound

    api = engine.client().api
    try:
        api.inspect_container(container_id)
        return True
    except NotFound:
        return False
    finally:
        api.close()


def test_session_start_reaps_dead_runs_not_live_ones(engine: PrivateEngine, testbed: Testbed,
                                                     tmp_path: Path) -> None:
    """Needs the session to call ``reaper.reap_dead_runs`` at start (the wiring line)."""
    from tests.test_reliability_reaper import dead_owner, live_owner

    with live_owner() as alive, dead_owner() as dead:
        dead_id = _labelled_container(engine, {RUN_LABEL: "deadbeef", **dead.labels()})
        live_id = _labelled_container(engine, {RUN_LABEL: "a11ve000", **alive.labels()})
        session = start_session(engine, tmp_path, testbed, "--pb-filter", CATLIKE, "--pb-submissions",
                                str(testbed.submissions))
        assert session.wait(300) == pytest.ExitCode.OK, session.output()[-3000:]
        assert not _exists(engine, dead_id), "the dead run's container survived the session start"
        assert _exists(engine, live_id), "a live run's container was removed"
        api = engine.client().api
        try:
            api.remove_container(live_id, force=True)
        finally:
            api.close()

