"""Integrity checks beyond the official evaluator.

The official score stays the official score; these checks only raise *flags* (and, under ``--pb-strict``,
neutralise what can be neutralised). What is flagged:

* ``pytest_config`` — files that configure the hidden pytest run: ``conftest.py`` anywhere; ``pytest.ini`` /
  ``.pytest.ini``, and ``tox.ini`` / ``setup.cfg`` / ``pyproject.toml`` with a pytest section (or that cannot be
  read within :data:`CONFIG_READ_CAP` or parsed: pytest reads them too), at the workspace root or under ``eval/``
  (where pytest's rootdir search from ``eval/tests`` looks). A ``conftest.py`` at the workspace root makes the
  official evaluator pass a program that prints ``nope`` (tests/test_integrity.py shows it).
* ``python_startup`` — what Python runs at start-up wherever it lies: ``sitecustomize`` / ``usercustomize`` in any
  importable form (source, bytecode, ``__pycache__``, extension module, package) and ``*.pth`` files; and package
  metadata at the workspace root (``*.dist-info`` / ``*.egg-info``: their ``pytest11`` entry points load plugins).
* ``module_shadowing`` — what ``python3 -m pytest``, run from ``/workspace`` with it first on ``sys.path``, would
  import in place of a standard-library or test-stack module: a module at the workspace root in any form Python
  imports (``X.py``, a sourceless ``X.pyc``, an extension module ``X.so`` / ``X.abi3.so`` /
  ``X.cpython-*.so``, its ``__pycache__`` entry), a package ``X/__init__.*``, and for pytest and its plugins any
  directory ``X/`` (a namespace package).
* ``eval_dir`` — files under ``eval/``: the hidden tests are unpacked over that directory, and extra test files
  there would be collected and counted by the official scorer.
* ``compile_outside_workspace`` — changes ``compile.sh`` made outside ``/workspace`` and ``/tmp`` (the compile
  container's changes right before and right after the compile step), build caches excepted.
* ``changed_after_compile`` — ``/workspace`` changed after ``compile.sh`` ended and its processes were stopped (the
  image is scanned again, frozen, right before it is committed: the scan covers exactly what is committed).
* ``harness_path`` — the submission (``compile.sh``, ``seed_git`` or a login profile) made or changed a path the
  grader's own material uses (:data:`~.harness_material.GRADER_PATHS`): the official's plugin directory, first on
  the hidden tests' ``PYTHONPATH``, or our wheel directories. Watched wherever they lie, ``/tmp`` included.
* ``git_metadata`` — ``/workspace/.git`` is not a plain directory (a ``gitdir:`` file, a symbolic link, ...): the
  official ``seed_git`` step then runs git as root with the submission's own configuration and hooks.
* ``seed_git_changed`` — the official ``seed_git`` step changed something besides the fresh ``/workspace/.git`` it
  makes (a hook or a configured command ran).
* ``reference_executable`` — the built executable's sha256 is in the task's ``eval_clean_hashes`` or equals the
  reference binary's.
* ``reads_hidden_tests`` — tests that passed in the official run failed in the audit (:mod:`.audit`), where the
  hidden tests' sources were withheld once collected and ``PYTEST_CURRENT_TEST`` named no test, twice: the program
  read the tests to pass them.
* ``audit_obstructed`` — a branch whose results were readable in the official run gave none the audit could read,
  or its test processes gave the audit's plugin no report, in both audit runs: counted as the submission's doing.
* ``workspace_import`` — a test process of the audit loaded a module from the submission's files (anything under
  ``/workspace`` but the tests' ``eval/``), whatever its name: measured in the process by the audit's plugin.
* ``scan_bounded`` — a walk reached one of its bounds (:data:`MAX_DEPTH` levels, :data:`MAX_ENTRIES` entries) or a
  part of the tree could not be read, so what lies past it was not checked. Never an exception: every walk and parse
  of submission content here is bounded and total, and a probe that fails says so as this flag.

Every text in a flag is printable (:func:`~pytest_programbench.text.printable.printable`: a file name that is not UTF-8
shows its bytes as ``\\xNN``); the path kept for neutralisation is the exact name. At most :data:`SHOW_FLAGS` flags
of a kind are kept, then one that counts the rest.

Under ``--pb-strict`` the files of the first four kinds and the ``harness_path`` ones are deleted after
``compile.sh`` ran and before the image the hidden tests run in is committed, so the build still sees them and the
tests never do; a ``git_metadata`` ``.git`` is removed before ``seed_git`` (which then seeds a fresh repository).
"""

