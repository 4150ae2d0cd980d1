"""How the evaluation reads a branch's results, its clocks, its storage and the files it writes (issues 20 §1 and
21 §1, §3, §4), each finding as a real session or a real engine:

* ``eval/results.xml`` that is a character device or a FIFO: the instance's 0 with ``EmptyTestResultError`` (the
  official's score for a device; it hangs forever on a FIFO), never a hang; a sparse 200 MB one: that branch
  ``results_read_failed``, never read whole;
* a submission whose executable forges the JUnit file through a FIFO while pytest writes it: flagged, never passed;
* a login profile that sleeps in every later step: the item's backstop fires inside the evaluation and the item is
  scored 0, never an error;
* the backstop counts every clock of the official pipeline (read from its source);
* output files take the umask (0644 under 022) as the official's do;
* evaluation containers ask for a storage limit where the engine can take one, and go on without it where it refuses.
"""

from __future__ import annotations

import ast
import copy
import json
import stat
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from programbench.utils.load_data import load_all_instances

from pytest_programbench.core.atomic import atomic_copy, atomic_write_text
from pytest_programbench.engine.facts import facts as engine_facts
from pytest_programbench.evaluation import container_layer
from pytest_programbench.evaluation.results_check import (
    RESULTS_MISMATCH,
    check_branch,
    mangled,
    outcome_lines,
    reported_not_passed,
)
from pytest_programbench.tasks.catalogue import load_tasks_dir
from tests.conftest import Testbed
from tests.task_copies import task_copies
from tests.test_evaluation_parity import official_blob_dir  # noqa: F401 - a fixture
from tests.test_outcomes import leaked

RPN = "pbfix__rpn.0b5e55e"
TAG = "task_cleanroom_v6"


def _umask() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise AssertionError("no Umask line in /proc/self/status")


# --------------------------------------------------------------------------------------------- output modes


def test_output_files_take_the_umask(tmp_path: Path) -> None:
    """Atomic writes (eval.json, pb-meta.json, summary.json, report.html, the copied submission) make files as
    any other write does: 0666 less the umask (0644 under the usual 022), like the official's outputs."""
    expected = 0o666 & ~_umask()
    atomic_write_text(tmp_path / "out" / "eval.json", "{}")
    source = tmp_path / "submission.tar.gz"
    source.write_bytes(b"\x1f\x8b")
    source.chmod(0o600)  # the copy's mode is the umask's, not the source's
    atomic_copy(source, tmp_path / "out" / "submission.tar.gz")
    for name in ("eval.json", "submission.tar.gz"):
        assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == expected, name
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval.json", "submission.tar.gz"]  # no temp left


# --------------------------------------------------------------------------------------------- JUnit cross-check

HONEST_TESTS = '''
import os
import pytest


def test_passes():
    print("1 passed in 0.01s")  # a program's output may look like pytest's outcome line
    assert True


def test_fails():
    print("==== 1 passed in 0.01s ====")
    assert 1 == 2


@pytest.mark.parametrize("arg", ["a - b", "x::y", "plain"])
def test_params(arg):
    assert arg != "plain"


def test_skipped():
    pytest.skip("not today")


@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False


@pytest.mark.xfail(reason="flaky", strict=False)
def test_xpass():
    assert True


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown")


def test_passes_then_teardown_errors(broken_teardown):
    assert True


def test_crashes_its_worker():
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(1)


class TestGroup:
    def test_in_class(self):
        assert True
'''


def _honest_run(pytester: pytest.Pytester, *args: str) -> tuple[str, str]:
    pytester.makepyfile(test_honest=HONEST_TESTS)
    with pytest.MonkeyPatch.context() as env:
        # The suite's own xdist worker's variables would make the inner session's process "a worker" to
        # test_crashes_its_worker, which then ends the whole run without -n (no results.xml at all).
        for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
            env.delenv(name, raising=False)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--junitxml=results.xml", "-rA", *args)
    return (pytester.path / "results.xml").read_text(), result.stdout.str()


@pytest.fixture(scope="module")
def honest_runs() -> dict[tuple[str, ...], tuple[str, str]]:
    """The honest sessions' JUnit file and output by their arguments, each made once in this module: the ``-n 2`` one
    is read by two tests (the agreement under xdist, and the forgeries made from it)."""
    return {}


