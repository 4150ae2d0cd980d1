"""Reaping dead runs: at session start, remove what runs that are gone left on the engine.

Every container and image the plugin makes carries ``pytest-programbench=<run id>``; made by a session (its
:class:`docker_engine.EngineRun`) they also carry the run's owner (``<host>/<boot id>/<controller pid>/<started>``)
and a deadline (``pytest-programbench.expires``). That is enough to decide from labels alone, without finding the
run directory:

* the current run: never touched;
* owner on this host (same hostname and boot id): the run is alive while a process with the controller's pid exists
  *and started before the run did* (a recycled pid is a new process); otherwise it is dead;
* owner on another host (or another boot): its liveness cannot be checked from here, so it is dead only once its
  deadline passed (a container's deadline is its own ``sleep`` lifetime plus a margin: it has stopped by then);
* no owner label (made by a session that did not configure the run): the run directories given to
  :func:`reap_dead_runs` are searched for a ``pb-run.json`` naming the run (its controller pid, host and start time
  decide as above); failing that, the object is dead only when older than :data:`UNLABELLED_MAX_AGE`.

An unlabelled volume named as a grader volume is the engine's empty stand-in for one that was removed while a
container was being made with it: a full reap removes it once no container uses it.

A live run's containers are never removed. Containers go before images; an image still used by any container is
left alone (the engine refuses; reported). Every removal is independent and a repeat finds nothing: crash-safe and
idempotent, two sessions reaping at once only see "not found".
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from docker.errors import APIError, NotFound
from requests.exceptions import RequestException

from pytest_programbench import GRADER_VOLUME_PREFIX, RUN_LABEL
from pytest_programbench.core import environment
from pytest_programbench.core.run_identity import RUN_MARKER
from pytest_programbench.engine.backpressure import stale_slot_dirs
from pytest_programbench.engine.container import Container
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.engine.ownership import EXPIRES_LABEL, OWNER_LABEL, Owner, boot_id, process_alive
from pytest_programbench.engine.protocol import DockerEngine

log = logging.getLogger(__name__)

UNLABELLED_MAX_AGE = environment.REAP_UNLABELLED_AFTER.number()
# A process that started this much after the run's recorded start is not its controller (clock granularity).

__all__ = ["ReapReport", "reap_dead_runs", "run_verdict"]


@dataclass
class ReapReport:
    containers: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)  # the grader's volumes (evaluation/harness_material.py)
    slot_dirs: list[str] = field(default_factory=list)
    dead_runs: dict[str, str] = field(default_factory=dict)  # run id -> why it is dead
    live_runs: dict[str, str] = field(default_factory=dict)  # run id -> why it is kept
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{len(self.containers)} containers, {len(self.images)} images and {len(self.volumes)} volumes of "
                 f"{len(self.dead_runs)} dead run(s) removed"]
        if self.live_runs:
            parts.append(f"{len(self.live_runs)} live run(s) left alone")
        if self.errors:
            parts.append(f"{len(self.errors)} error(s): " + "; ".join(self.errors[:5]))
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- liveness


@dataclass(frozen=True)
class _Here:
    hostname: str
    boot_id: str


def _here() -> _Here:
    return _Here(socket.gethostname(), boot_id())


def _owner_verdict(owner: Owner, here: _Here) -> tuple[bool, str] | None:
    """(dead, why) when this host can judge the owner; None when it cannot (another host or boot)."""
    if owner.hostname != here.hostname:
        return None
    if owner.boot_id and here.boot_id and owner.boot_id != here.boot_id:
        return True, f"its controller ran on {owner.hostname} before the last reboot"
    if process_alive(owner.pid, owner.started):
        return False, f"controller pid {owner.pid} on {owner.hostname} is alive"
    return True, f"controller pid {owner.pid} on {owner.hostname} is gone"


def run_verdict(labels: Mapping[str, str], created: float, *, current_run: str | None,
                run_records: Mapping[str, Owner] | None = None, now: float | None = None,
                here: _Here | None = None) -> tuple[bool, str]:
    """(dead, why) for one labelled container or image."""
    now = time.time() if now is None else now
    here = here or _here()
    run_id = labels.get(RUN_LABEL, "")
    if not run_id or run_id == current_run:
        return False, "the current run"
    owner = Owner.parse(labels.get(OWNER_LABEL))
    if owner is not None:
        verdict = _owner_verdict(owner, here)
        if verdict is not None:
            return verdict
    expires_raw = labels.get(EXPIRES_LABEL)
    if expires_raw:
        try:
            expires = float(expires_raw)
        except ValueError:
            expires = None
        if expires is not None:
            if now > expires:
                return True, f"its lifetime expired {now - expires:.0f} s ago"
            return False, f"owner {owner.hostname if owner else '?'} not checkable from here; expires in " \
                          f"{expires - now:.0f} s"
    record = (run_records or {}).get(run_id)
    if record is not None:
        verdict = _owner_verdict(record, here)
        if verdict is not None:
            return verdict
    age = now - created
    if age > UNLABELLED_MAX_AGE:
        return True, f"no owner label and {age / 3600:.1f} h old"
    return False, f"no owner label, {age / 3600:.1f} h old (kept up to {UNLABELLED_MAX_AGE / 3600:.0f} h)"


def load_run_records(roots: Iterable[Path]) -> dict[str, Owner]:
    """Run id -> owner, from ``pb-run.json`` files in ``roots`` (run directories, or directories of them)."""
    records: dict[str, Owner] = {}
    for root in roots:
        candidates = [root / RUN_MARKER] if (root / RUN_MARKER).is_file() else sorted(root.glob(f"*/{RUN_MARKER}"))
        for marker in candidates:
            try:
                data = json.loads(marker.read_text())
            except (OSError, ValueError):
                continue
            entries = [data, *(data.get("history") or [])]
            for entry in entries:
                try:
                    owner = Owner(str(data.get("hostname", "")), int(entry["controller_pid"]),
                                  float(entry["started"]))
                    records.setdefault(str(entry["run_id"]), owner)
                except (KeyError, TypeError, ValueError):
                    continue
    return records


# ---------------------------------------------------------------------------------------------- reaping


def _created(info: Mapping[str, Any]) -> float:
    if "CreatedAt" in info:  # a volume's: RFC 3339
        try:
            return datetime.fromisoformat(str(info["CreatedAt"])).timestamp()
        except ValueError:
            return 0.0
    value = info.get("Created", 0)
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def reap_dead_runs(current_run: str | None, *, engine: DockerEngine, run_dirs: Iterable[Path] = (),
                   now: float | None = None, slot_dirs: bool = True, runs: Iterable[str] | None = None) -> ReapReport:
    """Remove the containers, then the images, of every dead run on the engine; never raises for engine trouble.

    ``current_run`` is this session's run id (never touched). ``run_dirs``: where to look for ``pb-run.json`` of
    runs whose objects carry no owner label (e.g. ``<rootdir>/pb-runs``). ``runs``: judge only these run ids.
    """
    report = ReapReport()
    listed = _run_objects(engine, report, runs)
    if listed is None:
        return report
    api, containers, images, volumes = listed
    judge = _judge(current_run, load_run_records(run_dirs), _here(), time.time() if now is None else now, report)
    _remove_containers(api, containers, judge, report)
    for info in images:
        if judge(info) and _remove_image(api, info, report):
            report.images.append(info["Id"][:19])
    for info in volumes:
        if judge(info) and _remove_volume(api, info, report):
            report.volumes.append(str(info["Name"]))
    if runs is None:
        _remove_stand_ins(api, report)
    if slot_dirs:
        _reap_slot_dirs(report)
    if report.containers or report.images or report.volumes or report.errors:
        log.warning("reaper: %s", report.summary())
    return report


Listed = list[dict[str, Any]]


def _run_objects(engine: DockerEngine, report: ReapReport, runs: Iterable[str] | None
                 ) -> tuple[Any, Listed, Listed, Listed] | None:
    """The engine's API client, and the containers, images and volumes of any run (of ``runs`` only, when given);
    None when the engine cannot list them (said in ``report``)."""
    try:
        api = engine.api
        containers = api.containers(all=True, filters={"label": RUN_LABEL})
        images = api.images(all=True, filters={"label": RUN_LABEL})
        volumes = list((api.volumes(filters={"label": RUN_LABEL}) or {}).get("Volumes") or [])
    except (EngineUnavailable, APIError, RequestException) as exc:
        report.errors.append(f"cannot list the engine's containers: {exc}")
        log.warning("reaper: %s", report.errors[-1])
        return None
    if runs is not None:
        only = set(runs)
        containers = [c for c in containers if (c.get("Labels") or {}).get(RUN_LABEL) in only]
        images = [i for i in images if (i.get("Labels") or {}).get(RUN_LABEL) in only]
        volumes = [v for v in volumes if (v.get("Labels") or {}).get(RUN_LABEL) in only]
    return api, containers, images, volumes


def _judge(current_run: str | None, records: Mapping[str, Owner], here: _Here, now: float, report: ReapReport
           ) -> Callable[[Mapping[str, Any]], bool]:
    """Whether an object's run is dead (:func:`run_verdict`), each run other than ``current_run`` and its verdict's
    reason kept in ``report``."""
    def judge(info: Mapping[str, Any]) -> bool:
        labels = info.get("Labels") or {}
        dead, why = run_verdict(labels, _created(info), current_run=current_run, run_records=records, now=now,
                                here=here)
        run_id = labels.get(RUN_LABEL, "")
        if run_id and run_id != current_run:
            (report.dead_runs if dead else report.live_runs).setdefault(run_id, why)
        return dead

    return judge


def _remove_containers(api: Any, containers: list[dict[str, Any]], judge: Callable[[Mapping[str, Any]], bool],
                       report: ReapReport) -> None:
    """Force-remove the dead runs' containers (with their volumes); stop at the engine going away."""
    for info in containers:
        if not judge(info):
            continue
        try:
            Container(api, info["Id"]).remove(paused=info.get("State") == "paused")
            report.containers.append(info["Id"][:12])
        except APIError as exc:
            report.errors.append(f"container {info['Id'][:12]}: {exc}")
        except (EngineUnavailable, RequestException) as exc:
            report.errors.append(f"container {info['Id'][:12]}: {exc}")
            break


