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
    package = rel.split("/", maxsplit=1)[0]
    assert flag.path == (package if kind == integrity.MODULE_SHADOWING else rel.removeprefix("./"))


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


# --------------------------------------------------------------------------------------------- issues 20 and 21


@pytest.mark.parametrize(
    ("rel", "kind", "path"),
    [
        ("pprint.pyc", integrity.MODULE_SHADOWING, "pprint.pyc"),  # sourceless bytecode is imported
        ("json.cpython-311-x86_64-linux-gnu.so", integrity.MODULE_SHADOWING, "json.cpython-311-x86_64-linux-gnu.so"),
        ("json.abi3.so", integrity.MODULE_SHADOWING, "json.abi3.so"),
        ("_pytest.so", integrity.MODULE_SHADOWING, "_pytest.so"),
        ("__pycache__/pprint.cpython-311.pyc", integrity.MODULE_SHADOWING, "__pycache__/pprint.cpython-311.pyc"),
        ("json/__init__.pyc", integrity.MODULE_SHADOWING, "json"),
        ("json/__init__.abi3.so", integrity.MODULE_SHADOWING, "json"),
        ("pytest/anything.py", integrity.MODULE_SHADOWING, "pytest"),  # a namespace package named like pytest
        ("xdist/plugin.txt", integrity.MODULE_SHADOWING, "xdist"),
        ("sitecustomize.pyc", integrity.PYTHON_STARTUP, "sitecustomize.pyc"),
        ("lib/sitecustomize/__init__.py", integrity.PYTHON_STARTUP, "lib/sitecustomize/__init__.py"),
        ("lib/__pycache__/usercustomize.cpython-311.pyc", integrity.PYTHON_STARTUP,
         "lib/__pycache__/usercustomize.cpython-311.pyc"),
        ("usercustomize.cpython-311-x86_64-linux-gnu.so", integrity.PYTHON_STARTUP,
         "usercustomize.cpython-311-x86_64-linux-gnu.so"),
        ("evil.dist-info/entry_points.txt", integrity.PYTHON_STARTUP, "evil.dist-info/entry_points.txt"),
        ("evil.egg-info/entry_points.txt", integrity.PYTHON_STARTUP, "evil.egg-info/entry_points.txt"),
    ],
)
def test_python_import_forms_are_flagged(rel: str, kind: str, path: str) -> None:
    flag = classify(rel)
    assert flag is not None, rel
    assert (flag.kind, flag.path) == (kind, path)


@pytest.mark.parametrize("rel", ["json/data.txt", "test/main.c", "html/index.html", "libjson.so", "src/pprint.pyc",
                                 "build/__pycache__/pprint.cpython-311.pyc", "lib/json.abi3.so", "pytest.txt",
                                 "__pycache__/mytool.cpython-311.pyc", "vendor/pytest/x.py"])
def test_what_python_would_not_import_in_place_of_a_module_is_not_flagged(rel: str) -> None:
    assert classify(rel) is None


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"[project]\nversion = " + b"9" * 5000 + b"\n", "cannot be parsed (ValueError)"),  # int digit limit
        (b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "cannot be parsed (RecursionError)"),
        (b"not [valid toml\n", "cannot be parsed (TOMLDecodeError)"),
        (None, "could not be read within"),  # past the cap, or unreadable
    ],
)
def test_config_files_that_cannot_be_read_or_parsed_are_a_flag_never_an_exception(content: bytes | None,
                                                                                  why: str) -> None:
    flag = classify("pyproject.toml", lambda: content)
    assert flag is not None
    assert flag.kind == integrity.PYTEST_CONFIG
    assert why in flag.detail


def test_config_reads_are_capped_in_size_and_number() -> None:
    reads: list[str] = []

    def read(rel: str) -> bytes:
        reads.append(rel)
        return b"[project]\nname = 'x'\n" if rel == "pyproject.toml" else b"x" * (integrity.CONFIG_READ_CAP + 1)

    names = ["pyproject.toml", "setup.cfg", *(f"eval/d{i}/tox.ini" for i in range(integrity.MAX_CONFIG_READS + 5))]
    flags = {f.path: f for f in integrity.scan_paths(names, read)}
    assert "pyproject.toml" not in flags  # read, parsed, no pytest section
    assert "could not be read within" in flags["setup.cfg"].detail  # larger than the cap: counted, not parsed
    assert len(reads) == integrity.MAX_CONFIG_READS