from __future__ import annotations

import configparser
import shlex
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from pytest_programbench.evaluation.harness_material import is_grader_path
from pytest_programbench.text.printable import printable

WORKSPACE = "/workspace"

PYTEST_CONFIG = "pytest_config"
PYTHON_STARTUP = "python_startup"
MODULE_SHADOWING = "module_shadowing"
EVAL_DIR = "eval_dir"
COMPILE_OUTSIDE = "compile_outside_workspace"
CHANGED_AFTER_COMPILE = "changed_after_compile"
REFERENCE_EXECUTABLE = "reference_executable"
SCAN_BOUNDED = "scan_bounded"
HARNESS_PATH = "harness_path"
GIT_METADATA = "git_metadata"
SEED_GIT_CHANGED = "seed_git_changed"
READS_HIDDEN_TESTS = "reads_hidden_tests"
AUDIT_OBSTRUCTED = "audit_obstructed"
WORKSPACE_IMPORT = "workspace_import"

# Kinds that are files (in the workspace, or a harness path) and can be removed before the hidden tests run.
NEUTRALISABLE = frozenset({PYTEST_CONFIG, PYTHON_STARTUP, MODULE_SHADOWING, EVAL_DIR, HARNESS_PATH})

# Bounds of every walk and read of submission content (a bound reached is a scan_bounded flag).
MAX_DEPTH = 256  # directory levels below / (a legitimate build tree is far shallower)
MAX_ENTRIES = 400_000  # entries of one walk (build caches outside /workspace are not descended into)
CONFIG_READ_CAP = 1 << 20  # bytes of one config file read to look for a pytest section
MAX_CONFIG_READS = 16  # config files read per scan (past it, one is counted as configuring pytest unread)
SHOW_FLAGS = 10  # flags kept per kind, then one that counts the rest
NEUTRALISE_CHUNK = 64 << 10  # bytes of one rm command line (the kernel caps one argument at 128 KiB)

CONFIG_NAMES = frozenset({"pytest.ini", ".pytest.ini"})
SECTIONED_CONFIG_NAMES = frozenset({"tox.ini", "setup.cfg", "pyproject.toml"})
STARTUP_MODULES = frozenset({"sitecustomize", "usercustomize"})
STARTUP_NAMES = frozenset({"sitecustomize.py", "usercustomize.py"})
TEST_STACK_MODULES = frozenset({
    "pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "xdist", "execnet", "pytest_timeout",
    "pytest_rerunfailures", "programbench_pytest_timeout", "pexpect", "ptyprocess", "junitparser",
    "exceptiongroup", "tomli", "typing_extensions", "pygments", "yaml",
})
SHADOWABLE = frozenset(sys.stdlib_module_names) | TEST_STACK_MODULES
# Suffixes Python's path finder imports a module from (importlib.machinery.all_suffixes(), for any CPython: the
# extension suffixes .cpython-3XY-<platform>.so and .abi3.so end in .so).
IMPORTABLE_SUFFIXES = (".py", ".pyc", ".so")
METADATA_SUFFIXES = (".dist-info", ".egg-info", ".egg-link")

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
    """One finding: a kind, the path it is about (workspace-relative or absolute), and a sentence.

    ``path`` is the exact name (it may hold an undecodable byte as a surrogate: neutralisation needs the real
    name); everything shown or written (``str``, :meth:`as_dict`) is printable."""

    kind: str
    path: str
    detail: str

    def __str__(self) -> str:
        return printable(f"{self.kind}: {self.detail}")

    @property
    def neutralisable(self) -> bool:
        return self.kind in NEUTRALISABLE

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "path": printable(self.path), "detail": printable(self.detail)}


def _flag(kind: str, rel: str, detail: str) -> IntegrityFlag:
    return IntegrityFlag(kind, rel, printable(detail))


# --------------------------------------------------------------------------------------------- classification


