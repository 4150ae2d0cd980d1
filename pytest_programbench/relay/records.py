"""Records the agent decides the size of, bounded: one record, the file of records, and the memory they take.

The agent chooses what it sends through the relay (paths of 64 KiB, a ``model`` name of megabytes, thousands of
requests a second), so nothing it sends may reach a record unbounded:

* :func:`bounded_line` turns a record into one JSON line of at most ``RECORD_MAX`` bytes: strings are clipped to
  ``FIELD_MAX`` characters with a marker saying how long they were, lists and mappings to ``LIST_MAX`` entries.
* :class:`BoundedJsonl` is a JSON-lines file with a size cap (``PB_MODEL_REQUESTS_MAX``, default 32 MiB): lines go to
  the file as they come until half the cap is spent (the head, readable live), then only the most recent half is kept
  in memory (the tail); ``close`` writes one line saying how many records were dropped, then the tail. The file never
  exceeds the cap plus that line: the disk check before a task counts it (:func:`records_limit`).
* :class:`HeadTail` is the same head-and-tail policy by count, for records kept in memory.
* :func:`request_fields` reads ``model`` and ``stream`` from a request body without parsing it: ``json.loads`` of
  a hostile body (``[[],[],...]``) takes twenty times its size in memory.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

from pytest_programbench.core import environment
from pytest_programbench.text.sizes import human

log = logging.getLogger(__name__)

FIELD_MAX = 1024  # characters of one string in a record
LIST_MAX = 32  # entries of one list or mapping in a record
RECORD_MAX = 4 << 10  # bytes of one line
OMITTED_KEY = "omitted_records"  # the one line that says how many records were dropped

T = TypeVar("T")


def records_limit() -> int:
    """The cap of one ``model-requests.jsonl`` in bytes, from ``PB_MODEL_REQUESTS_MAX`` (default 32 MiB)."""
    return environment.MODEL_REQUESTS_MAX.size()


def clip_text(text: str, limit: int = FIELD_MAX) -> str:
    """``text``, or its first ``limit`` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text)} chars]"


def clip(value: Any, limit: int = FIELD_MAX, entries: int = LIST_MAX) -> Any:
    """A JSON value with every string clipped to ``limit`` characters and every container to ``entries`` entries
    (a clipped container ends with a string saying how many it had)."""
    if isinstance(value, str):
        return clip_text(value, limit)
    if isinstance(value, Mapping):
        items = list(value.items())
        out = {clip_text(str(key), limit): clip(item, limit, entries) for key, item in items[:entries]}
        if len(items) > entries:
            out["..."] = f"[{len(items)} entries]"
        return out
    if isinstance(value, list | tuple):
        kept = [clip(item, limit, entries) for item in value[:entries]]
        return [*kept, f"...[{len(value)} entries]"] if len(value) > entries else kept
    return value if value is None or isinstance(value, bool | int | float) else clip_text(repr(value), limit)


def bounded_line(record: Mapping[str, Any], max_bytes: int = RECORD_MAX) -> str:
    """``record`` as one JSON line (newline included) of at most ``max_bytes`` bytes.

    Clipped as :func:`clip` does; if escaping still makes it too long, clipped harder; a record that cannot fit keeps
    its scalar fields cut short and says how long it was (``clipped_bytes``).
    """
    limit, entries = FIELD_MAX, LIST_MAX
    while True:
        # The record's own fields all stay (they are ours); what the agent filled them with is clipped.
        clipped = {clip_text(str(key), 64): clip(value, limit, entries) for key, value in record.items()}
        line = json.dumps(clipped, separators=(",", ":")) + "\n"
        if len(line.encode()) <= max_bytes or limit <= 16:
            break
        limit, entries = limit // 4, max(1, entries // 4)
    if len(line.encode()) <= max_bytes:
        return line
    slim = {clip_text(str(key), 64): clip_text(value, 16) if isinstance(value, str) else value
            for key, value in list(record.items())[:LIST_MAX]
            if value is None or isinstance(value, str | bool | int | float)}
    slim["clipped_bytes"] = len(line.encode())
    line = json.dumps(slim, separators=(",", ":")) + "\n"
    return line if len(line.encode()) <= max_bytes else json.dumps({"clipped_bytes": slim["clipped_bytes"]}) + "\n"


class HeadTail(Generic[T]):
    """The first ``head`` items and the last ``tail`` ones, with the count of those dropped in between."""

    def __init__(self, head: int, tail: int) -> None:
        self.head: list[T] = []
        self.tail: collections.deque[T] = collections.deque(maxlen=max(0, tail))
        self._head_max = max(0, head)
        self.omitted = 0

    def add(self, item: T) -> None:
        if len(self.head) < self._head_max:
            self.head.append(item)
            return
        if self.tail.maxlen == 0 or len(self.tail) == self.tail.maxlen:
            self.omitted += 1
        self.tail.append(item)

    def items(self) -> list[T]:
        return [*self.head, *self.tail]


