"""Issue 30 §4: text from a sandbox or a submission reaches a reader escaped, never raw.

An agent whose log holds a title change (OSC 0), a clipboard write (OSC 52), an erased line and a fake green
``PASSED``, which leaves a ``conftest.py`` in a directory whose name holds the same, and a ``compile.sh`` that prints
them too, runs in a real session (``runpytest_subprocess``, real sandboxes): the session's raw output, JUnit,
summary.json, pb-meta.json, report.html, harness.log and the live and file logs hold the escaped forms (``\\x1b``)
and no control byte of the sandbox's. The unit tests pin :func:`printable` over every code point and at each boundary.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import jinja2
import pytest
from _pytest.reports import TestReport
from markupsafe import Markup

from pytest_programbench.results import compare, progress, report
from pytest_programbench.results.summary import RunSummary, TaskRecord
from pytest_programbench.results.verdict import read_failing, sanitise_report, tail_lines
from pytest_programbench.text.printable import PrintableRecords, html_text, printable, sanitise
from tests.conftest import Testbed
from tests.test_compare import _attempts_run
from tests.test_evaluate_only import leaked

RPN = "pbfix__rpn.0b5e55e"
BIDI = frozenset(range(0x202A, 0x202F)) | frozenset(range(0x2066, 0x206A))
NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def expected(char: str, multiline: bool) -> str:
    """The escape of one character, from Unicode's own categories (an independent statement of the rule)."""
    code = ord(char)
    if multiline and char in "\t\n":
        return char
    if char in NAMED:
        return NAMED[char]
    category = unicodedata.category(char)
    if category == "Cc" or code in BIDI:  # C0, DEL, C1; bidi embeddings, overrides, isolates
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    if category == "Cs":  # a lone surrogate: an undecodable byte (surrogateescape) as \xNN
        return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"
    return char


def unsafe(text: str, multiline: bool) -> list[str]:
    """Characters a reader must never get raw."""
    return [c for c in text if expected(c, multiline) != c]


@pytest.mark.parametrize("multiline", [False, True])
def test_every_code_point_is_escaped_as_its_category_says(multiline: bool) -> None:
    everything = "".join(map(chr, range(0x110000)))
    shown = printable(everything, multiline=multiline)
    assert shown == "".join(expected(c, multiline) for c in everything)
    assert unsafe(shown, multiline) == []
    shown.encode("utf-8")  # always encodable (xdist, JUnit, the terminal)
    assert printable(shown, multiline=multiline) == shown  # idempotent: two boundaries show what one does


def test_random_text_never_keeps_a_control_byte() -> None:
    alphabet = "ab \\x1b[]0;\t\n\r\x00\x07\x1b\x7f\x85\x9b\u202e\u2066\u2028\udcff\ud800é€😀"
    rng = random.Random(30)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        for multiline in (False, True):
            shown = printable(text, multiline=multiline)
            assert unsafe(shown, multiline) == [], repr(text)
            assert (shown == text) == (unsafe(text, multiline) == []), repr(text)
            assert printable(shown, multiline=multiline) == shown


def test_the_attacks_of_the_issue_read_as_escapes() -> None:
    assert printable("\x1b]0;title\x07") == "\\x1b]0;title\\x07"
    assert printable("\x1b]52;c;cm0gLXJmIH4=\x07") == "\\x1b]52;c;cm0gLXJmIH4=\\x07"
    assert printable("x\r\x1b[2K\x1b[32mPASSED\x1b[0m\x00") == "x\\r\\x1b[2K\\x1b[32mPASSED\\x1b[0m\\x00"
    assert printable("a\tb\nc", multiline=True) == "a\tb\nc"
    assert printable("a\tb\nc\r") == "a\\tb\\nc\\r"
    assert printable("\u202egnp.exe \x9b31m \udcff") == "\\u202egnp.exe \\x9b31m \\xff"
    assert printable("C:\\x1b\\path é 😀") == "C:\\x1b\\path é 😀"  # backslashes and printable text as they are


def test_a_log_tail_is_escaped_quickly() -> None:
    tail = "\x1b[32mPASSED\x1b[0m\x07\x00" * 8192  # 128 KiB, a third of it control bytes
    started = time.perf_counter()
    shown = printable(tail, multiline=True)
    assert time.perf_counter() - started < 1.0
    assert "\x1b" not in shown
    assert shown.count("\\x1b") == 2 * 8192


