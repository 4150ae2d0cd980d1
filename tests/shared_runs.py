"""Finished runs made once per suite run and shared by the tests that only read them.

A real ``pytest --pb-*`` session whose run directory several tests read is made by the first test that asks, under a
file lock, as pytest-xdist documents for once-only fixtures: the lock and the run live under the directory every
xdist worker of this run shares (``tmp_path_factory.getbasetemp().parent`` under xdist, the session's own base
temporary directory without it), so whichever worker asks first makes it and the others wait and reuse it. Each reader
works on its own copy (:meth:`FinishedRun.copy`), so no reader sees another's changes (a resume, a package, a
compare written beside it).

The session runs as a test's own sessions do (tests/conftest.py's ``_guard_the_sessions_a_test_starts`` and
``clean_env``): the network guard and the suite's session defaults loaded, the machine's plugin cache, no
``PROGRAMBENCH_*`` setting of the developer's, ``HOME`` in the run's own directory as pytester has it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from tests.conftest import GUARD_PLUGIN, MACHINE_CACHE, REPO, SESSION_DEFAULTS_PLUGIN
from tests.session_defaults import KEEP_AUDIT

DONE = "made.json"


@dataclass(frozen=True)
class FinishedRun:
    """A shared finished session: its directory (``place``), exit status and output."""

    place: Path
    ret: int
    outlines: list[str]
    errlines: list[str]

    def result(self) -> pytest.RunResult:
        """The session as pytester's result (``assert_outcomes``, ``stdout.fnmatch_lines``)."""
        return pytest.RunResult(self.ret, self.outlines, self.errlines, 0.0)

    def copy(self, dest: Path) -> Path:
        """The reader's own copy of everything the session made (run directories, JUnit XML, inputs)."""
        shutil.copytree(self.place, dest, symlinks=True)
        return dest


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base is a child of the run's; without it the parent holds earlier runs: not shared.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def session_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PROGRAMBENCH_") and k not in ("PYTEST_ADDOPTS", KEEP_AUDIT, "PYTEST_XDIST_WORKER")}
    plugins = [p for p in env.get("PYTEST_PLUGINS", "").split(",") if p and p not in (GUARD_PLUGIN,
                                                                                     SESSION_DEFAULTS_PLUGIN)]
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
               PYTEST_PLUGINS=",".join([*plugins, GUARD_PLUGIN, SESSION_DEFAULTS_PLUGIN]),
               XDG_CACHE_HOME=MACHINE_CACHE, HOME=str(home), PY_COLORS="0", HF_HUB_OFFLINE="1")
    return env


def made_once(tmp_path_factory: pytest.TempPathFactory, key: str, prepare: Callable[[Path], Sequence[str]],
              timeout: float = 900, env: Mapping[str, str] | None = None) -> FinishedRun:
    """The session ``key`` names, made once: ``prepare(place)`` writes its inputs into ``place`` and returns the
    session's arguments; the session runs with ``place`` as its working directory and ``env`` added to its
    environment. A session whose making failed (an exception in ``prepare`` or a timeout) is made again by the next
    test that asks."""
    root = shared_root(tmp_path_factory) / "pb-finished-runs"
    root.mkdir(parents=True, exist_ok=True)
    place = root / key
    with FileLock(str(root / f"{key}.lock")):
        if not (place / DONE).is_file():
            shutil.rmtree(place, ignore_errors=True)
            place.mkdir()
            args = list(prepare(place))
            done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=place,
                                  env={**session_env(place), **(env or {})}, capture_output=True, text=True,
                                  timeout=timeout, check=False)
            (place / DONE).write_text(json.dumps({"args": args, "ret": done.returncode,
                                                  "stdout": done.stdout, "stderr": done.stderr}))
    made = json.loads((place / DONE).read_text())
    return FinishedRun(place, made["ret"], made["stdout"].splitlines(), made["stderr"].splitlines())


RPN = "pbfix__rpn.0b5e55e"


def good_rpn_run(tmp_path_factory: pytest.TempPathFactory, tasks_dir: Path, blob_dir: Path,
                 submissions: Path) -> FinishedRun:
    """An evaluate-only session of the test bed's known-good rpn submission (``run/``, one item, passed), made once
    per suite run for the tests that only read such a run: test_friction's report of an official directory,
    test_viewer's timeline bar."""
    def prepare(place: Path) -> list[str]:
        return ["-p", "no:cacheprovider", "--pb-tasks-dir", str(tasks_dir), "--pb-blob-dir", str(blob_dir),
                "--pb-pull", "never", "--pb-filter", RPN, "--pb-submissions", str(submissions),
                "--pb-output", str(place / "run")]

    return made_once(tmp_path_factory, "good-rpn-evaluate-only", prepare, timeout=600)
