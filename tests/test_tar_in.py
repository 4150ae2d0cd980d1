"""The one tar-in helper: what the archive says (owners, modes, types, times) is what the engine unpacks."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

from pytest_programbench.engine.tar_in import TarIn


def members(archive: TarIn) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(archive.getvalue())) as tar:
        return {m.name: m for m in tar.getmembers()}


def test_directories_files_and_owners() -> None:
    archive = (TarIn().directory("/var/lib/x", 0o700)
               .file("/var/lib/x/a", b"abc", 0o600, uid=1777, gid=1778)
               .file("b", io.BytesIO(b"0123456789"), 0o755, size=10, mtime=12345))
    found = members(archive)
    assert list(found) == ["var/lib/x", "var/lib/x/a", "b"]  # relative to the destination, in order
    assert found["var/lib/x"].isdir()
    assert found["var/lib/x"].mode == 0o700
    a = found["var/lib/x/a"]
    assert (a.isfile(), a.size, a.mode, a.uid, a.gid) == (True, 3, 0o600, 1777, 1778)
    assert a.mtime > 0
    assert (found["b"].size, found["b"].mode, found["b"].mtime, found["b"].uid) == (10, 0o755, 12345, 0)


def test_a_tree_keeps_links_and_takes_a_filter(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    os.symlink("f", tmp_path / "d" / "link")
    (tmp_path / "d" / "skip").write_text("y")

    def owned(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.name.endswith("skip"):
            return None
        info.uid = 42
        return info

    found = members(TarIn().tree(tmp_path / "d", "src", owned))
    assert sorted(found) == ["src", "src/f", "src/link"]
    assert found["src/link"].issym()
    assert found["src/link"].linkname == "f"
    assert {m.uid for m in found.values()} == {42}
