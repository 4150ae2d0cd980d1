"""Hostile foreign runs (issue 38, attack 4): a run directory or leaderboard entry given to ``--pb-compare`` or
``--pb-report`` is untrusted input. Each attack is rebuilt as a file tree and run the way users run it, a real
``pytest --pb-compare BASE,NEW`` / ``pytest --pb-report DIR`` session in a subprocess (its address space capped, as a
small machine's would be, so a file that would exhaust memory fails fast instead of taking the host with it); where a
page is involved it is rendered by the real headless Chromium.

* ids holding ESC/BEL never reach the terminal raw (escaped, and listed as unknown ids);
* an id ``javascript:alert(document.domain)//x`` is no link: every link of report.html, as the browser resolves it,
  is a file inside the entry;
* an id that is an absolute or ``..`` path, or a task directory that is a symlink out of the entry, pulls no file of
  another run into the report;
* a YAML alias bomb, a sparse 6 GiB eval.json or score.json, a score.json linked out of the entry, JSON nested
  100,000 deep: each a one-line usage error naming the file, never a MemoryError or a traceback.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_report import chromium

# Tasks of programbench's own catalogue: an entry's ids count only when they are the benchmark's.
X, Y = "abishekvashok__cmatrix.5c082c6", "agourlay__zip-password-finder.704700d"
ADDRESS_SPACE = 4 << 30  # the sessions' cap: a file read whole past it fails with MemoryError
SPARSE = 6 << 30
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _entry(path: Path, score: Any) -> Path:
    (path / "_stats").mkdir(parents=True)
    (path / "_stats" / "score.json").write_text(json.dumps(score))
    return path


def _pytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """A real session as a user starts it, under ``prlimit --as`` (a hostile file must not need the host's memory
    to be refused)."""
    return pytester.run("prlimit", f"--as={ADDRESS_SPACE}", sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                        *args, timeout=300)


def _output(result: pytest.RunResult) -> str:
    return "\n".join([*result.outlines, *result.errlines])


def _usage_error(result: pytest.RunResult, door: str, path: Path, why: str) -> None:
    """One line on stderr: ``ERROR: --pb-...: <the file>: <why>``, exit status 4; no traceback, no MemoryError."""
    out = _output(result)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    errors = [line for line in result.errlines if line.strip()]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"ERROR: {door}: {path}: "), errors[0]
    assert why in errors[0], errors[0]
    assert "Traceback" not in out
    assert "MemoryError" not in out


# ------------------------------------------------------------------------------------------- escaped for the terminal

EVIL = "x\x1b]0;owned\x07\x1b[2J\x1b[32mPASSED\x9b"  # a title change, a cleared screen, a green PASSED, an 8-bit CSI
EVIL_SHOWN = r"x\x1b]0;owned\x07\x1b[2J\x1b[32mPASSED\x9b"


def test_ids_with_control_bytes_are_escaped_and_counted_nowhere(pytester: pytest.Pytester) -> None:
    """Entries naming tasks ``x<ESC>]0;owned<BEL>...``: the terminal gets the escapes as visible text, in the listing of
    ids no task of the catalogue has, and they count in no score, no denominator, no leaderboard number."""
    base = _entry(pytester.path / "base", {X: {"b/t1": True, "b/t2": False}, EVIL: {"b/t": True}})
    new = _entry(pytester.path / "new", {X: {"b/t1": True, "b/t2": True}, EVIL + "2": {"b/t": True}})
    compared = _pytest(pytester, "--pb-compare", f"{base},{new}")
    out = _output(compared)
    assert compared.ret == pytest.ExitCode.OK, out[-3000:]
    assert not CONTROL.search(out), [line for line in out.splitlines() if CONTROL.search(line)]
    assert "base: 1 id(s) not a task of the catalogue" in out
    assert EVIL_SHOWN in out
    assert EVIL_SHOWN + "2" in out
    result = json.loads((new / "compare.json").read_text())
    assert set(result["tasks"]) == {X}
    assert result["only_in_base"] == result["only_in_new"] == []
    assert result["leaderboard"]["base"]["tasks"] == result["leaderboard"]["new"]["tasks"] == 1
    assert result["base"]["headline"]["selected"] == 1, "an unknown id is in no denominator"

    reported = _pytest(pytester, "--pb-report", str(base))
    out = _output(reported)
    assert reported.ret == pytest.ExitCode.OK, out[-3000:]
    assert not CONTROL.search(out)
    assert EVIL_SHOWN in out
    page = (base / "report.html").read_text()
    assert 'data-task="' + X + '"' in page
    assert not CONTROL.search(page)
    assert "owned" not in page.split("<h2>Per task</h2>")[1], "no row for an unknown id"

    # Nothing but such ids: a usage error, its one line escaped too.
    only = _entry(pytester.path / "only", {EVIL: {"b/t": True}})
    refused = _pytest(pytester, "--pb-report", str(only))
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    assert not CONTROL.search(_output(refused))
    refused.stderr.fnmatch_lines([f"ERROR: --pb-report: {only}: none of its 1 instance(s) is a task the catalogue "
                                  f"knows*: {EVIL_SHOWN}"])


# -------------------------------------------------------------------------------------------- links inside the entry

JS = "javascript:alert(document.domain)//x"
PROBE = ("<script>document.body.setAttribute('data-probed-links', JSON.stringify("
         "Array.from(document.links, a => [a.protocol, a.href])));</script>")


def _links_in_browser(page: Path, profile: Path) -> list[tuple[str, str]]:
    """Every link of ``page`` as Chromium resolves it (protocol, absolute href): the page is loaded with a probe
    appended that writes ``document.links`` into the DOM Chromium dumps."""
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text() + PROBE)
    dom = chromium("--dump-dom", probe.as_uri(), profile=profile).stdout
    probe.unlink()
    found = re.search(r'data-probed-links="([^"]*)"', dom)
    assert found is not None, "the probe ran"
    return [(protocol, href) for protocol, href in json.loads(html.unescape(found.group(1)))]


def test_a_javascript_id_is_no_link_in_the_report(pytester: pytest.Pytester) -> None:
    """An entry naming a task ``javascript:alert(document.domain)//x`` with the files its links would point at:
    in report.html as Chromium resolves it, every link is a ``file:`` inside the entry (the task's own agent.log is
    linked), and the id is listed as unknown."""
    entry = _entry(pytester.path / "entry", {X: {"b/t": True}, JS: {"b/t": False}})
    for task_dir in (entry / X, entry / JS):  # ``//`` is one separator: javascript:alert(document.domain)/x/
        task_dir.mkdir(parents=True, exist_ok=True)
        (task_dir / "agent.log").write_text("log\n")
    reported = _pytest(pytester, "--pb-report", str(entry))
    assert reported.ret == pytest.ExitCode.OK, _output(reported)[-3000:]
    links = _links_in_browser(entry / "report.html", pytester.path / "chromium")
    inside = entry.resolve().as_uri() + "/"
    assert ("file:", f"{inside}{X}/agent.log") in links, links
    outside = [(p, href) for p, href in links if p != "file:" or not href.startswith(inside)]
    # in-page anchors (#task-...) resolve to the page itself, inside the entry
    assert outside == [], outside
    assert "javascript:" not in (entry / "report.html").read_text().split("<h2>Per task</h2>")[1].split("<script>")[0]
    assert "1 id(s) not a task of the catalogue" in _output(reported)


# ------------------------------------------------------------------------------------- no file of another run pulled

SECRET = "test_of_another_run_only"


def _other_run(root: Path) -> Path:
    """Another run's task: a failing test whose name must not reach a page it was not part of."""
    other = root / "other" / X
    other.mkdir(parents=True)
    (other / f"{X}.eval.json").write_text(json.dumps({"test_results": [
        {"branch": "b", "name": SECRET, "status": "failure", "extra": {"message": SECRET}}]}))
    (other / "agent.log").write_text(SECRET)
    return other