def _honest_once(pytester: pytest.Pytester, honest_runs: dict[tuple[str, ...], tuple[str, str]],
                 *args: str) -> tuple[str, str]:
    if args not in honest_runs:
        honest_runs[args] = _honest_run(pytester, *args)
    return honest_runs[args]


@pytest.mark.parametrize("args", [("-n", "2"), ("-q",), ()], ids=["xdist", "quiet", "plain"])
def test_cross_check_agrees_with_honest_pytest_runs(pytester: pytest.Pytester, args: tuple[str, ...],
                                                    honest_runs: dict[tuple[str, ...], tuple[str, str]]) -> None:
    """Every kind of outcome pytest has (xfail, xpass, skips, a teardown error after a pass, a crashed xdist worker,
    parameters with `::` and ` - `): the JUnit file and pytest's own report agree, no flag."""
    xml, output = _honest_once(pytester, honest_runs, *args)
    assert outcome_lines(output), output[-2000:]
    assert check_branch("b1", xml, {"output": output, "returncode": 1, "exception_info": ""}) is None


def _forge(xml: str, *, passes: tuple[str, ...] = (), fails: tuple[str, ...] = ()) -> str:
    """The JUnit file rewritten: the testcases named in ``passes`` (every one when empty) lose their failure, error
    or skip; those in ``fails`` get a failure."""
    root = ET.fromstring(xml)
    for case in root.iter("testcase"):
        name = case.get("name", "")
        if not passes or name in passes:
            for child in [c for c in case if c.tag in ("failure", "error", "skipped")]:
                case.remove(child)
        if name in fails:
            ET.SubElement(case, "failure", message="forged")
    return ET.tostring(root, encoding="unicode")


def test_cross_check_flags_forged_passes(pytester: pytest.Pytester,
                                         honest_runs: dict[tuple[str, ...], tuple[str, str]]) -> None:
    """Forgeries of the honest -n 2 session's JUnit file (the one test_cross_check_agrees_with_honest_pytest_runs
    [xdist] reads, made once) are flagged."""
    xml, output = _honest_once(pytester, honest_runs, "-n", "2")
    entry = {"output": output, "returncode": 1, "exception_info": ""}
    forged = _forge(xml)
    flag = check_branch("b1", forged, entry)
    assert flag is not None
    assert flag.kind == RESULTS_MISMATCH
    assert "pytest's own outcome line" in flag.detail, flag.detail
    # One failure made a pass while the count stays right (a pass turned into a failure elsewhere): the short
    # summary names it.
    swapped = _forge(xml, passes=("test_fails",), fails=("test_in_class",))
    assert check_branch("b1", swapped, {"output": ""}) is not None  # (the forgery is read as such)
    flag = check_branch("b1", swapped, entry)
    assert flag is not None
    assert "test_honest.test_fails" in flag.detail, flag
    # Copies of one passing testcase (each is scored): more passes than pytest counted.
    root = ET.fromstring(xml)
    suite = next(root.iter("testsuite"))
    original = next(c for c in suite.iter("testcase") if c.get("name") == "test_passes")
    suite.extend(copy.deepcopy(original) for _ in range(10))
    flag = check_branch("b1", ET.tostring(root, encoding="unicode"), entry)
    assert flag is not None
    assert "pytest's own outcome line" in flag.detail
    # pytest's report missing (killed before its summary, or the clock fired): passes cannot be vouched for.
    for lost in ({"output": "", "returncode": -1, "exception_info": "Command timed out after 5s"},
                 {"output": "collected 12 items\n", "returncode": 137, "exception_info": ""}):
        flag = check_branch("b1", xml, lost)
        assert flag is not None
        assert "cannot be checked" in flag.detail
    # A forger that appends its own outcome line after pytest's: pytest's line still disagrees (shown without the
    # short summary, which would give it away on its own).
    unlisted = "\n".join(line for line in output.splitlines() if not line.startswith(("FAILED", "ERROR")))
    assert check_branch("b1", forged, {"output": unlisted}) is not None
    appended = {"output": unlisted + "\n============ 12 passed in 0.50s ============\n", "returncode": 0,
                "exception_info": ""}
    assert check_branch("b1", forged, appended) is not None


