"""The upstream side of the relay: the one place it forwards to (:class:`Upstream`) and the httpx client that reaches
it (:class:`UpstreamClient`: keep-alive pool, TLS, streaming, timeouts; no proxy from the environment, no redirects),
with the retry policy.

Retries (:class:`RetryPolicy`, run by tenacity): before any byte of a response has gone to the agent, an answer of
``RETRY_STATUSES`` (408, 409, 429, 500, 502, 503, 504, 529), a connection refused or reset before an answer, or a
connect timeout is tried again after a wait: the provider's hint when it gives one (``retry-after-ms``,
``Retry-After`` in seconds or as a date, OpenAI's ``x-ratelimit-reset-*`` or Anthropic's
``anthropic-ratelimit-*-reset`` of the exhausted limit), else exponential backoff with full jitter; all within the
request's budget (``--pb-model-retry-budget``, default 10 minutes). The agent sees a slower answer. When the budget
is spent (the next wait would pass it), the last answer goes to the agent as it came and the request is marked given
up (:attr:`Attempts.gave_up`): the relay's caller decides what an outage means for the task.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, cast

import httpx
import tenacity

from pytest_programbench.relay.contract import Upstream
from pytest_programbench.relay.held import HeldTime
from pytest_programbench.relay.rate import RunRateLimit
from pytest_programbench.relay.server import Refusal
from pytest_programbench.relay.slots import ModelSlots, SlotsClosed

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the relay itself decides.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade"}
)
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect", "accept-encoding"}
KEY_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})
RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
_MAX_POOLED = 8
_POOL_IDLE_S = 60.0
_URLS_KEPT = 64  # request URLs built once per path (an agent uses a handful of paths)
#: What ``httpx.Client`` put under every request's own headers (its Accept-Encoding is always the relay's identity).
_CLIENT_HEADERS = (("Accept", "*/*"), ("Connection", "keep-alive"), ("User-Agent", f"python-httpx/{httpx.__version__}"))

#: Answers tried again before the first byte reaches the agent: timeouts, conflicts, rate limits, overloads.
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
#: Upstream statuses that say the key is not accepted: no retry helps.
REJECTED_STATUSES = frozenset({401, 403})
DEFAULT_RETRY_BUDGET_S = 600.0



def content_length(headers: httpx.Headers) -> int | None:
    """The upstream body's declared length; ``None`` when chunked or until the connection closes."""
    if "transfer-encoding" in headers:
        return None
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


def socket_of(response: httpx.Response) -> socket.socket | None:
    """The upstream socket under a streaming response (to cut it from another thread at close)."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    return sock if isinstance(sock, socket.socket) else None






@dataclass(frozen=True)
class RetryPolicy:
    """How long one request may be tried for (``budget_s``, from its first attempt) and the backoff without a hint:
    ``base_s`` doubling per attempt up to ``max_backoff_s``, full jitter."""

    budget_s: float = DEFAULT_RETRY_BUDGET_S
    base_s: float = 1.0
    max_backoff_s: float = 30.0


@dataclass
class Attempts:
    """What one request's tries went through: one entry per retried answer, and whether the budget ran out."""

    tries: list[dict[str, Any]] = field(default_factory=list)  # {"attempt", "status", "error", "wait_s"}
    waited_s: float = 0.0
    slot_wait_s: float = 0.0  # seconds waited for a --pb-model-concurrency slot, over every try
    rate_wait_s: float = 0.0  # seconds waited for --pb-model-rpm / --pb-model-tpm, over every try
    gave_up: bool = False  # the budget ran out on a transient failure: the last one went to the agent

    @property
    def retries(self) -> int:
        return len(self.tries)