def test_sanitise_walks_containers() -> None:
    value = {"k\x1b": ["a\x07", ("b\n", 3)], "n": None}
    assert sanitise(value) == {"k\\x1b": ["a\\x07", ("b\n", 3)], "n": None}
    assert sanitise(value, multiline=False) == {"k\\x1b": ["a\\x07", ("b\\n", 3)], "n": None}


def test_a_report_leaves_escaped() -> None:
    report = TestReport("programbench::x", ("x", None, "x"), {}, "failed",
                        "score 0\n  \x1b]0;title\x07\n  \x1b[32mPASSED\x1b[0m", "call",
                        [("Captured stdout call", "out \x1b[2K\n")],
                        user_properties=[("test:main/t\x1b[1m\nfake", "failed"), ("integrity_flags", "a\x07")])
    sanitise_report(report)
    assert report.longrepr == "score 0\n  \\x1b]0;title\\x07\n  \\x1b[32mPASSED\\x1b[0m"
    assert report.sections == [("Captured stdout call", "out \\x1b[2K\n")]
    assert report.user_properties == [("test:main/t\\x1b[1m\\nfake", "failed"), ("integrity_flags", "a\\x07")]


def test_a_traceback_holding_control_bytes_becomes_its_escaped_text() -> None:
    try:
        raise RuntimeError("container said \x1b]0;title\x07")
    except RuntimeError:
        info = pytest.ExceptionInfo.from_current()
    report = TestReport("programbench::x", ("x", None, "x"), {}, "failed", info.getrepr(), "call", [])
    sanitise_report(report)
    assert isinstance(report.longrepr, str)
    assert "container said \\x1b]0;title\\x07" in report.longrepr
    assert "\x1b" not in report.longrepr


def test_the_agent_log_tail_is_escaped_line_by_line(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"start\n\x1b]0;title\x07\x1b]52;c;eA==\x07\nprogress\r\x1b[2K\x1b[32mPASSED\x1b[0m\x00\t!\n")
    assert tail_lines(log) == ["start", "\\x1b]0;title\\x07\\x1b]52;c;eA==\\x07", "progress",
                               "\\x1b[2K\\x1b[32mPASSED\\x1b[0m\\x00\t!"]
    log.write_bytes(b"\x1b" * 1000 + b"\n")
    assert tail_lines(log, width=10) == ["\\x1b" * 10 + " [...]"]  # cut before escaping, never mid-escape


def test_hidden_test_texts_are_escaped(tmp_path: Path) -> None:
    eval_json = tmp_path / "x.eval.json"
    eval_json.write_text(json.dumps({"test_results": [
        {"branch": "main", "name": "t\x1b[1m\nx", "status": "failed",
         "extra": {"message": "got \x1b]0;t\x07\nline two\r"}},
        {"branch": "main", "name": "u", "status": "not_run",
         "extra": {"error_details": "\x1b[2K\x1b[32mPASSED"}}]}))
    failing = read_failing(eval_json, lambda b, n: True)["main"]
    assert [(t.name, t.detail) for t in failing] == [("t\\x1b[1m\\nx", "got \\x1b]0;t\\x07\nline two\\r"),
                                                      ("u", "\\x1b[2K\\x1b[32mPASSED")]


def test_html_pages_escape_control_bytes_and_markup() -> None:
    env = jinja2.Environment(autoescape=True, finalize=html_text)
    page = env.from_string("<pre>{{ text }}</pre>{{ n }}{{ safe }}").render(
        text="<b>\x1b]0;t\x07\n</b>", n=3, safe=Markup("<i>ok</i>"))
    assert page == "<pre>&lt;b&gt;\\x1b]0;t\\x07\n&lt;/b&gt;</pre>3<i>ok</i>"