def test_cross_check_reads_pytest_lines() -> None:
    assert [dict(line.counts) for line in outcome_lines(
        "=== 2 failed, 1 passed, 3 rerun, 1 warning in 65.43s (0:01:05) ===\n1 passed in 0.1s\nno tests ran in 0.01s\n"
        "\x1b[31m= 1 error in 0.2s =\x1b[0m\ncollected 3 items\n")] == [
        {"failed": 2, "passed": 1, "rerun": 3, "warning": 1}, {"passed": 1}, {}, {"error": 1}]
    assert mangled("eval/tests/test_x.py::TestA::test_y[a - b::c]") == "eval.tests.test_x.TestA.test_y[a - b::c]"
    output = ("FAILED eval/tests/test_x.py::test_in_captured_output\n"
              "======= short test summary info =======\nPASSED eval/tests/test_x.py::test_ok\n"
              "FAILED eval/tests/test_x.py::test_y[a - b] - AssertionError: x - y\nERROR eval/tests/test_x.py::test_z\n"
              "======= 2 failed, 1 passed in 0.1s =======\nFAILED after/the_line.py::test\n")
    assert reported_not_passed(output) == ["eval/tests/test_x.py::test_y[a - b] - AssertionError: x - y",
                                           "eval/tests/test_x.py::test_z"]


# --------------------------------------------------------------------------------------------- clocks


def _official_clocks() -> dict[str, int]:
    """Every literal timeout in the official evaluator's steps, read from its source: step name -> seconds."""
    import programbench

    root = Path(programbench.__file__).parent
    clocks: dict[str, int] = {}
    tree = ast.parse((root / "eval" / "eval.py").read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr not in ("_run_step", "_copy_file_from_container"):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        name = keywords.get("step_name")
        if not isinstance(name, ast.Constant):
            continue
        timeout = keywords.get("timeout")
        literal = timeout.value if isinstance(timeout, ast.Constant) else 20  # _run_step's default
        assert isinstance(literal, int), ast.dump(node)
        clocks[str(name.value)] = literal
    control = ast.parse((root / "utils" / "internet_control.py").read_text())
    for function in control.body:
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.keyword) and node.arg == "timeout" and isinstance(node.value, ast.Constant):
                    assert isinstance(node.value.value, int)
                    clocks[function.name] = node.value.value
    return clocks


def test_the_backstop_counts_every_official_clock() -> None:
    official = _official_clocks()
    assert {"wipe_workspace", "compile", "run_tests", "results_read", "block_build_internet_dns"} <= set(official)
    ours = {**container_layer.COMPILE_PHASE_CLOCKS, **container_layer.BRANCH_CLOCKS}
    for step, seconds in official.items():
        if step in ("compile", "run_tests"):
            continue  # ours: --pb-compile-timeout, --pb-test-timeout
        assert ours.get(step, -1) >= seconds, (step, seconds, "missing from container_layer's clock tables")
    budget = container_layer.evaluation_budget(compile_timeout=900, test_timeout=3600, branches=3, branch_workers=1,
                                               branch_retries=1)
    assert budget >= sum(official.values()) - official["run_tests"] + 3 * 2 * official["run_tests"]


def test_item_timeout_covers_the_evaluation_budget() -> None:
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.pytest_layer.run_state import item_timeout
    from pytest_programbench.tasks.catalogue import load_tasks_dir

    task = {t.instance_id: t for t in load_tasks_dir(Path(__file__).parent.parent / "testbed" / "tasks")}[RPN]
    settings = Settings(submissions="x")  # evaluate-only: no agent clock
    budget = container_layer.evaluation_budget(
        compile_timeout=settings.compile_timeout, test_timeout=settings.test_timeout, branches=3,
        branch_workers=settings.branch_workers, branch_retries=settings.branch_retries)
    assert item_timeout(task, settings) >= (1 + settings.infra_retries) * budget


# --------------------------------------------------------------------------------------------- hostile submissions

