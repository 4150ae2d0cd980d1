"""Step 2 of the pipeline: a task's hidden test archives, ``<id>/tests/<branch>.tar.gz``.

Sources, first match wins per task:

1. ``--pb-blob-dir`` / ``$PROGRAMBENCH_BLOB_DIR``: ``<dir>/<id>/tests/<branch>.tar.gz`` (the official layout);
2. the task dir's unpacked ``tests/<branch>/`` trees, packed deterministically into a cache;
3. the Hugging Face dataset ``programbench.constants.HF_REPO_ID`` (packaged tasks only), one file per branch via
   ``huggingface_hub.hf_hub_download`` under a file lock so xdist workers fetch each file once; with
   ``HF_HUB_OFFLINE=1`` only what the cache already holds.

The result is a :class:`BlobSet`: the ``<id>`` directory the official ``Evaluator`` takes as ``blob_dir`` and the
sha256 of every branch archive. Anything missing is a :class:`BlobError` (an infrastructure error) naming the
branch and where it was looked for.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock
from programbench.constants import HF_REPO_ID, HF_REVISION

from pytest_programbench.core import environment
from pytest_programbench.core.cache import cache_root
from pytest_programbench.core.memo import Memo
from pytest_programbench.tasks.catalogue import Task

# What the test bed's packer leaves out of a branch tree (bytecode, caches, stale results).
PACK_EXCLUDE_NAMES = frozenset({"__pycache__", ".pytest_cache", "results.xml"})
PACK_EXCLUDE_SUFFIXES = (".pyc",)


class BlobError(Exception):
    """A hidden test archive is missing or unreadable: an infrastructure error, never a score."""


@dataclass(frozen=True)
class BlobSet:
    """The archives of one task: ``directory / "tests" / f"{branch}.tar.gz"`` for every branch in ``sha256``."""

    instance_id: str
    directory: Path
    sha256: Mapping[str, str]
    source: str  # "blob-dir" | "task-dir" | "huggingface"
    origins: Mapping[str, str] = field(default_factory=dict)  # branch -> where it came from (for messages)

    def archive(self, branch: str) -> Path:
        return self.directory / "tests" / f"{branch}.tar.gz"

    @property
    def branches(self) -> tuple[str, ...]:
        return tuple(self.sha256)


_hashes: Memo[tuple[str, int, int, int], str] = Memo()


def sha256_file(path: Path) -> str:
    """sha256 of a file, memoised by (path, size, mtime, inode) so repeated items do not re-read big archives."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)

    def digest() -> str:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    return _hashes.get(key, digest)


def _check_archive(path: Path, branch: str) -> None:
    if not path.is_file():
        raise BlobError(f"hidden tests of branch {branch}: {path} is not a file")
    try:
        with path.open("rb") as f:
            if f.read(2) != b"\x1f\x8b":
                raise BlobError(f"hidden tests of branch {branch}: {path} is not a gzip file")
    except OSError as exc:
        raise BlobError(f"hidden tests of branch {branch}: cannot read {path} ({exc})") from exc


def _from_blob_dir(task: Task, branches: Sequence[str], blob_dir: Path) -> BlobSet | None:
    directory = blob_dir / task.instance_id
    if not (directory / "tests").is_dir():
        return None
    missing = [b for b in branches if not (directory / "tests" / f"{b}.tar.gz").exists()]
    if missing:
        raise BlobError(
            f"{task.instance_id}: blob dir {blob_dir} lacks the hidden tests of branch(es) {', '.join(missing)} "
            f"(expected {directory / 'tests' / (missing[0] + '.tar.gz')})"
        )
    return _finish(task, branches, directory, "blob-dir")


def _finish(task: Task, branches: Sequence[str], directory: Path, source: str) -> BlobSet:
    digests: dict[str, str] = {}
    origins: dict[str, str] = {}
    for branch in branches:
        path = directory / "tests" / f"{branch}.tar.gz"
        _check_archive(path, branch)
        digests[branch] = sha256_file(path)
        origins[branch] = str(path)
    return BlobSet(task.instance_id, directory, digests, source, origins)


# ----------------------------------------------------------------------------------------------- task dir trees


