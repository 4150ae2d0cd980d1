"""Everything the harness puts into an evaluation container, under one rule.

An evaluation container is one the submission controlled: ``compile.sh`` ran in it as root, and what it left is
committed into the image every hidden branch runs in. So what the grader brings in -- our rerunfailures wheels, the
audit's plugin -- is a read-only volume (:func:`grader_mount`) mounted when a container is created: in place before
any submission code runs there, made and checked through the engine's archive API (no tool of the container runs),
and impossible to rewrite. The official's own material at its fixed path, the timeout-retry plugin, is one too
(:func:`timeout_retry_mount`), standing for the file the official copies in; when the submission left anything at
the official's plugin directory, the official's copy is made instead, through the archive API and read back the same
way (:func:`verify_file`). Nothing is exchanged with a container at a path its runtime may keep from the archive API
(gVisor's ``/tmp``, a tmpfs of its own when the image's is empty). The paths the grader's material uses
(:data:`GRADER_PATHS`) are watched by the integrity scan wherever they lie; one the submission touched is a
``harness_path`` flag.

A replayed install (:mod:`.install_cache`) is verified by the cache when read, and only ever recorded in a container
of the task's own image, where no submission ran.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import docker
import docker.types
from docker.errors import APIError, NotFound
from programbench.eval.pytest_timeout_retry import (
    PYTEST_TIMEOUT_RETRY_PLUGIN_DIR,
    PYTEST_TIMEOUT_RETRY_PLUGIN_MODULE,
    PYTEST_TIMEOUT_RETRY_PLUGIN_PATH,
    PYTEST_TIMEOUT_RETRY_PLUGIN_SOURCE,
)

from pytest_programbench import GRADER_VOLUME_PREFIX, RUN_LABEL, TASK_LABEL
from pytest_programbench.engine.archive_out import REGULAR, CappedStream, Member
from pytest_programbench.engine.container import Container
from pytest_programbench.engine.facts import facts
from pytest_programbench.engine.reaper import is_stand_in
from pytest_programbench.engine.tar_in import TarIn

# The official's plugin directory: it puts it first on the hidden tests' PYTHONPATH (eval.py, run_tests).
GRADER_PLUGIN_DIR = PYTEST_TIMEOUT_RETRY_PLUGIN_DIR
# Where an older harness put its wheels: still watched (a submission that plants a look-alike there is flagged).
WHEEL_DIR_PREFIX = "/tmp/pytest-programbench-wheels"
# The audit's plugin mounts and report directories (evaluation/audit.py) are named from this prefix.
AUDIT_DIR_PREFIX = "/pytest-programbench-audit"
# Name prefixes of every path the grader's material uses inside a container: what the submission made there is a
# flag, and the integrity scan's walk descends into them even below a directory it otherwise only lists.
GRADER_PATHS = (GRADER_PLUGIN_DIR, WHEEL_DIR_PREFIX, AUDIT_DIR_PREFIX, "/pytest-programbench-grader")
VERIFY_TIMEOUT = 60.0
FILE_MODE = 0o644


def is_grader_path(path: str) -> bool:
    """Whether an absolute container path is one the grader's material uses (or lies below one)."""
    return any(path.startswith(prefix) for prefix in GRADER_PATHS)


class FileReader(Protocol):
    """What reading a file back needs of a container (``SdkContainerEnvironment`` offers it)."""

    def read_member(self, container_path: str, *, timeout: int = ...,
                    max_bytes: int | None = ...) -> tuple[int, Member | str]: ...


class MaterialRefused(RuntimeError):
    """The material could not be placed under the rule; the message says why. Never a score of the submission's."""


def verify_file(container: FileReader, path: str, data: bytes, mode: int) -> None:
    """Check that ``path`` is a regular root-owned file with ``mode`` and ``data``'s bytes (the official's own
    material at its fixed path, such as the timeout-retry plugin), through the engine's archive API: no tool of the
    container runs. Raises :class:`MaterialRefused`."""
    rc, found = container.read_member(path, timeout=int(VERIFY_TIMEOUT), max_bytes=len(data))
    if isinstance(found, str):
        raise MaterialRefused(f"{path} in the container could not be read back (exit {rc}): {found[:300]}")
    if (found.kind, found.mode, found.uid, found.data) != (REGULAR, mode, 0, data):
        raise MaterialRefused(f"{path} in the container is not what was sent: a {found.kind} of mode "
                              f"{found.mode:o}, owner {found.uid}, {found.size} bytes")


# --------------------------------------------------------------------------------------------- grader volumes
#
# The construction that replaces placing: the grader's material is a read-only volume, made once per content (per
# engine client and run) through the engine's archive API into a helper container that never starts, checked there
# (type, mode, owner, sha256 hashed here), and mounted when a container is created. No process of the submission
# exists yet, so nothing needs stopping; the mount is read-only, so nothing can rewrite it; no tool of the container
# is used to place or check it. It works on a remote engine (no host path is bound).

