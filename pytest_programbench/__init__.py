"""pytest-programbench: every ProgramBench task as a pytest item."""

from __future__ import annotations

__version__ = "0.1.0"

# The label every container and image made by the plugin carries; its value is the run id.
RUN_LABEL = "pytest-programbench"
WORKER_LABEL = "pytest-programbench.worker"
TASK_LABEL = "pytest-programbench.task"
