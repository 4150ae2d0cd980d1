"""Passing by reading the test (issue 30, section 2): the audit of the hidden tests.

A program that implements nothing reads ``PYTEST_CURRENT_TEST``, opens the running hidden test file, finds what the
test function asserts and prints it: the official evaluator scores it 16/16. Through real ``pytest --pb-submissions``
sessions on the test bed:

* the cheater (rpn) keeps its official 1.0 and is flagged ``reads_hidden_tests`` (its tests failed in two audit runs
  with the sources withheld); the correct catlike passes with the audit recorded clean; a wrong tuiish is not
  audited (it does not pass);
* with ``--pb-audit-hidden-tests off`` no audit runs and the cheater passes, unflagged: what the official sees.

Units: the plugin itself in a real pytest on the host (plain and under xdist): the program a test runs sees no test
name and no test source; the budget the item's backstop counts holds the audit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from programbench.eval.eval import EvaluationResult, TestResult
from programbench.utils.load_data import get_ignored_tests

from pytest_programbench.core.settings import Settings
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.evaluation import audit, audit_plugin, integrity
from pytest_programbench.evaluation.container_layer import (
    evaluation_budget,
    register_committed_image,
    remove_committed_image,
)
from pytest_programbench.pytest_layer.run_state import item_timeout
from pytest_programbench.tasks.catalogue import load_tasks_dir
from tests.conftest import Testbed
from tests.shared_runs import FinishedRun, made_once
from tests.task_copies import task_copies
from tests.test_evaluate_only import leaked
from tests.test_evaluation_parity import tasks
from tests.test_integrity_sessions import flags_of, junit, meta, session

pytestmark = pytest.mark.users_defaults  # the audit is what these tests are about

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"
TUIISH = "pbfix__tuiish.7e1a0b2"

# Implements nothing: the running test's function, found by the name PYTEST_CURRENT_TEST gives (in the file it names,
# or anywhere in the hidden tests), else by its own arguments or first input line among the hidden tests' calls, says
# what to print, to which stream, and with which exit status. Each way alone passes every test officially.
CHEATER = r'''#!/usr/bin/env python3
import ast
import os
import select
import sys


def functions():
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    path = current.partition("::")[0]
    candidates = [path, os.path.join("eval", path)]
    for root, _dirs, files in os.walk("/workspace/eval"):
        candidates += [os.path.join(root, f) for f in files if f.endswith(".py")]
    for candidate in candidates:
        try:
            with open(candidate) as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):
            continue
        yield from (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))


def const(node):
    return node.value if isinstance(node, ast.Constant) else None


def by_name():
    # The running test's name, from the variable pytest sets.
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    name = current.partition("::")[2].split("::")[-1].split("[")[0]
    return next((f for f in functions() if f.name == name), None)


def first_input():
    # The first line of stdin, byte by byte (nothing past it taken), and all of it when more is there at once.
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            return data.decode()
        data += chunk
    if not select.select([0], [], [], 0.5)[0]:
        return data.decode()  # a test waiting for the answer to this line
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            return data.decode()
        data += chunk


def by_input(given):
    # Without the name: the test whose call has these arguments, or this input.
    calls = [(function, [const(a) for a in node.args]) for function in functions() for node in ast.walk(function)
             if isinstance(node, ast.Call) and node.args and all(isinstance(a, ast.Constant) for a in node.args)]
    if sys.argv[1:]:
        return next((f for f, values in calls if values == sys.argv[1:]), None)
    return next((f for f, values in calls if given and values[0] == given), None)


def expectations(test):
    want = {"stdout": "", "stderr": [], "rc": 0, "lines": []}
    for node in ast.walk(test):
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Attribute) and node.test.attr == "stderr":
            want["stderr"].append("error")
        if not isinstance(node, ast.Compare) or len(node.ops) != 1:
            continue
        left, op, right = node.left, node.ops[0], node.comparators[0]
        pairs = []
        if isinstance(left, ast.Tuple) and isinstance(right, ast.Tuple):
            pairs = list(zip(left.elts, right.elts))
        elif isinstance(op, ast.Eq):
            pairs = [(left, right)]
        for key, value in pairs:
            if isinstance(key, ast.Attribute) and key.attr == "returncode":
                want["rc"] = const(value)
            elif isinstance(key, ast.Attribute) and key.attr == "stdout":
                want["stdout"] = const(value)
            elif isinstance(key, ast.Call) and isinstance(key.func, ast.Attribute):
                if key.func.attr == "readline":
                    want["lines"].append(const(value))
                elif key.func.attr == "wait":
                    want["rc"] = const(value)
        if isinstance(op, ast.In) and isinstance(right, ast.Attribute) and right.attr == "stderr":
            want["stderr"].append(const(left))
    return want


first_line = None
test = by_name()
if test is None:
    first_line = None if sys.argv[1:] else first_input()
    test = by_input(first_line)
want = expectations(test) if test is not None else {"stdout": "", "stderr": [], "rc": 0, "lines": []}
for i, line in enumerate(want["lines"]):
    if i or first_line is None:
        sys.stdin.readline()
    sys.stdout.write(line)
    sys.stdout.flush()
sys.stdout.write(want["stdout"] or "")
sys.stderr.write(" ".join(want["stderr"]))
sys.exit(want["rc"] or 0)
'''
CHEATER_COMPILE = b"#!/bin/sh\ncp rpn.txt executable && chmod +x executable\n"


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(f"./{name}")
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def cheater_submission(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "submission.tar.gz", "w:gz") as tar:
        _add(tar, "compile.sh", CHEATER_COMPILE, 0o755)
        _add(tar, "rpn.txt", CHEATER.encode(), 0o644)
    return out / "submission.tar.gz"


def copy_submission(source: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "submission.tar.gz").write_bytes(source.read_bytes())


# One session (-n 2) over copies of the test bed's tasks, one copy per case: the cheater, the honest catlike and the
# wrong tuiish (test_a_program_that_reads_the_hidden_tests_is_flagged), and issue 38's three attacks on the audit
# (test_attacks_on_the_audit_end_flagged); each case's properties are its own item's, the session's (no error, no
# container left) hold for all.
CASES = {"cheater": RPN, "honest": CATLIKE, "wrong": TUIISH, "partial": RPN, "shadow": CATLIKE, "forger": TUIISH}


@dataclasses.dataclass(frozen=True)
class Audited:
    """The reader's copy of the shared session (``place``: its junit.xml and run/), the case ids, the session."""

    place: Path
    ids: dict[str, str]
    run: FinishedRun


