"""The official ``programbench`` tools with the test bed's tasks as their catalogue.

``programbench submit package`` and ``verify`` know only the tasks packaged in programbench (``benchmark_instances()``
reads ``load_all_instances()``'s default directory); the 200 benchmark tasks cannot run offline here, the test bed's
can. With ``PB_OFFICIAL_TASKS_DIR`` set, importing this module points that default at the test bed's tasks: the
official code runs unchanged, with the test bed's tasks as the benchmark. Loaded as a pytest plugin
(``-p tests.official_catalogue``) in a session that packages, and imported by ``programbench`` run as ``CLI``.
"""

from __future__ import annotations

import os
from pathlib import Path

from programbench.utils import load_data

ENV = "PB_OFFICIAL_TASKS_DIR"
# The official CLI with the catalogue in place: ``python -c CLI submit verify DIR``.
CLI = "import tests.official_catalogue; from programbench.cli.main import app; app()"

if os.environ.get(ENV):
    load_data.load_all_instances.__defaults__ = (Path(os.environ[ENV]),)
