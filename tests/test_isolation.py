"""Isolation between evaluations: the grader's own material and the official's early steps (issue 30, section 1).

Three attacks of the fourth red-team round, each through a real ``pytest --pb-submissions`` session on the test bed:

* **a planted wheel** (rpn): a wrong but honest program whose ``compile.sh`` fills ``/tmp/pytest-programbench-wheels``
  with ``pytest_rerunfailures-16.4-1-py3-none-any.whl`` (a build tag pip prefers) that turns every failure into a
  pass. Our wheels now go into a fresh directory of an unguessable name, made after compile.sh's last process,
  verified: the planted one is never read, the program keeps its honest failures, the prepared path is flagged.
* **the grader's plugin directory** (catlike): ``echo nope`` plus a ``sitecustomize.py`` left by ``compile.sh`` in
  ``/tmp/programbench-grader-plugins``, which the official puts first on the hidden tests' ``PYTHONPATH``: the
  official passes it; we keep its score, flag it, and under ``--pb-strict`` remove the directory before the commit.
* **git before the baseline** (tuiish): ``echo nope`` plus a ``.git`` *file* (``gitdir: gm``) whose pre-commit hook,
  run as root by the official ``seed_git`` step, installs a pytest plugin into site-packages: flagged three ways
  (the ``.git``, the change during seed_git, the change outside /workspace), and under ``--pb-strict`` the ``.git``
  file is removed before seed_git, so the hook never runs.

The install step's record is made only from an untouched, flag-free evaluation (a direct evaluation with a private
cache shows the poisoned one records nothing and an honest one does).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.engine.archive_out import REGULAR, SYMLINK, Member
from pytest_programbench.evaluation import harness_material, integrity
from pytest_programbench.evaluation.container_layer import UpperWalk
from tests.conftest import Testbed
from tests.shared_runs import FinishedRun, made_once
from tests.task_copies import task_copies
from tests.test_evaluate_only import leaked
from tests.test_evaluation_divergences import one_branch
from tests.test_evaluation_integrity import EXPLOIT_CONFTEST
from tests.test_evaluation_parity import run_ours
from tests.test_integrity_sessions import (
    NOPE_COMPILE,
    ONE_BRANCH,
    PROFILE_WRITER,
    _pyc_shadow,
    flags_of,
    junit,
    meta,
    session,
)

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("clean_env")]
__all__ = ["one_branch"]  # a fixture shared with the divergence tests

CATLIKE = "pbfix__catlike.c47c47c"
RPN = "pbfix__rpn.0b5e55e"
TUIISH = "pbfix__tuiish.7e1a0b2"
PLANTED_DIR = "/tmp/pytest-programbench-wheels"
PLUGIN_DIR = "/tmp/programbench-grader-plugins"

# The force-pass hook (every report a pass) as a plain plugin module, loaded through PYTEST_PLUGINS.
FORCE_PASS_MODULE = EXPLOIT_CONFTEST
# The same under rerunfailures' name: it also accepts the options the official passes when the install succeeded.
FORCE_PASS_PLUGIN = FORCE_PASS_MODULE + b'''

def pytest_addoption(parser):
    group = parser.getgroup("rerunfailures")
    group.addoption("--reruns", action="store", type=int, default=0)
    group.addoption("--reruns-delay", action="store", type=float, default=0)
    group.addoption("--only-rerun", action="append", default=None)
'''
# Imported at every interpreter start from the plugin directory: every pytest then loads pb_force.
SITECUSTOMIZE = b'import os\nos.environ["PYTEST_PLUGINS"] = "pb_force"\n'


def planted_wheel() -> bytes:
    """``pytest_rerunfailures-16.4-1-py3-none-any.whl``: the pinned release with a build tag, so pip prefers it."""
    dist = "pytest_rerunfailures-16.4.dist-info"
    files = {
        "pytest_rerunfailures.py": FORCE_PASS_PLUGIN,
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: pytest-rerunfailures\nVersion: 16.4\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: planted\nRoot-Is-Purelib: true\nBuild: 1\n"
                         b"Tag: py3-none-any\n",
        f"{dist}/entry_points.txt": b"[pytest11]\nrerunfailures = pytest_rerunfailures\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist}/RECORD", record)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(f"./{name}")
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def write_archive(out: Path, files: dict[str, bytes | tuple[bytes, int]]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "submission.tar.gz", "w:gz") as tar:
        for name, data in files.items():
            content, mode = data if isinstance(data, tuple) else (data, 0o755 if name.endswith(".sh") else 0o644)
            _add(tar, name, content, mode)
    return out / "submission.tar.gz"


def planted_wheel_submission(testbed: Testbed, out: Path) -> Path:
    """rpn's wrong program; compile.sh also plants the wheel where the harness used to copy its own."""
    wrong = testbed.bad / RPN / "wrong"
    plant = (f"\nmkdir -p {PLANTED_DIR} && cp pytest_rerunfailures-16.4-1-py3-none-any.whl {PLANTED_DIR}/\n"
             f"rm -f pytest_rerunfailures-16.4-1-py3-none-any.whl\n").encode()
    return write_archive(out, {"main.c": (wrong / "main.c").read_bytes(),
                               "compile.sh": (wrong / "compile.sh").read_bytes() + plant,
                               "pytest_rerunfailures-16.4-1-py3-none-any.whl": planted_wheel()})