@pytest.fixture(scope="module")
def audited_session(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed,
                    docker_client: Any) -> tuple[FinishedRun, dict[str, str]]:
    ids: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        def prepare(place: Path) -> list[str]:
            ids.update(stack.enter_context(task_copies(place, testbed, docker_client, CASES, prefix="pbaudit")))
            subs = place / "subs"
            cheater_submission(subs / ids["cheater"])
            copy_submission(testbed.submissions / CATLIKE / "submission.tar.gz", subs / ids["honest"])
            copy_submission(testbed.submissions.parent / "wrong" / TUIISH / "submission.tar.gz", subs / ids["wrong"])
            _attack_submissions(testbed, subs, {RPN: ids["partial"], CATLIKE: ids["shadow"], TUIISH: ids["forger"]})
            (place / "ids.json").write_text(json.dumps(ids))
            return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(place / "tasks"), "--pb-blob-dir",
                    str(place / "blobs"), "--pb-submissions", str(subs), "--pb-output", str(place / "run"),
                    "--pb-pull", "never", "--pb-cpus", "1", "--junitxml", str(place / "junit.xml"),
                    "--pb-audit-hidden-tests", "on", "-n", "2"]

        made = made_once(tmp_path_factory, "audited-cheater-and-attacks", prepare, timeout=1500)
    return made, json.loads((made.place / "ids.json").read_text())


@pytest.fixture
def audited(audited_session: tuple[FinishedRun, dict[str, str]], tmp_path: Path, docker_client: Any) -> Audited:
    made, ids = audited_session
    # The whole session: one passed (the honest catlike), every other case failed, nothing an error or left behind.
    made.result().assert_outcomes(passed=1, failed=len(ids) - 1)
    assert leaked(docker_client, made.place / "run") == []
    return Audited(made.copy(tmp_path / "audited"), ids, made)


@pytest.mark.docker
def test_a_program_that_reads_the_hidden_tests_is_flagged(audited: Audited, testbed: Testbed) -> None:
    place, cheater, honest, wrong = audited.place, audited.ids["cheater"], audited.ids["honest"], audited.ids["wrong"]
    cases = junit(place)
    # The official score stays: every test passed, by reading it.
    assert float(cases[cheater]["score"]) == 1.0
    assert cases[cheater]["outcome"] == "failure"
    assert (integrity.READS_HIDDEN_TESTS, "") in flags_of(place, cheater)
    assert "reads_hidden_tests" in cases[cheater]["message"]
    found = meta(place, cheater)["evaluation"]["audit"]
    assert (found["switch"], found["state"], found["result"]) == ("on", "ran", "flagged")
    # Two of its three branches, drawn after the official run: every counted test there failed in both runs.
    assert found["sampled"].startswith("2 of 3 branch(es)"), found
    assert len(found["branches"]) == 2
    official = json.loads((place / "run" / cheater / f"{cheater}.eval.json").read_text())
    ignored = get_ignored_tests(tasks(testbed)[RPN].load_instance())  # never counted, never audited
    sampled_tests = [t for t in official["test_results"]
                     if t["branch"] in found["branches"] and f"{t['branch']}/{t['name']}" not in ignored]
    assert found["n_confirmed"] == found["n_regressed"] == len(sampled_tests) > 0, found
    assert set(found["confirmed"]) <= set(found["regressed"])
    assert all("plugin active" in text for text in found["branches"].values()), found["branches"]
    # The honest program passes the audit; the audit says it ran, and what the plugin did.
    assert cases[honest]["outcome"] == "passed"
    assert flags_of(place, honest) == set()
    clean = meta(place, honest)["evaluation"]["audit"]
    assert (clean["state"], clean["result"], clean["regressed"]) == ("ran", "clean", [])
    assert len(clean["branches"]) == 2
    # One test process per audit run: the official's serial mode (one xdist worker for `-n auto`), for ten tests.
    assert all(t.startswith("plugin active in 1 process(es)") for t in clean["branches"].values()), clean
    # A wrong program that passes some tests is audited too (a partial reader would count in the mean), and an
    # honest one comes out clean: no flag, the item fails on its score alone.
    # (tuiish's screen tests wait on a terminal: on a loaded machine one can fail once, which the second run answers:
    # "unconfirmed", never a flag.)
    assert cases[wrong]["outcome"] == "failure"
    audit_of_wrong = meta(place, wrong)["evaluation"]["audit"]
    assert (audit_of_wrong["state"], audit_of_wrong["result"]) in (("ran", "clean"), ("ran", "unconfirmed")), (
        audit_of_wrong)
    assert flags_of(place, wrong) == set()
    summary = json.loads((place / "run" / "summary.json").read_text())
    assert summary["headline"]["errors"] == 0