def _config_finding(name: str, content: bytes | None) -> str | None:
    """Why a tox.ini / setup.cfg / pyproject.toml counts as pytest configuration, or None when it does not.

    Content that could not be read within the cap, or parsed, counts: pytest reads (and chokes on) it too."""
    if content is None:
        return f"could not be read within {CONFIG_READ_CAP} bytes; counted as pytest configuration"
    text = content.decode("utf-8", errors="replace")
    if name == "pyproject.toml":
        try:
            data = tomllib.loads(text)
        except Exception as exc:  # hostile input: TOMLDecodeError, ValueError (int digits), RecursionError
            return f"cannot be parsed ({type(exc).__name__}); pytest reads it, so it counts as pytest configuration"
        tool = data.get("tool")
        return "has a pytest section" if isinstance(tool, dict) and "pytest" in tool else None
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    try:
        parser.read_string(text)
    except Exception as exc:  # hostile input: any configparser.Error, RecursionError
        return f"cannot be parsed ({type(exc).__name__}); pytest reads it, so it counts as pytest configuration"
    wanted = {"pytest", "tool:pytest"}
    return "has a pytest section" if any(section in wanted for section in parser.sections()) else None


def _on_rootdir_search_path(parts: Sequence[str]) -> bool:
    """The file's directory is the workspace root or lies under ``eval/``."""
    return len(parts) == 1 or parts[0] == "eval"


def module_name(filename: str) -> str | None:
    """The module Python's path finder would import from a file of this name, if any (``json.abi3.so``: json)."""
    if filename.startswith(".") or not filename.endswith(IMPORTABLE_SUFFIXES):
        return None
    return filename.split(".", 1)[0]


def needs_content(rel: str) -> bool:
    """Whether :func:`classify` reads this file's content (a sectioned config on pytest's rootdir search path)."""
    parts = PurePosixPath(_normalise_member(rel)).parts
    return bool(parts) and parts[-1] in SECTIONED_CONFIG_NAMES and _on_rootdir_search_path(parts)


def classify(rel: str, read: Callable[[], bytes | None] | None = None) -> IntegrityFlag | None:
    """The flag for one workspace-relative path, if any; ``read`` gives the content when it matters (None: could
    not be read within the cap). Directories are classified by the entries below them."""
    rel = _normalise_member(rel)
    parts = PurePosixPath(rel).parts
    if not parts or parts == (".",):
        return None
    shown = printable(rel)
    name = parts[-1]
    if name == "conftest.py":
        return _flag(PYTEST_CONFIG, rel, f"{shown} configures the hidden pytest run (conftest.py)")
    if name in CONFIG_NAMES and _on_rootdir_search_path(parts):
        return _flag(PYTEST_CONFIG, rel, f"{shown} configures the hidden pytest run")
    if name in SECTIONED_CONFIG_NAMES and _on_rootdir_search_path(parts):
        finding = _config_finding(name, read() if read is not None else None)
        if finding is not None:
            return _flag(PYTEST_CONFIG, rel, f"{shown} {finding}")
    if name.endswith(".pth"):
        return _flag(PYTHON_STARTUP, rel, f"{shown} runs code at Python start-up (.pth)")
    startup = next((p for p in parts[:-1] if p in STARTUP_MODULES), None) or (
        module_name(name) if module_name(name) in STARTUP_MODULES else None)
    if startup is not None:
        return _flag(PYTHON_STARTUP, rel, f"{shown} is Python's start-up module {startup!r}")
    if parts[0].endswith(METADATA_SUFFIXES):
        return _flag(PYTHON_STARTUP, rel, f"{shown}: package metadata at the workspace root, whose entry points "
                                          f"(pytest11) load plugins into the hidden test run")
    if parts[0] == "eval":
        return _flag(EVAL_DIR, rel, f"{shown} lies in eval/, where the hidden tests are unpacked")
    return _shadowing(rel, parts)


