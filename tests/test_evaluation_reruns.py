"""pytest-rerunfailures 16.4 offline: the wheel cache, its checks, and reruns on/off in real evaluations."""

from __future__ import annotations

import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from pytest_programbench.evaluation import rerunfailures
from pytest_programbench.evaluation.install_cache import pip_writes, pristine_for_pip
from pytest_programbench.evaluation.rerunfailures import (
    CONTAINER_WHEEL_DIR,
    RerunWheels,
    ensure_wheels,
    pip_environment,
    validate_wheel_dir,
)
from pytest_programbench.tasks.catalogue import Task
from tests.conftest import Testbed
from tests.outcome_support import item_message
from tests.test_evaluation_divergences import GOOD_COMPILE, custom_rpn, load, rpn_archive
from tests.test_evaluation_parity import RPN, run_ours, submission

# The one rpn branch these evaluations need: the wrong submission fails one of its tests (1 4 / gives 0), which is
# rerun; the other two branches would only add containers (issue 40).
ARGV_BRANCH = "0b5e55e01a2b"


def one_branch_rpn(testbed: Testbed, root: Path) -> tuple[Task, Path]:
    """rpn with only ARGV_BRANCH active: the task and its blob directory."""
    custom_rpn(testbed, root, active=[ARGV_BRANCH])
    return load(root)[0], root / "blobs"


def with_line(script: str, line: str) -> str:
    return script.rstrip("\n") + "\n" + line + "\n"


def _wheel(directory: Path, name: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / name, "w") as z:
        z.writestr("x/__init__.py", "")


def test_validate_accepts_exactly_the_pin(tmp_path: Path) -> None:
    _wheel(tmp_path, "pytest_rerunfailures-16.4-py3-none-any.whl")
    _wheel(tmp_path, "packaging-26.3-py3-none-any.whl")
    assert validate_wheel_dir(tmp_path) == ("packaging-26.3-py3-none-any.whl",
                                            "pytest_rerunfailures-16.4-py3-none-any.whl")


def test_validate_refuses_16_6_1(tmp_path: Path) -> None:
    _wheel(tmp_path, "pytest_rerunfailures-16.4-py3-none-any.whl")
    _wheel(tmp_path, "pytest_rerunfailures-16.6.1-py3-none-any.whl")
    with pytest.raises(ValueError, match=r"16\.6\.1, which must never be used"):
        validate_wheel_dir(tmp_path)


@pytest.mark.parametrize("names", [[], ["pytest_rerunfailures-16.5-py3-none-any.whl"],
                                   ["pytest_rerunfailures-16.4-py3-none-any.whl",
                                    "fast-1.0-cp311-cp311-linux_x86_64.whl"]])
def test_validate_refuses_anything_else(tmp_path: Path, names: list[str]) -> None:
    for name in names:
        _wheel(tmp_path, name)
    with pytest.raises(ValueError):
        validate_wheel_dir(tmp_path)


def test_prepared_directory_wins(tmp_path: Path) -> None:
    _wheel(tmp_path / "w", "pytest_rerunfailures-16.4-py3-none-any.whl")
    wheels = ensure_wheels(tmp_path / "cache", environ={"PYTEST_PROGRAMBENCH_WHEELS": str(tmp_path / "w")})
    assert wheels.available
    assert wheels.directory == tmp_path / "w"
    bad = ensure_wheels(tmp_path / "cache", environ={"PYTEST_PROGRAMBENCH_WHEELS": str(tmp_path / "nowhere")})
    assert not bad.available
    assert "PYTEST_PROGRAMBENCH_WHEELS" in bad.reason


def test_download_failure_is_said_loudly_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def offline(dest: Path, *, timeout: float = 0) -> tuple[str, ...]:
        calls.append(dest)
        raise RuntimeError("pip download for Python 3.10 failed: network is unreachable")

    monkeypatch.setattr(rerunfailures, "download_wheels", offline)
    rerunfailures.reset_memo()
    first = ensure_wheels(tmp_path, environ={})
    assert not first.available
    assert "cannot download pytest-rerunfailures==16.4" in first.reason
    assert "network is unreachable" in first.reason
    failed = json.loads((tmp_path / "rerunfailures-16.4" / "FAILED").read_text())
    assert "network is unreachable" in failed["reason"]
    rerunfailures.reset_memo()  # another worker process: it reads the marker instead of retrying
    second = ensure_wheels(tmp_path, environ={})
    assert not second.available
    assert "cached failure" in second.reason
    assert len(calls) == 1
    rerunfailures.reset_memo()


