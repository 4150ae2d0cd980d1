"""The command line as a new user types it: option values as separate words (the rootdir, the run directory and the
node ids do not move), node ids copied from a FAILED line as arguments, and pytest's listings (``--fixtures``,
``--markers``, ``--fixtures-per-test``), which run nothing. Real pytest sessions started from a project directory.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.conftest import Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

CATLIKE = "pbfix__catlike.c47c47c"
NOIMAGE = "pbinvoke__noimage.1111111"  # catlike without Dockerfile or image: an infrastructure error, fast
RESUME_LINE = "to resume (finished tasks are kept): "


def _layout(root: Path, testbed: Testbed) -> tuple[Path, Path, Path, Path]:
    """``root/proj`` where pytest runs, the task, blobs and submission in ``root/data``: their common ancestor with
    the project is ``root``, where a value read as a path puts the rootdir."""
    proj = root / "proj"
    proj.mkdir()
    data = root / "data"
    tasks, blobs, subs = data / "tasks", data / "blobs", data / "subs"
    shutil.copytree(testbed.tasks_dir / CATLIKE, tasks / NOIMAGE, ignore=shutil.ignore_patterns("Dockerfile"))
    shutil.copytree(testbed.blob_dir / CATLIKE, blobs / NOIMAGE)
    shutil.copytree(testbed.submissions / CATLIKE, subs / NOIMAGE)
    return proj, tasks, blobs, subs


def _spelled(joined: bool, *pairs: tuple[str, str]) -> list[str]:
    return [word for flag, value in pairs for word in ([f"{flag}={value}"] if joined else [flag, value])]


def _error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("ERROR ")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def _rootdir(out: str) -> str:
    match = re.search(r"^rootdir: (\S+)", out, re.M)
    assert match is not None, out[:2000]
    return match.group(1)


def test_separate_words_leave_rootdir_run_dir_and_node_ids_alone(pytester: pytest.Pytester, testbed: Testbed,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    proj, tasks, blobs, subs = _layout(pytester.path, testbed)
    monkeypatch.chdir(proj)
    seen: dict[bool, tuple[str, str, list[str]]] = {}
    for joined in (True, False):
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-rE", "--pb-pull", "never", "--pb-infra-retries", "0",
            *_spelled(joined, ("--pb-tasks-dir", str(tasks)), ("--pb-blob-dir", str(blobs)),
                      ("--pb-submissions", str(subs))), timeout=600)
        result.assert_outcomes(errors=1)
        out = result.stdout.str()
        runs = sorted(p.parent for p in proj.glob("pb-runs/*/pb-run.json"))
        assert len(runs) == 1 + (not joined), sorted(proj.rglob("pb-run.json"))
        assert not (pytester.path / "pb-runs").exists(), "the run directory went to the moved rootdir"
        seen[joined] = (_rootdir(out), _error_line(out).partition(" - ")[0], _resume_words(out))
    assert seen[True][:2] == seen[False][:2] == (str(proj), f"ERROR programbench::{NOIMAGE}")

    # The printed command resumes from the same place: same rootdir, same node id.
    resume = seen[False][2]
    assert resume[0] == "--pb-resume"
    assert Path(resume[1]).parent == proj / "pb-runs"
    again = pytester.runpytest_subprocess(*resume, "-rE", timeout=600)
    again.assert_outcomes(errors=1)
    assert _rootdir(again.stdout.str()) == str(proj)
    assert _error_line(again.stdout.str()).startswith(f"ERROR programbench::{NOIMAGE} - ")

    # The node id copied from that line is a selection (with options around it), as pytest users expect.
    copied = seen[False][1].removeprefix("ERROR ")
    listed = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--co", "-q", "--pb-tasks-dir", str(tasks), copied,
                                           "--pb-filter", "pbinvoke__|jgm__", "programbench::jgm__pandoc.5caad90")
    assert listed.ret == pytest.ExitCode.OK, listed.stderr.str()
    assert [line for line in listed.outlines if "::" in line] == [
        "programbench::jgm__pandoc.5caad90", f"programbench::{NOIMAGE}"]
    # Under xdist too: the workers get the same arguments and take the same selection (not the other task).
    other = "pbinvoke__other.2222222"
    shutil.copytree(tasks / NOIMAGE, pytester.path / "more" / other)
    shutil.copytree(blobs / NOIMAGE, blobs / other)
    shutil.copytree(subs / NOIMAGE, subs / other)
    run_dir = pytester.path / "by-id"
    by_id = pytester.runpytest_subprocess(
        copied, "-p", "no:cacheprovider", "-n", "2", "--pb-pull", "never", "--pb-infra-retries", "0",
        "--pb-tasks-dir", str(tasks), "--pb-tasks-dir", str(pytester.path / "more"), "--pb-blob-dir", str(blobs),
        "--pb-submissions", str(subs), "--pb-output", str(run_dir), timeout=600)
    by_id.assert_outcomes(errors=1)
    assert list(json.loads((run_dir / "summary.json").read_text())["tasks"]) == [NOIMAGE]

    # Below a project's rootdir (its ini): the run directory is where pytest was invoked, not the rootdir.
    (proj / "pytest.ini").write_text("[pytest]\n")
    monkeypatch.chdir(pytester.mkdir(proj / "sub"))
    below = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rE", "--pb-pull", "never", "--pb-infra-retries", "0", "--pb-tasks-dir",
        str(tasks), "--pb-blob-dir", str(blobs), "--pb-submissions", str(subs), timeout=600)
    below.assert_outcomes(errors=1)
    assert _rootdir(below.stdout.str()) == str(proj)
    assert len(list((proj / "sub").glob("pb-runs/*/pb-run.json"))) == 1
    assert _error_line(below.stdout.str()).startswith(f"ERROR ../programbench::{NOIMAGE} - ")


def _resume_words(out: str) -> list[str]:
    lines = [line for line in out.splitlines() if line.startswith(RESUME_LINE)]
    assert len(lines) == 1, out[-3000:]
    words = shlex.split(lines[0].removeprefix(RESUME_LINE))
    assert words[0] == "pytest"
    return words[1:]


# ---------------------------------------------------------------------------------------------- node ids


def test_node_ids_as_arguments_select(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pandoc, zoxide = "jgm__pandoc.5caad90", "ajeetdsouza__zoxide.67ca1bc"

    def listed(*args: str) -> list[str]:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--co", "-q", *args)
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-2000:] + result.stderr.str()
        return [line for line in result.outlines if "::" in line]

    # Alone (a node id opts in, as any --pb-* option does), several, mixed with options.
    assert listed(f"programbench::{pandoc}") == [f"programbench::{pandoc}"]
    assert listed(f"programbench::{zoxide}", "--pb-language", "rust,haskell", f"programbench::{pandoc}") == [
        f"programbench::{zoxide}", f"programbench::{pandoc}"]
    # Other selection options narrow the named tasks further, as -k narrows pytest's node ids.
    assert listed(f"programbench::{zoxide}", f"programbench::{pandoc}", "--pb-language", "haskell") == [
        f"programbench::{pandoc}"]
    # The suite itself.
    assert len(listed("programbench", "--pb-language", "go")) == 46

    # Below the rootdir pytest writes node ids relative to where it runs: a copied one works from there.
    pytester.makeini("[pytest]\n")
    monkeypatch.chdir(pytester.mkdir("sub"))
    assert listed(f"../programbench::{pandoc}") == [f"programbench::{pandoc}"]

    unknown = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--co", f"programbench::{pandoc}",
                                            "programbench::nobody__nothing.0000000", "--pb-language", "haskell")
    assert unknown.ret == pytest.ExitCode.USAGE_ERROR
    unknown.stderr.fnmatch_lines(["ERROR: programbench::nobody__nothing.0000000: no such ProgramBench task*"])
    assert "file or directory not found" not in unknown.stderr.str()


# ---------------------------------------------------------------------------------------------- listings


@pytest.mark.parametrize(("listing", "expected"), [
    ("--fixtures", "*pb_outcome*"), ("--fixtures-per-test", "*fixtures used by jgm__pandoc.5caad90*"),
    ("--markers", "@pytest.mark.lang_haskell: *")])
def test_listings_run_nothing(pytester: pytest.Pytester, listing: str, expected: str) -> None:
    """Never a run directory, a summary or a resume command, and no agent needed."""
    for args in (["--pb-agent", "true", "--pb-filter", "jgm__"], ["--pb-language", "go"]):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", listing, *args)
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-2000:] + result.stderr.str()
        if args[0] == "--pb-agent":
            result.stdout.fnmatch_lines([expected])
        out = result.stdout.str()
        assert "programbench summary" not in out
        assert RESUME_LINE not in out
        assert not list(pytester.path.rglob("pb-run.json")), out[-2000:]
        assert not (pytester.path / "pb-runs").exists()
