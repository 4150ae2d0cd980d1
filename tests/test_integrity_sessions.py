"""The integrity probes against hostile submissions, through real sessions (issues 20 and 21).

Each submission is evaluated by a real ``pytest --pb-submissions`` session on the test bed (real containers): the
item is scored the official way, failed (flagged where a flag applies), never passed, never an error; the
session's exit status and summary say so; no container or image is left. What each session holds:

* under ``-n 2`` and again without xdist: file names that are not UTF-8 in flagged paths (a file ``compile.sh``
  writes outside /workspace, a ``.pth`` in the archive) reach the report, JUnit, summary.json and the terminal
  escaped (``\\xff``), and the other tasks of the session still run;
* the ``-n 2`` session is one over copies of the test bed's tasks (tests/task_copies.py), made once
  (tests/shared_runs.py) and read by the two tests whose cases it holds, each case on its own item;
* a correct program with a tree 1,200 levels deep in its archive and another one made in /tmp by compile.sh scores
  exactly what it scores without them (the walk is iterative and bounded: a ``scan_bounded`` flag, no exception);
* a ``pyproject.toml`` with an integer past Python's 4,300-digit limit is a flag, not an infrastructure error;
* a process ``compile.sh`` leaves behind that writes ``conftest.py`` once the executable is stashed is stopped
  before the scan: the exploit never reaches the hidden tests;
* a login-shell snippet that writes ``conftest.py`` while the official runs its post-compile steps is seen by the
  scan of the frozen container right before its commit (and neutralised there under ``--pb-strict``);
* a sourceless ``argparse.pyc`` at the workspace root (a module pytest imports) that makes ``echo nope`` pass is
  flagged, and neutralised under ``--pb-strict``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import py_compile
import re
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.evaluation import integrity
from tests.conftest import Testbed
from tests.shared_runs import FinishedRun, made_once
from tests.task_copies import task_copies
from tests.test_evaluate_only import leaked

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("clean_env")]

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"
TUIISH = "pbfix__tuiish.7e1a0b2"
DEPTH = 1200
NOPE_COMPILE = b"#!/bin/sh\nprintf '#!/bin/sh\\necho nope\\n' > executable\nchmod +x executable\n"
# Every hidden test "passes" without running (so no rerun ever sees a failure).
EXPLOIT_CONFTEST = (
    "import pytest\n\n\n"
    "@pytest.hookimpl(tryfirst=True)\n"
    "def pytest_pyfunc_call(pyfuncitem):\n"
    "    return True\n"
)
UNDECODABLE = "\udcff\udcfe"  # the bytes ff fe, as Python holds a file name that is not UTF-8


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", *, mode: int = 0o644,
         kind: bytes = tarfile.REGTYPE) -> None:
    info = tarfile.TarInfo(f"./{name}")
    info.type = kind
    info.mode = mode
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def archive(out: Path, src: Path | None, extra: dict[str, bytes], *, deep: str | None = None) -> None:
    """``out/submission.tar.gz``: the files of ``src`` (compile.sh replaced if ``extra`` has one), ``extra``, and a
    directory chain ``DEPTH`` levels deep under ``deep``. Names may hold undecodable bytes (surrogates)."""
    out.mkdir(parents=True)
    with tarfile.open(out / "submission.tar.gz", "w:gz", format=tarfile.PAX_FORMAT,
                      errors="surrogateescape") as tar:
        for path in sorted(src.iterdir()) if src is not None else []:
            if path.name not in extra:
                _add(tar, path.name, path.read_bytes(), mode=path.stat().st_mode & 0o777)
        for name, data in extra.items():
            _add(tar, name, data, mode=0o755 if name.endswith(".sh") else 0o644)
        if deep is not None:
            # Ignored by git as a build tree would be: the official's `git add -A` (a 20 s step) never walks it.
            _add(tar, ".gitignore", f"{deep}/\n".encode())
            chain = deep
            for _ in range(DEPTH):
                chain += "/d"
                _add(tar, chain, mode=0o755, kind=tarfile.DIRTYPE)
            _add(tar, f"{chain}/leaf.txt", b"deep\n")


def session(pytester: pytest.Pytester, testbed: Testbed, submissions: Path, *args: str,
            copies: bool = False) -> pytest.RunResult:
    """``copies``: over the task copies tests/task_copies.py wrote in the pytester's directory, not the test bed's."""
    tasks, blobs = ((pytester.path / "tasks", pytester.path / "blobs") if copies
                    else (testbed.tasks_dir, testbed.blob_dir))
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks), "--pb-blob-dir", str(blobs),
        "--pb-submissions", str(submissions), "--pb-output", str(pytester.path / "run"), "--pb-cpus", "1",
        "--junitxml", str(pytester.path / "junit.xml"), *(("--pb-pull", "never") if copies else ()), *args,
    )


def _place(where: pytest.Pytester | Path) -> Path:
    """The directory a session ran in: a pytester's, or a shared finished run's copy (tests/shared_runs.py)."""
    return where if isinstance(where, Path) else where.path


def junit(where: pytest.Pytester | Path) -> dict[str, dict[str, str]]:
    """Per test case name: its properties, plus ``outcome`` (passed, failure, error, skipped) and ``message``."""
    root = ET.parse(_place(where) / "junit.xml").getroot()
    cases: dict[str, dict[str, str]] = {}
    for case in root.iter("testcase"):
        props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        message = next((child.get("message", "") + "\n" + (child.text or "") for child in case
                        if child.tag in ("failure", "error")), "")
        cases[case.get("name", "")] = {**props, "outcome": outcome, "message": message}
    return cases


def meta(where: pytest.Pytester | Path, instance_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((_place(where) / "run" / instance_id / "pb-meta.json").read_text())
    return data


def flags_of(where: pytest.Pytester | Path, instance_id: str) -> set[tuple[str, str]]:
    found = meta(where, instance_id)
    evaluation = found.get("evaluation", found)
    return {(f["kind"], f["path"]) for f in evaluation["integrity_flags"]}


def _undecodable_rpn(testbed: Testbed, out: Path) -> None:
    """The correct rpn program; compile.sh also leaves a cache file named ff fe outside /workspace, and the archive
    has a start-up file whose name is not UTF-8."""
    compile_sh = (testbed.solutions / RPN / "compile.sh").read_bytes() + (
        b"\nmkdir -p /usr/local/share/pbcache && touch \"/usr/local/share/pbcache/$(printf '\\377\\376').bin\"\n")
    archive(out, testbed.solutions / RPN, {"compile.sh": compile_sh,
                                           f"lib/{UNDECODABLE}.pth".encode("utf-8", "surrogateescape").decode(
                                               "utf-8", "surrogateescape"): b"import os\n"})


def _assert_undecodable_scored(where: pytest.Pytester | Path, result: pytest.RunResult, rpn: str = RPN) -> None:
    case = junit(where)[rpn]
    assert case["outcome"] == "failure"
    assert float(case["score"]) == 1.0  # the official score: the program is correct
    assert "python_startup: lib/\\xff\\xfe.pth" in case["integrity_flags"]
    assert "/usr/local/share/pbcache/\\xff\\xfe.bin" in case["integrity_flags"]
    assert "lib/\\xff\\xfe.pth" in case["message"]
    result.stdout.fnmatch_lines(["*python_startup: lib/\\xff\\xfe.pth*"])
    summary = json.loads((_place(where) / "run" / "summary.json").read_text())
    assert summary["tasks"][rpn]["outcome"] == "failed"
    assert summary["tasks"][rpn]["score"] == 1.0
    assert (integrity.PYTHON_STARTUP, "lib/\\xff\\xfe.pth") in flags_of(where, rpn)


# One session (-n 2) over copies of the test bed's tasks, one copy per case: the names that are not UTF-8, the deep
# trees and the pyproject.toml (test_hostile_names_and_trees_under_xdist), the process outliving compile.sh and the
# sourceless .pyc (test_a_process_outliving_compile_and_a_pyc_shadow_are_caught); each case's properties are its own
# item's, the session's (three failed each, no error, no container left) hold for all.
# Each copy keeps one branch active (ONE_BRANCH): every case's property is decided once per evaluation (what the
# scans find, what the official scores), not per branch.
CASES = {"undecodable": RPN, "deep": CATLIKE, "pyproject": TUIISH, "detached": CATLIKE, "pyc": TUIISH}
ONE_BRANCH = {RPN: "0b5e55e01a2b", CATLIKE: "3f9c1a7e2b40", TUIISH: "5e6f7a8b9c0d"}


@dataclasses.dataclass(frozen=True)
class Hostile:
    """The reader's copy of the shared session (``place``: its junit.xml and run/), the case ids, the session."""

    place: Path
    ids: dict[str, str]
    run: FinishedRun


