"""One path out of a container: docker's ``GET /containers/{id}/archive`` read as a stream, never whole.

:func:`read_one` looks at the first member of the archive (what ``docker cp`` of that path would produce) and reads
its bytes only when it is a regular file within ``max_bytes``; the response is closed on every path, so an early
stop never leaves the engine holding the container's lock. What a container left at a path is the submission's
doing: a FIFO, a device, a sparse file of 200 MB that costs the container nothing, a directory of millions of files.
"""

from __future__ import annotations

import base64
import io
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

TAR_OVERHEAD = 1 << 20  # headers around one member (pax records: long names, xattrs)
CHUNK = 1 << 20

REGULAR = "regular file"
SYMLINK = "symbolic link"
HARDLINK = "hard link"
CHARACTER_DEVICE = "character device"
BLOCK_DEVICE = "block device"
FIFO = "FIFO"
DIRECTORY = "directory"
OTHER = "not a regular file"
SPECIAL = frozenset({CHARACTER_DEVICE, BLOCK_DEVICE, FIFO})  # nodes with no bytes of their own in the archive


class TooLarge(Exception):
    """More bytes than the read allows came from the engine."""


@dataclass(frozen=True)
class Member:
    """The first member of the archive: its kind, its size in the header, its bytes (a regular file within the
    cap only), the link target for links."""

    kind: str
    size: int = 0
    data: bytes | None = None
    linkname: str = ""
    mode: int = 0  # permission bits, as the engine's archive gives them
    uid: int = 0


class CappedStream(io.RawIOBase):
    """A file object over docker's archive chunks that refuses to deliver more than ``limit`` bytes."""

    def __init__(self, chunks: Iterator[bytes], limit: int) -> None:
        self._chunks = iter(chunks)
        self._buffer = b""
        self._seen = 0
        self._limit = limit

    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
            self._seen += len(self._buffer)
            if self._seen > self._limit:
                raise TooLarge(self._seen)
        size = min(len(target), len(self._buffer))
        target[:size] = self._buffer[:size]
        self._buffer = self._buffer[size:]
        return size


def _kind(info: tarfile.TarInfo) -> str:
    if info.issym():
        return SYMLINK
    if info.islnk():
        return HARDLINK
    if info.ischr():
        return CHARACTER_DEVICE
    if info.isblk():
        return BLOCK_DEVICE
    if info.isfifo():
        return FIFO
    if info.isdir():
        return DIRECTORY
    if info.isfile():
        return REGULAR
    return OTHER


def first_member(chunks: Iterator[bytes], max_bytes: int | None) -> Member | None:
    """The archive's first member; its bytes read only for a regular file of at most ``max_bytes`` (None: any).

    Raises :class:`TooLarge` when the stream carries more than the member and its headers may take, and
    ``tarfile.TarError``/``EOFError`` for a stream that is not a tar.
    """
    limit = (max_bytes + TAR_OVERHEAD) if max_bytes is not None else 1 << 62
    with tarfile.open(fileobj=CappedStream(chunks, limit), mode="r|") as tar:
        info = tar.next()
        if info is None:
            return None
        kind = _kind(info)
        if kind != REGULAR or (max_bytes is not None and info.size > max_bytes):
            return Member(kind, info.size, None, info.linkname, info.mode & 0o7777, info.uid)
        handle = tar.extractfile(info)
        assert handle is not None
        return Member(kind, info.size, handle.read(), info.linkname, info.mode & 0o7777, info.uid)


class Archive:
    """``GET /containers/{id}/archive?path=...`` with the response kept, so it can be closed from any thread."""

    def __init__(self, api: Any, container_id: str, path: str) -> None:
        self._api = api
        self._response = api._get(api._url("/containers/{0}/archive", container_id), params={"path": path},
                                  stream=True, headers={"Accept-Encoding": "identity"})

    def check(self) -> dict[str, Any] | None:
        """Raises as docker-py does for an error answer (``NotFound``, ``APIError``); the path's stat."""
        self._api._raise_for_status(self._response)
        header = self._response.headers.get("x-docker-container-path-stat")
        stat: dict[str, Any] | None = json.loads(base64.b64decode(header)) if header else None
        return stat

    def chunks(self) -> Iterator[bytes]:
        chunks: Iterator[bytes] = self._response.iter_content(CHUNK, False)
        return chunks

    def close(self) -> None:
        self._response.close()
