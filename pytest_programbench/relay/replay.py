"""Replay: an agent's model conversation recorded by one run, answered again by the relay of another, offline.

Recording (every run with a relay): each forwarded request and the answer the agent got go to the task's
``model-replay.jsonl``, one line each: method, path, the request body's sha256 and bytes, the status, the headers that
matter to a client (content type and encoding) and the response body's bytes as they went to the agent. The file has a
cap (``PB_MODEL_REPLAY_MAX``, default 64 MiB): past it, exchanges are no longer recorded and one last line says how
many were left out. A replay can only reproduce a prefix of a conversation anyway, so the head is what is kept.

Replaying (``--pb-agent-replay RUN_DIR``): :class:`ReplayUpstream` stands in for the upstream client. A request is
answered from the first recorded exchange not yet used with the same method, path and body hash (so the recording's
order holds among identical requests, and side requests sent in parallel still find theirs); nothing is ever sent
upstream. The first request that matches nothing is the *first mismatch*: it is answered with a 409 the agent sees,
and :attr:`ReplayUpstream.mismatch` says which request it was with a diff against the recorded request at the same
position (the task becomes an error, never a score).
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import IO, Any

import httpx

from pytest_programbench.relay.contract import replay_limit
from pytest_programbench.relay.server import Refusal

log = logging.getLogger(__name__)

_KEPT_HEADERS = ("content-type", "content-encoding")


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class ReplayWriter:
    """Appends exchanges to ``model-replay.jsonl`` until ``limit`` bytes; thread-safe; ``room`` says how many bytes of
    response body may still be captured (so a response past the cap is not held in memory)."""

    def __init__(self, path: Path, limit: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.limit = replay_limit() if limit is None else limit
        self._file: IO[str] | None = path.open("a", encoding="ascii")
        self._left = max(0, self.limit - self._file.tell())
        self._lock = threading.Lock()
        self.omitted = 0

    @property
    def room(self) -> int:
        return self._left * 3 // 4  # base64 takes 4 bytes for 3

    def add(self, method: str, path: str, request: bytes, status: int, headers: httpx.Headers, *,
            response: bytes | None) -> None:
        """``response`` is ``None`` when it did not fit: this exchange and every later one are left out."""
        entry = {"method": method, "path": path, "request_sha256": body_hash(request),
                 "request_b64": base64.b64encode(request).decode(), "status": status,
                 "headers": {name: headers[name] for name in _KEPT_HEADERS if name in headers},
                 "response_b64": None if response is None else base64.b64encode(response).decode()}
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            if response is None or len(line) > self._left:
                self.omitted += 1
                self._left = 0  # a prefix, never a conversation with holes
                return
            self._left -= len(line)
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            handle, self._file = self._file, None
            if handle is None:
                return
            if self.omitted:
                handle.write(json.dumps({"omitted_exchanges": self.omitted,
                                         "note": f"{self.path.name} reached PB_MODEL_REPLAY_MAX "
                                                 f"({self.limit} bytes): a replay stops there"}) + "\n")
            handle.close()


def _pretty(body: bytes) -> list[str]:
    try:
        return json.dumps(json.loads(body), indent=1, sort_keys=True).splitlines()
    except ValueError:
        return body.decode("utf-8", "replace").splitlines()


class ReplayUpstream:
    """The upstream client's stand-in under ``--pb-agent-replay``: answers from a recording, never connects."""

    def __init__(self, recording: Path) -> None:
        self.recording = recording
        self.entries: list[dict[str, Any]] = []
        if recording.is_file():
            for line in recording.read_text(encoding="ascii", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and "request_sha256" in entry:
                    self.entries.append(entry)
        self._used = [False] * len(self.entries)
        self._lock = threading.Lock()
        self.requests = 0
        self.mismatch: str | None = None  # the first request that matched nothing

    def send(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
             attempts: object = None) -> httpx.Response:
        digest = body_hash(body)
        with self._lock:
            position = self.requests
            self.requests += 1
            for index, entry in enumerate(self.entries):
                if (not self._used[index] and entry.get("method") == method and entry.get("path") == path
                        and entry.get("request_sha256") == digest and entry.get("response_b64") is not None):
                    self._used[index] = True
                    return httpx.Response(int(entry["status"]), headers=entry.get("headers") or {},
                                          stream=httpx.ByteStream(base64.b64decode(entry["response_b64"])))
            if self.mismatch is None:
                self.mismatch = self._describe(position, method, path, body)
            message = self.mismatch
        raise Refusal(409, f"replay: {message}")

    def _describe(self, position: int, method: str, path: str, body: bytes) -> str:
        where = f"request {position + 1} ({method} {path[:200]})"
        if position >= len(self.entries):
            return f"{where} goes past the {len(self.entries)} recorded in {self.recording}"
        recorded = self.entries[position]
        old = base64.b64decode(recorded.get("request_b64") or "")
        diff = list(difflib.unified_diff(_pretty(old), _pretty(body), "recorded", "now", n=1, lineterm=""))
        shown = "\n".join(line[:200] for line in diff[:24])
        more = f"\n... ({len(diff) - 24} more diff lines)" if len(diff) > 24 else ""
        head = f"{recorded.get('method')} {str(recorded.get('path'))[:200]}"
        return f"{where} matches no recorded request; the recorded request {position + 1} ({head}) differs:\n" \
               f"{shown}{more}"

    def done(self, response: httpx.Response) -> None:
        response.close()

    def cut(self) -> None:
        pass

    def close(self) -> None:
        pass