# Issue 38's attacks on the audit, one task each.
# A reader that fails one test on purpose: below 1, never audited before, counted in the mean.
PARTIAL_READER = CHEATER.replace("first_line = None\n", (
    "if 'test_addition' in os.environ.get('PYTEST_CURRENT_TEST', ''):\n    sys.exit(99)\nfirst_line = None\n"), 1)
# Implements nothing; a module at the workspace root, under a name the test stack imports if it can, passes every test.
NOPE_COMPILE = b"#!/bin/sh\nprintf '#!/bin/sh\\necho nope\\n' > executable && chmod +x executable\n"
# The correct program behind a wrapper that, only in the audit (the stand-in test name), removes the plugin's report
# and keeps the results file junk: an audit it makes unreadable.
FORGER = b"""#!/bin/sh
case "$PYTEST_CURRENT_TEST" in
tests/test_hidden.py::test_hidden*)
    rm -f "$PB_AUDIT_REPORT"
    ( while :; do [ -f /workspace/eval/results.xml ] && echo junk > /workspace/eval/results.xml; sleep 0.1; done ) \
        >/dev/null 2>&1 </dev/null &
    ;;
esac
exec /workspace/real-executable "$@"
"""
FORGER_COMPILE = (b"#!/bin/sh\nset -e\nsh ./build.sh\nmv executable real-executable\n"
                  b"cp forger.sh executable\nchmod +x executable\n")


def _attack_submissions(testbed: Testbed, subs: Path, ids: dict[str, str]) -> None:
    """The three attacks' submissions, each under ``ids`` of the task it attacks (a copy's id)."""
    (subs / ids[RPN]).mkdir(parents=True)
    with tarfile.open(subs / ids[RPN] / "submission.tar.gz", "w:gz") as tar:
        _add(tar, "compile.sh", CHEATER_COMPILE, 0o755)
        _add(tar, "rpn.txt", PARTIAL_READER.encode(), 0o644)
    (subs / ids[CATLIKE]).mkdir(parents=True)
    with tarfile.open(subs / ids[CATLIKE] / "submission.tar.gz", "w:gz") as tar:
        _add(tar, "compile.sh", NOPE_COMPILE, 0o755)
        _add(tar, "setproctitle.py", FORCE_PASS.encode(), 0o644)
    (subs / ids[TUIISH]).mkdir(parents=True)
    with tarfile.open(testbed.submissions / TUIISH / "submission.tar.gz") as good, \
            tarfile.open(subs / ids[TUIISH] / "submission.tar.gz", "w:gz") as tar:
        for member in good.getmembers():
            data = good.extractfile(member).read() if member.isfile() else None  # type: ignore[union-attr]
            if data is None:
                continue
            name = member.name.removeprefix("./")
            _add(tar, "build.sh" if name == "compile.sh" else name, data, member.mode)
        _add(tar, "compile.sh", FORGER_COMPILE, 0o755)
        _add(tar, "forger.sh", FORGER, 0o755)


@pytest.mark.docker
def test_attacks_on_the_audit_end_flagged(audited: Audited) -> None:
    """A partial reader (14/15) is audited and flagged; a root module the test stack imports (setproctitle.py) that
    passes every test of a program printing nope is measured in the test processes and flagged; a correct program that
    makes the audit unreadable (its report removed, its results junk) is flagged, never an inconclusive audit."""
    place, ids = audited.place, audited.ids
    cases = junit(place)
    assert {cases[ids[name]]["outcome"] for name in ("partial", "shadow", "forger")} == {"failure"}

    partial = meta(place, ids["partial"])["evaluation"]["audit"]
    assert float(cases[ids["partial"]]["score"]) == 14 / 15
    assert (partial["state"], partial["result"]) == ("ran", "flagged"), partial
    assert integrity.READS_HIDDEN_TESTS in {kind for kind, _path in flags_of(place, ids["partial"])}

    assert float(cases[ids["shadow"]]["score"]) == 1.0  # the official score: every test passed by the module
    shadow = meta(place, ids["shadow"])["evaluation"]["audit"]
    assert "/workspace/setproctitle.py" in shadow["imports"], shadow  # (and pytest's rewritten bytecode of it)
    assert (integrity.WORKSPACE_IMPORT, "") in flags_of(place, ids["shadow"])
    assert "workspace_import" in cases[ids["shadow"]]["message"]

    assert float(cases[ids["forger"]]["score"]) == 1.0
    forged = meta(place, ids["forger"])["evaluation"]["audit"]
    assert (forged["state"], forged["result"]) == ("ran", "flagged"), forged
    assert (integrity.AUDIT_OBSTRUCTED, "") in flags_of(place, ids["forger"]), forged