class _Transient(Exception):
    """No answer from the upstream, of a kind worth another try (refused, reset, connect timeout)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_GO_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def _seconds_until(value: str, now: datetime) -> float | None:
    """A reset header's value: seconds (``12``, ``1.5``), a Go duration (``6m0s``, ``20ms``) or a date."""
    value = value.strip()
    if not value:
        return None
    with contextlib.suppress(ValueError):
        return max(0.0, float(value))
    parts = _GO_DURATION.findall(value)
    if parts and "".join(number + unit for number, unit in parts) == value:
        return sum(float(number) * _GO_UNITS[unit] for number, unit in parts)
    when: datetime | None = None
    with contextlib.suppress(ValueError):
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if when is None:
        with contextlib.suppress(TypeError, ValueError, IndexError):
            when = parsedate_to_datetime(value)
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())


_RESET_KINDS = ("requests", "tokens", "input-tokens", "output-tokens")


def retry_hint(headers: httpx.Headers, now: datetime | None = None) -> float | None:
    """Seconds the provider asks to wait before trying again, ``None`` when it says nothing usable.

    ``retry-after-ms``, then ``Retry-After`` (seconds or an HTTP date); else the reset of a limit whose remaining
    count is 0 (OpenAI ``x-ratelimit-{remaining,reset}-requests|tokens``, Anthropic
    ``anthropic-ratelimit-*-{remaining,reset}``), the latest of those; else the earliest reset given."""
    now = now or datetime.now(UTC)
    with contextlib.suppress(KeyError, ValueError):
        return max(0.0, float(headers["retry-after-ms"]) / 1000)
    if "retry-after" in headers:
        hint = _seconds_until(headers["retry-after"], now)
        if hint is not None:
            return hint
    exhausted: list[float] = []
    resets: list[float] = []
    for kind in _RESET_KINDS:
        for remaining, reset in ((f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}"),
                                 (f"anthropic-ratelimit-{kind}-remaining", f"anthropic-ratelimit-{kind}-reset")):
            if reset not in headers:
                continue
            seconds = _seconds_until(headers[reset], now)
            if seconds is None:
                continue
            resets.append(seconds)
            if headers.get(remaining, "").strip() == "0":
                exhausted.append(seconds)
    if exhausted:
        return max(exhausted)
    return min(resets) if resets else None