# The submission's executable (it runs as root while the hidden tests run): on its first call it starts a detached
# process that holds pytest's own stdout open (so the branch's `run_tests` step lasts until it is done), and
#   forge:   replaces eval/results.xml with a FIFO before pytest writes it, reads what pytest writes, and once
#            pytest is gone renames a copy with every failure and error removed into place;
#   chardev: once pytest is gone, puts a character device (/dev/null's numbers) there;
#   fifo:    a FIFO;
#   huge:    a sparse 200 MB file.
# The program itself prints `nope`: it solves nothing.
HOSTILE_EXECUTABLE = r'''#!/usr/bin/env python3
import os, stat, time
MODE = "@MODE@"
RESULTS = "/workspace/eval/results.xml"


def pytest_pids():
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"pytest" in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def work():
    held = []
    for pid in pytest_pids():
        try:
            held.append(os.open(f"/proc/{pid}/fd/1", os.O_WRONLY))
        except OSError:
            pass
    if MODE == "forge":
        os.mkfifo(RESULTS)
        with open(RESULTS, "rb") as f:  # pytest's JUnit writer opens it for writing: both go on
            written = f.read()
    deadline = time.time() + 120
    while pytest_pids() and time.time() < deadline:
        time.sleep(0.05)
    tmp = RESULTS + ".tmp"
    if MODE == "forge":
        import xml.etree.ElementTree as ET
        root = ET.fromstring(written)
        for case in root.iter("testcase"):
            for child in [c for c in case if c.tag in ("failure", "error")]:
                case.remove(child)
        with open(tmp, "wb") as f:
            f.write(ET.tostring(root))
    elif MODE == "chardev":
        os.mknod(tmp, stat.S_IFCHR | 0o644, os.makedev(1, 3))
    elif MODE == "fifo":
        os.mkfifo(tmp)
    elif MODE == "huge":
        with open(tmp, "wb") as f:
            f.write(b"<testsuites>")
            f.truncate(200 << 20)
    os.rename(tmp, RESULTS)
    for fd in held:
        os.close(fd)


try:
    lock = os.open("/tmp/pb-hostile.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
except FileExistsError:
    pass
else:
    os.close(lock)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for n in (0, 1, 2):
                os.dup2(null, n)
            try:
                work()
            finally:
                os._exit(0)
        os._exit(0)
    os.wait()
print("nope")
'''

HOSTILE_COMPILE = "#!/bin/sh\nset -e\ncp hostile.py executable\nchmod +x executable\n"
# A login profile that sleeps in every later `bash -lc` step, each time just under the shortest step clock (10 s: a
# step that times out has every process but init killed, the container's own command too, which ends the evaluation
# at once, the official's the same): the evaluation then lasts minutes, whatever the machine's speed.
SLEEPY_COMPILE = (
    "#!/bin/sh\nset -e\ngcc -O2 -o executable main.c\n"
    "printf 'sleep 8\\n' > /etc/profile.d/zz-sleep.sh\n"
)
MODES = ("forge", "chardev", "fifo", "huge")

# Gives one item (named by PB_TEST_BACKSTOP_ITEM) a short pytest-timeout backstop; the plugin keeps a marker it finds.
BACKSTOP_PLUGIN = textwrap.dedent("""
    import os
    import pytest

    def pytest_collection_modifyitems(items):
        for item in items:
            if item.name == os.environ.get("PB_TEST_BACKSTOP_ITEM"):
                item.add_marker(pytest.mark.timeout(int(os.environ["PB_TEST_BACKSTOP"]), method="signal"))
""")


def _archive(out: Path, files: dict[str, bytes]) -> Path:
    import io
    import tarfile

    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return out


def hostile_archive(out: Path, mode: str) -> Path:
    return _archive(out, {"compile.sh": HOSTILE_COMPILE.encode(),
                          "hostile.py": HOSTILE_EXECUTABLE.replace("@MODE@", mode).encode()})