class BoundedJsonl:
    """An append-only JSON-lines file with a size cap, a head written as it comes and a tail written at close.

    Thread-safe; ``write`` after ``close`` is ignored. ``written``: records given; ``omitted``: records that will
    not reach the file (known for certain after ``close``).
    """

    def __init__(self, path: Path, *, limit: int | None = None, record_max: int = RECORD_MAX) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.limit = records_limit() if limit is None else limit
        self.record_max = record_max
        self._file: IO[str] | None = path.open("a", encoding="utf-8")
        budget = max(0, self.limit - self._file.tell())  # what an earlier writer of this file left
        self._head_room = budget // 2
        self._tail_room = budget - self._head_room
        self._tail: collections.deque[str] = collections.deque()
        self._tail_bytes = 0
        self._lock = threading.Lock()
        self.written = 0
        self.omitted = 0
        self.omitted_bytes = 0
        self.head_records = 0

    def write(self, record: Mapping[str, Any]) -> None:
        line = bounded_line(record, self.record_max)
        size = len(line.encode())
        with self._lock:
            if self._file is None:
                return
            self.written += 1
            if size <= self._head_room:
                self._head_room -= size
                self.head_records += 1
                self._file.write(line)
                self._file.flush()  # the head is read live (progress, tokens so far)
                return
            self._head_room = 0  # the head is over: later lines never jump the tail
            self._tail.append(line)
            self._tail_bytes += size
            while self._tail_bytes > self._tail_room and self._tail:
                dropped = self._tail.popleft()
                self._tail_bytes -= len(dropped.encode())
                self.omitted += 1
                self.omitted_bytes += len(dropped.encode())

    def close(self) -> None:
        """Write the line saying what was dropped (when anything was) and the tail. Idempotent."""
        with self._lock:
            handle, self._file = self._file, None
            if handle is None:
                return
            try:
                if self.omitted:
                    handle.write(json.dumps({
                        OMITTED_KEY: self.omitted, "omitted_bytes": self.omitted_bytes,
                        "note": f"{self.path.name} capped at {human(self.limit)} (PB_MODEL_REQUESTS_MAX): "
                                f"{self.omitted} records dropped here; kept the first {self.head_records} and the "
                                f"last {len(self._tail)}"}, separators=(",", ":")) + "\n")
                handle.writelines(self._tail)
                self._tail.clear()
            finally:
                handle.close()


# -- what a request body says about itself, without parsing it -------------------------------------------------

# A JSON string (escapes included) or a structural character; everything else (numbers, literals, blanks) is skipped.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]:,]')
_SCAN_TOKENS = 200_000  # a body with more tokens than this before its model is found keeps its secret


def request_fields(body: bytes) -> tuple[str | None, bool | None]:
    """The top-level ``model`` (a string, clipped) and ``stream`` (a boolean) of a JSON object body.

    Scans tokens without building the document: memory stays at the body's size whatever it holds, and time is
    bounded by ``_SCAN_TOKENS``. Anything else (not an object, a value of another type) gives ``None``.
    """
    start = len(body) - len(body.lstrip())
    if body[start:start + 1] != b"{":
        return None, None
    model: str | None = None
    stream: bool | None = None
    depth = 0
    key: bytes | None = None
    expect_key = False
    for count, match in enumerate(_TOKEN.finditer(body, start)):
        if count >= _SCAN_TOKENS or (model is not None and stream is not None):
            break
        token = match.group()
        if token in (b"{", b"["):
            depth += 1
            expect_key = depth == 1 and token == b"{"
            key = None
        elif token in (b"}", b"]"):
            depth -= 1
            if depth <= 0:
                break
        elif depth != 1:
            continue
        elif token == b",":
            expect_key, key = True, None
        elif token == b":":
            if key == b'"stream"':
                stream = _boolean_at(body, match.end())
            expect_key = False
        elif expect_key:
            key = token
        elif key == b'"model"' and token.startswith(b'"'):
            model = _model_text(token)
            key = None
    return model, stream


def _boolean_at(body: bytes, end: int) -> bool | None:
    """The literal ``true`` or ``false`` after a colon at ``end`` (blanks skipped), ``None`` for anything else."""
    literal = body[end:end + 16].lstrip()
    return True if literal.startswith(b"true") else False if literal.startswith(b"false") else None


def _model_text(token: bytes) -> str | None:
    """The model's string token decoded and clipped; a very long one decoded from its head and said so; ``None``
    for a token that does not decode."""
    try:
        value = json.loads(token[:FIELD_MAX * 8] + (b'"' if len(token) > FIELD_MAX * 8 else b""))
    except ValueError:
        value = None
    model = clip_text(value) if isinstance(value, str) else None
    if len(token) > FIELD_MAX * 8:
        model = f"{(model or '')[:FIELD_MAX]}...[{len(token) - 2} bytes]"
    return model