def _caused_by_tls(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class UpstreamClient:
    """httpx for the upstream side: a keep-alive pool, streaming, TLS, and a read timeout long enough for a model
    that thinks for an hour before its first byte. No proxy from the environment, no redirects: the relay goes to
    the configured endpoint and nowhere else. Responses in flight are tracked so that :meth:`cut` can end them.

    Requests go straight to httpx's transport: ``httpx.Client.send`` would spend a fifth of the relay's time to the
    first byte on merging defaults, URLs and cookies and reading ``Set-Cookie`` for every request. What it did that
    matters is done here, only when it applies: its default headers, and the cookies the upstream sets sent back.

    ``on_wait(seconds)`` is told each wait before it starts (the live view shows it). ``slots``: the run's
    ``--pb-model-concurrency`` slots, one held by each try from before it is sent until its response is done
    (``on_slot_wait()`` is told when a try has to wait for one). ``rate``: the run's ``--pb-model-rpm`` /
    ``--pb-model-tpm`` buckets, a request token taken by each try once it holds its slot, just before it is sent
    (``on_rate_wait(seconds)`` is told each wait)."""

    def __init__(self, upstream: Upstream, *, connect_timeout: float, read_timeout: float,
                 ssl_context: ssl.SSLContext | None, policy: RetryPolicy | None = None,
                 on_wait: Callable[[float], None] | None = None, slots: ModelSlots | None = None,
                 on_slot_wait: Callable[[], None] | None = None, rate: RunRateLimit | None = None,
                 on_rate_wait: Callable[[float], None] | None = None) -> None:
        self.upstream = upstream
        self.policy = policy or RetryPolicy()
        self._on_wait = on_wait
        self.slots = slots
        self._on_slot_wait = on_slot_wait
        self.rate = rate
        self._on_rate_wait = on_rate_wait
        self.held = HeldTime()  # every wait below: the seconds the agent's clock gives back
        self._held: dict[httpx.Response, int] = {}  # the slot each response in flight holds
        timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=_MAX_POOLED,
                              keepalive_expiry=_POOL_IDLE_S)
        verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._transport = httpx.HTTPTransport(verify=verify, limits=limits, trust_env=False)
        self._timeout = timeout.as_dict()
        self._cookies = httpx.Cookies()
        self._urls: dict[str, httpx.URL] = {}
        self._lock = threading.Lock()
        self._inflight: set[httpx.Response] = set()
        self._closing = threading.Event()  # also ends every wait between tries at once

    def send(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
             attempts: Attempts | None = None) -> httpx.Response:
        """One request, streamed (headers read, body not yet), tried again per the policy; ``attempts`` gets what
        the tries went through. A failure with no answer is a :class:`Refusal` (502, 504) the agent receives."""
        # The path was checked against the endpoint's prefix as sent: the URL is built from its raw bytes, so
        # nothing is re-encoded or normalised on the way.
        url = self._urls.get(path)
        if url is None:
            url = httpx.URL(scheme=self.upstream.scheme, host=self.upstream.host, port=self.upstream.port,
                            raw_path=path.encode("ascii", "surrogateescape"))
            if len(self._urls) < _URLS_KEPT:
                self._urls[path] = url
        log = attempts if attempts is not None else Attempts()
        started = time.monotonic()  # the budget runs from the first try
        try:
            response = self._attempt(method, url, headers, body, log)
        except _Transient as exc:
            first: httpx.Response | _Transient = exc
        else:
            if response.status_code not in RETRY_STATUSES:
                return response  # answered at once, as nearly every request is: no retry machinery on the way
            first = response
        return self._retry(first, started, lambda: self._attempt(method, url, headers, body, log), log)

    def _retry(self, first: httpx.Response | _Transient, started: float, again: Callable[[], httpx.Response],
               log: Attempts) -> httpx.Response:
        """The tries after a first one worth another, run by tenacity: its first try is ``first``'s outcome, the
        next ones ``again()``."""
        policy = self.policy
        pending = [first]

        def attempt() -> httpx.Response:
            if pending:
                done = pending.pop()
                if isinstance(done, _Transient):
                    raise done
                return done
            return again()

        def wait(state: tenacity.RetryCallState) -> float:
            outcome = state.outcome
            hint = None
            if outcome is not None and not outcome.failed:
                hint = retry_hint(cast(httpx.Response, outcome.result()).headers)
            if hint is None:
                return float(tenacity.wait_random_exponential(multiplier=policy.base_s,
                                                              max=policy.max_backoff_s)(state))
            return hint + random.uniform(0, min(1.0, hint / 10))  # noqa: S311 (jitter, so waiters do not stampede)

        def stop(state: tenacity.RetryCallState) -> bool:
            return self._closing.is_set() or time.monotonic() - started + state.upcoming_sleep > policy.budget_s

        def before_sleep(state: tenacity.RetryCallState) -> None:
            outcome = state.outcome
            assert outcome is not None
            status, error = None, None
            if outcome.failed:
                exc = cast(_Transient, outcome.exception())
                error = exc.message
            else:
                response = cast(httpx.Response, outcome.result())
                status = response.status_code
                self.done(response)  # its body is not wanted: the connection goes
            waited = round(state.upcoming_sleep, 3)
            log.tries.append({"attempt": state.attempt_number, "status": status, "error": error, "wait_s": waited})
            log.waited_s = round(log.waited_s + waited, 3)
            if self._on_wait is not None:
                self._on_wait(waited)

        def give_up(state: tenacity.RetryCallState) -> httpx.Response:
            outcome = state.outcome
            assert outcome is not None
            log.gave_up = not self._closing.is_set()
            if outcome.failed:
                exc = cast(_Transient, outcome.exception())
                raise Refusal(exc.status, f"{exc.message} (tried {state.attempt_number} times over "
                                          f"{time.monotonic() - started:.0f} s)")
            return cast(httpx.Response, outcome.result())  # the last answer, as it came

        retrying = tenacity.Retrying(
            retry=(tenacity.retry_if_exception_type(_Transient)
                   | tenacity.retry_if_result(lambda r: r.status_code in RETRY_STATUSES)),
            wait=wait, stop=stop, before_sleep=before_sleep, retry_error_callback=give_up,
            sleep=self._sleep)
        return retrying(attempt)

    def _sleep(self, seconds: float) -> None:
        with self.held.holding():
            self._closing.wait(seconds)  # closing the relay ends the wait

    def _attempt(self, method: str, url: httpx.URL, headers: list[tuple[str, str]], body: bytes,
                 log: Attempts) -> httpx.Response:
        if self._closing.is_set():
            raise Refusal(503, "the relay is closing")
        slot: int | None = None
        if self.slots is not None:
            try:
                with self.held.holding():
                    slot, waited = self.slots.acquire(self._closing, self._on_slot_wait)
            except SlotsClosed:
                raise Refusal(503, "the relay is closing") from None
            log.slot_wait_s = round(log.slot_wait_s + waited, 3)
        try:
            if self.rate is not None:  # after the slot: the request goes out as soon as its token is taken
                try:
                    with self.held.holding():
                        waited = self.rate.acquire(self._closing, self._on_rate_wait)
                except SlotsClosed:
                    raise Refusal(503, "the relay is closing") from None
                log.rate_wait_s = round(log.rate_wait_s + waited, 3)
            response = self._send(method, url, headers, body)
        except BaseException:
            if slot is not None:
                ModelSlots.release(slot)
            raise
        with self._lock:
            self._inflight.add(response)
            if slot is not None:
                self._held[response] = slot
        return response

    def _send(self, method: str, url: httpx.URL, headers: list[tuple[str, str]], body: bytes) -> httpx.Response:
        own = {name.lower() for name, _ in headers}
        request = httpx.Request(method, url, content=body if body else None, extensions={"timeout": self._timeout},
                                headers=[(n, v) for n, v in _CLIENT_HEADERS if n.lower() not in own] + headers)
        if self._cookies:
            self._cookies.set_cookie_header(request)
        origin = self.upstream.origin
        try:
            response = self._transport.handle_request(request)
        except httpx.ConnectTimeout as exc:
            raise _Transient(504, f"upstream {origin} did not accept a connection in time: {exc!r}") from exc
        except httpx.TimeoutException as exc:
            raise Refusal(504, f"upstream {origin} timed out: {exc!r}") from exc
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:  # refused, reset, closed before answering
            if _caused_by_tls(exc):  # a certificate the relay does not trust stays untrusted: no retry
                raise Refusal(502, f"upstream {origin} unreachable: {exc!r}") from exc
            raise _Transient(502, f"upstream {origin} unreachable: {exc!r}") from exc
        except httpx.UnsupportedProtocol as exc:
            raise Refusal(502, f"upstream {origin} unreachable: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise Refusal(502, f"upstream {origin} sent no valid response: {exc!r}") from exc
        response.request = request
        if "set-cookie" in response.headers or "set-cookie2" in response.headers:
            self._cookies.extract_cookies(response)
        return response

    def done(self, response: httpx.Response) -> None:
        """A response finished with: a body read to its end returns the connection to the pool."""
        with self._lock:
            self._inflight.discard(response)
            slot = self._held.pop(response, None)
        response.close()
        if slot is not None:
            ModelSlots.release(slot)

    def cut(self) -> None:
        """Shut the sockets of responses in flight (from another thread): their readers see the end at once."""
        self._closing.set()
        with self._lock:
            sockets = [sock for sock in map(socket_of, self._inflight) if sock is not None]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._transport.close()
