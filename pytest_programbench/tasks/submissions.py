"""Evaluate-only runs: ``--pb-submissions DIR`` holds ``<id>/submission.tar.gz`` per task."""

from __future__ import annotations

from pathlib import Path

import pytest
from programbench.constants import TASKS_DIR

from pytest_programbench.tasks.catalogue import Catalogue

ARCHIVE = "submission.tar.gz"


class SubmissionsDir:
    def __init__(self, root: Path, catalogue: Catalogue) -> None:
        self.root = root
        present = []
        for d in sorted(root.iterdir()):
            archive = d / ARCHIVE
            if not d.is_dir() or not (archive.exists() or archive.is_symlink()):
                continue
            if not archive.is_file():  # the user's mistake, not a task to score as "no submission"
                what = ("a directory" if archive.is_dir() else "a broken symbolic link" if not archive.exists()
                        else "not a regular file")
                raise pytest.UsageError(f"--pb-submissions: {archive} is {what}; a task's submission is a gzip tar "
                                        "archive of its source tree")
            present.append(d.name)
        if not present:  # a wrong folder: a run of nothing would follow (a run directory, an empty report, exit 5)
            raise pytest.UsageError(f"--pb-submissions: {root} holds no <id>/{ARCHIVE}: expected one folder per "
                                    f"task, named by its instance id, holding the task's {ARCHIVE}")
        # Packaged fixtures left out of this selection are still tasks: only warn about ids nobody knows.
        known = {t.instance_id for t in catalogue} | {d.name for d in TASKS_DIR.iterdir() if d.is_dir()}
        self.ids = frozenset(i for i in present if i in known)
        self.unknown_ids = [i for i in present if i not in known]

    def has(self, instance_id: str) -> bool:
        return instance_id in self.ids

    def archive(self, instance_id: str) -> Path:
        return self.root / instance_id / ARCHIVE