GRADER_VOLUME_LABEL = "pytest-programbench.grader"  # the content's sha256 (the run's labels are added)
VOLUME_PREFIX = GRADER_VOLUME_PREFIX
HELPER_MOUNT = "/pb-grader-volume"  # where the helper container sees the volume while it is filled
GRADER_MOUNT_ROOT = "/pytest-programbench-grader"  # our material's mount targets lie below this
VOLUME_CHECK_BYTES = 64 << 20  # the most a volume's check reads back


def content_digest(files: Mapping[str, bytes], mode: int) -> str:
    """The material's identity: names, mode and bytes."""
    digest = hashlib.sha256(f"mode {mode:o}\n".encode())
    for name in sorted(files):
        digest.update(f"{name}\n{len(files[name])}\n".encode())
        digest.update(files[name])
    return digest.hexdigest()


@dataclass(frozen=True)
class GraderMount:
    """A grader volume and where a container sees it (read-only); ``stands_for``: the files the official copies into
    a container that this volume provides in their place (path -> bytes)."""

    volume: str
    target: str
    files: Mapping[str, bytes]
    mode: int
    digest: str
    stands_for: Mapping[str, bytes] = field(default_factory=dict)

    def mount(self) -> docker.types.Mount:
        # no_copy: the image's content at the target never enters the volume.
        return docker.types.Mount(self.target, self.volume, type="volume", read_only=True, no_copy=True)

    def at(self, target: str) -> GraderMount:
        """The same volume seen at another path."""
        return GraderMount(self.volume, target, self.files, self.mode, self.digest)

    def provides(self, container_path: str, data: bytes) -> bool:
        """Whether this volume stands for the official's copy of ``data`` to ``container_path``."""
        return self.stands_for.get(container_path) == data


def grader_mount(engine: docker.DockerClient, files: Mapping[str, bytes], *, target: str,
                 labels: Mapping[str, str], image: str, mode: int = FILE_MODE) -> GraderMount:
    """``files`` (name -> bytes, root-owned, ``mode``) as a read-only volume to mount at ``target`` when a container
    is created (``LayerConfig.branch_mounts``). Made once per content per engine client and run (``labels`` carry
    the run: the session's sweep removes it, and :func:`remove_grader_volumes` for a caller outside a session), in a
    helper container of ``image`` (any image on the engine; it never starts), and checked through the engine's
    archive API. Raises :class:`MaterialRefused` when it cannot be made as sent."""
    digest = content_digest(files, mode)
    labels = {k: v for k, v in labels.items() if k != TASK_LABEL}  # the run's, shared by its tasks
    run = str(labels.get(RUN_LABEL, ""))
    api = engine.api
    known = facts(api)
    with known.lock:
        name = known.grader_volumes.get((run, digest))
        if name is not None and not _volume_is(api, name, digest):
            known.grader_volumes.pop((run, digest), None)  # swept meanwhile, or replaced: made again
            name = None
        if name is None:
            name = _make_volume(api, files, mode=mode, digest=digest, labels=labels, image=image)
            known.grader_volumes[(run, digest)] = name
    return GraderMount(name, target, dict(files), mode, digest)


# The official's timeout-retry plugin as a package of its module's name inside the official's plugin directory: the
# official's `mkdir -p DIR && rm -f DIR/MODULE.py` step finds DIR made and no MODULE.py to remove, pytest's
# `-p MODULE` imports the package (a package wins over a module of the same name), and DIR stays the directory the
# image has, writable, as the official's is.
TIMEOUT_RETRY_TARGET = f"{GRADER_PLUGIN_DIR}/{PYTEST_TIMEOUT_RETRY_PLUGIN_MODULE}"


def timeout_retry_mount(engine: docker.DockerClient, *, labels: Mapping[str, str], image: str) -> GraderMount:
    """The official's timeout-retry plugin as a read-only grader volume at :data:`TIMEOUT_RETRY_TARGET`, standing for
    the official's copy of its source to ``PYTEST_TIMEOUT_RETRY_PLUGIN_PATH``. For a container whose image has
    nothing at the plugin directory (the caller checks: otherwise the official's copy is made). Raises
    :class:`MaterialRefused`."""
    source = PYTEST_TIMEOUT_RETRY_PLUGIN_SOURCE.encode()
    made = grader_mount(engine, {"__init__.py": source}, target=TIMEOUT_RETRY_TARGET, labels=labels, image=image)
    return replace(made, stands_for={PYTEST_TIMEOUT_RETRY_PLUGIN_PATH: source})


def _volume_is(api: Any, name: str, digest: str) -> bool:
    try:
        info = api.inspect_volume(name)
    except NotFound:
        return False
    return bool((info.get("Labels") or {}).get(GRADER_VOLUME_LABEL) == digest)


