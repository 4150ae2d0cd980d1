"""The official ``programbench`` tools with the test bed's tasks as their catalogue.

``programbench submit package`` and ``verify`` know only the tasks packaged in programbench (``benchmark_instances()``
reads ``load_all_instances()``'s default directory); the 200 benchmark tasks cannot run offline here, the test bed's
can. With ``PB_OFFICIAL_TASKS_DIR`` set, importing this module points that default at the test bed's tasks: the
official code runs unchanged, with the test bed's tasks as the benchmark. Loaded as a pytest plugin
(``-p tests.official_catalogue``) in a session that packages, and imported by ``programbench`` run as ``CLI``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from programbench.utils import load_data

ENV = "PB_OFFICIAL_TASKS_DIR"
# The official CLI with the catalogue in place: ``python -c CLI submit verify DIR`` (the repository on sys.path).
CLI = "import tests.official_catalogue; from programbench.cli.main import app; app()"

if os.environ.get(ENV):
    load_data.load_all_instances.__defaults__ = (Path(os.environ[ENV]),)


def run_cli(args: list[str], *, cwd: Path, tasks_dir: Path, blob_dir: Path) -> subprocess.CompletedProcess[str]:
    """``programbench ARGS`` run in ``cwd`` with the test bed's tasks as its catalogue (tier 1: its blobs, and no
    more CPUs per container than this machine has)."""
    env = {**os.environ, ENV: str(tasks_dir), "PROGRAMBENCH_BLOB_DIR": str(blob_dir),
           "PROGRAMBENCH_DOCKER_CPUS": str(min(2, os.cpu_count() or 1)), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", CLI, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