@pytest.mark.docker
@pytest.mark.usefixtures("clean_env")
def test_hostile_results_are_scored_flagged_never_errors(pytester: pytest.Pytester, testbed: Testbed,
                                                         docker_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One session (-n 2), five hostile submissions evaluated the official way: each item failed (never passed,
    never an error), scored as the official scores it, flagged where a flag applies, no container left."""
    root = pytester.path
    # "asleep": the longest item (its backstop's 45 s and the teardown after it) sorts first, so it starts first;
    # the plugin's schedule keeps collection order between tasks it expects to take as long (copies of one task).
    with task_copies(root, testbed, docker_client, {name: RPN for name in ("asleep", *MODES)},
                     prefix="pbread") as ids:
        subs = root / "subs"
        for mode in MODES:
            hostile_archive(subs / ids[mode] / "submission.tar.gz", mode)
        main_c = (testbed.solutions / RPN / "main.c").read_bytes()
        _archive(subs / ids["asleep"] / "submission.tar.gz", {"compile.sh": SLEEPY_COMPILE.encode(), "main.c": main_c})
        pytester.makepyfile(pb_backstop=BACKSTOP_PLUGIN)
        monkeypatch.setenv("PB_TEST_BACKSTOP_ITEM", ids["asleep"])
        # 45 s: well inside the evaluation (every step after compile.sh sleeps 8 s, so it runs for minutes), and the
        # session's longest item (the others take 14-48 s on the other worker).
        monkeypatch.setenv("PB_TEST_BACKSTOP", "45")
        run_dir = root / "run"
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-p", "pb_backstop", "--pb-tasks-dir", str(root / "tasks"),
            "--pb-blob-dir", str(root / "blobs"), "--pb-submissions", str(subs), "--pb-pull", "never",
            "--pb-output", str(run_dir), "--pb-cpus", "2", "-n", "2", timeout=1500)
        result.assert_outcomes(failed=len(ids))
        tasks = json.loads((run_dir / "summary.json").read_text())["tasks"]
        meta = {name: json.loads((run_dir / iid / "pb-meta.json").read_text()) for name, iid in ids.items()}
        flags = {name: [f["kind"] for f in m["evaluation"]["integrity_flags"]] for name, m in meta.items()}

        # Issue 21 §1: the forged JUnit file gives the official score (every test passes) and a flag.
        forged = tasks[ids["forge"]]
        assert forged["outcome"] == "failed", forged
        assert forged["score"] == 1.0  # the official is blind to it
        assert RESULTS_MISMATCH in flags["forge"], flags["forge"]
        # Issue 20 §1: a device or a FIFO at eval/results.xml: the instance's 0 (EmptyTestResultError), no hang.
        for mode in ("chardev", "fifo"):
            assert (tasks[ids[mode]]["score"], tasks[ids[mode]]["error_code"]) == (0.0, "EmptyTestResultError"), mode
            kind = "character device" if mode == "chardev" else "FIFO"
            assert any(kind in note for note in meta[mode]["evaluation"]["notes"]), meta[mode]["evaluation"]["notes"]
        # Issue 21 §3: a sparse 200 MB results file is not read: its branches results_read_failed, eval.json small.
        huge = meta["huge"]["evaluation"]
        assert huge["score"] == 0.0
        assert set(huge["branch_errors"]) == {"0b5e55e01a2b", "4d3c2b1a0f9e", "9a8b7c6d5e4f"}
        assert all(codes == ["results_read_failed"] for codes in huge["branch_errors"].values()), huge
        assert (run_dir / ids["huge"] / f"{ids['huge']}.eval.json").stat().st_size < 1 << 20
        # Issue 21 §4: every step made to run to its clock; the backstop fired inside the evaluation: scored 0.
        sleepy = tasks[ids["asleep"]]
        assert (sleepy["outcome"], sleepy["score"], sleepy["error_code"]) == ("failed", 0.0, "backstop_timeout")
        assert any("backstop" in note for note in meta["asleep"]["evaluation"]["notes"])
        # Issue 20 §1: output files take the umask, as the official's.
        expected = 0o666 & ~_umask()
        task_dir = run_dir / ids["forge"]
        for path in (run_dir / "summary.json", task_dir / "pb-meta.json", task_dir / f"{ids['forge']}.eval.json",
                     task_dir / "submission.tar.gz"):
            assert stat.S_IMODE(path.stat().st_mode) == expected, path
        assert leaked(docker_client, run_dir) == []


@pytest.mark.docker
@pytest.mark.usefixtures("official_blob_dir")
def test_device_results_score_as_the_official(testbed: Testbed, tmp_path: Path) -> None:
    """`programbench eval` itself on a submission that leaves a character device (/dev/null's numbers) at
    eval/results.xml: 0, EmptyTestResultError. Ours on the same submission gives the same, with a note naming the
    device: test_hostile_results_are_scored_flagged_never_errors's chardev case (one evaluation of it, not two)."""
    from tests.test_evaluation_divergences import run_official_cli

    archive = hostile_archive(tmp_path / "s.tar.gz", "chardev")
    instance = {i["instance_id"]: i for i in load_all_instances(testbed.tasks_dir)}[RPN]
    summary, official = run_official_cli(instance, archive, tmp_path / "official")
    assert official is None  # it raised: no eval.json
    assert (summary.score, summary.error_code) == (0.0, "EmptyTestResultError")


@pytest.mark.docker
def test_storage_limit_refused_by_the_engine_is_dropped(testbed: Testbed) -> None:
    """An evaluation container asks for a size limit where the driver looks able; an engine that refuses it (overlay2
    without xfs pquota, as here when forced) gets the container without it, and is not asked again."""
    import docker

    from pytest_programbench.sandbox.sandbox import StorageQuota

    client = docker.from_env()  # its own client: the remembered answer stays with it
    try:
        engine_facts(client.api).storage_quota = StorageQuota(True, "forced by the test")
        env = container_layer.SdkContainerEnvironment(
            image=f"programbench/pbfix_1776_rpn.0b5e55e:{TAG}", engine=client, storage=1 << 30, cpus=2,
            labels={"pytest-programbench": "pb-test-storage"}, lifetime=120)
        try:
            opts = client.api.inspect_container(env.container_id)["HostConfig"].get("StorageOpt") or {}
            if env.storage_limited:  # an engine that can (xfs with pquota, btrfs, zfs)
                assert opts == {"size": str(1 << 30)}
            else:
                assert opts == {}
                remembered = engine_facts(client.api).storage_quota
                assert isinstance(remembered, StorageQuota)
                assert remembered.supported is False
                assert "refused" in remembered.reason
            assert env.execute("echo ok")["output"] == "ok\n"
        finally:
            env.cleanup()
    finally:
        client.close()


@pytest.mark.docker
def test_disk_checked_before_and_after_an_evaluation_that_ran_out(testbed: Testbed, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Short before the evaluation: an error (no container started). A compile.sh failing with "No space left on
    device": the disk is checked again once its containers are gone; still short (another task, the host) is an
    error, room again means the submission used it: scored 0 with a note."""
    from pytest_programbench.engine import disk
    from tests.test_evaluation_divergences import run_ours

    task = {t.instance_id: t for t in load_tasks_dir(testbed.tasks_dir)}[RPN]
    full = _archive(tmp_path / "full.tar.gz", {"compile.sh": b"#!/bin/sh\necho 'write error: No space left on device'"
                                                             b" >&2\nexit 1\n"})
    needs: list[int] = []
    monkeypatch.setattr(disk, "run_need", lambda: needs.pop(0) if needs else 0)

    needs[:] = [1 << 62]
    before = run_ours(task, full, testbed.blob_dir, tmp_path / "before")
    assert before.infra_error is not None
    assert "not enough disk space" in before.infra_error
    assert before.result is None  # nothing ran

    needs[:] = [0, 1 << 62]  # room before, short after
    after = run_ours(task, full, testbed.blob_dir, tmp_path / "after")
    assert after.infra_error is not None
    assert "still short" in after.infra_error, after.notes

    needs[:] = [0, 0]
    scored = run_ours(task, full, testbed.blob_dir, tmp_path / "scored")
    assert scored.infra_error is None
    assert (scored.score, scored.error_code) == (0.0, "compile_failed")
    assert any("submission used it" in note for note in scored.notes), scored.notes


@pytest.mark.docker
@pytest.mark.usefixtures("official_blob_dir")
@pytest.mark.parametrize("content", [b"", b"definitely not gzip\n"], ids=["empty", "not-gzip"])
def test_unreadable_archives_score_as_the_row_says(testbed: Testbed, tmp_path: Path, content: bytes) -> None:
    """README's row: a 0-byte or non-gzip archive is RuntimeError for `programbench eval` (the container's GNU tar
    refuses both), invalid_submission_archive for us, 0 for both."""
    from tests.test_evaluation_divergences import run_official_cli, run_ours

    archive = tmp_path / "submission.tar.gz"
    archive.write_bytes(content)
    task = {t.instance_id: t for t in load_tasks_dir(testbed.tasks_dir)}[RPN]
    instance = {i["instance_id"]: i for i in load_all_instances(testbed.tasks_dir)}[RPN]
    summary, _ = run_official_cli(instance, archive, tmp_path / "official")
    assert (summary.score, summary.error_code) == (0.0, "RuntimeError")
    outcome = run_ours(task, archive, testbed.blob_dir, tmp_path / "ours")
    assert (outcome.score, outcome.error_code) == (0.0, "invalid_submission_archive")
