"""pytest-rerunfailures 16.4 for the compile container, fetched once on the host.

The official evaluator runs ``pip3 install -q --disable-pip-version-check pytest-rerunfailures==16.4`` in the compile
container with internet access; when it succeeds, every hidden branch runs with ``--reruns=2 --reruns-delay=1``.
Our containers have no network, so the same command runs against a wheel directory prepared here: the pinned
wheel plus its pure-Python dependency closure (pytest and what it needs, for the Python versions task images ship),
downloaded once per machine into a cache with a file lock, copied into the compile container, and used through
``PIP_NO_INDEX=1`` / ``PIP_FIND_LINKS`` for that one step only. So reruns are on exactly when pip in that image
could install 16.4 — as for the official run with internet.

Never 16.6.1: it emits a bare ``<testcase/>`` per rerun that parses as a pass. The cache is checked to hold 16.4
and no other release of the plugin.

When the wheels cannot be had (an offline host with an empty cache), the evaluation runs with reruns off and the
outcome says so (``reruns: off`` and the reason); never silently.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from pytest_programbench.core import environment
from pytest_programbench.core.cache import cache_root
from pytest_programbench.core.memo import Memo

log = logging.getLogger(__name__)

PINNED_VERSION = "16.4"
FORBIDDEN_VERSIONS = frozenset({"16.6.1"})
REQUIREMENT = f"pytest-rerunfailures=={PINNED_VERSION}"
# The official install step's command (eval.py 1.2.5), as it appears in the log.
INSTALL_COMMAND = f"pip3 install -q --disable-pip-version-check {REQUIREMENT}"
# Markers in pip's metadata are evaluated against the *host* interpreter by `pip download`, so dependencies that
# only older Pythons need are named explicitly.
EXTRA_REQUIREMENTS = ("exceptiongroup", "tomli")
PYTHON_VERSIONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
# The wheel directory's canonical name (in a record's key); each evaluation's own is this plus a random token
# (evaluation/harness_material.py).
CONTAINER_WHEEL_DIR = "/tmp/pytest-programbench-wheels"
# A failed download is not retried by other workers for this long (an offline host would stall every item).
FAILURE_TTL = 3600
DOWNLOAD_TIMEOUT = 600

_WHEEL_RE = re.compile(r"^pytest_rerunfailures-(?P<version>[^-]+)-.*\.whl$")


@dataclass(frozen=True)
class RerunWheels:
    """The wheel directory for the install step, or why there is none."""

    directory: Path | None
    reason: str = ""
    wheels: tuple[str, ...] = field(default=())

    @property
    def available(self) -> bool:
        return self.directory is not None

    def files(self) -> dict[str, bytes]:
        assert self.directory is not None
        return {name: (self.directory / name).read_bytes() for name in self.wheels}


def validate_wheel_dir(directory: Path) -> tuple[str, ...]:
    """The wheels in ``directory``; raises ValueError unless it holds exactly the pinned plugin release."""
    wheels = tuple(sorted(p.name for p in directory.glob("*.whl")))
    versions = sorted({m.group("version") for w in wheels if (m := _WHEEL_RE.match(w))})
    bad = sorted(set(versions) & FORBIDDEN_VERSIONS)
    if bad:
        raise ValueError(f"{directory}: holds pytest-rerunfailures {', '.join(bad)}, which must never be used "
                         f"(bare <testcase/> per rerun parses as a pass)")
    if versions != [PINNED_VERSION]:
        raise ValueError(f"{directory}: expected exactly pytest-rerunfailures {PINNED_VERSION}, found "
                         f"{versions or 'none'}")
    non_pure = [w for w in wheels if not w.endswith("-none-any.whl")]
    if non_pure:
        raise ValueError(f"{directory}: only pure-Python wheels are allowed, found {non_pure}")
    return wheels


def _pip_download(dest: Path, python_version: str, requirements: Sequence[str], timeout: float) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
           "--only-binary=:all:", "--implementation", "py", "--abi", "none", "--platform", "any",
           "--python-version", python_version, "--dest", str(dest), *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip download for Python {python_version} failed: {' | '.join(tail)}")


def download_wheels(dest: Path, *, timeout: float = DOWNLOAD_TIMEOUT) -> tuple[str, ...]:
    """Fill ``dest`` with the pinned plugin and its dependency closure for every supported Python."""
    dest.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    for version in PYTHON_VERSIONS:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"pip download exceeded {timeout:.0f}s")
        # 16.4 needs Python >= 3.10; the older interpreters fail at pip in the container, as with the official.
        _pip_download(dest, version, [REQUIREMENT, *EXTRA_REQUIREMENTS], remaining)
    return validate_wheel_dir(dest)


_wheels: Memo[Path, RerunWheels] = Memo()  # per cache directory: checked or downloaded once per process


def ensure_wheels(cache_dir: Path | None = None, *, environ: Mapping[str, str] | None = None,
                  timeout: float = DOWNLOAD_TIMEOUT) -> RerunWheels:
    """The wheel directory, downloading it on first use (once per machine: a file lock across xdist workers).

    ``$PYTEST_PROGRAMBENCH_WHEELS`` names a prepared directory (for offline hosts:
    ``pip download --only-binary=:all: pytest-rerunfailures==16.4 -d DIR``) and wins over the cache.
    """
    if environment.WHEELS.is_set(environ):
        prepared = Path(environment.WHEELS.raw(environ)).expanduser()
        try:
            return RerunWheels(prepared, wheels=validate_wheel_dir(prepared))
        except (OSError, ValueError) as exc:
            return RerunWheels(None, reason=f"${environment.WHEELS.name}: {exc}")
    root = (cache_dir or cache_root(environ)) / f"rerunfailures-{PINNED_VERSION}"
    return _wheels.get(root, lambda: _ensure_locked(root, timeout))


def _ensure_locked(root: Path, timeout: float) -> RerunWheels:
    root.parent.mkdir(parents=True, exist_ok=True)
    wheels_dir = root / "wheels"
    complete = root / "COMPLETE"
    failed = root / "FAILED"
    with FileLock(str(root) + ".lock"):
        if complete.exists():
            try:
                return RerunWheels(wheels_dir, wheels=validate_wheel_dir(wheels_dir))
            except (OSError, ValueError) as exc:
                log.warning("rerunfailures wheel cache is damaged (%s); downloading again", exc)
                complete.unlink(missing_ok=True)
        if failed.exists():
            try:
                info = json.loads(failed.read_text())
                if time.time() - float(info["time"]) < FAILURE_TTL:
                    return RerunWheels(None, reason=f"{info['reason']} (cached failure; delete {failed} to retry)")
            except (OSError, ValueError, KeyError, TypeError):
                pass
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="wheels.", dir=root))
        try:
            wheels = download_wheels(staging, timeout=timeout)
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(staging, ignore_errors=True)
            reason = f"cannot download {REQUIREMENT} and its wheels on this host: {exc}"
            failed.write_text(json.dumps({"time": time.time(), "reason": reason}))
            log.warning("reruns off: %s", reason)
            return RerunWheels(None, reason=reason)
        shutil.rmtree(wheels_dir, ignore_errors=True)
        staging.rename(wheels_dir)
        failed.unlink(missing_ok=True)
        complete.write_text("\n".join(wheels) + "\n")
        log.info("rerunfailures wheels cached in %s: %s", wheels_dir, ", ".join(wheels))
        return RerunWheels(wheels_dir, wheels=wheels)


def pip_environment(wheels: RerunWheels, directory: str | None = None) -> dict[str, str]:
    """The environment of the official install step: offline, our wheels in ``directory`` (the fresh one they were
    placed in; the canonical :data:`CONTAINER_WHEEL_DIR` names them in a record's key), or none: pip fails fast,
    reruns off."""
    found = (directory or CONTAINER_WHEEL_DIR) if wheels.available else ""
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": found, "PIP_NO_INPUT": "1"}


def install_cache_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where recorded install steps live (None: ``$PYTEST_PROGRAMBENCH_PIP_REPLAY=0``, pip runs every time)."""
    if not environment.PIP_REPLAY.enabled(environ):
        return None
    return cache_root(environ) / f"rerunfailures-{PINNED_VERSION}" / "installed"


def reset_memo() -> None:
    _wheels.clear()