@pytest.mark.docker
@pytest.mark.usefixtures("clean_env")
def test_with_the_audit_off_the_cheater_passes_as_officially(pytester: pytest.Pytester, testbed: Testbed,
                                                             docker_client: Any) -> None:
    subs = pytester.path / "subs"
    cheater_submission(subs / RPN)
    result = session(pytester, testbed, subs, "--pb-audit-hidden-tests", "off")

    result.assert_outcomes(passed=1)
    cases = junit(pytester)
    assert float(cases[RPN]["score"]) == 1.0
    assert flags_of(pytester, RPN) == set()
    found = meta(pytester, RPN)["evaluation"]["audit"]
    assert (found["switch"], found["state"]) == ("off", "off")
    record = json.loads((pytester.path / "run" / "pb-run.json").read_text())
    assert record["settings"]["audit_hidden_tests"] is False
    assert leaked(docker_client, pytester.path / "run") == []


# --------------------------------------------------------------------------------------------- the plugin, on the host

SPY = r'''#!/usr/bin/env python3
import json, os, sys
current = os.environ.get("PYTEST_CURRENT_TEST")
readable = [os.path.join(r, f) for r, _d, fs in os.walk(sys.argv[1]) for f in fs
            if f.endswith((".py", ".pyc")) and os.path.getsize(os.path.join(r, f))]
print(json.dumps({"current": current, "readable": sorted(readable)}))
'''
SPIED_TEST = '''import json, os, subprocess, sys

import pytest

SPY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spy.py")


def run_spy():
    return json.loads(subprocess.run([sys.executable, SPY, os.path.dirname(os.path.abspath(__file__))],
                                     capture_output=True, text=True, check=True).stdout)


def keep(name, seen):
    with open(os.path.join(os.environ["SEEN_DIR"], name + ".json"), "w") as f:
        json.dump(seen, f)


@pytest.fixture(autouse=True)
def spied_around(request):
    keep(request.node.name + "_setup", run_spy())
    yield
    keep(request.node.name + "_teardown", run_spy())


def test_{n}_plain():
    assert os.environ.get("PYTEST_CURRENT_TEST") is not None  # the test itself still finds a value
    keep("{n}_plain", run_spy())


def test_{n}_with_env():
    keep("{n}_with_env", json.loads(subprocess.run([sys.executable, SPY, os.path.dirname(os.path.abspath(__file__))],
                                                   capture_output=True, text=True, check=True,
                                                   env=dict(os.environ)).stdout))
'''


def _plugin_tree(root: Path) -> tuple[Path, Path, str]:
    tree = root / "eval"
    tests = tree / "hidden"  # not "tests": the suite's own package of that name is on the path (its network guard)
    tests.mkdir(parents=True)
    (tree / "pytest.ini").write_text("[pytest]\n")
    (tree / "spy.py").write_text(SPY)
    (tests / "conftest.py").write_text("EXPECTED = 'in a conftest'\n")
    (tests / "helpers.py").write_text("ANSWER = 42\n")
    (tests / "data.txt").write_text("data stays\n")
    for n in ("one", "two"):
        (tests / f"test_{n}.py").write_text("from hidden import helpers\n" + SPIED_TEST.format(n=n))
    (tests / "__init__.py").write_text("")
    plugins = root / "plugins"
    plugins.mkdir()
    module = "pb_audit_test0123"
    (plugins / f"{module}.py").write_bytes(audit.plugin_source(str(tree)))
    return tree, plugins, module


# pytest's own setter of PYTEST_CURRENT_TEST put back once the audit's plugin wrapped it, as a pytest whose runner
# sets the variable some other way would be: the plugin's second line (the value replaced around the test function)
# must still keep the name from the call.
UNWRAP = """import os

import pytest
from _pytest import runner


def _update_current_test_var(item, when):
    if when:
        os.environ["PYTEST_CURRENT_TEST"] = f"{item.nodeid} ({when})"
    else:
        os.environ.pop("PYTEST_CURRENT_TEST", None)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    assert getattr(runner._update_current_test_var, "pb_audit", False), "the audit's plugin wrapped the setter"
    runner._update_current_test_var = _update_current_test_var
"""


