"""pytest-programbench: every ProgramBench task as a pytest item."""

from __future__ import annotations

__version__ = "0.1.0"

# The label every container and image made by the plugin carries; its value is the run id.
RUN_LABEL = "pytest-programbench"
WORKER_LABEL = "pytest-programbench.worker"
TASK_LABEL = "pytest-programbench.task"
# Every grader volume's name starts with this (evaluation/harness_material.py). The engine makes an empty, unlabelled
# volume of a removed one's name for a container that names it: the reaper removes such stand-ins.
GRADER_VOLUME_PREFIX = "pb-grader"