@pytest.fixture(scope="module")
def hostile_session(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed,
                    docker_client: Any) -> tuple[FinishedRun, dict[str, str]]:
    ids: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        def prepare(place: Path) -> list[str]:
            ids.update(stack.enter_context(task_copies(place, testbed, docker_client, CASES, prefix="pbhostile",
                                                       one_branch=ONE_BRANCH)))
            subs = place / "subs"
            _undecodable_rpn(testbed, subs / ids["undecodable"])
            deep_compile = (testbed.solutions / CATLIKE / "compile.sh").read_bytes() + (
                b"\n(cd /tmp && i=0 && while [ $i -lt %d ]; do mkdir d && cd d || exit 1; i=$((i + 1)); done"
                b" && echo deep > leaf.txt)\n" % DEPTH)
            archive(subs / ids["deep"], testbed.solutions / CATLIKE, {"compile.sh": deep_compile}, deep="deep")
            archive(subs / ids["pyproject"], testbed.solutions / TUIISH,
                    {"pyproject.toml": b"[project]\nversion = " + b"9" * 5000 + b"\n"})
            archive(subs / ids["detached"], None, {"compile.sh": DETACHED_WRITER})
            archive(subs / ids["pyc"], None, {"compile.sh": NOPE_COMPILE, "argparse.pyc": _pyc_shadow(place)})
            (place / "ids.json").write_text(json.dumps(ids))
            return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(place / "tasks"), "--pb-blob-dir",
                    str(place / "blobs"), "--pb-submissions", str(subs), "--pb-output", str(place / "run"),
                    "--pb-pull", "never", "--pb-cpus", "1", "--junitxml", str(place / "junit.xml"), "-n", "2"]

        made = made_once(tmp_path_factory, "hostile-names-trees-and-writers", prepare, timeout=1500)
    return made, json.loads((made.place / "ids.json").read_text())