def plugin_dir_submission(out: Path) -> Path:
    """``echo nope``; compile.sh leaves a sitecustomize.py and the force-pass module in the official's plugin dir."""
    plant = (f"mkdir -p {PLUGIN_DIR} && cp sitecustomize.txt {PLUGIN_DIR}/sitecustomize.py "
             f"&& cp pb_force.txt {PLUGIN_DIR}/pb_force.py\n").encode()
    return write_archive(out, {"compile.sh": NOPE_COMPILE + plant, "sitecustomize.txt": SITECUSTOMIZE,
                               "pb_force.txt": FORCE_PASS_MODULE})


def git_hook_submission(out: Path, scratch: Path) -> Path:
    """``echo nope``; ``.git`` is a file naming ``gm/``, a repository whose pre-commit hook installs the force-pass
    plugin into site-packages (a .pth setting PYTEST_PLUGINS) when the official's seed_git commits."""
    repo = scratch / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    gitdir = repo / ".git"
    hook = (b"#!/bin/sh\n"
            b"d=$(python3 -c 'import site; print(site.getsitepackages()[0])')\n"
            b"mkdir -p \"$d\" && cp /workspace/gm/pb_force.py \"$d/pb_force.py\"\n"
            b"echo 'import os; os.environ.setdefault(\"PYTEST_PLUGINS\", \"pb_force\")' > \"$d/pb_force.pth\"\n")
    files: dict[str, bytes | tuple[bytes, int]] = {"compile.sh": NOPE_COMPILE, ".git": b"gitdir: gm\n",
                                                   "gm/hooks/pre-commit": (hook, 0o755),
                                                   "gm/pb_force.py": FORCE_PASS_MODULE}
    files["gm/objects/info/.keep"] = b""  # the repository's empty directories, which a tar of files lacks
    files["gm/refs/heads/.keep"] = b""
    for path in sorted(gitdir.rglob("*")):
        rel = path.relative_to(gitdir).as_posix()
        if path.is_file() and not rel.startswith("hooks/"):
            files[f"gm/{rel}"] = path.read_bytes()
    return write_archive(out, files)