def test_successful_download_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(dest: Path, *, timeout: float = 0) -> tuple[str, ...]:
        _wheel(dest, "pytest_rerunfailures-16.4-py3-none-any.whl")
        return validate_wheel_dir(dest)

    monkeypatch.setattr(rerunfailures, "download_wheels", fake)
    rerunfailures.reset_memo()
    wheels = ensure_wheels(tmp_path, environ={})
    assert wheels.available
    assert (tmp_path / "rerunfailures-16.4" / "COMPLETE").exists()
    monkeypatch.setattr(rerunfailures, "download_wheels", None)  # a second download would crash
    rerunfailures.reset_memo()
    assert ensure_wheels(tmp_path, environ={}).wheels == wheels.wheels
    rerunfailures.reset_memo()


def test_pip_environment_is_offline() -> None:
    on = pip_environment(RerunWheels(Path("/x"), wheels=("a.whl",)))
    assert on["PIP_NO_INDEX"] == "1"
    assert on["PIP_FIND_LINKS"] == CONTAINER_WHEEL_DIR
    off = pip_environment(RerunWheels(None, reason="offline"))
    assert off["PIP_NO_INDEX"] == "1"
    assert off["PIP_FIND_LINKS"] == ""


@pytest.mark.docker
def test_reruns_on_in_a_real_evaluation(testbed: Testbed, tmp_path: Path) -> None:
    """pip runs (and is recorded) in a container of the task's image at the first evaluation of it, and is replayed;
    the second replays the record too: same log
    entry, same statuses, and the plugin really there (a failing test is rerun)."""
    cache = tmp_path / "installed"
    task, blob_dir = one_branch_rpn(testbed, tmp_path / "task")
    runs_by_evaluation = []
    for n, expected in enumerate(("recorded from the task's image, replayed", "replayed")):
        outcome = run_ours(task, submission(testbed, "wrong", RPN), testbed, tmp_path / str(n), blob_dir=blob_dir,
                           reruns=True, install_cache=str(cache))
        assert outcome.reruns, outcome.reruns_reason
        assert outcome.reruns_install == expected
        assert outcome.meta()["reruns_install"] == expected
        result = outcome.result
        assert result is not None
        install = next(e for e in result.log if e["step"] == "install_rerunfailures")
        # The official command, unchanged in the log; it ran offline against the host's wheels.
        assert install["command"] == "pip3 install -q --disable-pip-version-check pytest-rerunfailures==16.4"
        assert install["returncode"] == 0
        runs = [e for e in result.log if e["step"] == "run_tests"]
        assert all("--reruns=2 --reruns-delay=1" in e["command"] for e in runs)
        assert any(" rerun" in e["output"] for e in runs)  # the failing test was rerun
        assert "reruns: on" in item_message(outcome, task)
        runs_by_evaluation.append(({t.full_name: t.status for t in result.test_results},
                                   [e["step"] for e in result.log], install["output"]))
    assert runs_by_evaluation[0] == runs_by_evaluation[1]
    # A compile.sh that touches what pip reads (here /etc/pip.conf, empty) gets pip itself, never the record.
    planted = rpn_archive(testbed, tmp_path / "planted.tar.gz", with_line(GOOD_COMPILE, "touch /etc/pip.conf"))
    outcome = run_ours(task, planted, testbed, tmp_path / "planted", blob_dir=blob_dir, reruns=True,
                       install_cache=str(cache))
    assert outcome.reruns, outcome.reruns_reason
    assert outcome.reruns_install == "pip"
    records = [d for d in cache.iterdir() if not d.name.startswith(".")]
    assert len(records) == 1
    with tarfile.open(records[0] / "files.tar") as tar:
        names = tar.getnames()
    assert any(n.endswith("pytest_rerunfailures.py") for n in names), names[:20]
    assert not [n for n in names if n.startswith(("tmp/", "workspace/"))]