def replaced_volumes(api: Any, mounts: Sequence[GraderMount]) -> list[str]:
    """The volumes of ``mounts`` that are no longer the ones made for them. One removed after :func:`grader_mount`
    checked it (the run's sweep at its end, a reaper) is made again by the engine, empty and unlabelled, for a
    container created with its name: tests would run without the grader's material (an empty plugin package still
    imports). Asked once a container holds them, which the engine then refuses to remove."""
    return [name for name, digest in dict.fromkeys((m.volume, m.digest) for m in mounts)
            if not _volume_is(api, name, digest)]


def remove_stand_in(api: Any, name: str) -> None:
    """Remove volume ``name`` when it is the engine's stand-in (no grader label); the engine refuses while a container
    uses it (the reaper removes it later)."""
    with contextlib.suppress(NotFound, APIError):
        if is_stand_in(api.inspect_volume(name)):
            api.remove_volume(name)


def _make_volume(api: Any, files: Mapping[str, bytes], *, mode: int, digest: str, labels: Mapping[str, str],
                 image: str) -> str:
    name = f"{VOLUME_PREFIX}-{digest[:16]}-{secrets.token_hex(6)}"  # per client: no other worker writes it
    api.create_volume(name, labels={**labels, GRADER_VOLUME_LABEL: digest})
    helper = ""
    try:
        host_config = api.create_host_config(network_mode="none", mounts=[
            docker.types.Mount(HELPER_MOUNT, name, type="volume", read_only=False, no_copy=True)])
        helper = str(api.create_container(image, command=["true"], labels=dict(labels), host_config=host_config,
                                          network_disabled=True)["Id"])
        archive = TarIn()
        for base, data in sorted(files.items()):
            archive.file(base, data, mode)
        if not archive.put(api, helper, HELPER_MOUNT):
            raise MaterialRefused(f"the engine refused the grader's files into volume {name}")
        found = volume_listing(Container(api, helper), HELPER_MOUNT)
        if found != expected_entries(files, mode):
            raise MaterialRefused(f"volume {name} does not hold what was sent: {sorted(found.items())[:5]}")
    except (APIError, OSError, tarfile.TarError, MaterialRefused) as exc:
        _remove_quietly(api, helper, name)
        raise exc if isinstance(exc, MaterialRefused) else MaterialRefused(f"grader volume {name}: {exc}") from exc
    except BaseException:
        _remove_quietly(api, helper, name)
        raise
    _remove_quietly(api, helper, None)
    return name


def expected_entries(files: Mapping[str, bytes], mode: int) -> dict[str, tuple[str, int, int, str]]:
    """What :func:`volume_listing` gives for exactly ``files``: name -> (kind, mode, uid, sha256)."""
    return {name: ("f", mode, 0, hashlib.sha256(data).hexdigest()) for name, data in files.items()}


def volume_listing(container: Container, directory: str) -> dict[str, tuple[str, int, int, str]]:
    """Every entry below ``directory`` of ``container`` as the engine's archive gives it (name -> kind, mode, uid,
    sha256 of a regular file's bytes), hashed here: no tool of the container runs."""
    entries: dict[str, tuple[str, int, int, str]] = {}
    with (container.archive(directory) as (chunks, _stat),
          tarfile.open(fileobj=CappedStream(chunks, VOLUME_CHECK_BYTES), mode="r|") as tar):
        for info in tar:
            rel = info.name.split("/", 1)[1] if "/" in info.name else ""
            if not rel:
                continue  # the directory itself
            digest = ""
            if info.isfile():
                handle = tar.extractfile(info)
                digest = hashlib.sha256(handle.read() if handle is not None else b"").hexdigest()
            kind = "f" if info.isfile() else "d" if info.isdir() else "o"
            entries[rel] = (kind, info.mode & 0o7777, info.uid, digest)
    return entries


def _remove_quietly(api: Any, container: str, volume: str | None) -> None:
    if container:
        with contextlib.suppress(NotFound, APIError):
            api.remove_container(container, force=True, v=False)
    if volume:
        with contextlib.suppress(NotFound, APIError):
            api.remove_volume(volume, force=True)


def remove_grader_volumes(engine: docker.DockerClient, run_id: str) -> list[str]:
    """Remove the run's grader volumes (for a caller outside a session; a session's sweep does it at its end)."""
    api = engine.api
    removed = []
    for info in (api.volumes(filters={"label": [f"{RUN_LABEL}={run_id}", GRADER_VOLUME_LABEL]}) or {}).get(
            "Volumes") or []:
        with contextlib.suppress(NotFound, APIError):
            api.remove_volume(info["Name"], force=True)
            removed.append(str(info["Name"]))
    known = facts(api)
    with known.lock:
        for key in [k for k in known.grader_volumes if k[0] == run_id]:
            del known.grader_volumes[key]
    return removed
