"""Integrity flags beyond the official evaluator (unit level; the conftest exploit end to end is in
tests/test_evaluation_integrity.py)."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from pytest_programbench.evaluation import integrity
from pytest_programbench.evaluation.evaluation import check_archive
from pytest_programbench.evaluation.integrity import IntegrityFlag, classify


def _tar(path: Path, files: dict[str, bytes], *, symlinks: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (symlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return path


@pytest.mark.parametrize(
    ("rel", "kind"),
    [
        ("conftest.py", integrity.PYTEST_CONFIG),
        ("./conftest.py", integrity.PYTEST_CONFIG),
        ("src/deep/conftest.py", integrity.PYTEST_CONFIG),
        ("pytest.ini", integrity.PYTEST_CONFIG),
        (".pytest.ini", integrity.PYTEST_CONFIG),
        ("eval/pytest.ini", integrity.PYTEST_CONFIG),
        ("sitecustomize.py", integrity.PYTHON_STARTUP),
        ("lib/usercustomize.py", integrity.PYTHON_STARTUP),
        ("vendor/evil.pth", integrity.PYTHON_STARTUP),
        ("subprocess.py", integrity.MODULE_SHADOWING),
        ("pytest.py", integrity.MODULE_SHADOWING),
        ("json/__init__.py", integrity.MODULE_SHADOWING),
        ("eval/tests/test_extra.py", integrity.EVAL_DIR),
    ],
)
def test_flagged_paths(rel: str, kind: str) -> None:
    flag = classify(rel)
    assert flag is not None
    assert flag.kind == kind
    # A package is flagged (and neutralised) as its directory.
    assert flag.path == (rel.split("/")[0] if kind == integrity.MODULE_SHADOWING else rel.removeprefix("./"))


@pytest.mark.parametrize("rel", ["main.c", "compile.sh", "src/pytest.ini", "src/tox.ini", "tools/gen.py",
                                 "src/subprocess.py", "README.md", "Cargo.toml", "src/json/__init__.py"])
def test_ordinary_paths_are_not_flagged(rel: str) -> None:
    assert classify(rel, lambda: b"[pytest]\n") is None


@pytest.mark.parametrize(
    ("name", "content", "flagged"),
    [
        ("tox.ini", b"[tox]\nenvlist = py3\n[pytest]\naddopts = -p no:junitxml\n", True),
        ("tox.ini", b"[tox]\nenvlist = py3\n", False),
        ("setup.cfg", b"[metadata]\nname = x\n[tool:pytest]\naddopts = -x\n", True),
        ("setup.cfg", b"[metadata]\nname = x\n", False),
        ("pyproject.toml", b"[tool.pytest.ini_options]\naddopts = '-p x'\n", True),
        ("pyproject.toml", b"[project]\nname = 'x'\n", False),
        ("pyproject.toml", b"not [valid toml\n[tool.pytest.ini_options]\n", True),
    ],
)
def test_sectioned_configs_need_a_pytest_section(name: str, content: bytes, flagged: bool) -> None:
    assert (classify(name, lambda: content) is not None) is flagged
    in_eval = classify(f"eval/{name}", lambda: content)
    assert in_eval is not None  # anything under eval/ is flagged; a pytest section is the stronger finding
    assert in_eval.kind == (integrity.PYTEST_CONFIG if flagged else integrity.EVAL_DIR)


def test_archive_scan_reads_config_contents(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "s.tar.gz", {
        "./compile.sh": b"#!/bin/sh\n",
        "./conftest.py": b"import pytest\n",
        "./pyproject.toml": b"[tool.pytest.ini_options]\n",
        "./setup.cfg": b"[metadata]\n",
        "./lib/x.pth": b"import os\n",
    })
    check = check_archive(archive)
    assert check.problem is None
    assert check.sha256 == hashlib.sha256(archive.read_bytes()).hexdigest()  # of the archive file, as written
    assert sorted((f.kind, f.path) for f in check.flags) == [
        (integrity.PYTEST_CONFIG, "conftest.py"),
        (integrity.PYTEST_CONFIG, "pyproject.toml"),
        (integrity.PYTHON_STARTUP, "lib/x.pth"),
    ]


def test_archive_check_names_the_problem(tmp_path: Path) -> None:
    missing = check_archive(tmp_path / "nope.tar.gz")
    assert missing.error_code == "no_submission"
    assert "no submission archive" in (missing.problem or "")

    plain = tmp_path / "plain.tar.gz"
    with tarfile.open(plain, "w") as tar:
        tar.addfile(tarfile.TarInfo("x"), io.BytesIO(b""))
    assert check_archive(plain).error_code == "invalid_submission_archive"
    assert "not gzip-compressed" in (check_archive(plain).problem or "")

    good = _tar(tmp_path / "good.tar.gz", {"compile.sh": b"x" * 100_000})
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(good.read_bytes()[:-20])
    problem = check_archive(truncated)
    assert problem.error_code == "invalid_submission_archive"
    assert "not a readable gzip tar" in (problem.problem or "")

    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"\x1f\x8b" + b"\x00" * 50)
    assert check_archive(garbage).error_code == "invalid_submission_archive"


def test_escaping_symlinks_are_not_a_host_side_problem(tmp_path: Path) -> None:
    """The container's tar keeps escaping symlinks (official semantics); the host check does not reject them."""
    archive = _tar(tmp_path / "s.tar.gz", {"compile.sh": b"#!/bin/sh\n"},
                   symlinks={"cfg/link": "../../../etc/bashrc"})
    check = check_archive(archive)
    assert check.problem is None
    assert check.flags == []
    assert check.sha256 is not None
    assert len(check.sha256) == 64