def is_stand_in(info: Mapping[str, Any]) -> bool:
    """Whether a volume (``inspect_volume``/``volumes`` entry) is the engine's stand-in for a removed grader volume:
    a grader volume's name and no labels at all (ours are labelled when they are made)."""
    return str(info.get("Name", "")).startswith(GRADER_VOLUME_PREFIX) and not info.get("Labels")


def _remove_stand_ins(api: Any, report: ReapReport) -> None:
    """Remove the engine's unused stand-ins for removed grader volumes: a volume of a grader volume's name without
    the run's label, which the engine made for a container created after the real one was removed (the run's
    container check refused it; the container may have gone with its run's sweep since). Never one of ours: a grader
    volume is labelled when it is made."""
    try:
        listed = (api.volumes(filters={"name": GRADER_VOLUME_PREFIX}) or {}).get("Volumes") or []
    except (EngineUnavailable, APIError, RequestException) as exc:
        report.errors.append(f"cannot list the engine's volumes: {exc}")
        return
    for info in listed:
        if is_stand_in(info) and _remove_volume(api, info, report):
            report.volumes.append(str(info["Name"]))


def _remove_volume(api: Any, info: Mapping[str, Any], report: ReapReport) -> bool:
    """Remove a dead run's volume; one a container still uses (a live run's) stays."""
    try:
        api.remove_volume(info["Name"], force=True)
    except NotFound:
        return False
    except APIError as exc:
        if "in use" not in str(exc):
            report.errors.append(f"volume {info['Name']}: {exc}")
        return False
    except (EngineUnavailable, RequestException) as exc:
        report.errors.append(f"volume {info['Name']}: {exc}")
        return False
    return True


def _remove_image(api: Any, info: Mapping[str, Any], report: ReapReport) -> bool:
    """Untag, then delete, without force; an image any container still uses (a live run's) stays."""
    image_id = str(info["Id"])
    try:
        users = api.containers(all=True, filters={"ancestor": image_id})
        if users:
            report.errors.append(f"image {image_id[:19]} kept: used by container(s) "
                                 + ", ".join(str(c["Id"])[:12] for c in users[:5]))
            return False
        for tag in info.get("RepoTags") or []:
            if tag and tag != "<none>:<none>":
                api.remove_image(tag, force=False, noprune=False)
        api.remove_image(image_id, force=False, noprune=False)
    except NotFound:
        return True
    except APIError as exc:
        report.errors.append(f"image {image_id[:19]} kept: {getattr(exc, 'explanation', None) or exc}")
        return False
    except (EngineUnavailable, RequestException) as exc:
        report.errors.append(f"image {image_id[:19]}: {exc}")
        return False
    return True


def _reap_slot_dirs(report: ReapReport) -> None:
    try:
        stale = stale_slot_dirs()
    except OSError as exc:
        report.errors.append(f"slot directories: {exc}")
        return
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        report.slot_dirs.append(str(path))