def _change(path: str, kind: int = 1, stamp: tuple[int, int, int] | None = (1, 2, 0o100644)) -> dict[str, object]:
    return {"Path": path, "Kind": kind, "Stamp": stamp}


def test_pristine_for_pip_rule() -> None:
    """Replay only where compile.sh left pip's world as shipped: the workspace, scratch, build caches and what the
    official writes itself (with their parent directories) are fine; anything else, or no stamps, is not."""
    ok = [_change("/workspace", 0, None), _change("/workspace/target/x"), _change("/tmp", 0, None),
          _change("/root", 0, None), _change("/root/.cache", 1, None), _change("/etc", 0, None),
          _change("/etc/resolv.conf", 0)]
    assert pristine_for_pip(ok, [], "/usr/local/bin:/usr/bin:/bin") is None
    assert pristine_for_pip([*ok, _change("/usr/local/lib/python3.11/dist-packages/x.pth")], [], "/usr/bin")
    assert pristine_for_pip([*ok, _change("/etc/profile", 0)], [], "/usr/bin")
    assert pristine_for_pip([*ok, _change("/root/.config/pip/pip.conf")], [], "/usr/bin")
    # A directory listed only as a copy-up (nothing of its own) is no change; one the walk stamps (its mode, owner or
    # opaqueness is not the image's: test_the_walk_stamps_a_directory_changed_itself) is.
    assert pristine_for_pip([*ok, _change("/usr/local", 0, None)], [], "/usr/bin") is None
    assert pristine_for_pip([*ok, _change("/usr/local", 0, (0, 0, 0o40700))], [], "/usr/bin")  # a chmod
    assert pristine_for_pip([_change("/tmp", 0, (1, 2, 0o120777))], [], "/usr/bin")  # /tmp made a symlink
    assert pristine_for_pip(ok, [], "/usr/bin:.")
    assert pristine_for_pip(ok, [], "/workspace/bin:/usr/bin")
    assert pristine_for_pip(ok, [], None)
    assert pristine_for_pip(ok, ["more than 400000 changed entries"], "/usr/bin")
    assert pristine_for_pip([{"Path": "/workspace/x", "Kind": 1}], [], "/usr/bin")  # the engine's diff: no stamps


def test_pip_writes_leaves_scratch_and_unchanged_entries() -> None:
    before = [_change("/usr", 0, None), _change("/usr/local/bin/old", 0, (1, 1, 0o100755))]
    after = [*before, _change("/usr/local/lib/python3.11", 1, None), _change("/usr/local/lib/python3.11/a.py"),
             _change("/tmp/pip-xyz/f"), _change("/workspace/f"), _change("/usr/local/bin/gone", 2, None),
             _change("/usr/local/bin/old2", 0, (1, 1, 0o100755))]
    written, deleted = pip_writes(before, after)
    assert written == ["/usr/local/bin/old2", "/usr/local/lib/python3.11", "/usr/local/lib/python3.11/a.py"]
    assert deleted == ["/usr/local/bin/gone"]


@pytest.mark.docker
def test_reruns_off_is_said(testbed: Testbed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without wheels pip fails offline; a second evaluation replays that failure: reruns off all the same."""
    monkeypatch.setenv("PYTEST_PROGRAMBENCH_WHEELS", str(tmp_path / "no-wheels-here"))
    task, blob_dir = one_branch_rpn(testbed, tmp_path / "task")
    installs = []
    for n, expected in enumerate(("recorded from the task's image, replayed", "replayed")):
        outcome = run_ours(task, submission(testbed, "good", RPN), testbed, tmp_path / str(n), blob_dir=blob_dir,
                           reruns=True, install_cache=str(tmp_path / "installed"))
        assert not outcome.reruns
        assert outcome.reruns_install == expected
        assert "no pytest-rerunfailures wheels on this host" in outcome.reruns_reason
        assert "reruns: off (no pytest-rerunfailures wheels" in item_message(outcome, task)
        assert outcome.meta()["reruns"] == "off"
        assert outcome.score == 1.0
        assert outcome.result is not None
        install = next(e for e in outcome.result.log if e["step"] == "install_rerunfailures")
        assert install["returncode"] != 0
        installs.append((install["returncode"], install["output"]))
    assert installs[0] == installs[1]