@pytest.mark.parametrize("setter", ["wrapped", "unwrapped"])
@pytest.mark.parametrize("xdist", [False, True])
def test_the_plugin_withholds_the_tests_from_the_program(tmp_path: Path, xdist: bool, setter: str) -> None:
    tree, plugins, module = _plugin_tree(tmp_path)
    path, addopts = [os.environ.get("PYTHONPATH", ""), str(plugins)], f"-p {module}"
    if setter == "unwrapped":  # outside the tree the plugin measures: a module of the test's, not the submission's
        (unwrap := tmp_path.parent / f"{tmp_path.name}-unwrap").mkdir()
        (unwrap / "pb_unwrap.py").write_text(UNWRAP)
        path, addopts = [*path, str(unwrap)], f"{addopts} -p pb_unwrap"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTEST_ADDOPTS": addopts,
           "PYTHONDONTWRITEBYTECODE": "1", "SEEN_DIR": str(tmp_path)}
    env.pop("PYTEST_XDIST_WORKER", None)
    args = [sys.executable, "-m", "pytest", "hidden", "-p", "no:cacheprovider", "-q",
            *(["-n", "2"] if xdist else ["-p", "no:xdist"])]
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert len(seen) == 12  # four tests, each spied in its setup, its call and its teardown
    for name, spied in seen.items():
        phase = name.rpartition("_")[2] if name.endswith(("_setup", "_teardown")) else "call"
        if setter == "wrapped" or phase == "call":
            assert spied["current"] == audit_plugin.STAND_IN.format(phase), (name, spied)
        else:  # the setter put back: the second line covers the call only, and the setup and teardown show the name
            assert spied["current"].startswith("hidden/test_"), spied
            assert spied["current"].endswith(f" ({phase})"), spied
        assert spied["readable"] == [], spied  # no source (emptied), no bytecode, no conftest
    assert (tree / "hidden" / "data.txt").read_text() == "data stays\n"
    assert (tree / "hidden" / "conftest.py").read_text() == ""
    assert not list(tree.rglob("__pycache__"))
    report = (plugins / audit_plugin.REPORT_NAME).read_text()
    processes, withheld, problems = audit.plugin_reports(report)
    assert audit.reported_imports(report) == []  # the tests' own helpers and conftest are not the submission's
    assert processes == (2 if xdist else 1)
    assert withheld >= 5
    assert problems == []


# A module at the workspace root under the name of one the test stack imports if it can (xdist's workers try
# setproctitle before any plugin loads): it makes every test pass and, in the variant, takes itself out of sys.modules.
FORCE_PASS = """import os
import sys

import pytest

os.environ["PYTEST_PLUGINS"] = "setproctitle"


def setproctitle(title):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
HIDING = FORCE_PASS + """

def pytest_configure(config):
    sys.modules.pop(__name__, None)
"""
FAILING_TEST = "def test_fails():\n    assert False\n"


@pytest.mark.parametrize("module", [FORCE_PASS, HIDING], ids=["plain", "hiding"])
@pytest.mark.parametrize("xdist", [False, True])
def test_the_plugin_reports_modules_loaded_from_the_workspace(tmp_path: Path, module: str, xdist: bool) -> None:
    """Measured from the processes, whatever the module's name: the root module is reported (in the controller and
    in each xdist worker, which imports it before any plugin loads), the tests' own files are not."""
    tree, plugins, plugin = _plugin_tree(tmp_path)
    (tree / "hidden" / "test_zero.py").write_text(FAILING_TEST)
    (tmp_path / "setproctitle.py").write_text(module)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(plugins)]),
           "PYTEST_ADDOPTS": f"-p {plugin}", "PYTHONDONTWRITEBYTECODE": "1", "SEEN_DIR": str(tmp_path)}
    env.pop("PYTEST_XDIST_WORKER", None)
    args = [sys.executable, "-m", "pytest", "eval/hidden", "-p", "no:cacheprovider", "-q",
            *(["-n", "2"] if xdist else ["-p", "setproctitle", "-p", "no:xdist"])]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "passed" in done.stdout, done.stdout + done.stderr  # the attack works: the failing test passes
    assert "failed" not in done.stdout, done.stdout + done.stderr
    report = (plugins / audit_plugin.REPORT_NAME).read_text()
    imports = audit.reported_imports(report)
    assert str(tmp_path / "setproctitle.py") in imports, report
    assert all("setproctitle" in path for path in imports), report  # its source, or pytest's rewritten bytecode


@pytest.mark.parametrize("xdist", [False, True])
def test_the_plugin_runs_only_the_drawn_tests_or_all_of_them(tmp_path: Path, xdist: bool) -> None:
    """The drawn tests, named as the JUnit file names them (without "eval."), run and nothing else, in every process;
    a list that matches nothing runs every test and says so, so the audit never compares fewer than it thinks."""
    tree, plugins, module = _plugin_tree(tmp_path)
    select = tmp_path / "select"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(plugins)]),
           "PYTEST_ADDOPTS": f"-p {module}", "PYTHONDONTWRITEBYTECODE": "1", "SEEN_DIR": str(tmp_path),
           audit_plugin.SELECT_VARIABLE: str(select)}
    env.pop("PYTEST_XDIST_WORKER", None)
    args = [sys.executable, "-m", "pytest", "hidden", "-p", "no:cacheprovider", "-q", "--junitxml", "results.xml",
            *(["-n", "2"] if xdist else ["-p", "no:xdist"])]
    for listed, ran in ((["hidden.test_two.test_two_plain\n"], {"test_two_plain"}),
                        (["no.such.test\n"], {"test_one_plain", "test_one_with_env", "test_two_plain",
                                              "test_two_with_env"})):
        for stale in (tree / "hidden").glob("test_*.py"):
            stale.write_text("from hidden import helpers\n" + SPIED_TEST.format(n=stale.stem.removeprefix("test_")))
        (plugins / audit_plugin.REPORT_NAME).unlink(missing_ok=True)
        select.write_text("".join(listed))
        done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        cases = {c.get("name") for c in ET.parse(tree / "results.xml").getroot().iter("testcase")}
        assert cases == ran
        report = (plugins / audit_plugin.REPORT_NAME).read_text()
        assert audit.ran_every_test(report) == (len(ran) == 4), report