def test_grader_material_attacks_are_flagged_and_score_officially(pytester: pytest.Pytester, testbed: Testbed,
                                                                  docker_client: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # pip runs in every evaluation (no recorded install replayed): the planted wheel meets pip itself.
    monkeypatch.setenv("PYTEST_PROGRAMBENCH_PIP_REPLAY", "0")
    # On one-branch copies of the tasks (ONE_BRANCH: rpn's is where its wrong program fails a test).
    with task_copies(pytester.path, testbed, docker_client, {"planted": RPN, "plugindir": CATLIKE, "githook": TUIISH},
                     prefix="pbgrader", one_branch=ONE_BRANCH) as ids:
        subs = pytester.path / "subs"
        planted_wheel_submission(testbed, subs / ids["planted"])
        plugin_dir_submission(subs / ids["plugindir"])
        git_hook_submission(subs / ids["githook"], pytester.path)
        result = session(pytester, testbed, subs, copies=True)
        _assert_grader_material_scored(pytester, result, docker_client, ids["planted"], ids["plugindir"],
                                       ids["githook"])


def _assert_grader_material_scored(pytester: pytest.Pytester, result: pytest.RunResult, docker_client: Any,
                                   rpn: str, catlike: str, tuiish: str) -> None:
    result.assert_outcomes(failed=3)
    cases = junit(pytester)
    # The planted wheel is never read: the wrong program keeps its failures (reruns still on, with our wheels).
    assert float(cases[rpn]["score"]) < 1.0
    assert (integrity.HARNESS_PATH, PLANTED_DIR) in flags_of(pytester, rpn)
    assert meta(pytester, rpn)["evaluation"]["reruns"] == "on"
    # The plugin directory: the official passes `echo nope` through it; the score stays the official one, flagged.
    assert float(cases[catlike]["score"]) == 1.0
    assert (integrity.HARNESS_PATH, PLUGIN_DIR) in flags_of(pytester, catlike)
    assert "harness_path" in cases[catlike]["message"]
    # Git: the baseline is taken before seed_git, so what its hook installed is seen, and named three ways.
    git_flags = flags_of(pytester, tuiish)
    assert float(cases[tuiish]["score"]) == 1.0
    assert (integrity.GIT_METADATA, ".git") in git_flags
    assert (integrity.SEED_GIT_CHANGED, "") in git_flags
    assert (integrity.COMPILE_OUTSIDE, "/") in git_flags
    assert "pb_force.pth" in cases[tuiish]["integrity_flags"]
    summary = json.loads((pytester.path / "run" / "summary.json").read_text())
    assert summary["headline"]["errors"] == 0
    assert leaked(docker_client, pytester.path / "run") == []


# One --pb-strict session (-n 2) over copies of the test bed's tasks, one copy per case: the grader's plugin directory
# and git before the baseline (test_grader_material_attacks_under_strict_score_what_the_program_deserves), the
# conftest.py a login-shell snippet writes after compile.sh and the sourceless .pyc
# (tests/test_integrity_sessions.py::test_hostile_submissions_under_strict); each case's properties are its own item's.
# Each copy keeps one branch active (tests.test_integrity_sessions.ONE_BRANCH): neutralised, `echo nope` scores < 1
# on it, and its failing tests (each rerun twice) are one branch's, not every branch's.
STRICT_CASES = {"plugindir": CATLIKE, "githook": TUIISH, "profile": CATLIKE, "pyc": TUIISH}


def strict_session(tmp_path_factory: pytest.TempPathFactory, testbed: Testbed, docker_client: Any,
                   dest: Path) -> tuple[Path, dict[str, str]]:
    """The shared strict session, made once (tests/shared_runs.py), its session-wide properties asserted (every case
    failed, none an error, nothing left); returns the reader's copy (``dest``) and the case ids."""
    ids: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        def prepare(place: Path) -> list[str]:
            ids.update(stack.enter_context(task_copies(place, testbed, docker_client, STRICT_CASES,
                                                       prefix="pbstrict", one_branch=ONE_BRANCH)))
            subs = place / "subs"
            plugin_dir_submission(subs / ids["plugindir"])
            (place / "git-scratch").mkdir()
            git_hook_submission(subs / ids["githook"], place / "git-scratch")
            write_archive(subs / ids["profile"], {"compile.sh": PROFILE_WRITER})
            write_archive(subs / ids["pyc"], {"compile.sh": NOPE_COMPILE, "argparse.pyc": _pyc_shadow(place)})
            (place / "ids.json").write_text(json.dumps(ids))
            return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(place / "tasks"), "--pb-blob-dir",
                    str(place / "blobs"), "--pb-submissions", str(subs), "--pb-output", str(place / "run"),
                    "--pb-pull", "never", "--pb-cpus", "1", "--junitxml", str(place / "junit.xml"), "-n", "2",
                    "--pb-strict"]

        made: FinishedRun = made_once(tmp_path_factory, "hostile-strict", prepare, timeout=1500)
    ids = json.loads((made.place / "ids.json").read_text())
    made.result().assert_outcomes(failed=len(STRICT_CASES))
    summary = json.loads((made.place / "run" / "summary.json").read_text())
    assert summary["headline"]["errors"] == 0
    assert leaked(docker_client, made.place / "run") == []
    return made.copy(dest), ids


