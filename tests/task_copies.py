"""Copies of the test bed's tasks under ids of one session alone: several same-option cases in one session.

A session over task copies asserts each case on its own item (its outcome, properties, files, message) at the cost of
one session instead of one per case. Each copy is the task's directory (without its Dockerfile: the image is never
built) and its hidden-test blobs under a fresh id, its image an extra tag of the original's, removed afterwards (the
tags only, never the image).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from tests.conftest import Testbed

TAG = "task_cleanroom_v6"


def copy_id(org: str, name: str, source: str) -> str:
    """``org__name.hash``: the source's commit hash kept, so the id has the official form."""
    return f"{org}__{name}.{source.rpartition('.')[2]}"


def keep_active_branches(task_dir: Path, active: Collection[str]) -> None:
    """The copy's ``tests.json`` with ``active`` its active branches (the others ignored, as a task may list them):
    for a case whose property is decided once per evaluation, each branch more only adds containers (issue 40)."""
    tests = json.loads((task_dir / "tests.json").read_text())
    if missing := sorted(set(active) - set(tests["branches"])):
        raise ValueError(f"{task_dir.name} has no branch {', '.join(missing)}")
    for name, data in tests["branches"].items():
        data["ignored"] = name not in active
        data["ignore_reason"] = "" if name in active else "not needed by this test"
    (task_dir / "tests.json").write_text(json.dumps(tests, indent=2, sort_keys=True))


@contextlib.contextmanager
def task_copies(root: Path, testbed: Testbed, docker_client: Any, sources: Mapping[str, str],
                prefix: str = "pbcopy", one_branch: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """``sources``: case name -> the test bed task it copies. Writes ``root/tasks`` and ``root/blobs``; yields case
    name -> the copy's instance id. ``one_branch``: test bed task -> the one branch its copies keep active (tasks not
    named keep theirs)."""
    from programbench.constants import image_name_from_instance_id

    org = f"{prefix}{secrets.token_hex(3)}"
    ids: dict[str, str] = {}
    tags: list[str] = []
    try:
        for name, source in sources.items():
            new_id = copy_id(org, name, source)
            shutil.copytree(testbed.tasks_dir / source, root / "tasks" / new_id,
                            ignore=shutil.ignore_patterns("Dockerfile"))
            if one_branch and source in one_branch:
                keep_active_branches(root / "tasks" / new_id, [one_branch[source]])
            shutil.copytree(testbed.blob_dir / source, root / "blobs" / new_id)
            repository = image_name_from_instance_id(new_id)
            docker_client.images.get(f"{image_name_from_instance_id(source)}:{TAG}").tag(repository, TAG)
            tags.append(f"{repository}:{TAG}")
            ids[name] = new_id
        yield ids
    finally:
        for tag in tags:
            with contextlib.suppress(Exception):
                docker_client.api.remove_image(tag, noprune=True)