def test_report_and_compare_pages_escape_what_they_print(tmp_path: Path) -> None:
    """report.html and compare.html escape every value they print, whatever the run's files hold (a reason from a
    run of an older version, a test name from a submission-swayed eval.json)."""
    header = {"run_id": "r", "run_dir": str(tmp_path), "plugin_version": "0", "programbench_version": "1.2.5"}
    record = TaskRecord(RPN, "c", "easy", outcome="failed", score=0.0, reasons=["flag \x1b]0;t\x07\u202e"])
    page = report.render(tmp_path, RunSummary(tmp_path / "summary.json", header, [record]).as_dict(), lambda _: None)
    assert "flag \\x1b]0;t\\x07\\u202e" in page
    assert unsafe(page, multiline=True) == []

    evil = "t\x1b]0;t\x07"
    _attempts_run(tmp_path / "base", {"t1": [{f"b/{evil}": "passed", "b/x": "passed"}] * 2})
    _attempts_run(tmp_path / "new", {"t1": [{f"b/{evil}": "failure", "b/x": "passed"}] * 2})
    written = compare.write(tmp_path / "base", tmp_path / "new")
    assert [r["test"] for r in written.result["tasks"]["t1"]["pass_to_fail"]] == [f"b/{evil}"]
    page = written.html_path.read_text()
    assert "b/t\\x1b]0;t\\x07" in page
    assert unsafe(page, multiline=True) == []


def test_log_records_are_made_printable_once_for_every_handler() -> None:
    try:
        raise ValueError("bad \x1b[2K")
    except ValueError:
        record = logging.LogRecord("programbench.eval", logging.DEBUG, __file__, 1, "Output: %s", ("\x1b]0;t\x07\n",),
                                   sys.exc_info())
    assert PrintableRecords().filter(record) is True
    handler = logging.StreamHandler()
    text = handler.format(record)
    assert text.startswith("Output: \\x1b]0;t\\x07\n")
    assert "bad \\x1b[2K" in text
    assert "\x1b" not in text
    malformed = logging.LogRecord("x", logging.INFO, __file__, 1, "%s %s", ("one",), None)
    assert PrintableRecords().filter(malformed) is True  # logging reports it as it would; never raised here


def test_the_progress_view_shows_printable_lines() -> None:
    flight = progress.InFlight("task\x1b]0;t\x07", "gw0", "branch 1/2: b\x1b[2K", 1.0, 1.0, note="n\x07")
    snapshot = progress.Snapshot([flight], {}, 1)
    counts = progress.Counts(1, 0, 0, 0, ())
    for quiet in (False, True):
        lines = progress.render(counts, snapshot, 1.0, quiet=quiet)
        assert not [c for line in lines for c in line if unicodedata.category(c) == "Cc"], lines
        assert "task\\x1b]0;t\\x07" in "\n".join(lines)


# -- the session -------------------------------------------------------------------------------------------------

# Everything the agent does is a sequence a terminal would act on. Its directory name and compile.sh's last line
# reach the item's message through an integrity flag and the official result's error details.
AGENT = r'''
import os, sys
out = sys.stdout.buffer
out.write(b"AGENT-START\n")
out.write(b"\x1b]0;PWNED-TITLE\x07")                 # the terminal's title
out.write(b"\x1b]52;c;cm0gLXJmIH4=\x07")              # the clipboard (OSC 52)
out.write(b"working\r\x1b[2K")                       # an erased line
out.write(b"\x1b[32mPASSED\x1b[0m \x00NUL \xc2\x9b31mC1 \xe2\x80\xaeBIDI\n")  # a fake green PASSED, NUL, C1, bidi
out.write(b"AGENT-END\n")
out.flush()
evil = os.path.join("/workspace/src", "\x1b]0;DIR-TITLE\x07\x1b[32mPASSED\u202e")
os.makedirs(evil)
open(os.path.join(evil, "conftest.py"), "w").write("")
with open("/workspace/src/compile.sh", "w") as handle:
    handle.write("#!/bin/sh\nprintf 'building\\n\\033]0;COMPILE-TITLE\\007\\033[32mPASSED\\033[0m\\n'\nexit 1\n")
os.chmod("/workspace/src/compile.sh", 0o755)
'''
SANDBOX_BYTES = (b"\x1b", b"\x07", b"\x00", b"\xc2\x9b", b"\xe2\x80\xae")
SHOWN_TAIL = "\\x1b]0;PWNED-TITLE\\x07\\x1b]52;c;cm0gLXJmIH4=\\x07working"
SHOWN_FAKE = "\\x1b[2K\\x1b[32mPASSED\\x1b[0m \\x00NUL \\x9b31mC1 \\u202eBIDI"
SHOWN_DIR = "\\x1b]0;DIR-TITLE\\x07\\x1b[32mPASSED\\u202e"
SHOWN_COMPILE = "\\x1b]0;COMPILE-TITLE\\x07\\x1b[32mPASSED\\x1b[0m"


def strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
    return [s for v in value for s in strings(v)] if isinstance(value, list) else []


def no_sandbox_bytes(data: bytes, where: str) -> None:
    found = [b for b in SANDBOX_BYTES if b in data]
    assert not found, f"{where} holds raw {found}: ...{data[max(0, data.find(found[0]) - 200):][:400]!r}"


@pytest.mark.docker
@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_control_bytes_from_the_sandbox_reach_every_reader_escaped(pytester: pytest.Pytester, testbed: Testbed,
                                                                    docker_client: Any, xdist: bool) -> None:
    """Without xdist the item runs in the session's process (its live log on the terminal); under xdist its report
    crosses to the controller, which shows it."""
    agent_dir = pytester.mkdir("escapes")
    (agent_dir / "agent.py").write_text(AGENT)
    run_dir, log_file = pytester.path / "run", pytester.path / "pytest.log"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--color=no", "-rA", "--log-cli-level", "DEBUG", "--log-file", str(log_file),
        "--log-file-level", "DEBUG", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", f"^{RPN}$", "--pb-agent", "python3 /pb-escapes/agent.py",
        "--pb-agent-mount", f"{agent_dir}:/pb-escapes", "--pb-pull", "never", "--pb-output", str(run_dir),
        "--pb-cpus", "1", "--junitxml", str(pytester.path / "junit.xml"), *(["-n", "1"] if xdist else []),
        timeout=1200)
    result.assert_outcomes(failed=1)
    task_dir = run_dir / RPN
    assert b"\x1b]52;c;" in (task_dir / "agent.log").read_bytes()  # the attack is real: the agent's log holds it

    # The terminal: pytest's own output (--color=no) and the live log hold no byte of the sandbox's.
    stdout, stderr = (pytester.path / "stdout").read_bytes(), (pytester.path / "stderr").read_bytes()
    no_sandbox_bytes(stdout, "stdout")
    no_sandbox_bytes(stderr, "stderr")
    shown = stdout.decode()
    for text in (SHOWN_TAIL, SHOWN_FAKE, f"pytest_config: {SHOWN_DIR}/conftest.py", f"compile_failed: {SHOWN_COMPILE}"):
        assert text in shown, text
    # The official's debug line quoting compile.sh's output, escaped in harness.log and --log-file as in the live
    # log above (under xdist a worker writes --log-file too: the file then holds one process's records).
    logs = [task_dir / "harness.log", *([] if xdist else [log_file])]
    for path in logs:
        assert "COMPILE-TITLE" in path.read_text(), path
        no_sandbox_bytes(path.read_bytes(), path.name)

    # JUnit: the message, <system-out> and the properties hold the escapes; none reached pytest's XML escaping.
    junit = (pytester.path / "junit.xml").read_bytes()
    no_sandbox_bytes(junit, "junit.xml")
    assert b"#x1B" not in junit
    assert b"#x7" not in junit
    junit_text = junit.decode()
    for text in (SHOWN_TAIL, SHOWN_FAKE, SHOWN_DIR, SHOWN_COMPILE):
        assert text in junit_text, text

    # summary.json: no control character in any string (not merely under JSON's escapes); pb-meta.json is stored
    # data, JSON-escaped, its flags printable.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [text for text in strings(summary) if unsafe(text, multiline=True)] == []
    reasons = "\n".join(summary["tasks"][RPN]["reasons"])
    for text in (SHOWN_TAIL, SHOWN_FAKE, f"pytest_config: {SHOWN_DIR}/conftest.py"):
        assert text in reasons, text
    meta = json.loads((task_dir / "pb-meta.json").read_text())
    assert {"kind": "pytest_config", "path": f"{SHOWN_DIR}/conftest.py"}.items() <= next(
        f for f in meta["evaluation"]["integrity_flags"] if f["kind"] == "pytest_config").items()
    no_sandbox_bytes((task_dir / "pb-meta.json").read_bytes(), "pb-meta.json")

    # report.html: escaped text inside HTML's own escaping.
    report = (run_dir / "report.html").read_bytes()
    no_sandbox_bytes(report, "report.html")
    for text in (SHOWN_DIR, SHOWN_TAIL):
        assert text.encode() in report, text

    assert leaked(docker_client, run_dir) == []