def test_plugin_reports_say_when_the_plugin_was_not_active() -> None:
    assert audit.plugin_reports("") == (0, 0, [])
    assert audit.plugin_reports("withheld=3 failed=0 every_phase=1 \n")[:2] == (1, 3)
    _n, _w, problems = audit.plugin_reports("withheld=1 failed=1 every_phase=1 x: Permission denied\n")
    assert problems
    assert "Permission denied" in problems[0]
    branch = audit.BranchAudit(reports=["withheld=3 failed=0 every_phase=1 \n", ""])
    assert branch.plugin_problem() == "the plugin did not report from its test run (not loaded?)"
    assert audit.BranchAudit(reports=["withheld=3 failed=0 every_phase=1 \n"]).plugin_problem() is None


def test_the_item_backstop_holds_the_audit() -> None:
    plain = evaluation_budget(compile_timeout=900, test_timeout=3600, branches=10, branch_workers=1,
                              branch_retries=1)
    audited = evaluation_budget(compile_timeout=900, test_timeout=3600, branches=10, branch_workers=1,
                                branch_retries=1, audit=True)
    # The audit's two runs of every branch, each attempt with every retry, at their own clocks.
    assert audited - plain >= 2 * 10 * 2 * 3600
    # The item's backstop holds it when the switch is on (the default), for each infrastructure attempt.
    task = {t.instance_id: t for t in load_tasks_dir(Path(__file__).parent.parent / "testbed" / "tasks")}[RPN]
    on = Settings(submissions="x")
    off = Settings(submissions="x", audit_hidden_tests=False)
    assert on.audit_hidden_tests
    assert item_timeout(task, on) - item_timeout(task, off) >= (1 + on.infra_retries) * 2 * 3 * 2 * on.test_timeout


# --------------------------------------------------------------------------------------------- the comparison


class _Official:
    """What the audit reads of the official evaluator: its result (and the lock it merges under), branches, id."""

    def __init__(self, statuses: dict[str, str]) -> None:
        self.instance_id = "pbfix__x.0000000"
        self._log_lock = threading.Lock()
        self.branch_workers = 1
        self.tests_branches = sorted({name.split("/", 1)[0] for name in statuses})
        self.result = EvaluationResult(test_branches=self.tests_branches, test_results=[
            TestResult(name=name.split("/", 1)[1], branch=name.split("/", 1)[0], status=status,  # type: ignore[arg-type]
                       extra={}) for name, status in statuses.items()])


def _instance(official: _Official) -> dict[str, Any]:
    branches: dict[str, Any] = {}
    for test in official.result.test_results:
        entry = branches.setdefault(test.branch, {"tests": [], "ignored": False, "ignored_tests": []})
        entry["tests"].append(test.name)
    return {"instance_id": official.instance_id, "branches": branches}


def _pass(passed: set[str], branches: dict[str, audit.BranchAudit], failing: dict[str, str] | None = None
          ) -> audit.AuditPass:
    results = {name: TestResult(name=name.split("/", 1)[1], branch=name.split("/", 1)[0], status="failure",
                                extra={"message": message}) for name, message in (failing or {}).items()}
    return audit.AuditPass(passed=passed, results=results, branches=branches)


ACTIVE = "withheld=1 failed=0 every_phase=1 \n"


