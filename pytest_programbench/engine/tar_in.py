"""Files into a container: one tar built in memory with ``tarfile``, sent with docker-py's ``put_archive``.

The engine unpacks it at the destination as root, taking owners and modes from the archive; missing parents of an
entry are created root-owned. Streaming a big on-disk archive, or a tar unpacked by the container's own ``tar``
(the evaluation's ``copy_in_tar``, which must keep escaping symlinks like the official harness), is not this.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


class TarIn:
    """``TarIn().directory("d", 0o700).file("d/f", b"...", 0o600).put(api, container_id, "/")``."""

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buffer, mode="w")  # noqa: SIM115 (closed by getvalue)
        self._done = False
        self._mtime = int(time.time())

    def directory(self, name: str, mode: int = 0o755, *, uid: int = 0, gid: int = 0) -> TarIn:
        info = self._info(name, mode, uid, gid, self._mtime)
        info.type = tarfile.DIRTYPE
        self._tar.addfile(info)
        return self

    def file(self, name: str, data: bytes | IO[bytes], mode: int = 0o644, *, uid: int = 0, gid: int = 0,
             size: int | None = None, mtime: int | None = None) -> TarIn:
        """A regular file from bytes, or from an open binary file of ``size`` bytes (read as it is added)."""
        info = self._info(name, mode, uid, gid, self._mtime if mtime is None else mtime)
        if isinstance(data, bytes):
            info.size = len(data)
            self._tar.addfile(info, io.BytesIO(data))
        else:
            if size is None:
                raise ValueError("a file object needs its size")
            info.size = size
            self._tar.addfile(info, data)
        return self

    def tree(self, source: Path, name: str,
             entry: Callable[[tarfile.TarInfo], tarfile.TarInfo | None] | None = None) -> TarIn:
        """``source`` (a file or a whole directory, symlinks kept as links) as ``name``; ``entry`` may rewrite or
        drop (``None``) each member, e.g. to set its owner."""
        self._tar.add(source, arcname=name, filter=entry)
        return self

    def getvalue(self) -> bytes:
        """The finished archive (no entries can be added afterwards)."""
        if not self._done:
            self._tar.close()
            self._done = True
        return self._buffer.getvalue()

    def put(self, api: Any, container_id: str, dest: str) -> bool:
        """Unpack into ``dest`` (an existing directory) of the container; False when the engine refuses."""
        return bool(api.put_archive(container_id, dest, self.getvalue()))

    @staticmethod
    def _info(name: str, mode: int, uid: int, gid: int, mtime: int) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.mode, info.uid, info.gid, info.mtime = mode, uid, gid, mtime
        return info