def _change(path: str, kind: int) -> dict[str, object]:
    return {"Path": path, "Kind": kind}


def test_compile_diff_flags_changes_outside_workspace_only() -> None:
    before = [_change("/workspace", 0), _change("/workspace/main.c", 1), _change("/etc", 0),
              _change("/etc/resolv.conf.programbench-build-bak", 1)]
    after = [*before, _change("/workspace/executable", 1), _change("/workspace/conftest.py", 1),
             _change("/tmp", 0), _change("/tmp/build.o", 1), _change("/root", 0), _change("/root/.cache", 1),
             _change("/root/.cache/go-build", 1), _change("/usr", 0), _change("/usr/lib", 0),
             _change("/usr/lib/python3/dist-packages", 0), _change("/usr/lib/python3/dist-packages/evil.pth", 1),
             _change("/etc/profile", 0)]
    flags = integrity.scan_compile(before, after, lambda rel: None)
    kinds = {f.kind: f for f in flags}
    assert set(kinds) == {integrity.PYTEST_CONFIG, integrity.COMPILE_OUTSIDE}
    outside = kinds[integrity.COMPILE_OUTSIDE].detail
    assert "A /usr/lib/python3/dist-packages/evil.pth" in outside
    assert "C /etc/profile" in outside
    assert "/tmp/build.o" not in outside
    assert "/root/.cache" not in outside
    assert "resolv" not in outside
    assert "2 path(s)" in outside


def test_clean_compile_diff_has_no_flags() -> None:
    before = [_change("/workspace", 0), _change("/workspace/main.c", 1)]
    after = [*before, _change("/workspace/executable", 1), _change("/workspace/.git", 1)]
    assert integrity.scan_compile(before, after, lambda rel: None) == []


def test_executable_flags() -> None:
    assert integrity.executable_flags("a" * 64, ["a" * 64], None)[0].kind == integrity.REFERENCE_EXECUTABLE
    assert integrity.executable_flags("b" * 64, [], "b" * 64)[0].kind == integrity.REFERENCE_EXECUTABLE
    assert integrity.executable_flags("c" * 64, ["a" * 64], "b" * 64) == []
    assert integrity.executable_flags(None, ["a" * 64], "a" * 64) == []


def test_neutralise_command_only_touches_workspace_files() -> None:
    flags = [IntegrityFlag(integrity.PYTEST_CONFIG, "conftest.py", ""),
             IntegrityFlag(integrity.PYTHON_STARTUP, "a b/x.pth", ""),
             IntegrityFlag(integrity.COMPILE_OUTSIDE, "/", ""),
             IntegrityFlag(integrity.REFERENCE_EXECUTABLE, "executable", ""),
             IntegrityFlag(integrity.PYTEST_CONFIG, "../escape/conftest.py", "")]
    planned = integrity.neutralise_command(flags)
    assert planned is not None
    commands, paths = planned
    assert paths == ["a b/x.pth", "conftest.py"]
    assert commands == ["rm -rf -- '/workspace/a b/x.pth' /workspace/conftest.py"]
    assert integrity.neutralise_command([IntegrityFlag(integrity.COMPILE_OUTSIDE, "/", "")]) is None


def test_merge_deduplicates_by_kind_and_path() -> None:
    a = IntegrityFlag(integrity.PYTEST_CONFIG, "conftest.py", "from the archive")
    b = IntegrityFlag(integrity.PYTEST_CONFIG, "conftest.py", "from the diff")
    c = IntegrityFlag(integrity.PYTHON_STARTUP, "x.pth", "")
    assert integrity.merge([a], [b, c]) == [a, c]
