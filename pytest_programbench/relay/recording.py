"""Recording: one :class:`RelayRecord` per request through the relay, the :class:`RelayStats` they add up to, and the
:class:`Recorder` that keeps both (in memory, head and tail, and as lines of the task's ``model-requests.jsonl``,
bounded by ``records.py``). No record ever contains a header value, so no key reaches the records.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_programbench.relay.apis import api_of
from pytest_programbench.relay.metering import Usage
from pytest_programbench.relay.records import BoundedJsonl, HeadTail, clip_text
from pytest_programbench.relay.upstream import Attempts

log = logging.getLogger(__name__)

#: Records kept in memory (:meth:`Recorder.records`): the first and the last half of this many.
RECORDS_IN_MEMORY = 2000


def _sum(*values: int | None) -> int | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


@dataclass(frozen=True)
class RelayRecord:
    """One request through the relay. ``status`` is what the client got (the relay's own 4xx/5xx included);
    latencies run from the moment the request was read in full; ``first_byte_s`` is the first response body byte
    (the headers when there is no body); ``error`` says why the exchange went wrong, ``None`` when it did not."""

    started_at: str
    listener: str
    method: str
    path: str
    status: int
    model: str | None
    stream: bool | None
    api: str | None
    first_byte_s: float | None
    total_s: float
    request_bytes: int
    response_bytes: int
    usage: Usage | None
    error: str | None
    tool_calls: int | None = None  # in the response, when it was a readable model API response
    # The tries before the answer (upstream.Attempts): {"attempt", "status", "error", "wait_s"} each.
    retried: tuple[dict[str, Any], ...] = ()
    retry_wait_s: float = 0.0
    slot_wait_s: float = 0.0  # waiting for a --pb-model-concurrency slot
    rate_wait_s: float = 0.0  # waiting for --pb-model-rpm / --pb-model-tpm
    gave_up: bool = False  # the retry budget ran out: the last transient failure went to the agent
    rejected: bool = False  # the upstream answered 401/403 (the relay's own probe decides whether the key was at fault)
    stream_broken: bool = False  # the upstream broke off after bytes went to the agent (not retryable)
    cleanroom_refused: str | None = None  # what the cleanroom relay refused (apis.py), never sent upstream

    @property
    def failed(self) -> bool:
        return self.error is not None or self.status >= 400

    def as_dict(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "listener": self.listener, "method": self.method, "path": self.path,
                "status": self.status, "model": self.model, "stream": self.stream, "api": self.api,
                "first_byte_s": self.first_byte_s, "total_s": self.total_s, "request_bytes": self.request_bytes,
                "response_bytes": self.response_bytes, "usage": None if self.usage is None else self.usage.as_dict(),
                "error": self.error, "tool_calls": self.tool_calls, "retries": list(self.retried),
                "retry_wait_s": self.retry_wait_s, "slot_wait_s": self.slot_wait_s, "rate_wait_s": self.rate_wait_s,
                "gave_up": self.gave_up,
                "rejected": self.rejected,
                "stream_broken": self.stream_broken,
                "cleanroom_refused": self.cleanroom_refused}


_MODEL_APIS = frozenset({"chat.completions", "responses", "anthropic.messages", "completions"})


@dataclass
class RelayStats:
    """The aggregate of a relay's records. Token sums are ``None`` when no request reported them."""

    requests: int = 0
    errors: int = 0
    requests_with_usage: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    latency_s: float = 0.0
    turns: int = 0  # answered model API requests (chat, responses, messages, completions)
    tool_calls: int = 0  # tool calls in the model's responses
    cached_input_tokens: int | None = None
    model_latency_s: float = 0.0  # time in answered model API requests, first byte to last
    retries: int = 0  # tries again after a transient failure, before the answer went to the agent
    retry_wait_s: float = 0.0  # seconds spent waiting between those tries
    slot_wait_s: float = 0.0  # seconds spent waiting for a --pb-model-concurrency slot
    rate_wait_s: float = 0.0  # seconds spent waiting for --pb-model-rpm / --pb-model-tpm
    gave_up: int = 0  # requests whose retry budget ran out
    rejected: int = 0  # requests the upstream answered 401/403
    stream_breaks: int = 0  # responses the upstream broke off after bytes went to the agent
    cleanroom_refused: int = 0  # requests the cleanroom relay refused (provider-side tools, other APIs)

    def add(self, record: RelayRecord) -> None:
        self.requests += 1
        self.errors += record.failed
        self.latency_s += record.total_s
        self.retries += len(record.retried)
        self.retry_wait_s += record.retry_wait_s
        self.slot_wait_s += record.slot_wait_s
        self.rate_wait_s += record.rate_wait_s
        self.gave_up += record.gave_up
        self.rejected += record.rejected
        self.stream_breaks += record.stream_broken
        self.cleanroom_refused += record.cleanroom_refused is not None
        if record.api in _MODEL_APIS and not record.failed:
            self.turns += 1
            self.model_latency_s += record.total_s
            self.tool_calls += record.tool_calls or 0
        if record.usage is not None:
            self.requests_with_usage += 1
            self.input_tokens = _sum(self.input_tokens, record.usage.input_tokens)
            self.output_tokens = _sum(self.output_tokens, record.usage.output_tokens)
            self.total_tokens = _sum(self.total_tokens, record.usage.total_tokens)
            self.cached_input_tokens = _sum(self.cached_input_tokens, record.usage.cached_input_tokens)

    def as_dict(self) -> dict[str, int | float | None]:
        """Plain builtins only: safe for ``user_properties`` across xdist and for pb-meta.json."""
        return {"requests": self.requests, "errors": self.errors, "requests_with_usage": self.requests_with_usage,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.total_tokens, "latency_s": round(self.latency_s, 6), "turns": self.turns,
                "tool_calls": self.tool_calls, "cached_input_tokens": self.cached_input_tokens,
                "model_latency_s": round(self.model_latency_s, 6), "retries": self.retries,
                "retry_wait_s": round(self.retry_wait_s, 3), "slot_wait_s": round(self.slot_wait_s, 3),
                "rate_wait_s": round(self.rate_wait_s, 3),
                "gave_up": self.gave_up, "rejected": self.rejected,
                "stream_breaks": self.stream_breaks, "cleanroom_refused": self.cleanroom_refused}


class Exchange:
    """Book-keeping of one request on its way through."""

    def __init__(self, listener: str, method: str, target: str) -> None:
        self.t0 = time.monotonic()
        self.started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        self.listener = listener
        self.method = method
        self.path = target if target.startswith("/") else target[:200]
        self.status = 0
        self.model: str | None = None
        self.stream: bool | None = None
        self.first_byte_s: float | None = None
        self.request_bytes = 0
        self.response_bytes = 0
        self.usage: Usage | None = None
        self.error: str | None = None
        self.tool_calls: int | None = None
        self.held = 0  # bytes of the relay's budget this request holds (its body), given back when it ends
        self.attempts = Attempts()
        self.rejected = False
        self.stream_broken = False
        self.captured: bytearray | None = None  # the response body as it went out, for model-replay.jsonl
        self.cleanroom: str | None = None  # what the cleanroom relay refused
        self.head: bytearray | None = None  # the first bytes of a 400's body (agent_loop.refuses_client)

    def mark_first_byte(self) -> None:
        if self.first_byte_s is None:
            self.first_byte_s = round(time.monotonic() - self.t0, 6)

    def record(self) -> RelayRecord:
        # The agent chose the path, the method and the model: clipped, so that no record is larger than a few KiB.
        return RelayRecord(self.started_at, self.listener, clip_text(self.method, 64), clip_text(self.path),
                           self.status, None if self.model is None else clip_text(self.model, 256), self.stream,
                           api_of(self.path), self.first_byte_s, round(time.monotonic() - self.t0, 6),
                           self.request_bytes, self.response_bytes, self.usage,
                           None if self.error is None else clip_text(self.error), self.tool_calls,
                           tuple(self.attempts.tries), self.attempts.waited_s, self.attempts.slot_wait_s,
                           self.attempts.rate_wait_s, self.attempts.gave_up, self.rejected, self.stream_broken,
                           None if self.cleanroom is None else clip_text(self.cleanroom, 256))



class Recorder:
    """The records of one relay: in memory (head and tail), summed, and one bounded line each in ``path``."""

    def __init__(self, path: Path | None, limit: int | None = None) -> None:
        self.path = path
        self._limit = limit
        self._lock = threading.Lock()
        self._records: HeadTail[RelayRecord] = HeadTail(RECORDS_IN_MEMORY // 2, RECORDS_IN_MEMORY // 2)
        self._stats = RelayStats()
        self._file: BoundedJsonl | None = None

    def open(self) -> None:
        if self.path is not None:
            self._file = BoundedJsonl(self.path, limit=self._limit)

    def add(self, exchange: Exchange) -> RelayRecord:
        record = exchange.record()
        with self._lock:
            self._records.add(record)
            self._stats.add(record)
            if self._file is not None:
                self._file.write(record.as_dict())  # bounded line, head and tail kept
        log.debug("relay %s %s -> %s (%s)", record.method, record.path, record.status, record.error or "ok")
        return record

    def close(self) -> None:
        """The tail and what was dropped go to the file; later records stay in memory only."""
        with self._lock:
            if self._file is not None:
                self._file.close()

    def records(self) -> list[RelayRecord]:
        with self._lock:
            return self._records.items()

    def stats(self) -> RelayStats:
        with self._lock:
            return RelayStats(**vars(self._stats))

    def omitted(self) -> tuple[int, int]:
        """Records dropped from the file and from memory."""
        with self._lock:
            return (0 if self._file is None else self._file.omitted), self._records.omitted