def test_walk_bounds_are_a_flag() -> None:
    flags = integrity.scan_paths([f"f{i}.c" for i in range(50)], lambda rel: None, max_entries=10)
    assert [f.kind for f in flags] == [integrity.SCAN_BOUNDED]
    assert "more than 10 entries" in flags[0].detail
    deep = "/workspace/" + "d/" * 300
    bounded = integrity.scan_compile([], [_change("/workspace", 0)], lambda rel: None,
                                     bounded=[f"{deep}: deeper than 256 levels"])
    assert [f.kind for f in bounded] == [integrity.SCAN_BOUNDED]
    assert len(bounded[0].detail) < 400  # the path is shortened, the record bounded


def test_undecodable_names_are_printable_and_neutralised_byte_for_byte(tmp_path: Path) -> None:
    import json
    import subprocess

    name = "lib/\udcff\udcfe.pth"  # bytes ff fe: a name that is not UTF-8, as Python decodes it
    flag = classify(name)
    assert flag is not None
    assert flag.path == name  # the exact name, for neutralisation
    assert str(flag) == "python_startup: lib/\\xff\\xfe.pth runs code at Python start-up (.pth)"
    json.dumps(flag.as_dict(), ensure_ascii=False).encode("utf-8")  # what xdist and JUnit do: no error
    planned = integrity.neutralise_command([flag])
    assert planned is not None
    commands, paths = planned
    assert paths == ["lib/\\xff\\xfe.pth"]
    target = tmp_path / "workspace" / "lib"
    target.mkdir(parents=True)
    raw = bytes(target) + b"/\xff\xfe.pth"
    with open(raw, "wb") as f:
        f.write(b"x")
    (target / "keep.pth").write_text("x")
    script = commands[0].replace("/workspace/", str(tmp_path / "workspace") + "/")
    subprocess.run(["bash", "-c", script], check=True)
    assert not Path(raw.decode("utf-8", "surrogateescape")).exists()
    assert (target / "keep.pth").exists()


def test_archive_with_undecodable_and_many_names(tmp_path: Path) -> None:
    archive = tmp_path / "s.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT, errors="surrogateescape") as tar:
        for name in ("./compile.sh", "./lib/\udcff.pth", "./\udcfe/conftest.py"):
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    flags = {f.as_dict()["path"]: str(f) for f in check_archive(archive).flags}
    assert flags == {"lib/\\xff.pth": "python_startup: lib/\\xff.pth runs code at Python start-up (.pth)",
                     "\\xfe/conftest.py": "pytest_config: \\xfe/conftest.py configures the hidden pytest run "
                                          "(conftest.py)"}


def test_merge_keeps_a_bounded_number_of_flags_per_kind() -> None:
    many = [IntegrityFlag(integrity.PYTEST_CONFIG, f"d{i}/conftest.py", "x") for i in range(50)]
    merged = integrity.merge(many)
    assert len(merged) == integrity.SHOW_FLAGS + 1
    assert merged[-1].detail == f"and {50 - integrity.SHOW_FLAGS} more pytest_config finding(s)"
    assert integrity.neutralise_command(many) is not None  # neutralisation still sees every path


def test_sanitise_report_makes_every_string_encodable() -> None:
    from _pytest.reports import TestReport

    from pytest_programbench.results.verdict import sanitise_report

    report = TestReport("programbench::x", ("x", None, "x"), {}, "failed", "flag lib/\udcff.pth", "call",
                        [("Captured log", "path \udcfe")], user_properties=[("integrity_flags", "a\udcff")])
    sanitise_report(report)
    assert report.longrepr == "flag lib/\\xff.pth"
    assert report.user_properties == [("integrity_flags", "a\\xff")]
    assert report.sections == [("Captured log", "path \\xfe")]
