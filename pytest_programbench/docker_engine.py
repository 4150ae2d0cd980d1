"""The Docker engine: one lazily created SDK client per process, the run's labels, and the sweep.

Every container and image the plugin makes carries ``pytest-programbench=<run id>`` plus worker and task labels,
so the controller can remove everything of its run at session end, also after a worker crashed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_programbench import RUN_LABEL, TASK_LABEL, WORKER_LABEL

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)

_client: docker.DockerClient | None = None
_client_lock = threading.Lock()

# Generous: creates and commits wait behind other workers' on a loaded 2-core machine.
API_TIMEOUT = 300


class EngineUnavailable(Exception):
    """The Docker engine does not answer: an infrastructure error, never a score."""


HOW_TO_START = (
    "start one (e.g. `bash testbed/setup.sh`, or `dockerd &` after writing /etc/docker/daemon.json), "
    "or point DOCKER_HOST at it"
)


def client() -> docker.DockerClient:
    """The process-wide client; created on first use so collection never touches the engine."""
    global _client  # noqa: PLW0603 - one client per process, created lazily
    with _client_lock:
        if _client is None:
            import docker
            from docker.errors import DockerException

            try:
                candidate = docker.from_env(timeout=API_TIMEOUT)
                candidate.ping()
            except DockerException as exc:
                raise EngineUnavailable(f"Docker engine unreachable ({exc}); {HOW_TO_START}") from exc
            _client = candidate
        return _client


def reset_client() -> None:
    """Forget the client (after fork, or when the engine was restarted)."""
    global _client  # noqa: PLW0603 - one client per process, created lazily
    with _client_lock:
        if _client is not None:
            with contextlib.suppress(Exception):  # closing a dead connection is best effort
                _client.close()
        _client = None


@dataclass(frozen=True)
class Labels:
    """The labels of one run, worker and task."""

    run_id: str
    worker: str = "controller"
    task: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)

    def for_task(self, task: str) -> Labels:
        return Labels(self.run_id, self.worker, task, self.extra)

    def as_dict(self) -> dict[str, str]:
        labels = {RUN_LABEL: self.run_id, WORKER_LABEL: self.worker, **self.extra}
        if self.task:
            labels[TASK_LABEL] = self.task
        return labels


@dataclass
class SweepReport:
    containers: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def sweep(run_id: str, *, engine: Any | None = None, task: str | None = None) -> SweepReport:
    """Remove every container, then every image, labelled with this run (optionally one task only)."""
    from docker.errors import APIError, NotFound

    report = SweepReport()
    api = (engine or client()).api
    filters = [f"{RUN_LABEL}={run_id}"]
    if task is not None:
        filters.append(f"{TASK_LABEL}={task}")
    for info in api.containers(all=True, filters={"label": filters}):
        try:
            api.remove_container(info["Id"], force=True, v=True)
            report.containers.append(info["Id"][:12])
        except NotFound:
            pass
        except APIError as exc:
            report.errors.append(f"container {info['Id'][:12]}: {exc}")
    for info in api.images(all=True, filters={"label": filters}):
        try:
            api.remove_image(info["Id"], force=True, noprune=False)
            report.images.append(info["Id"][:19])
        except NotFound:
            pass
        except APIError as exc:
            report.errors.append(f"image {info['Id'][:19]}: {exc}")
    if report.containers or report.images:
        log.info("swept run %s: %d containers, %d images", run_id, len(report.containers), len(report.images))
    return report