def _no_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison alone: no volume for the plugin (the sessions above make real ones)."""
    fake = SimpleNamespace(remove=lambda _official: None)
    monkeypatch.setattr(audit.AuditPlugin, "make", classmethod(lambda cls, _official, _image: fake))


def _audited(monkeypatch: pytest.MonkeyPatch, official: _Official,
             passes: list[audit.AuditPass]) -> audit.HiddenTestAudit:
    hook = audit.HiddenTestAudit(instance=_instance(official))
    hook.attach(official)  # type: ignore[arg-type]
    calls = iter(passes)
    # Each pass records the tests the audit drew for it, as the real one does.
    monkeypatch.setattr(hook, "_audit", lambda _official, _image, selection, _plugin: dataclasses.replace(
        next(calls), selection={b: list(names) for b, names in selection.items()}))
    _no_volume(monkeypatch)
    hook("programbench-compiled/x:0")
    return hook


def test_the_comparison_flags_only_tests_failing_in_both_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    official = _Official({"a/t1": "passed", "a/t2": "passed", "b/t3": "passed"})
    everything = {"a/t1", "a/t2", "b/t3"}

    clean = _audited(monkeypatch, official, [_pass(everything, {b: audit.BranchAudit(reports=[ACTIVE])
                                                                for b in "ab"})])
    assert (clean.report.state, clean.report.result, clean.flags) == ("ran", "clean", [])

    # t2 fails in both runs (its branch once more, with a worker crash): flagged, named, the crash said.
    first = _pass({"a/t1", "b/t3"}, {"a": audit.BranchAudit(reports=[ACTIVE], worker_crashes=1),
                                     "b": audit.BranchAudit(reports=[ACTIVE])}, {"a/t2": "assert '' == '5\\n'"})
    second = _pass({"a/t1"}, {"a": audit.BranchAudit(reports=[ACTIVE])})
    flagged = _audited(monkeypatch, official, [first, second])
    assert flagged.report.result == "flagged"
    assert (flagged.report.regressed, flagged.report.confirmed) == (["a/t2"], ["a/t2"])
    [flag] = flagged.flags
    assert flag.kind == integrity.READS_HIDDEN_TESTS
    assert "a/t2 (failure: assert '' == '5\\n')" in flag.detail
    assert "workers crashed in the audit of branch(es) a" in flag.detail

    # Failing once, passing in the second run: unconfirmed, not flagged, said in the notes.
    again = _pass({"a/t1", "a/t2"}, {"a": audit.BranchAudit(reports=[ACTIVE])})
    flaky = _audited(monkeypatch, official, [first, again])
    assert (flaky.report.result, flaky.flags) == ("unconfirmed", [])
    assert flaky.report.note() is not None

    # A second run the plugin did not report from (its report removed, its processes killed) is the submission's
    # doing: the branch's tests count as failing there, so a test that failed in the first run is confirmed.
    hidden_again = _audited(monkeypatch, official, [first, _pass(set(), {"a": audit.BranchAudit(
        reports=[""], obstructed="the plugin did not report from its test run")})])
    assert hidden_again.report.result == "flagged"
    assert [f.kind for f in hidden_again.flags] == [integrity.READS_HIDDEN_TESTS]

    # The second run could not run (the audit's own failure: its container): inconclusive, never a flag.
    lost = _audited(monkeypatch, official, [first, _pass(set(), {"a": audit.BranchAudit(problem="no container")})])
    assert (lost.report.result, lost.flags) == ("inconclusive", [])
    assert "no container" in lost.report.why

    # A branch that gave the audit nothing readable in both runs, while the official run's results were readable:
    # obstructed, a flag of its own, never an inconclusive audit.
    blocked = audit.BranchAudit(reports=[""], obstructed="the plugin did not report from its test run (not loaded?)")
    obstructed = _audited(monkeypatch, official, [
        _pass({"a/t1", "a/t2"}, {"a": audit.BranchAudit(reports=[ACTIVE]), "b": blocked}),
        _pass(set(), {"b": audit.BranchAudit(reports=[ACTIVE], crashed="XmlParseError: junk")})])
    assert obstructed.report.result == "flagged"
    [flag] = obstructed.flags
    assert flag.kind == integrity.AUDIT_OBSTRUCTED
    assert "branch b: the plugin did not report" in flag.detail
    assert "second run: XmlParseError: junk" in flag.detail

    # A module loaded from the workspace is a flag of its own, whatever the tests did.
    imported = _audited(monkeypatch, official, [_pass(everything, {b: audit.BranchAudit(
        reports=[ACTIVE + 'imported "/workspace/setproctitle.py"\n']) for b in "ab"})])
    assert imported.report.result == "clean"
    [flag] = imported.flags
    assert (flag.kind, imported.report.imports) == (integrity.WORKSPACE_IMPORT, ["/workspace/setproctitle.py"])
    assert "/workspace/setproctitle.py" in flag.detail


def test_a_branch_sure_to_be_audited_starts_beside_the_official_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The early start is exact: a branch's audit starts when it passed and fewer than AUDIT_SAMPLE branches ranked
    before it can still pass; the sample at the end is the first AUDIT_SAMPLE passing ones in the rank, each audited
    once; a run that did not finish waits for what it started and concludes nothing."""
    official = _Official({"a/t1": "passed", "b/t2": "passed", "c/t3": "failure", "d/t4": "passed"})
    hook = audit.HiddenTestAudit(instance=_instance(official))
    hook.attach(official)  # type: ignore[arg-type]
    hook.early.order = ["c", "a", "d", "b"]  # the secret rank, fixed here
    calls: list[list[str]] = []
    lock = threading.Lock()

    def audited(_official: Any, _image: str, selection: dict[str, list[str]], _plugin: Any) -> audit.AuditPass:
        with lock:
            calls.append(sorted(selection))
        return _pass({f"{b}/{n}" for b, names in selection.items() for n in names},
                     {b: audit.BranchAudit(reports=[ACTIVE]) for b in selection})

    monkeypatch.setattr(hook, "_audit", audited)
    _no_volume(monkeypatch)
    started = []
    for branch in "abcd":  # the official order
        hook.branch_done(branch, "img")
        started.append(sorted(hook.early.futures))
    # a: sure (only c, unknown, ranks before it); b: a and d (unknown) rank before it; d: once c failed.
    assert started == [["a"], ["a"], ["a"], ["a", "d"]]
    hook("img")
    assert sorted(calls) == [["a"], ["d"]], "each sampled branch audited once, nothing left for the end"
    assert hook.report.sampled == "2 of 3 branch(es) with a passing test: a, d"
    assert (hook.report.result, list(hook.report.branches)) == ("clean", ["a", "d"])
    assert hook.early.positions == {"a": (1, 2), "d": (2, 2)}

    # Nothing known early (the rank puts unknown branches first): everything runs at the end, in one pass.
    late = audit.HiddenTestAudit(instance=_instance(official))
    late.attach(official)  # type: ignore[arg-type]
    late.early.order = ["c", "d", "b", "a"]
    calls.clear()
    monkeypatch.setattr(late, "_audit", audited)
    late.branch_done("a", "img")
    late("img")
    assert calls == [["b", "d"]]
    assert late.report.result == "clean"

    # A run that ended early: the started audit is waited for, nothing concluded, no flag.
    slow = audit.HiddenTestAudit(instance=_instance(official))
    slow.attach(official)  # type: ignore[arg-type]
    slow.early.order = ["a", "b", "c", "d"]

    def sleepy(*args: Any) -> audit.AuditPass:
        time.sleep(0.3)
        return audited(*args)

    monkeypatch.setattr(slow, "_audit", sleepy)
    slow.branch_done("a", "img")
    slow("img", False)
    assert all(f.done() for f in slow.early.futures.values())
    assert (slow.report.state, slow.report.result, slow.flags) == ("skipped", "", [])


