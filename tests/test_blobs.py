"""Hidden test archives: blob dir, task-dir trees packed deterministically, Hugging Face offline rules."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from pytest_programbench.tasks.blobs import BlobError, pack_tree, resolve_blobs
from pytest_programbench.tasks.catalogue import Task


def _task(tmp_path: Path, *, packaged: bool = False, instance_id: str = "org__tool.abc1234") -> Task:
    task_dir = tmp_path / "tasks" / instance_id
    task_dir.mkdir(parents=True)
    return Task(instance_id=instance_id, language="c", difficulty="easy", image_name="programbench/x",
                task_dir=task_dir, packaged=packaged)


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _blob(path: Path, payload: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("eval/run.sh")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))


def test_blob_dir_layout_wins(tmp_path: Path) -> None:
    task = _task(tmp_path)
    _tree(task.task_dir / "tests" / "b1", {"eval/run.sh": "from the task dir"})
    blob_dir = tmp_path / "blobs"
    for b in ("b1", "b2"):
        _blob(blob_dir / task.instance_id / "tests" / f"{b}.tar.gz", b.encode())
    blobs = resolve_blobs(task, ["b1", "b2"], blob_dir=blob_dir, cache_dir=tmp_path / "cache")
    assert blobs.source == "blob-dir"
    assert blobs.directory == blob_dir / task.instance_id
    assert blobs.archive("b2") == blob_dir / task.instance_id / "tests" / "b2.tar.gz"
    expected = hashlib.sha256((blob_dir / task.instance_id / "tests" / "b1.tar.gz").read_bytes()).hexdigest()
    assert blobs.sha256["b1"] == expected
    assert blobs.branches == ("b1", "b2")


def test_missing_branch_in_blob_dir_names_it(tmp_path: Path) -> None:
    task = _task(tmp_path)
    blob_dir = tmp_path / "blobs"
    _blob(blob_dir / task.instance_id / "tests" / "b1.tar.gz")
    with pytest.raises(BlobError, match=r"branch\(es\) b2 .*b2\.tar\.gz"):
        resolve_blobs(task, ["b1", "b2"], blob_dir=blob_dir, cache_dir=tmp_path / "cache")


def test_not_a_gzip_is_an_error(tmp_path: Path) -> None:
    task = _task(tmp_path)
    path = tmp_path / "blobs" / task.instance_id / "tests" / "b1.tar.gz"
    path.parent.mkdir(parents=True)
    path.write_text("not gzip")
    with pytest.raises(BlobError, match=r"branch b1: .* is not a gzip file"):
        resolve_blobs(task, ["b1"], blob_dir=tmp_path / "blobs", cache_dir=tmp_path / "cache")


def test_task_dir_trees_are_packed_deterministically(tmp_path: Path) -> None:
    task = _task(tmp_path)
    _tree(task.task_dir / "tests" / "b1", {"eval/run.sh": "#!/bin/bash\n", "eval/tests/test_a.py": "def test(): pass\n",
                                             "eval/tests/__pycache__/test_a.cpython-311.pyc": "junk",
                                             "eval/results.xml": "<stale/>"})
    (task.task_dir / "tests" / "b1" / "eval" / "run.sh").chmod(0o755)
    os.symlink("tests/test_a.py", task.task_dir / "tests" / "b1" / "eval" / "link.py")
    first = resolve_blobs(task, ["b1"], blob_dir=tmp_path / "empty-blob-dir", cache_dir=tmp_path / "cache1")
    second = resolve_blobs(task, ["b1"], cache_dir=tmp_path / "cache2")
    assert first.source == second.source == "task-dir"
    assert first.sha256 == second.sha256
    assert first.directory.name == task.instance_id
    with tarfile.open(first.archive("b1")) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == [".", "./eval", "./eval/link.py", "./eval/run.sh", "./eval/tests",
                               "./eval/tests/test_a.py"]
    assert members["./eval/run.sh"].mode == 0o755
    assert members["./eval/tests/test_a.py"].mode == 0o644
    assert members["./eval/link.py"].issym()
    assert {m.mtime for m in members.values()} == {0}
    assert {(m.uid, m.gid) for m in members.values()} == {(0, 0)}

    # A changed tree gets a new archive, not the stale cached one.
    (task.task_dir / "tests" / "b1" / "eval" / "tests" / "test_a.py").write_text("def test(): assert 0\n")
    third = resolve_blobs(task, ["b1"], cache_dir=tmp_path / "cache1")
    assert third.sha256 != first.sha256


def test_pack_tree_is_byte_stable(tmp_path: Path) -> None:
    _tree(tmp_path / "t", {"eval/run.sh": "x", "eval/a/b.py": "y"})
    pack_tree(tmp_path / "t", tmp_path / "1.tar.gz")
    os.utime(tmp_path / "t" / "eval" / "run.sh", (1, 1))
    pack_tree(tmp_path / "t", tmp_path / "2.tar.gz")
    assert (tmp_path / "1.tar.gz").read_bytes() == (tmp_path / "2.tar.gz").read_bytes()


def test_task_dir_missing_one_branch_tree(tmp_path: Path) -> None:
    task = _task(tmp_path)
    _tree(task.task_dir / "tests" / "b1", {"eval/run.sh": "x"})
    with pytest.raises(BlobError, match=r"not the tree of branch\(es\) b2"):
        resolve_blobs(task, ["b1", "b2"], cache_dir=tmp_path / "cache")


def test_unpackaged_task_without_tests_is_an_error_naming_the_options(tmp_path: Path) -> None:
    task = _task(tmp_path)
    with pytest.raises(BlobError, match="--pb-blob-dir"):
        resolve_blobs(task, ["b1"], blob_dir=tmp_path / "blobs", cache_dir=tmp_path / "cache")


def test_huggingface_offline_uses_only_the_cache(tmp_path: Path) -> None:
    task = _task(tmp_path, packaged=True, instance_id="pbnone__absent.0000000")
    with pytest.raises(BlobError, match="HF_HUB_OFFLINE=1 and the Hugging Face cache does not hold it"):
        resolve_blobs(task, ["b1"], cache_dir=tmp_path / "cache", environ={"HF_HUB_OFFLINE": "1"})


def test_no_branches_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BlobError, match="no active test branches"):
        resolve_blobs(_task(tmp_path), [], cache_dir=tmp_path / "cache")