def _shadowing(rel: str, parts: Sequence[str]) -> IntegrityFlag | None:
    """A module or package at the workspace root that ``python3 -m pytest`` would import in place of a real one."""
    shown = printable(rel)
    name = parts[-1]
    module = module_name(name)
    if len(parts) == 1 and module in SHADOWABLE:
        return _flag(MODULE_SHADOWING, rel, f"{shown} at the workspace root shadows Python module {module!r} for "
                                            f"the hidden test run")
    if len(parts) == 2 and parts[0] == "__pycache__" and module in SHADOWABLE:
        return _flag(MODULE_SHADOWING, rel, f"{shown} at the workspace root is bytecode of Python module "
                                            f"{module!r} for the hidden test run")
    if len(parts) >= 2 and parts[0] in SHADOWABLE:
        package = parts[0]
        if len(parts) == 2 and module == "__init__":
            return _flag(MODULE_SHADOWING, package, f"package {package}/ at the workspace root shadows Python module "
                                                    f"{package!r} for the hidden test run")
        if package in TEST_STACK_MODULES:
            return _flag(MODULE_SHADOWING, package, f"directory {package}/ at the workspace root is importable as "
                                                    f"package {package!r} (pytest's or a plugin's name) in the "
                                                    f"hidden test run")
    return None


