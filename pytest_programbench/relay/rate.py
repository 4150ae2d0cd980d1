"""Model requests and tokens per minute across the whole run: ``--pb-model-rpm N`` and ``--pb-model-tpm N``.

Two token buckets shared by every process of the run (every xdist worker, whichever engine its task runs on). Their
levels and the time of their last refill are one small file in the run directory (``.pb-model-slots/rate.json``),
read, refilled and written back under an ``flock`` of ``rate.lock`` beside it. Each bucket holds at most a minute's
worth and refills at that much a minute (the token bucket Anthropic documents for its own limits): a burst of up to
N, then N a minute, so over any T seconds at most N + N*T/60.

* requests: every try sent upstream (a retry too: the provider counts it) first takes one request token, waiting
  for one when there is none;
* tokens: an answer's metered tokens (its usage's total) are charged once it has gone by, which may leave the bucket
  below zero (the size of an answer is known only after it); a request waits while the bucket is below zero.

The lock is held for the read-modify-write only, never while waiting, and ``flock`` belongs to the open file: a worker
that dies holds nothing. A wait is recorded (``rate_wait_s``) and shown live, like a ``--pb-model-concurrency`` wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_programbench.relay.metering import Usage
from pytest_programbench.relay.slots import SlotsClosed

STATE = "rate.json"
LOCK = "rate.lock"
WINDOW_S = 60.0  # the limits are per minute
_MIN_WAIT_S = 0.01  # a wait shorter than this is not worth a sleep


def usage_tokens(usage: Usage | None) -> int:
    """The tokens an answer counts against ``--pb-model-tpm``: its total, else its input plus output."""
    if usage is None:
        return 0
    if usage.total_tokens is not None:
        return usage.total_tokens
    return (usage.input_tokens or 0) + (usage.output_tokens or 0)


@dataclass
class Buckets:
    """The shared state: both levels (``None``: that limit is off) at ``stamp`` (``time.time()``), and the counts of
    requests taken and tokens charged over the run (for the record)."""

    stamp: float
    requests: float | None
    tokens: float | None
    sent: int = 0
    charged: int = 0

    @classmethod
    def parse(cls, text: str) -> Buckets | None:
        try:
            data = json.loads(text)
            return cls(float(data["stamp"]), _level(data.get("requests")), _level(data.get("tokens")),
                       int(data.get("sent") or 0), int(data.get("charged") or 0))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def as_dict(self) -> dict[str, Any]:
        return {"stamp": self.stamp, "requests": self.requests, "tokens": self.tokens, "sent": self.sent,
                "charged": self.charged}


def _level(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


class RunRateLimit:
    """The run's request and token buckets in ``directory`` (per ``window_s``: a minute, shorter in tests only)."""

    def __init__(self, directory: Path, *, rpm: int | None, tpm: int | None, window_s: float = WINDOW_S) -> None:
        if rpm is None and tpm is None:
            raise ValueError("a rate limit needs requests or tokens per minute")
        if (rpm is not None and rpm < 1) or (tpm is not None and tpm < 1):
            raise ValueError("a rate limit is at least 1 a minute")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.rpm = rpm
        self.tpm = tpm
        self.window_s = window_s

    @contextlib.contextmanager
    def _state(self) -> Iterator[Buckets]:
        """The buckets, refilled to now, under the lock; written back when the block ends without an exception."""
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = self.directory / STATE
            now = time.time()
            try:
                state = Buckets.parse(path.read_text())
            except OSError:
                state = None
            if state is None:  # the first request of the run (or a state cut short by a crash): full buckets
                state = Buckets(now, None, None)
            elapsed = max(0.0, now - state.stamp)  # a clock set back refills nothing
            state.stamp = now
            state.requests = self._refill(state.requests, self.rpm, elapsed)
            state.tokens = self._refill(state.tokens, self.tpm, elapsed)
            yield state
            temp = path.with_name(f".{STATE}.tmp")  # one writer at a time: the lock is held
            temp.write_text(json.dumps(state.as_dict()))
            temp.replace(path)
        finally:
            os.close(fd)  # frees the lock

    def _refill(self, level: float | None, limit: int | None, elapsed: float) -> float | None:
        if limit is None:
            return None
        if level is None:
            return float(limit)
        return min(float(limit), level + limit * elapsed / self.window_s)  # at most a window's worth

    def _take(self) -> float:
        """Take one request token now (0.0), or the seconds to wait before trying again."""
        with self._state() as state:
            waits = [0.0]
            if state.tokens is not None and state.tokens < 0 and self.tpm is not None:
                waits.append(-state.tokens * self.window_s / self.tpm)
            if state.requests is not None and state.requests < 1 and self.rpm is not None:
                waits.append((1 - state.requests) * self.window_s / self.rpm)
            wait = max(waits)
            if wait <= 0:
                if state.requests is not None:
                    state.requests -= 1
                state.sent += 1
            return wait

    def acquire(self, closing: threading.Event, on_wait: Callable[[float], None] | None = None) -> float:
        """The seconds waited until a request may be sent (its request token taken); ``on_wait(seconds)`` is told
        each wait before it starts; :class:`~pytest_programbench.relay.slots.SlotsClosed` when ``closing`` is set."""
        started, waited = time.monotonic(), False
        while True:
            wait = self._take()
            if wait <= 0:
                return round(time.monotonic() - started, 3) if waited else 0.0
            waited = True
            wait = max(wait, _MIN_WAIT_S)
            if on_wait is not None:
                on_wait(wait)
            if closing.wait(wait):  # another process may take the token first: then it is computed again
                raise SlotsClosed

    def charge(self, usage: Usage | None) -> None:
        """An answer's tokens, charged to the token bucket once it has gone by."""
        tokens = usage_tokens(usage)
        if tokens <= 0 or self.tpm is None:
            return
        with self._state() as state:
            if state.tokens is not None:
                state.tokens -= tokens
            state.charged += tokens

    def read(self) -> Buckets | None:
        """The state as last written (no lock, no refill): for the record and for tests."""
        try:
            return Buckets.parse((self.directory / STATE).read_text())
        except OSError:
            return None