def test_an_id_that_is_a_path_pulls_no_file_of_another_run(pytester: pytest.Pytester) -> None:
    """Ids that are an absolute path and a ``..`` path to another run's task: no row, no failing test, no link of
    it in the report; the ids listed as unknown. A known task's agent.log that is a symlink to the other run's is not
    linked either (the browser would follow it)."""
    other = _other_run(pytester.path)
    entry = _entry(pytester.path / "entry", {X: {"b/t": True}, str(other / X): {"b/t": False},
                                             f"../other/{X}/{X}": {"b/t": False}})
    (entry / X).mkdir()
    (entry / X / "agent.log").symlink_to(other / "agent.log")
    reported = _pytest(pytester, "--pb-report", str(entry))
    out = _output(reported)
    assert reported.ret == pytest.ExitCode.OK, out[-3000:]
    page = (entry / "report.html").read_text()
    assert SECRET not in page
    rows = page.split("<h2>Per task</h2>")[1].split("<script>")[0]
    assert "other/" not in rows
    assert f'id="task-{X}"' in rows
    assert ">agent.log</a>" not in page, "a link that leads out of the entry"
    assert "2 id(s) not a task of the catalogue" in out
    assert str(other / X) in out


def test_a_task_directory_linked_out_of_the_entry_is_a_usage_error(pytester: pytest.Pytester) -> None:
    """The entry's own task directory a symlink to another run's: its eval.json is refused, naming it, before any
    page is written (the report would show that run's failing tests)."""
    other = _other_run(pytester.path)
    entry = _entry(pytester.path / "entry", {X: {"b/t": True}})
    (entry / X).symlink_to(other, target_is_directory=True)
    reported = _pytest(pytester, "--pb-report", str(entry))
    _usage_error(reported, "--pb-report", entry / X / f"{X}.eval.json", "leads outside")
    assert not (entry / "report.html").exists()


