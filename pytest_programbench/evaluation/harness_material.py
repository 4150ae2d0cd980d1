"""Everything the harness puts into an evaluation container, under one rule.

An evaluation container is one the submission controlled: ``compile.sh`` ran in it as root, and what it left in
``/tmp`` is committed into the image every hidden branch runs in. So what the grader brings in -- our rerunfailures
wheels, the official's timeout-retry plugin, a replayed install -- could be poisoned by a submission that prepared
its path first (a planted ``pytest_rerunfailures-16.4-1-...whl`` that pip prefers; a ``sitecustomize.py`` in the
official's plugin directory, which is first on the hidden tests' ``PYTHONPATH``). The rule for all of it:

* it enters **after the submission's last process has ended** (the container's processes are stopped first);
* at a path the submission **could not have prepared**: a directory made fresh under an unguessable name by
  ``mkdir`` (which refuses a path that exists); the paths the grader's material uses are watched by the integrity
  scan wherever they lie (``/tmp`` exemption or not), and one the submission touched is a ``harness_path`` flag;
* with its **content verified** in the container once it landed: every entry's type, mode, owner and sha256 equal
  what was sent, nothing more.

A replayed install (:mod:`.install_cache`) is verified by the cache when read, and is only ever recorded from an
evaluation whose wheels were placed and verified here and whose container the submission left untouched outside
``/workspace``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from programbench.eval.pytest_timeout_retry import PYTEST_TIMEOUT_RETRY_PLUGIN_DIR

# The official's plugin directory: it puts it first on the hidden tests' PYTHONPATH (eval.py, run_tests).
GRADER_PLUGIN_DIR = PYTEST_TIMEOUT_RETRY_PLUGIN_DIR
# Our wheel directories are this prefix plus "-" and a random token, one per evaluation.
WHEEL_DIR_PREFIX = "/tmp/pytest-programbench-wheels"
# The audit's plugin directories (evaluation/audit.py), likewise; at the root, which a submission cannot make
# unusable for root's mkdir (a /tmp it replaced by a file could).
AUDIT_DIR_PREFIX = "/pytest-programbench-audit"
# Name prefixes of every path the grader's material uses inside a container: what the submission made there is a
# flag, and the integrity scan's walk descends into them even below a directory it otherwise only lists.
GRADER_PATHS = (GRADER_PLUGIN_DIR, WHEEL_DIR_PREFIX, AUDIT_DIR_PREFIX)
VERIFY_TIMEOUT = 60.0
VERIFY_OUTPUT_LIMIT = 256 << 10
FILE_MODE = 0o644
# Lists every entry below $1 (type, octal mode, owner uid, path) then each regular file's sha256. `find` and
# `sha256sum` are what the official's own remove_hashed_files step runs, so every task image has them.
VERIFY_SCRIPT = ('cd -- "$1" && find . -mindepth 1 -printf "entry %y %m %U %p\\n" '
                 '&& find . -mindepth 1 -type f -exec sha256sum -- {} +')

VERIFY_FILE_SCRIPT = 'stat -c "%F %a %u" -- "$1" && sha256sum -- "$1"'


def is_grader_path(path: str) -> bool:
    """Whether an absolute container path is one the grader's material uses (or lies below one)."""
    return any(path.startswith(prefix) for prefix in GRADER_PATHS)


class MaterialTarget(Protocol):
    """What placing material needs of a container (``SdkContainerEnvironment`` offers it)."""

    def stop_processes(self) -> int | None: ...

    def harness_run(self, argv: list[str], *, timeout: float, limit: int = ...) -> tuple[int | None, str]: ...

    def put_files(self, directory: str, files: Mapping[str, bytes], *, mode: int = ..., subdir: str = ...) -> None: ...


class MaterialRefused(RuntimeError):
    """The material could not be placed under the rule; the message says why. Never a score of the submission's."""


@dataclass(frozen=True)
class Placed:
    """A directory of harness files, made fresh and verified."""

    directory: str
    collisions: tuple[str, ...] = ()  # fresh names that already existed (a flag: someone prepared them)


def expected_listing(files: Mapping[str, bytes]) -> str:
    """What :data:`VERIFY_SCRIPT` prints for exactly ``files`` (root-owned, :data:`FILE_MODE`), sorted by line."""
    lines = [f"entry f {FILE_MODE:o} 0 ./{name}" for name in files]
    lines += [f"{hashlib.sha256(data).hexdigest()}  ./{name}" for name, data in files.items()]
    return "\n".join(sorted(lines))


def place_directory(container: MaterialTarget, files: Mapping[str, bytes], *, prefix: str,
                    token: Callable[[], str] = lambda: secrets.token_hex(8)) -> Placed:
    """``files`` into a new directory ``<prefix>-<token>``: the container's processes stopped, the directory made
    by ``mkdir`` (a name that exists is tried once more under another token, and named in ``collisions``), the
    files put, then checked in the container against what was sent. Raises :class:`MaterialRefused`."""
    if container.stop_processes() is None:
        raise MaterialRefused("the container's processes could not be stopped before the harness's files went in")
    collisions: list[str] = []
    for _attempt in range(2):
        directory = f"{prefix}-{token()}"
        code, output = container.harness_run(["mkdir", "-m", "0755", "--", directory], timeout=VERIFY_TIMEOUT)
        if code == 0:
            break
        collisions.append(directory)
    else:
        raise MaterialRefused(f"could not make a fresh directory for the harness's files: {output.strip()[:300]}")
    try:
        container.put_files(directory, files, mode=FILE_MODE)
    except RuntimeError as exc:
        raise MaterialRefused(str(exc)) from exc
    code, output = container.harness_run(["sh", "-c", VERIFY_SCRIPT, "sh", directory], timeout=VERIFY_TIMEOUT,
                                         limit=VERIFY_OUTPUT_LIMIT)
    found = "\n".join(sorted(line for line in output.splitlines() if line))
    if code != 0 or found != expected_listing(files):
        remove_directory(container, directory)
        raise MaterialRefused(f"the harness's files in {directory} are not what was sent "
                              f"(exit {code}): {output.strip()[:300]}")
    return Placed(directory, tuple(collisions))


def verify_file(container: MaterialTarget, path: str, data: bytes, mode: int) -> None:
    """Check in the container that ``path`` is a regular root-owned file with ``mode`` and ``data``'s sha256 (the
    official's own material at its fixed path, such as the timeout-retry plugin). Raises :class:`MaterialRefused`."""
    code, output = container.harness_run(["sh", "-c", VERIFY_FILE_SCRIPT, "sh", path], timeout=VERIFY_TIMEOUT)
    expected = f"regular file {mode:o} 0\n{hashlib.sha256(data).hexdigest()}  {path}"
    if code != 0 or output.strip() != expected:
        raise MaterialRefused(f"{path} in the container is not what was sent (exit {code}): {output.strip()[:300]}")


def remove_directory(container: MaterialTarget, directory: str) -> str | None:
    """Remove a placed directory with a harness command (no login shell: no profile runs); its error, or None."""
    code, output = container.harness_run(["rm", "-rf", "--", directory], timeout=VERIFY_TIMEOUT)
    return None if code == 0 else f"exit {code}: {output.strip()[:300]}"

