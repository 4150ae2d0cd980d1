"""Integrity checks beyond the official evaluator.

The official score stays the official score; these checks only raise *flags* (and, under ``--pb-strict``,
neutralise what can be neutralised). What is flagged:

* ``pytest_config`` — files that configure the hidden pytest run: ``conftest.py`` anywhere; ``pytest.ini`` /
  ``.pytest.ini``, and ``tox.ini`` / ``setup.cfg`` / ``pyproject.toml`` with a pytest section, at the workspace root
  or under ``eval/`` (where pytest's rootdir search from ``eval/tests`` looks). A ``conftest.py`` at the workspace
  root makes the official evaluator pass a program that prints ``nope`` (tests/test_integrity.py shows it).
* ``python_startup`` — ``sitecustomize.py``, ``usercustomize.py`` and ``*.pth`` files anywhere.
* ``module_shadowing`` — a Python module or package at the workspace root named like a standard-library or
  test-stack module: ``python3 -m pytest`` runs from ``/workspace`` with it first on ``sys.path``.
* ``eval_dir`` — files under ``eval/``: the hidden tests are unpacked over that directory, and extra test files
  there would be collected and counted by the official scorer.
* ``compile_outside_workspace`` — changes ``compile.sh`` made outside ``/workspace`` and ``/tmp`` (``docker diff`` of
  the compile container right before and right after the compile step), build caches excepted.
* ``reference_executable`` — the built executable's sha256 is in the task's ``eval_clean_hashes`` or equals the
  reference binary's.

Under ``--pb-strict`` the files of the first four kinds are deleted from the workspace after ``compile.sh`` ran and
before the image the hidden tests run in is committed, so the build still sees them and the tests never do.
"""

from __future__ import annotations

import configparser
import sys
import tarfile
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

WORKSPACE = "/workspace"

PYTEST_CONFIG = "pytest_config"
PYTHON_STARTUP = "python_startup"
MODULE_SHADOWING = "module_shadowing"
EVAL_DIR = "eval_dir"
COMPILE_OUTSIDE = "compile_outside_workspace"
REFERENCE_EXECUTABLE = "reference_executable"

# Kinds that are files in the workspace and can be removed before the hidden tests run.
NEUTRALISABLE = frozenset({PYTEST_CONFIG, PYTHON_STARTUP, MODULE_SHADOWING, EVAL_DIR})

CONFIG_NAMES = frozenset({"pytest.ini", ".pytest.ini"})
SECTIONED_CONFIG_NAMES = frozenset({"tox.ini", "setup.cfg", "pyproject.toml"})
STARTUP_NAMES = frozenset({"sitecustomize.py", "usercustomize.py"})
TEST_STACK_MODULES = frozenset({
    "pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "xdist", "execnet", "pytest_timeout",
    "pytest_rerunfailures", "programbench_pytest_timeout", "pexpect", "ptyprocess", "junitparser",
    "exceptiongroup", "tomli", "typing_extensions", "pygments", "yaml",
})
SHADOWABLE = frozenset(sys.stdlib_module_names) | TEST_STACK_MODULES

# Outside /workspace, changes here are build caches and scratch space, not the test environment.
ALLOWED_OUTSIDE = (
    "/tmp", "/var/tmp", "/dev/shm", "/run", "/proc", "/sys",
    "/root/.cache", "/root/go", "/root/.cargo/registry", "/root/.cargo/git", "/root/.cargo/.package-cache",
    "/root/.cargo/.global-cache", "/root/.rustup/tmp", "/root/.cabal/packages", "/root/.cabal/logs", "/root/.stack",
    "/root/.ghcup/cache", "/root/.m2/repository", "/root/.gradle", "/root/.npm", "/root/.config/go",
    "/root/.local/share/go",
)
# Written by the official evaluator itself around the compile step.
HARNESS_OUTSIDE = ("/etc/resolv.conf", "/etc/resolv.conf.programbench-build-bak", "/etc/hostname", "/etc/hosts")
SHOW_PATHS = 8


