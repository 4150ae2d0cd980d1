"""Disk space: checked before pulling or building an image and before a task runs; images pruned when asked.

* :func:`require_for_image` — the Docker data root (``info()["DockerRootDir"]``, else ``/var/lib/docker``) must
  have :func:`image_need` bytes free before a pull or a build. :mod:`docker_engine`'s client calls it itself before
  every ``pull``/``build``/``load``, so no caller can forget it.
* :func:`require_for_run` — before a task runs: the data root needs :func:`run_need` (its containers and the
  committed compile image) plus, when an agent runs and the engine enforces it, the sandbox's writable-layer limit
  (``PB_SANDBOX_STORAGE``); the run directory :func:`run_dir_need` (by default the most one task can write there:
  the submission cap, the ``agent.log`` cap ``PB_AGENT_LOG_MAX``, the proxy's call log, the relay's
  ``model-requests.jsonl`` cap ``PB_MODEL_REQUESTS_MAX``, and 64 MiB for the rest).
* :func:`prune_images` — ``--pb-prune-images``: remove, by id, images the run built or pulled once their task is
  done (never an image some container still uses).

A shortfall is a :class:`DiskSpaceError`, an infrastructure error (it is an ``EngineUnavailable``, so the pipeline
reports it as an error, never a score) whose message names what was about to happen, the path, the space free and
the space needed. Needs are sizes (``10g``, ``512m``, bytes) from the environment: ``PB_DISK_IMAGE_NEED`` (default
10g), ``PB_DISK_RUN_NEED`` (4g), ``PB_DISK_RUN_DIR_NEED`` (default: what one task may write, see above); ``0``
disables a check. When the data root is not
on this machine's filesystem (a remote engine) only the run directory is checked.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from docker.errors import APIError, NotFound

from pytest_programbench.core import environment
from pytest_programbench.engine.errors import DiskSpaceError
from pytest_programbench.engine.facts import NOT_ASKED, facts
from pytest_programbench.engine.protocol import DockerEngine
from pytest_programbench.text.sizes import human

log = logging.getLogger(__name__)

DEFAULT_DOCKER_ROOT = Path("/var/lib/docker")


@dataclass(frozen=True)
class Space:
    path: Path
    free: int
    total: int


def image_need() -> int:
    return environment.DISK_IMAGE_NEED.size()


def run_need() -> int:
    return environment.DISK_RUN_NEED.size()


def free_space(path: Path) -> Space:
    """Free space of the filesystem holding ``path`` (or its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return Space(Path(path), usage.free, usage.total)


def docker_root(engine_api: Any) -> Path | None:
    """The engine's data root on this machine's filesystem; None when it is not here (a TCP/SSH engine, rootless
    or another mount namespace): then only the run directory can be checked."""
    known = facts(engine_api)
    if known.docker_root is not NOT_ASKED:
        return cast(Path | None, known.docker_root)
    root: Path | None = None
    if (environment.DOCKER_HOST.raw() or "unix://").startswith("unix://"):
        try:
            reported = Path(str(engine_api.info().get("DockerRootDir") or DEFAULT_DOCKER_ROOT))
        except Exception as exc:  # an engine that cannot say: assume the default, the check stays useful
            log.debug("docker info failed (%s); assuming %s", exc, DEFAULT_DOCKER_ROOT)
            reported = DEFAULT_DOCKER_ROOT
        root = reported if reported.exists() else None
    known.docker_root = root
    return root


def require(path: Path, need: int, what: str, *, label: str) -> Space:
    """Raise :class:`DiskSpaceError` unless ``path``'s filesystem has ``need`` bytes free."""
    space = free_space(path)
    if need > 0 and space.free < need:
        raise DiskSpaceError(
            f"not enough disk space to {what}: {label} {path} has {human(space.free)} free, {human(need)} needed "
            f"(of {human(space.total)}); free some (`docker image prune`, `docker builder prune`, old pb-runs/), "
            f"or lower the bar with the environment variable named in pytest_programbench.engine.disk")
    return space


def require_for_image(what: str, *, engine_api: Any) -> Space | None:
    """Before a pull or a build (``what``: e.g. ``"pull programbench/x:tag"``)."""
    root = docker_root(engine_api)
    if root is None:
        return None
    return require(root, image_need(), what, label="the Docker data root")


def require_for_run(run_dir: Path, *, engine_api: Any, run_dir_need: int, sandbox_need: int = 0,
                    what: str = "run a task") -> None:
    """Before a task runs: the engine's data root has room for its containers (plus ``sandbox_need``, the sandbox's
    storage limit when an agent runs) and the run directory has ``run_dir_need`` bytes (what one task may write)."""
    root = docker_root(engine_api)
    if root is not None:
        need = run_need()
        require(root, need + sandbox_need if need else 0, what, label="the Docker data root")
    require(run_dir, run_dir_need, what, label="the run directory")


# ---------------------------------------------------------------------------------------------- pruning


@dataclass
class PruneReport:
    removed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # image id -> why


def prune_images(image_ids: Iterable[str], *, engine: DockerEngine) -> PruneReport:
    """``--pb-prune-images``: remove these images (ids the run built or pulled), their tags first, never forced.

    An image some container still uses, or that is already gone, is reported, not an error.
    """
    api = engine.api
    report = PruneReport()
    for image_id in dict.fromkeys(image_ids):
        try:
            info = api.inspect_image(image_id)
        except NotFound:
            report.kept[image_id] = "already gone"
            continue
        try:
            users = api.containers(all=True, filters={"ancestor": info["Id"]})
            if users:
                report.kept[image_id] = "in use by " + ", ".join(str(c["Id"])[:12] for c in users[:5])
                continue
            for tag in info.get("RepoTags") or []:
                api.remove_image(tag, force=False, noprune=False)
            api.remove_image(info["Id"], force=False, noprune=False)
        except NotFound:
            pass
        except APIError as exc:
            report.kept[image_id] = str(getattr(exc, "explanation", None) or exc)
            continue
        report.removed.append(image_id)
    if report.removed:
        log.info("pruned %d image(s): %s", len(report.removed), ", ".join(i[:19] for i in report.removed))
    return report
