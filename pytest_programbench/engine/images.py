"""Step 3 of the pipeline: the task image ``<image_name>:<tag>``, resolved to an image id before any work starts.

Local if present; else pulled (unless ``--pb-pull never``); else built from the task's ``Dockerfile`` with no
network, labelled, once per image across xdist workers (a file lock; the second worker finds it built). The build
context never holds the hidden tests: ``tests/``, ``tests.json`` and ``task.yaml`` are excluded on top of the
task's ``.dockerignore``. A missing image with no way to get it is an :class:`ImageError` (infrastructure) that
names the image and how to provide it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from docker.errors import APIError, BuildError, DockerException, ImageNotFound
from docker.utils.build import tar
from filelock import FileLock

from pytest_programbench.core.cache import cache_root
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.tasks.catalogue import Task

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)

# Never part of a build context: the hidden tests and the task's metadata.
CONTEXT_EXCLUDES = ("tests", "tests/**", "tests.json", "task.yaml")
BUILD_TIMEOUT = 3600


class ImageError(Exception):
    """The task image is missing and cannot be pulled or built: an infrastructure error, never a score."""


@dataclass(frozen=True)
class ResolvedImage:
    ref: str  # "<image_name>:<tag>"
    id: str  # "sha256:..."
    source: str  # "local" | "pulled" | "built"


def image_ref(task: Task, tag: str) -> str:
    return f"{task.image_name}:{tag}"


def _local_id(engine: docker.DockerClient, ref: str) -> str | None:
    try:
        return str(engine.api.inspect_image(ref)["Id"])
    except ImageNotFound:
        return None


def _pull(engine: docker.DockerClient, ref: str) -> str:
    """Pull ``ref``; returns an error text, empty on success."""
    repository, _, tag = ref.rpartition(":")
    try:
        for event in engine.api.pull(repository, tag=tag, stream=True, decode=True):
            if isinstance(event, dict) and event.get("error"):
                return str(event["error"])
    except APIError as exc:
        return str(getattr(exc, "explanation", None) or exc)
    return ""


def _dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    stripped = (raw.strip() for raw in path.read_text().splitlines())
    return [line for line in stripped if line and not line.startswith("#")]


def _build(engine: docker.DockerClient, task: Task, ref: str, labels: Mapping[str, str]) -> str:
    """Build ``ref`` from the task's Dockerfile with no network; returns the image id."""
    dockerfile = task.dockerfile
    assert dockerfile is not None
    context = dockerfile.parent
    excludes = [*_dockerignore(context), *CONTEXT_EXCLUDES]
    # ".dockerignore" and "Dockerfile" must stay in the context even when ignored (docker-py's rule too).
    excludes = [e for e in excludes if e not in {".dockerignore", "Dockerfile"}]
    log.info("building %s from %s (no network)", ref, dockerfile)
    with tar(str(context), exclude=excludes, dockerfile=("Dockerfile", None), gzip=False) as archive:
        try:
            stream = engine.api.build(
                fileobj=archive, custom_context=True, tag=ref, network_mode="none", labels=dict(labels),
                rm=True, forcerm=True, decode=True, pull=False, timeout=BUILD_TIMEOUT,
            )
            tail: list[str] = []
            image_id = ""
            for chunk in stream:
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error"):
                    detail = "".join(tail[-20:])
                    raise ImageError(f"building {ref} from {dockerfile} failed: {chunk['error']}\n{detail}")
                if "stream" in chunk:
                    tail.append(str(chunk["stream"]))
                    del tail[:-40]
                aux = chunk.get("aux")
                if isinstance(aux, dict) and aux.get("ID"):
                    image_id = str(aux["ID"])
        except (APIError, BuildError) as exc:
            raise ImageError(f"building {ref} from {dockerfile} failed: {exc}") from exc
    found = _local_id(engine, ref)
    if found is None:
        raise ImageError(f"building {ref} from {dockerfile} reported success ({image_id or 'no id'}) but the "
                         f"image is not there")
    return found


def _lock_path(ref: str, lock_dir: Path | None) -> Path:
    directory = lock_dir or cache_root() / "image-locks"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / (re.sub(r"[^A-Za-z0-9_.-]", "_", ref) + ".lock")


def ensure_image(
    task: Task,
    *,
    tag: str = "task_cleanroom_v6",
    pull: str = "missing",
    labels: Mapping[str, str] | None = None,
    engine: docker.DockerClient | Any,
    lock_dir: Path | None = None,
) -> ResolvedImage:
    """The task image's id: local, else pulled (``pull="missing"``), else built from the task's Dockerfile.

    ``labels`` go on a built image (the run's labels make the controller's sweep remove it at session end).
    """
    if pull not in {"never", "missing"}:
        raise ValueError(f"pull must be 'never' or 'missing', not {pull!r}")
    ref = image_ref(task, tag)
    try:
        found = _local_id(engine, ref)
        if found is not None:
            return ResolvedImage(ref, found, "local")
        with FileLock(str(_lock_path(ref, lock_dir))):
            found = _local_id(engine, ref)  # another worker may have pulled or built it meanwhile
            if found is not None:
                return ResolvedImage(ref, found, "local")
            pull_error = ""
            if pull == "missing":
                pull_error = _pull(engine, ref)
                if not pull_error:
                    found = _local_id(engine, ref)
                    if found is not None:
                        return ResolvedImage(ref, found, "pulled")
                    pull_error = "pull reported success but the image is not there"
            if task.dockerfile is not None:
                return ResolvedImage(ref, _build(engine, task, ref, labels or {}), "built")
    except DockerException as exc:
        if "connection" in str(exc).lower():
            raise EngineUnavailable(f"Docker engine unreachable while resolving {ref}: {exc}") from exc
        raise ImageError(f"{ref}: {exc}") from exc
    tried = "not present locally"
    if pull == "missing":
        tried += f"; pull failed ({pull_error})"
    else:
        tried += "; not pulled (--pb-pull never)"
    raise ImageError(
        f"{task.instance_id}: image {ref} is {tried}; and {task.task_dir} has no Dockerfile to build it from. "
        f"Provide it with `docker pull {ref}` (or `docker load`), allow pulling with --pb-pull missing, or add a "
        f"Dockerfile to the task dir"
    )
