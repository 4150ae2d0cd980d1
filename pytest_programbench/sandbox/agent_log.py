"""``agent.log`` with a size cap: the agent decides what it prints, so it cannot decide how much disk it takes.

A :class:`CappedLog` appends to the file as output arrives until the file's budget is half spent (the head), then
keeps only the most recent output in memory (the tail, the other half); on ``close`` it writes one line saying how
many bytes were dropped, then the tail. The file therefore never exceeds the cap (plus that one line per writer),
shows the output live while it is small, and keeps both how the run started and how it ended.

The cap is ``PB_AGENT_LOG_MAX`` (a size: ``64m``, ``1g``, bytes; default 64 MiB). It is per file: several writers
of the same ``agent.log`` in turn (set-up command, agent, harness notes) share it.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from pathlib import Path
from types import TracebackType
from typing import IO

from pytest_programbench.core import environment
from pytest_programbench.text.sizes import human

log = logging.getLogger(__name__)

MARKER = "[pytest-programbench] agent.log capped at {limit}: {dropped} bytes of output dropped here (kept the first " \
         "{head} and the last {tail} bytes of this output)"


def agent_log_limit() -> int:
    """The cap in bytes, from ``PB_AGENT_LOG_MAX`` (default 64 MiB)."""
    return environment.AGENT_LOG_MAX.size()


class CappedLog:
    """An append-only binary sink for ``agent.log`` that keeps a head and a tail of what it is given.

    Thread-safe (an output pump writes while the caller may close). ``write`` after ``close`` is ignored.
    """

    def __init__(self, path: Path, *, limit: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        cap = agent_log_limit() if limit is None else limit
        self.path = path
        self.limit = cap
        self._file: IO[bytes] = path.open("ab")
        budget = max(0, cap - self._file.tell())  # what earlier writers of this file left
        self._head_room = budget // 2
        self.head = self._head_room
        self.tail = budget - self._head_room
        self._tail = bytearray()
        self._lock = threading.Lock()
        self.written = 0  # bytes given to write()
        self.dropped = 0  # bytes that will not reach the file
        self.closed = False

    def write(self, data: bytes) -> int:
        size = len(data)
        with self._lock:
            if self.closed:
                return size
            self.written += size
            if self._head_room:
                part = data[: self._head_room]
                self._file.write(part)
                self._file.flush()
                self._head_room -= len(part)
                data = data[len(part):]
            if data:
                self._tail += data
                excess = len(self._tail) - self.tail
                if excess > 0:
                    del self._tail[:excess]
                    self.dropped += excess
        return size

    def text(self, line: str) -> None:
        """A line of the harness's own (it shares the budget)."""
        self.write(line.encode("utf-8", "replace") + (b"" if line.endswith("\n") else b"\n"))

    def flush(self) -> None:
        with self._lock:
            if not self.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                if self.dropped:
                    marker = MARKER.format(limit=human(self.limit), dropped=self.dropped, head=self.head,
                                           tail=self.tail)
                    self._file.write(f"\n{marker}\n".encode())
                self._file.write(bytes(self._tail))
                self._tail.clear()
            finally:
                self._file.close()

    def __enter__(self) -> CappedLog:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def pump(fd: int, sink: CappedLog, stop: threading.Event) -> None:
    """Copy a pipe's read end into ``sink`` until EOF, a read error, or ``stop`` (for a host process's output:
    a grandchild that left the process group may hold the write end open forever)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while not stop.is_set():
        if not poller.poll(200):
            continue
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        sink.write(chunk)
