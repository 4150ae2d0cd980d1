"""The output of one command in a container: the hijacked exec connection, read with no timeout.

A command's window ends when the command exits or its own clock fires. It must never end because its connection was
quiet: the engine client's socket timeout (``PB_DOCKER_API_TIMEOUT``, 300 s) is for request/response calls, and a
reasoning model's single call, a quiet build or a long test run inside the agent can be silent for longer. So the
socket is switched to blocking reads here, and whoever owns the stream stops it by :meth:`ExecStream.shutdown`
(its watchdog, when the command's clock fired) instead of by a read timeout.

The engine answers ``exec_start`` with ``101 UPGRADED`` and may send the first frames in the same write:
``http.client`` has then already buffered them while parsing the headers (docker-py issues 425 and 3332). They are
taken from that buffer first, so a short command's output is never lost.

Over ``ssh://`` (docker-py's ``SSHSocket``: the system's ``ssh`` running ``docker system dial-stdio``) the
connection is a pair of pipes: reads already go through the buffered reader, a half-close is closing ssh's stdin,
and unblocking a reader is ending ssh.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator
from typing import Any

STDOUT, STDERR = 1, 2
_HEADER = struct.Struct(">BxxxL")
_CHUNK = 1 << 16


def _buffered_reader(sock: Any) -> Any | None:
    """The ``BufferedReader`` that parsed the 101 response (docker-py keeps the response on the socket)."""
    response = getattr(sock, "_response", None)
    raw = getattr(response, "raw", None)
    http_response = getattr(raw, "_fp", None)
    return getattr(http_response, "fp", None)


class ExecStream:
    """Demultiplexed frames of one exec connection (as returned by ``APIClient.exec_start(socket=True)``)."""

    def __init__(self, sock: Any) -> None:
        self._holder = sock  # keeps the HTTP response, and so the connection, alive
        self.raw: socket.socket = getattr(sock, "_sock", sock)
        self._ssh = getattr(self.raw, "proc", None)  # SSHSocket: the ssh process whose pipes carry the stream
        self._pending = bytearray(b"" if self._ssh is not None else self._take_buffered())
        with contextlib.suppress(OSError, AttributeError):
            self.raw.settimeout(None)  # quiet is not the end: see the module docstring

    def _take_buffered(self) -> bytes:
        reader = _buffered_reader(self._holder)
        if reader is None or not hasattr(self.raw, "setblocking"):
            return b""
        try:
            self.raw.setblocking(False)  # only what is already buffered: never wait here
            data = reader.read1(1 << 20)
        except (OSError, ValueError):
            data = b""
        finally:
            with contextlib.suppress(OSError):
                self.raw.settimeout(None)
        return bytes(data or b"")

    def _recv(self, size: int) -> bytes:
        if self._pending:
            data = bytes(self._pending[:size])
            del self._pending[:size]
            return data
        return self.raw.recv(size)

    def _recv_exact(self, size: int) -> bytes | None:
        chunks = []
        while size:
            chunk = self._recv(min(size, _CHUNK))
            if not chunk:
                return None
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def frames(self) -> Iterator[tuple[int, bytes]]:
        """``(stream, payload)`` until the engine closes the connection or :meth:`shutdown` is called.

        An ``OSError`` ends the iteration like EOF does: the caller asks the engine whether the command ended.
        """
        try:
            while True:
                header = self._recv_exact(_HEADER.size)
                if header is None:
                    return
                kind, length = _HEADER.unpack(header)
                payload = self._recv_exact(length) if length else b""
                if payload is None:
                    return
                yield kind, payload
        except OSError:
            return

    def write(self, data: bytes) -> None:
        """Write ``data`` to the command's stdin (it stays open). ``OSError`` when the other side is gone."""
        try:
            self.raw.sendall(data)
        except OSError:
            raise
        except Exception as exc:  # SSHSocket says "not initiated" once its pipe is closed
            raise BrokenPipeError(str(exc)) from exc

    def close_stdin(self) -> None:
        """EOF on the command's stdin; its output can still be read."""
        if self._ssh is not None:
            with contextlib.suppress(Exception):
                self._ssh.stdin.close()  # dial-stdio passes the half-close on to the engine
            return
        with contextlib.suppress(OSError):
            self.raw.shutdown(socket.SHUT_WR)

    def send(self, data: bytes) -> None:
        """Write ``data`` to the command's stdin and close it (EOF)."""
        try:
            self.write(data)
        finally:
            self.close_stdin()

    def shutdown(self) -> None:
        """Unblock a reader in :meth:`frames` (it then ends)."""
        if self._ssh is not None:
            with contextlib.suppress(Exception):
                self._ssh.kill()  # the reader's pipe then ends
            return
        with contextlib.suppress(OSError):
            self.raw.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        for closer in (getattr(self._holder, "close", None), self.raw.close):
            if closer is not None:
                with contextlib.suppress(Exception):  # best effort on a connection we abandon
                    closer()