def _tree_entries(root: Path) -> Iterable[Path]:
    """Every path under ``root`` in a stable order, excluded names pruned."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in PACK_EXCLUDE_NAMES)
        here = Path(dirpath)
        # Symlinked directories appear in dirnames but os.walk does not descend: pack them as links.
        for name in sorted([*filenames, *(d for d in dirnames if (here / d).is_symlink())]):
            if name in PACK_EXCLUDE_NAMES or name.endswith(PACK_EXCLUDE_SUFFIXES):
                continue
            yield here / name
        for d in dirnames:
            if not (here / d).is_symlink():
                yield here / d


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(_tree_entries(root)):
        rel = path.relative_to(root).as_posix()
        st = path.lstat()
        digest.update(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{st.st_mode & 0o111}\0".encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def pack_tree(root: Path, out: Path) -> None:
    """A deterministic ``.tar.gz`` of ``root`` (archive root ``.``; sorted; mtime 0; root-owned; u+rwX,go=rX)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
            tar.addfile(_normalise(tar.gettarinfo(str(root), arcname=".")))
            for path in sorted(_tree_entries(root)):
                info = _normalise(tar.gettarinfo(str(path), arcname="./" + path.relative_to(root).as_posix()))
                if info.isreg():
                    with path.open("rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
        with tmp.open("wb") as out_file, gzip.GzipFile(filename="", mode="wb", fileobj=out_file, mtime=0,
                                                      compresslevel=9) as gz:
            gz.write(raw.getvalue())
        tmp.chmod(0o644)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if info.isdir() or info.mode & 0o100:
        info.mode = 0o755
    elif not info.issym():
        info.mode = 0o644
    return info


def _from_task_dir(task: Task, branches: Sequence[str], cache: Path) -> BlobSet | None:
    tests_root = task.task_dir / "tests"
    trees = {b: tests_root / b for b in branches}
    if not any(t.is_dir() for t in trees.values()):
        return None
    missing = [b for b, t in trees.items() if not t.is_dir()]
    if missing:
        raise BlobError(
            f"{task.instance_id}: task dir {task.task_dir} has tests/ but not the tree of branch(es) "
            f"{', '.join(missing)} (expected {trees[missing[0]]}/)"
        )
    key = hashlib.sha256("".join(f"{b}:{_tree_digest(trees[b])};" for b in branches).encode()).hexdigest()[:16]
    directory = cache / "task-dir-blobs" / task.instance_id / key / task.instance_id
    done = directory / ".complete"
    if not done.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(directory.parent) + ".lock"):
            if not done.exists():
                for branch, tree in trees.items():
                    pack_tree(tree, directory / "tests" / f"{branch}.tar.gz")
                done.write_text("\n".join(branches) + "\n")
    return _finish(task, branches, directory, "task-dir")


# ----------------------------------------------------------------------------------------------- Hugging Face


def _from_huggingface(task: Task, branches: Sequence[str], cache: Path, environ: Mapping[str, str]) -> BlobSet:
    offline = environment.HF_HUB_OFFLINE.true(environ)
    try:
        from huggingface_hub import hf_hub_download  # noqa: PLC0415 - lazy: huggingface_hub, for Hub archives only
        from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415 - lazy: huggingface_hub, for Hub archives only
    except ImportError as exc:
        raise BlobError(f"{task.instance_id}: huggingface_hub is not installed ({exc})") from exc
    locks = cache / "hf-locks"
    locks.mkdir(parents=True, exist_ok=True)
    directory: Path | None = None
    for branch in branches:
        filename = f"{task.instance_id}/tests/{branch}.tar.gz"
        with FileLock(str(locks / f"{task.instance_id}.{branch}.lock")):
            try:
                local = Path(hf_hub_download(HF_REPO_ID, filename, repo_type="dataset",
                                             revision=HF_REVISION or None, local_files_only=offline))
            except LocalEntryNotFoundError as exc:
                how = ("HF_HUB_OFFLINE=1 and the Hugging Face cache does not hold it" if offline
                       else f"download failed ({exc})")
                raise BlobError(f"{task.instance_id}: hidden tests of branch {branch} ({HF_REPO_ID}:{filename}): "
                                f"{how}; or pass --pb-blob-dir DIR with {filename}") from exc
            except Exception as exc:
                raise BlobError(f"{task.instance_id}: hidden tests of branch {branch} ({HF_REPO_ID}:{filename}) "
                                f"could not be fetched: {type(exc).__name__}: {exc}; or pass --pb-blob-dir DIR "
                                f"with {filename}") from exc
        here = local.parent.parent
        if directory is None:
            directory = here
        elif here.resolve() != directory.resolve():
            # Different snapshots (a revision moved between files): gather the files in one directory.
            directory = _gather(task, branches, cache, directory, here)
    assert directory is not None
    return _finish(task, branches, directory, "huggingface")


def _gather(task: Task, branches: Sequence[str], cache: Path, *dirs: Path) -> Path:
    target = cache / "hf-gathered" / task.instance_id / "tests"
    target.mkdir(parents=True, exist_ok=True)
    for d in dirs:
        for archive in (d / "tests").glob("*.tar.gz"):
            if archive.name[: -len(".tar.gz")] in branches:
                shutil.copyfile(archive, target / archive.name)
    return target.parent


# ----------------------------------------------------------------------------------------------- entry point


def resolve_blobs(
    task: Task,
    branches: Sequence[str],
    *,
    blob_dir: Path | str | None = None,
    cache_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> BlobSet:
    """The archives of ``branches`` (normally the task's active branches) with their sha256."""
    env = os.environ if environ is None else environ
    if not branches:
        raise BlobError(f"{task.instance_id}: no active test branches to fetch hidden tests for")
    cache = cache_dir or cache_root(env)
    looked: list[str] = []
    if blob_dir:
        found = _from_blob_dir(task, branches, Path(blob_dir))
        if found is not None:
            return found
        looked.append(f"blob dir {Path(blob_dir) / task.instance_id / 'tests'}")
    found = _from_task_dir(task, branches, cache)
    if found is not None:
        return found
    looked.append(f"task dir {task.task_dir / 'tests'}")
    if not task.packaged:
        raise BlobError(
            f"{task.instance_id}: no hidden tests found (looked in {'; '.join(looked)}); tasks from --pb-tasks-dir "
            f"need tests/<branch>/ trees or --pb-blob-dir DIR with {task.instance_id}/tests/<branch>.tar.gz"
        )
    return _from_huggingface(task, branches, cache, env)
