"""Evaluate-only runs: ``--pb-submissions DIR`` holds ``<id>/submission.tar.gz`` per task."""

from __future__ import annotations

from pathlib import Path

from pytest_programbench.tasks.catalogue import Catalogue

ARCHIVE = "submission.tar.gz"


class SubmissionsDir:
    def __init__(self, root: Path, catalogue: Catalogue) -> None:
        self.root = root
        present = sorted(d.name for d in root.iterdir() if d.is_dir() and (d / ARCHIVE).is_file())
        from programbench.constants import TASKS_DIR

        # Packaged fixtures left out of this selection are still tasks: only warn about ids nobody knows.
        known = {t.instance_id for t in catalogue} | {d.name for d in TASKS_DIR.iterdir() if d.is_dir()}
        self.ids = frozenset(i for i in present if i in known)
        self.unknown_ids = [i for i in present if i not in known]

    def has(self, instance_id: str) -> bool:
        return instance_id in self.ids

    def archive(self, instance_id: str) -> Path:
        return self.root / instance_id / ARCHIVE