@pytest.fixture
def hostile(hostile_session: tuple[FinishedRun, dict[str, str]], tmp_path: Path, docker_client: Any) -> Hostile:
    made, ids = hostile_session
    # The whole session: every case failed (scored, flagged where a flag applies), none an error or left behind.
    result = made.result()
    result.assert_outcomes(failed=len(ids))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    summary = json.loads((made.place / "run" / "summary.json").read_text())
    assert summary["headline"]["errors"] == 0
    assert leaked(docker_client, made.place / "run") == []
    return Hostile(made.copy(tmp_path / "hostile"), ids, made)


def test_hostile_names_and_trees_under_xdist(hostile: Hostile) -> None:
    """-n 2: names that are not UTF-8 (rpn), deep trees (catlike), a pyproject.toml tomllib refuses (tuiish)."""
    ids = hostile.ids
    _assert_undecodable_scored(hostile.place, hostile.run.result(), ids["undecodable"])
    cases = junit(hostile.place)
    # The deep trees: scored exactly as without them (the correct program: 1.0), the bound said as a flag.
    deep = cases[ids["deep"]]
    assert float(deep["score"]) == 1.0
    assert deep["outcome"] == "failure"
    assert {kind for kind, _ in flags_of(hostile.place, ids["deep"])} == {integrity.SCAN_BOUNDED}
    assert "deeper than" in deep["integrity_flags"]
    assert "/tmp" not in deep["integrity_flags"]  # scratch space is listed, not walked
    # The pyproject.toml: a flag (pytest itself cannot read it either), scored, not an infrastructure error.
    assert cases[ids["pyproject"]]["outcome"] == "failure"
    assert (integrity.PYTEST_CONFIG, "pyproject.toml") in flags_of(hostile.place, ids["pyproject"])
    assert "cannot be parsed (ValueError)" in cases[ids["pyproject"]]["integrity_flags"]


def _pyc_shadow(tmp: Path) -> bytes:
    """A sourceless ``argparse.pyc``: pytest imports argparse (``_pytest.config``) from /workspace first, before it
    loads any conftest.py; it plants an exploit conftest.py where the hidden run's rootdir finds it (the workspace,
    and ``eval/`` for a branch whose ``eval/pytest.ini`` makes that the rootdir) and hands over to the real module."""
    source = tmp / "argparse.py"
    source.write_text(
        "import os, sys\n"
        "for where in ('.', 'eval'):\n"
        "    if os.path.isdir(where):\n"
        f"        open(os.path.join(where, 'conftest.py'), 'w').write({EXPLOIT_CONFTEST!r})\n"
        "here = os.path.dirname(os.path.abspath(__file__))\n"
        "del sys.modules['argparse']\n"
        "saved = sys.path[:]\n"
        "sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != here]\n"
        "import argparse as real\n"
        "sys.path[:] = saved\n"
        "globals().update({k: v for k, v in vars(real).items() if not k.startswith('__')})\n"
        "sys.modules['argparse'] = real\n")
    compiled = tmp / "argparse.pyc"
    py_compile.compile(str(source), cfile=str(compiled), doraise=True)
    return compiled.read_bytes()