def _normalise_member(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.lstrip("/").rstrip("/")


class FlagScan:
    """Flags of one scan, first finding per path kept, with the bounds of the walk that fed it.

    ``read`` gives a workspace-relative file's content capped at :data:`CONFIG_READ_CAP` (None: unreadable or
    larger); at most :data:`MAX_CONFIG_READS` files are read, past that one counts as unread."""

    def __init__(self, read: Callable[[str], bytes | None]) -> None:
        self._read = read
        self.reads = 0
        self.flags: dict[str, IntegrityFlag] = {}
        self.entries = 0
        self.bounded: list[str] = []

    def add(self, rel: str) -> None:
        rel = _normalise_member(rel)
        if not rel:
            return
        self.entries += 1
        flag = classify(rel, lambda: self._read_capped(rel))
        if flag is not None:
            self.flags.setdefault(flag.path, flag)

    def _read_capped(self, rel: str) -> bytes | None:
        if self.reads >= MAX_CONFIG_READS:
            return None
        self.reads += 1
        data = self._read(rel)
        return data if data is not None and len(data) <= CONFIG_READ_CAP else None

    def bound(self, where: str) -> None:
        where = printable(where)
        self.bounded.append(where if len(where) <= 200 else f"{where[:120]}...{where[-60:]}")

    def result(self) -> list[IntegrityFlag]:
        found = list(self.flags.values())
        if self.bounded:
            shown = "; ".join(self.bounded[:SHOW_PATHS]) + (f"; ... ({len(self.bounded)} in all)"
                                                            if len(self.bounded) > SHOW_PATHS else "")
            found.append(_flag(SCAN_BOUNDED, "", f"the integrity scan stopped at a bound, what lies past it was not "
                                                 f"checked: {shown}"))
        return found


def scan_paths(paths: Iterable[str], read: Callable[[str], bytes | None], *,
               max_entries: int = MAX_ENTRIES) -> list[IntegrityFlag]:
    """Flags for workspace-relative paths (an archive's members, what compile made), bounded in entries."""
    scan = FlagScan(read)
    for rel in paths:
        if scan.entries >= max_entries:
            scan.bound(f"more than {max_entries} entries")
            break
        scan.add(rel)
    return scan.result()


# --------------------------------------------------------------------------------------------- container diff


def _leaves(changes: Iterable[Mapping[str, Any]]) -> dict[str, tuple[int, Any]]:
    """``{path: (kind, stamp)}`` of the changes that are not merely parent directories of other changes."""
    by_path = {str(c["Path"]): (int(c["Kind"]), c.get("Stamp")) for c in changes}
    parents: set[str] = set()
    for path in by_path:
        parent = path.rsplit("/", 1)[0]
        while parent and parent not in parents:  # every ancestor (stops at one already seen with its own)
            parents.add(parent)
            parent = parent.rsplit("/", 1)[0]
    return {path: entry for path, entry in by_path.items() if path not in parents or entry[0] == 2}


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def _ignored_outside(path: str) -> bool:
    return _under(path, (WORKSPACE,)) or _under(path, ALLOWED_OUTSIDE) or path in HARNESS_OUTSIDE


def outside_changes(before: Iterable[Mapping[str, Any]], after: Iterable[Mapping[str, Any]]) -> list[str]:
    """Leaf paths changed between the snapshots outside /workspace, /tmp and build caches, as ``"A /path"``."""
    old = _leaves(before)
    new = _leaves(after)
    kinds = {0: "C", 1: "A", 2: "D"}
    out: list[str] = []
    for path, (kind, stamp) in sorted(new.items()):
        if old.get(path) == (kind, stamp) or _ignored_outside(path):
            continue
        out.append(f"{kinds.get(kind, '?')} {path}")
    for path in sorted(set(old) - set(new)):
        if not _ignored_outside(path):
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


def _listed(paths: Sequence[str]) -> str:
    shown = ", ".join(printable(p) for p in paths[:SHOW_PATHS])
    return shown + (f", ... ({len(paths)} in all)" if len(paths) > SHOW_PATHS else "")


def scan_compile(
    before: Iterable[Mapping[str, Any]],
    after: Iterable[Mapping[str, Any]],
    read: Callable[[str], bytes | None],
    *,
    bounded: Sequence[str] = (),
) -> list[IntegrityFlag]:
    """Flags from the compile container's filesystem changes; ``read`` takes a workspace-relative path and returns
    at most :data:`CONFIG_READ_CAP` bytes (more: None). ``bounded``: where the walks that gave the changes stopped."""
    after = list(after)
    scan = FlagScan(read)
    for rel in workspace_files(after):
        scan.add(rel)
    for where in bounded:
        scan.bound(where)
    flags = scan.result()
    outside = outside_changes(before, after)
    if outside:
        flags.append(_flag(COMPILE_OUTSIDE, "/", f"compile.sh changed {len(outside)} path(s) outside /workspace and "
                                                 f"/tmp: {_listed(outside)}"))
    return flags + grader_path_flags(before, after)


def grader_path_flags(before: Iterable[Mapping[str, Any]], after: Iterable[Mapping[str, Any]]) -> list[IntegrityFlag]:
    """A ``harness_path`` flag for each top path of the grader's material (:data:`GRADER_PATHS`) under which
    something changed between the snapshots: the submission prepared what the grader was to create there."""
    old = _leaves(before)
    tops: dict[str, list[str]] = {}
    for path, entry in sorted(_leaves(after).items()):
        if not is_grader_path(path) or old.get(path) == entry:
            continue
        tops.setdefault(_grader_top(path), []).append(path)
    return [_flag(HARNESS_PATH, top, f"{printable(top)} was prepared by the submission before the grader made it "
                                     f"(the official's plugin directory, first on the hidden tests' PYTHONPATH, our "
                                     f"wheels or the audit's plugin): {_listed(paths)}")
            for top, paths in tops.items()]


def _grader_top(path: str) -> str:
    """The directory the grader makes that ``path`` lies in (its shortest leading part that is a grader path)."""
    parts = path.split("/")
    return next((top for i in range(2, len(parts) + 1) if is_grader_path(top := "/".join(parts[:i]))), path)


def git_metadata_flag(kind: str) -> IntegrityFlag:
    """``/workspace/.git`` is a ``kind`` (not a plain directory)."""
    return _flag(GIT_METADATA, ".git", f".git is a {kind}, not a plain directory: the official seed_git step "
                                       f"([ ! -d .git ]) then runs git as root with the submission's own "
                                       f"configuration and hooks")


def seed_git_flags(before: Iterable[Mapping[str, Any]], after: Iterable[Mapping[str, Any]], *,
                   seeded: bool) -> list[IntegrityFlag]:
    """What changed between the snapshots around ``clear_stale_executable`` and ``seed_git`` besides the removed
    ``./executable`` and, when seed_git made a repository (``seeded``), the new ``/workspace/.git``."""
    old = _leaves(before)
    allowed = [f"{WORKSPACE}/.git"] if seeded else []
    changed = [path for path, entry in sorted(_leaves(after).items())
               if old.get(path) != entry and path != f"{WORKSPACE}/executable" and not _under(path, allowed)
               and path not in HARNESS_OUTSIDE]
    changed += [f"{path} (undone)" for path in sorted(set(old) - set(_leaves(after)))
                if path != f"{WORKSPACE}/executable" and not _under(path, allowed)]
    if not changed:
        return []
    return [_flag(SEED_GIT_CHANGED, "", f"the official seed_git step changed {len(changed)} path(s) besides the "
                                        f"repository it seeds (git ran the submission's configuration or hooks): "
                                        f"{_listed(changed)}")]


def late_changes(scanned: Iterable[Mapping[str, Any]], committed: Iterable[Mapping[str, Any]]) -> list[str]:
    """Workspace-relative paths added or changed in /workspace between the scan and the commit (deletions, such as
    the official moving ``executable`` away, add nothing the hidden tests could run)."""
    old = {rel: entry for rel, entry in _workspace_leaves(scanned).items()}
    return sorted(rel for rel, entry in _workspace_leaves(committed).items()
                  if entry[0] != 2 and old.get(rel) != entry)


def _workspace_leaves(changes: Iterable[Mapping[str, Any]]) -> dict[str, tuple[int, Any]]:
    prefix = WORKSPACE + "/"
    return {path[len(prefix):]: entry for path, entry in _leaves(changes).items() if path.startswith(prefix)}


def scan_late(paths: Sequence[str], read: Callable[[str], bytes | None]) -> list[IntegrityFlag]:
    """Flags for what changed in /workspace after compile.sh ended: each path classified, and the change itself.
    (The grader's paths changed since the scan: :func:`grader_path_flags` of the two snapshots.)"""
    if not paths:
        return []
    flags = scan_paths(paths, read)
    flags.append(_flag(CHANGED_AFTER_COMPILE, "", f"/workspace changed after compile.sh ended and its processes were "
                                                  f"stopped, before the image was committed: {_listed(paths)}"))
    return flags


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


def probe_failed(where: str, exc: BaseException) -> IntegrityFlag:
    """A probe of ours that raised: said as a flag (the score stays the official one, the item cannot pass)."""
    return _flag(SCAN_BOUNDED, "", f"the integrity check {where} could not complete, so it is not known to be "
                                   f"clean: {type(exc).__name__}: {str(exc)[:300]}")


def merge(*groups: Iterable[IntegrityFlag]) -> list[IntegrityFlag]:
    """Flags deduplicated by (kind, path), first occurrence kept, in order; at most :data:`SHOW_FLAGS` per kind,
    then one flag counting the rest (every record stays bounded)."""
    seen: dict[tuple[str, str], IntegrityFlag] = {}
    for group in groups:
        for flag in group:
            seen.setdefault((flag.kind, flag.path), flag)
    kept: list[IntegrityFlag] = []
    per_kind: dict[str, int] = {}
    for flag in seen.values():
        per_kind[flag.kind] = per_kind.get(flag.kind, 0) + 1
        if per_kind[flag.kind] <= SHOW_FLAGS:
            kept.append(flag)
    for kind, count in per_kind.items():
        if count > SHOW_FLAGS:
            kept.append(IntegrityFlag(kind, "...", f"and {count - SHOW_FLAGS} more {kind} finding(s)"))
    return kept


_SHELL_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-")


def _shell_path(path: str) -> str:
    """``path`` for bash, byte for byte: a name that is not UTF-8 (surrogates here) as ``$'\\xNN'`` escapes."""
    try:
        return shlex.quote(path.encode("utf-8").decode("utf-8"))
    except UnicodeEncodeError:
        raw = path.encode("utf-8", "surrogateescape")
        return "$'" + "".join(chr(b) if chr(b) in _SHELL_SAFE else f"\\x{b:02x}" for b in raw) + "'"


def neutralise_command(flags: Iterable[IntegrityFlag]) -> tuple[list[str], list[str]] | None:
    """Shell commands (each line at most :data:`NEUTRALISE_CHUNK` bytes) removing the neutralisable flagged files
    from /workspace, and their paths (printable)."""
    paths = sorted({f.path for f in flags if f.neutralisable and f.path and f.path != "..."
                    and ".." not in PurePosixPath(f.path).parts
                    and (not f.path.startswith("/") or is_grader_path(f.path))})
    if not paths:
        return None
    commands: list[str] = []
    line = ""
    for path in paths:
        word = _shell_path(path if path.startswith("/") else f"{WORKSPACE}/{path}")
        if line and len(line) + len(word) + 1 > NEUTRALISE_CHUNK:
            commands.append(line)
            line = ""
        line = f"{line} {word}" if line else f"rm -rf -- {word}"
    commands.append(line)
    return commands, [printable(p) for p in paths]