def test_grader_material_attacks_under_strict_score_what_the_program_deserves(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, testbed: Testbed, docker_client: Any) -> None:
    place, ids = strict_session(tmp_path_factory, testbed, docker_client, tmp_path / "strict")
    cases = junit(place)
    assert float(cases[ids["plugindir"]]["score"]) < 1.0
    assert PLUGIN_DIR in meta(place, ids["plugindir"])["evaluation"]["neutralised"]
    assert float(cases[ids["githook"]]["score"]) < 1.0
    assert ".git" in meta(place, ids["githook"])["evaluation"]["neutralised"]
    tuiish = flags_of(place, ids["githook"])
    assert (integrity.GIT_METADATA, ".git") in tuiish
    assert (integrity.SEED_GIT_CHANGED, "") not in tuiish  # the hook never ran


def test_install_record_only_from_an_untouched_evaluation(testbed: Testbed, tmp_path: Path, one_branch: Any) -> None:
    """A private record cache: records are made in a container of the task's image, never where a submission ran, so
    even the poisoned evaluation's comes from the image (its planted wheel is never read: the wheels are mounted);
    the next replays it (the same replay twice proved nothing more: one honest evaluation replays it). On a one-branch
    copy of rpn (the branch where its wrong program fails a test): the record is made and replayed once per
    evaluation, not per branch."""
    task, _instance, blob_dir = one_branch(RPN)
    records = tmp_path / "records"
    poisoned = run_ours(task, planted_wheel_submission(testbed, tmp_path / "poisoned"), testbed, tmp_path / "a",
                        reruns=True, install_cache=str(records), blob_dir=blob_dir)
    assert poisoned.reruns_install == "recorded from the task's image, replayed"
    assert poisoned.score < 1.0
    record = next(records.glob("*/record.json"))
    assert json.loads(record.read_text())["v"] == 3
    good = testbed.submissions / RPN / "submission.tar.gz"
    first = run_ours(task, good, testbed, tmp_path / "b", reruns=True, install_cache=str(records), blob_dir=blob_dir)
    assert first.reruns_install == "replayed"
    assert first.score == 1.0
    # A record whose files no longer match its digest is never replayed.
    with (record.parent / "files.tar").open("ab") as f:
        f.write(b"\0" * 512)
    third = run_ours(task, good, testbed, tmp_path / "d", reruns=True, install_cache=str(records), blob_dir=blob_dir)
    assert third.reruns_install == "recorded from the task's image, replayed"  # a new record replaced it
    assert third.score == 1.0


# --------------------------------------------------------------------------------------------- units


def test_the_scan_walks_grader_paths_below_pruned_scratch(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "tmp" / "programbench-grader-plugins").mkdir(parents=True)
    (upper / "tmp" / "programbench-grader-plugins" / "sitecustomize.py").write_text("x")
    (upper / "tmp" / "build" / "deep").mkdir(parents=True)
    (upper / "tmp" / "build" / "deep" / "obj.o").write_text("x")
    walked = UpperWalk(str(upper), [], ("/tmp",), 64, 1000, harness_material.GRADER_PATHS).run()
    paths = {c["Path"] for c in walked.changes}
    assert "/tmp/programbench-grader-plugins/sitecustomize.py" in paths
    assert "/tmp/build" in paths
    assert "/tmp/build/deep" not in paths
    flags = integrity.grader_path_flags([], walked.changes)
    assert [(f.kind, f.path) for f in flags] == [(integrity.HARNESS_PATH, PLUGIN_DIR)]
    assert integrity.neutralise_command(flags) == ([f"rm -rf -- {PLUGIN_DIR}"], [PLUGIN_DIR])
    # A grader directory at the root (the audit's) is named as the directory, not the file in it.
    audit = [{"Path": "/pytest-programbench-audit-ab12/sitecustomize.py", "Kind": 1, "Stamp": (1, 2, 3)}]
    assert [f.path for f in integrity.grader_path_flags([], audit)] == ["/pytest-programbench-audit-ab12"]


