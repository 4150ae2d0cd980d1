"""The ``install_rerunfailures`` step's effect, recorded once per image and replayed.

The official runs ``pip3 install ... pytest-rerunfailures==16.4`` in every compile container after ``compile.sh``:
pip resolves and unpacks about a thousand files (pytest, pygments, ...) and byte-compiles them, 3 to 12 s on a
loaded 2-core host, for a result that depends only on the image, the wheels and the step's environment -- unless
``compile.sh`` changed something pip reads. So:

* a record is made only where no submission ran: pip run in a container of the task's own image, with the same
  settings and the wheels mounted, its return code and output and the files it wrote (a tar made by that container's
  own ``tar``) kept under a key of (image id, wheel set, command, environment);
* an evaluation whose compile container was *pristine* for pip (:func:`pristine_for_pip`: compile.sh left everything
  pip reads as the image shipped it) gets the step's recorded result, and the recorded files unpacked by the
  container's own ``tar`` (pristine: the image's) in its install step's container (owners, modes, mtimes kept): one
  exec instead of pip. A record is made first when there is none.

The log entry keeps the official command and the recorded output and return code; ``wall_time`` is the replay's.
Anything unusual (no record, a container that is not pristine, no overlay2 stamps, a replay that fails) runs pip.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from programbench.eval.eval import Evaluator

from pytest_programbench.evaluation import integrity

log = logging.getLogger(__name__)

# 3: records are made only in a container of the task's image (no submission ran there), with mounted wheels, and
# carry their archive's sha256 (version 1 and 2 records come from compile containers: never read).
RECORD_VERSION = 3
# The most a record's tar may hold; past it nothing is recorded (pip's closure is ~10 MB).
MAX_RECORD_BYTES = 256 << 20
# Where pip's own writes are never taken from: scratch, the wheel directory we copy in, the workspace.
# Mount points the engine makes in every container (--init's binary; the network files): never the submission's.
ENGINE_MOUNTS = ("/usr/sbin/docker-init", "/etc/hostname", "/etc/hosts", "/etc/resolv.conf")
NOT_RECORDED = ("/tmp", "/var/tmp", "/dev", "/proc", "/sys", "/run", integrity.WORKSPACE, *ENGINE_MOUNTS)
# The directories the diff walk need not descend into to see pip's writes (build trees, caches, scratch).
DIFF_PRUNE = (integrity.WORKSPACE, "/tmp", "/var/tmp", "/dev", "/proc", "/sys", "/run", "/root/go", "/root/.cargo",
              "/root/.rustup", "/root/.cabal", "/root/.stack", "/root/.ghcup", "/root/.m2", "/root/.gradle",
              "/root/.npm")


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def pristine_for_pip(changes: Sequence[Mapping[str, Any]], bounded: Sequence[str], path_env: str | None) -> str | None:
    """Why pip could behave differently in this container than in the image as shipped, or None when it cannot.

    ``changes`` are the compile container's filesystem changes after ``compile.sh`` (the integrity scan's walk of
    the overlay2 upper directory, with stamps). Pip reads the interpreter, site-packages, its config files, the
    login shell's profile and PATH; ``compile.sh`` may change only /workspace, scratch space and build caches
    (``integrity.ALLOWED_OUTSIDE``) and what the official writes itself (resolv.conf, hosts), plus their parent
    directories. /tmp must still be a directory (pip unpacks there); PATH may not reach the workspace (a relative
    or empty entry would make ``pip3`` the submission's). The engine's own mount points (``ENGINE_MOUNTS``) are in
    every container."""
    if bounded:
        return f"the compile scan was bounded ({bounded[0]})"
    if path_env is None:
        return "the container's PATH is unknown"
    for part in path_env.split(":"):
        if not part.startswith("/") or _under(part, (integrity.WORKSPACE,)):
            return f"PATH entry {part!r} is relative or in the workspace"
    allowed = (integrity.WORKSPACE, *integrity.ALLOWED_OUTSIDE)
    harness = (*integrity.HARNESS_OUTSIDE, *ENGINE_MOUNTS, Evaluator._stashed_executable)
    # What is not a directory (a file, a link, a deletion): a directory's own change shows in what lies below it.
    entries = [str(c.get("Path", "")) for c in changes if c.get("Kind") == 2 or c.get("Stamp") is not None]
    for change in changes:
        if "Stamp" not in change:
            return "no overlay2 stamps (the engine's diff cannot show a file changed in place)"
        path = str(change.get("Path", ""))
        is_dir = change.get("Kind") != 2 and change.get("Stamp") is None
        if path in ("/tmp", "/var/tmp") and not is_dir:
            return f"{path} is no longer a directory"
        if _under(path, allowed) or path in harness:
            continue
        # A directory of the image listed only because something allowed below it changed (its copy-up), or
        # something came and went below it (the official's DNS file, moved back), is no change of its own: every
        # entry that changed below it is listed by itself.
        below = [leaf for leaf in entries if leaf.startswith(path.rstrip("/") + "/")]
        if is_dir and change.get("Kind") == 0 and all(_under(leaf, allowed) or leaf in harness for leaf in below):
            continue
        return f"compile.sh changed {path}"
    return None


def record_key(image: str, wheels: Sequence[str], command: str, environment: Mapping[str, str]) -> str:
    payload = json.dumps({"v": RECORD_VERSION, "image": image, "wheels": sorted(wheels), "command": command,
                          "env": dict(sorted(environment.items()))}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def pip_writes(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
               ) -> tuple[list[str], list[str]]:
    """What changed between two stamped diffs outside scratch and the workspace: (written paths, parents first;
    deleted paths)."""
    old = {str(c["Path"]): (c.get("Kind"), c.get("Stamp")) for c in before}
    written: list[str] = []
    deleted: list[str] = []
    for change in after:
        path = str(change["Path"])
        if _under(path, NOT_RECORDED) or old.get(path) == (change.get("Kind"), change.get("Stamp")):
            continue
        if change.get("Kind") == 2:
            deleted.append(path)
        elif not (change.get("Stamp") is None and path in old):  # a directory that merely holds new entries
            written.append(path)
    return sorted(written), sorted(deleted)


@dataclass(frozen=True)
class InstallRecord:
    """One recorded install step: its official result and the files it left."""

    returncode: int
    output: str
    deleted: tuple[str, ...]
    archive: Path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class InstallCache:
    """Records on disk, one directory per key: ``record.json`` and ``files.tar`` (written whole, then renamed)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def load(self, key: str) -> InstallRecord | None:
        directory = self.root / key
        try:
            data = json.loads((directory / "record.json").read_text())
            archive = directory / "files.tar"
            if data.get("v") != RECORD_VERSION or not archive.is_file():
                return None
            if _sha256(archive) != data["files_sha256"]:
                log.warning("install record %s does not match its own digest: not replayed", directory)
                return None
            return InstallRecord(int(data["returncode"]), str(data["output"]),
                                 tuple(str(p) for p in data["deleted"]), archive)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def staging(self) -> Path:
        """A fresh directory under the root for a record being written."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))

    def commit(self, key: str, staging: Path, *, returncode: int, output: str, deleted: Sequence[str]) -> None:
        (staging / "record.json").write_text(json.dumps({
            "v": RECORD_VERSION, "returncode": returncode, "output": output, "deleted": list(deleted),
            "files_sha256": _sha256(staging / "files.tar")}))
        target = self.root / key
        if target.exists() and self.load(key) is None:
            shutil.rmtree(target, ignore_errors=True)  # a damaged record (its digest failed): this one replaces it
        try:
            os.rename(staging, target)
        except OSError:  # another worker recorded it first: theirs stays
            shutil.rmtree(staging, ignore_errors=True)