# compile.sh leaves a process that waits for the evaluator to stash the executable (after the integrity scan of
# old), then writes the exploit conftest.py: the committed image would have it.
DETACHED_WRITER = NOPE_COMPILE + (
    b"cat > /tmp/late.sh <<'EOF'\n"
    b"while [ ! -e /opt/programbench-stashed-executable-do-not-modify ]; do sleep 0.05; done\n"
    b"cat > /workspace/conftest.py <<'PY'\n" + EXPLOIT_CONFTEST.encode() + b"PY\n"
    b"EOF\n"
    b"setsid sh /tmp/late.sh </dev/null >/dev/null 2>&1 &\n")
# compile.sh leaves a login-shell snippet: the official's next `bash -lc` step (after compile) writes conftest.py.
PROFILE_WRITER = NOPE_COMPILE + (
    b"cat > /etc/profile.d/zz-late.sh <<'EOF'\n"
    b"if [ -e /opt/programbench-stashed-executable-do-not-modify ] && [ ! -e /workspace/eval ]; then\n"
    b"cat > /workspace/conftest.py <<'PY'\n" + EXPLOIT_CONFTEST.encode() + b"PY\n"
    b"fi\n"
    b"EOF\n")


def test_a_process_outliving_compile_and_a_pyc_shadow_are_caught(hostile: Hostile) -> None:
    """A process outliving compile.sh (catlike), a sourceless .pyc shadowing a module pytest imports (tuiish)."""
    cases = junit(hostile.place)
    # The detached writer was stopped with compile.sh: `echo nope` scores what it deserves, and the note says so.
    detached = cases[hostile.ids["detached"]]
    assert float(detached["score"]) < 1.0
    assert "conftest" not in detached["integrity_flags"]
    assert re.search(r"compile.sh left \d+ process\(es\) running; they were stopped", detached["message"])
    # The sourceless .pyc: the official passes `echo nope` (the planted conftest.py), ours flags it.
    pyc = cases[hostile.ids["pyc"]]
    assert float(pyc["score"]) == 1.0
    assert pyc["outcome"] == "failure"
    assert (integrity.MODULE_SHADOWING, "argparse.pyc") in flags_of(hostile.place, hostile.ids["pyc"])


def test_hostile_submissions_without_xdist(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any) -> None:
    """No xdist: names that are not UTF-8 (rpn, on a one-branch copy) reach the report, JUnit, summary.json and the
    terminal escaped."""
    with task_copies(pytester.path, testbed, docker_client, {"undecodable": RPN}, prefix="pbnoxdist",
                     one_branch=ONE_BRANCH) as ids:
        subs = pytester.path / "subs"
        _undecodable_rpn(testbed, subs / ids["undecodable"])
        result = session(pytester, testbed, subs, copies=True)

        result.assert_outcomes(failed=1)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        _assert_undecodable_scored(pytester, result, ids["undecodable"])
        assert leaked(docker_client, pytester.path / "run") == []


def test_hostile_submissions_under_strict(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                          testbed: Testbed, docker_client: Any) -> None:
    """--pb-strict (-n 2): the .pyc is neutralised (tuiish); the conftest.py written by a login-shell snippet after
    compile.sh is found by the scan before the commit and neutralised (catlike). Their session is shared with
    tests/test_isolation.py's strict cases (tests.test_isolation.strict_session, over task copies)."""
    from tests.test_isolation import strict_session

    place, ids = strict_session(tmp_path_factory, testbed, docker_client, tmp_path / "strict")
    cases = junit(place)
    assert float(cases[ids["pyc"]]["score"]) < 1.0
    assert "argparse.pyc" in meta(place, ids["pyc"])["evaluation"]["neutralised"]
    catlike = flags_of(place, ids["profile"])
    assert (integrity.CHANGED_AFTER_COMPILE, "") in catlike
    assert (integrity.PYTEST_CONFIG, "conftest.py") in catlike
    assert "conftest.py" in meta(place, ids["profile"])["evaluation"]["neutralised"]
    assert float(cases[ids["profile"]]["score"]) < 1.0