def test_the_walk_stamps_a_directory_changed_itself(tmp_path: Path) -> None:
    """A directory in the upper layer over an image's directory is listed without a stamp when it is only a copy-up
    (something below it changed); a chmod, a new owner or an opaque directory (removed and made again, the image's
    contents hidden with no whiteout) gets a stamp: a change of its own (install_cache.pristine_for_pip reads it)."""
    upper, lower = tmp_path / "upper", tmp_path / "lower"
    for name in ("copied", "chmodded", "opaque"):
        (lower / "usr" / name).mkdir(parents=True, mode=0o755)
        (lower / "usr" / name).chmod(0o755)
        (upper / "usr" / name).mkdir(parents=True, mode=0o755)
        (upper / "usr" / name).chmod(0o755)
    (upper / "usr" / "copied" / "new.txt").write_text("x")
    (upper / "usr" / "chmodded").chmod(0o700)
    os.setxattr(upper / "usr" / "opaque", "user.overlay.opaque", b"y")
    walked = UpperWalk(str(upper), [str(lower)], (), 64, 1000).run()
    stamps = {c["Path"]: c["Stamp"] for c in walked.changes}
    assert stamps["/usr/copied"] is None
    assert stamps["/usr/chmodded"] is not None
    assert stamps["/usr/opaque"] is not None
    assert stamps["/usr"] is None


def test_seed_git_flags_only_what_is_not_its_own_repository() -> None:
    before = [{"Path": "/workspace", "Kind": 0, "Stamp": None},
              {"Path": "/workspace/executable", "Kind": 1, "Stamp": (1, 2, 3)}]
    seeded = [{"Path": "/workspace", "Kind": 0, "Stamp": None},
              {"Path": "/workspace/executable", "Kind": 2, "Stamp": None},
              {"Path": "/workspace/.git", "Kind": 1, "Stamp": None},
              {"Path": "/workspace/.git/HEAD", "Kind": 1, "Stamp": (1, 2, 3)}]
    assert integrity.seed_git_flags(before, seeded, seeded=True) == []
    hooked = [*seeded, {"Path": "/usr/lib/python3/dist-packages/x.pth", "Kind": 1, "Stamp": (1, 2, 3)}]
    flags = integrity.seed_git_flags(before, hooked, seeded=True)
    assert [f.kind for f in flags] == [integrity.SEED_GIT_CHANGED]
    assert "x.pth" in flags[0].detail
    # A shipped .git directory: seed_git runs no git, so even its own repository changing is a finding.
    assert integrity.seed_git_flags(before, seeded, seeded=False) != []



def test_verify_file_refuses_what_was_not_sent() -> None:
    """The official's plugin read back through the engine's archive (a Member): its kind, mode, owner and bytes."""
    data = b"plugin source\n"
    path = "/tmp/programbench-grader-plugins/p.py"

    class _Reader:
        def __init__(self, member: Member | str) -> None:
            self.member = member

        def read_member(self, container_path: str, *, timeout: int = 60,
                        max_bytes: int | None = None) -> tuple[int, Member | str]:
            return (0, self.member) if isinstance(self.member, Member) else (1, self.member)

    sent = Member(REGULAR, len(data), data, mode=0o600, uid=0)
    harness_material.verify_file(_Reader(sent), path, data, 0o600)
    for wrong in (Member(REGULAR, 5, b"other", mode=0o600), Member(REGULAR, len(data), data, mode=0o644),
                  Member(REGULAR, len(data), data, mode=0o600, uid=1000), Member(SYMLINK, linkname="/etc/x")):
        with pytest.raises(harness_material.MaterialRefused, match="not what was sent"):
            harness_material.verify_file(_Reader(wrong), path, data, 0o600)
    with pytest.raises(harness_material.MaterialRefused, match="could not be read back"):
        harness_material.verify_file(_Reader("No such container:path"), path, data, 0o600)