def test_an_id_of_our_kind_that_is_a_path_is_left_out(pytester: pytest.Pytester) -> None:
    """A run directory of our kind whose summary.json names a task by an absolute path: not read, listed."""
    other = _other_run(pytester.path)
    ours = pytester.mkdir("ours")
    (ours / "pb-run.json").write_text(json.dumps({"settings": {}}))
    tasks = {X: {"outcome": "passed", "score": 1.0}, str(other / X): {"outcome": "passed", "score": 1.0}}
    (ours / "summary.json").write_text(json.dumps({"tasks": tasks}))
    base = _entry(pytester.path / "base", {X: {"b/t": True}, str(other / X): {"b/t": True}})
    compared = _pytest(pytester, "--pb-compare", f"{base},{ours}")
    out = _output(compared)
    assert compared.ret == pytest.ExitCode.OK, out[-3000:]
    assert SECRET not in (ours / "compare.json").read_text() + (ours / "compare.html").read_text()
    assert set(json.loads((ours / "compare.json").read_text())["tasks"]) == {X}
    assert "new: 1 id(s) not a task of the catalogue" in out


# ------------------------------------------------------------------------------- bounded reads, one-line usage errors

BOMB = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]",
                  *(f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join([f'*{chr(96 + i)}'] * 9)}]" for i in range(1, 9)),
                  "system: {agent: *i, model: m, provider: p}", ""])


def _sparse(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.truncate(SPARSE)


def _deep(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("door", ["--pb-report", "--pb-compare"])
@pytest.mark.parametrize("case", ["alias-bomb", "sparse-eval-json", "sparse-score-json", "linked-score-json",
                                  "deep-score-json"])
def test_a_hostile_file_is_a_one_line_usage_error(pytester: pytest.Pytester, door: str, case: str) -> None:
    entry = _entry(pytester.path / "entry", {X: {"b/t": True}, Y: {"b/t": False}})
    named, why = {
        "alias-bomb": (entry / "submission.yaml", "an alias (*name), which no entry needs"),
        "sparse-eval-json": (entry / X / f"{X}.eval.json", "holds 6.0 GiB, above the 256.0 MiB"),
        "sparse-score-json": (entry / "_stats" / "score.json", "holds 6.0 GiB, above the 64.0 MiB"),
        "linked-score-json": (entry / "_stats" / "score.json", "leads outside"),
        "deep-score-json": (entry / "_stats" / "score.json", "nested deeper than 64"),
    }[case]
    if case == "alias-bomb":
        named.write_text(BOMB)
    elif case.startswith("sparse"):
        _sparse(named)
    elif case.startswith("linked"):  # another entry's map, read as this one's
        named.unlink()
        named.symlink_to(_entry(pytester.path / "elsewhere", {X: {"b/t": True}}) / "_stats" / "score.json")
    else:
        _deep(named)
    if door == "--pb-report":
        result = _pytest(pytester, "--pb-report", str(entry))
    else:
        base = _entry(pytester.path / "base", {X: {"b/t": False}, Y: {"b/t": False}})
        result = _pytest(pytester, "--pb-compare", f"{base},{entry}")
    _usage_error(result, door, named, why)
    assert not (entry / "report.html").exists()
    assert not (entry / "compare.json").exists()
    shutil.rmtree(entry)  # a 6 GiB sparse file is small on disk, but not in a copy of the tmp dir