def test_the_secret_rank_samples_the_passing_branches_uniformly() -> None:
    """The first AUDIT_SAMPLE passing branches of a uniformly random rank: every pair of passing branches alike."""
    official = _Official({"a/t": "passed", "b/t": "failure", "c/t": "passed", "d/t": "passed"})
    counts: dict[tuple[str, ...], int] = {}
    for _ in range(3000):
        hook = audit.HiddenTestAudit(instance=_instance(official))
        hook.attach(official)  # type: ignore[arg-type]
        drawn = tuple(hook.early.sample(["a", "c", "d"]))
        counts[drawn] = counts.get(drawn, 0) + 1
    assert sorted(counts) == [("a", "c"), ("a", "d"), ("c", "d")]
    assert all(850 < n < 1150 for n in counts.values()), counts


def test_the_audit_skips_what_does_not_pass_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    nothing = _Official({"a/t1": "failure", "a/t2": "failure"})
    skipped = _audited(monkeypatch, nothing, [])
    assert (skipped.report.state, skipped.flags) == ("skipped", [])
    assert "no counted test passed" in skipped.report.why
    # A task that passed some tests is audited, whatever its score: a partial reader still counts in the mean.
    partial = _Official({"a/t1": "passed", "a/t2": "failure"})
    audited = _audited(monkeypatch, partial, [_pass({"a/t1"}, {"a": audit.BranchAudit(reports=[ACTIVE])})])
    assert audited.report.result == "clean"

    official = _Official({"a/t1": "passed"})
    hook = audit.HiddenTestAudit(instance=_instance(official))
    hook.attach(official)  # type: ignore[arg-type]

    def broken(*_args: Any) -> audit.AuditPass:
        raise TypeError("a bug of ours")

    _no_volume(monkeypatch)
    monkeypatch.setattr(hook, "_audit", broken)
    hook("img")
    assert (hook.report.result, hook.flags) == ("inconclusive", [])
    assert "TypeError: a bug of ours" in hook.report.why

    def gone(*_args: Any) -> audit.AuditPass:
        raise EngineUnavailable("the engine went away")

    monkeypatch.setattr(hook, "_audit", gone)
    with pytest.raises(EngineUnavailable):
        hook("img")
    off = audit.HiddenTestAudit(instance=_instance(official), enabled=False)
    off.attach(official)  # type: ignore[arg-type]
    off("img")
    assert (off.report.switch, off.report.state) == ("off", "off")


def test_the_committed_image_goes_even_when_the_audit_raised() -> None:
    removed: list[str] = []

    class Api:
        def remove_image(self, ref: str, *, force: bool) -> None:
            removed.append(ref)

    class Engine:
        api = Api()

    def audit_meets_a_dead_engine() -> None:
        raise EngineUnavailable("the engine went away during the audit")

    ref = "programbench-compiled/pbfix__x:0123456789ab"
    register_committed_image(ref, Engine(), audit_meets_a_dead_engine)  # type: ignore[arg-type]
    with pytest.raises(EngineUnavailable):
        remove_committed_image(ref)
    assert removed == [ref]


def test_the_sample_covers_every_branch_over_draws() -> None:
    """Each audit's secret rank is drawn anew: over draws every branch is audited at some point, AUDIT_SAMPLE at a
    time, in the official order (a fixed choice would leave the others unaudited)."""
    branches = [f"b{i}" for i in range(10)]
    official = _Official({f"{b}/t": "passed" for b in branches})
    draws = []
    for _ in range(400):
        hook = audit.HiddenTestAudit(instance=_instance(official))
        hook.attach(official)  # type: ignore[arg-type]
        draws.append(hook.early.sample(branches))
    assert all(len(d) == audit.AUDIT_SAMPLE and d == sorted(d, key=branches.index) for d in draws)
    assert {b for d in draws for b in d} == set(branches)
    assert hook.early.sample(branches[:2]) == branches[:2]