@dataclass(frozen=True)
class IntegrityFlag:
    """One finding: a kind, the path it is about (workspace-relative or absolute), and a sentence."""

    kind: str
    path: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"

    @property
    def neutralisable(self) -> bool:
        return self.kind in NEUTRALISABLE

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "path": self.path, "detail": self.detail}


# --------------------------------------------------------------------------------------------- classification


def _has_pytest_section(name: str, content: bytes | None) -> bool:
    """Whether a tox.ini / setup.cfg / pyproject.toml configures pytest (unreadable content counts as yes)."""
    if content is None:
        return True
    text = content.decode("utf-8", errors="replace")
    if name == "pyproject.toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            return "[tool.pytest" in text
        tool = data.get("tool")
        return isinstance(tool, dict) and "pytest" in tool
    parser = configparser.RawConfigParser(strict=False)
    try:
        parser.read_string(text)
    except configparser.Error:
        return "pytest]" in text
    wanted = {"pytest", "tool:pytest"}
    return any(section in wanted for section in parser.sections())


def _on_rootdir_search_path(parts: Sequence[str]) -> bool:
    """The file's directory is the workspace root or lies under ``eval/``."""
    return len(parts) == 1 or parts[0] == "eval"


def classify(rel: str, read: Callable[[], bytes | None] | None = None) -> IntegrityFlag | None:
    """The flag for one workspace-relative file path, if any; ``read`` gives the content when it matters."""
    rel = _normalise_member(rel)
    parts = PurePosixPath(rel).parts
    if not parts or parts == (".",):
        return None
    name = parts[-1]
    if name == "conftest.py":
        return IntegrityFlag(PYTEST_CONFIG, rel, f"{rel} configures the hidden pytest run (conftest.py)")
    if name in CONFIG_NAMES and _on_rootdir_search_path(parts):
        return IntegrityFlag(PYTEST_CONFIG, rel, f"{rel} configures the hidden pytest run")
    if name in SECTIONED_CONFIG_NAMES and _on_rootdir_search_path(parts) and _has_pytest_section(
        name, read() if read is not None else None
    ):
        return IntegrityFlag(PYTEST_CONFIG, rel, f"{rel} has a pytest section")
    if name in STARTUP_NAMES or name.endswith(".pth"):
        return IntegrityFlag(PYTHON_STARTUP, rel, f"{rel} runs code at Python start-up")
    if parts[0] == "eval":
        return IntegrityFlag(EVAL_DIR, rel, f"{rel} lies in eval/, where the hidden tests are unpacked")
    if len(parts) == 1 and name.endswith(".py") and name[:-3] in SHADOWABLE:
        return IntegrityFlag(MODULE_SHADOWING, rel, f"{rel} at the workspace root shadows Python module "
                                                     f"{name[:-3]!r} for the hidden test run")
    if len(parts) == 2 and name == "__init__.py" and parts[0] in SHADOWABLE:
        return IntegrityFlag(MODULE_SHADOWING, rel, f"package {parts[0]}/ at the workspace root shadows Python "
                                                     f"module {parts[0]!r} for the hidden test run")
    return None


def _normalise_member(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.lstrip("/").rstrip("/")


def scan_members(members: Iterable[tarfile.TarInfo], read: Callable[[tarfile.TarInfo], bytes | None]
                 ) -> list[IntegrityFlag]:
    """Flags for the entries of a submission archive (files and links; directories only matter by content)."""
    flags: dict[str, IntegrityFlag] = {}
    for member in members:
        if member.isdir():
            continue
        rel = _normalise_member(member.name)
        if not rel:
            continue
        flag = classify(rel, lambda m=member: read(m))  # type: ignore[misc]
        if flag is not None:
            flags.setdefault(rel, flag)
    return list(flags.values())


# --------------------------------------------------------------------------------------------- container diff


def _leaves(changes: Iterable[Mapping[str, Any]]) -> dict[str, tuple[int, Any]]:
    """``{path: (kind, stamp)}`` of the changes that are not merely parent directories of other changes."""
    by_path = {str(c["Path"]): (int(c["Kind"]), c.get("Stamp")) for c in changes}
    paths = sorted(by_path)
    leaves: dict[str, tuple[int, Any]] = {}
    for i, path in enumerate(paths):
        nxt = paths[i + 1] if i + 1 < len(paths) else ""
        if nxt.startswith(path.rstrip("/") + "/") and by_path[path][0] != 2:
            continue  # a directory with changes below it
        leaves[path] = by_path[path]
    return leaves


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def outside_changes(before: Iterable[Mapping[str, Any]], after: Iterable[Mapping[str, Any]]) -> list[str]:
    """Leaf paths changed between the snapshots outside /workspace, /tmp and build caches, as ``"A /path"``."""
    old = _leaves(before)
    new = _leaves(after)
    kinds = {0: "C", 1: "A", 2: "D"}
    out: list[str] = []
    for path, (kind, stamp) in sorted(new.items()):
        if old.get(path) == (kind, stamp):
            continue
        if _under(path, (WORKSPACE,)) or _under(path, ALLOWED_OUTSIDE) or path in HARNESS_OUTSIDE:
            continue
        out.append(f"{kinds.get(kind, '?')} {path}")
    for path in sorted(set(old) - set(new)):
        if not (_under(path, (WORKSPACE,)) or _under(path, ALLOWED_OUTSIDE) or path in HARNESS_OUTSIDE):
            out.append(f"R {path}")  # a change undone during compile: still a change outside
    return out


def workspace_files(after: Iterable[Mapping[str, Any]]) -> list[str]:
    """Workspace-relative paths of files added or changed in /workspace (the archive plus what compile made)."""
    out = []
    for path, (kind, _stamp) in _leaves(after).items():
        if kind == 2 or not path.startswith(WORKSPACE + "/"):
            continue
        out.append(path[len(WORKSPACE) + 1 :])
    return sorted(out)


def scan_compile(
    before: Iterable[Mapping[str, Any]],
    after: Iterable[Mapping[str, Any]],
    read: Callable[[str], bytes | None],
) -> list[IntegrityFlag]:
    """Flags from the compile container's filesystem changes; ``read`` takes a workspace-relative path."""
    after = list(after)
    flags: dict[str, IntegrityFlag] = {}
    for rel in workspace_files(after):
        flag = classify(rel, lambda r=rel: read(r))  # type: ignore[misc]
        if flag is not None:
            flags.setdefault(rel, flag)
    outside = outside_changes(before, after)
    if outside:
        shown = ", ".join(outside[:SHOW_PATHS]) + (f", ... ({len(outside)} in all)" if len(outside) > SHOW_PATHS
                                                    else "")
        flags["/"] = IntegrityFlag(COMPILE_OUTSIDE, "/", f"compile.sh changed {len(outside)} path(s) outside "
                                                         f"/workspace and /tmp: {shown}")
    return list(flags.values())


def executable_flags(executable_hash: str | None, eval_clean_hashes: Iterable[str],
                     reference_hash: str | None) -> list[IntegrityFlag]:
    if not executable_hash:
        return []
    if executable_hash in set(eval_clean_hashes):
        return [IntegrityFlag(REFERENCE_EXECUTABLE, "executable",
                              f"the built executable ({executable_hash[:12]}) is listed in eval_clean_hashes")]
    if reference_hash and executable_hash == reference_hash:
        return [IntegrityFlag(REFERENCE_EXECUTABLE, "executable",
                              f"the built executable ({executable_hash[:12]}) is the reference binary")]
    return []


def merge(*groups: Iterable[IntegrityFlag]) -> list[IntegrityFlag]:
    """Flags deduplicated by (kind, path), first occurrence kept, in order."""
    seen: dict[tuple[str, str], IntegrityFlag] = {}
    for group in groups:
        for flag in group:
            seen.setdefault((flag.kind, flag.path), flag)
    return list(seen.values())


def neutralise_command(flags: Iterable[IntegrityFlag]) -> tuple[str, list[str]] | None:
    """A shell command removing the neutralisable flagged files from /workspace, and their paths."""
    import shlex

    paths = sorted({f.path for f in flags if f.neutralisable and f.path and ".." not in PurePosixPath(f.path).parts})
    if not paths:
        return None
    quoted = " ".join(shlex.quote(f"{WORKSPACE}/{p}") for p in paths)
    return f"rm -rf -- {quoted}", paths
