"""The upstream side of the relay: the one place it forwards to (:class:`Upstream`) and the httpx client that reaches
it (:class:`UpstreamClient`: keep-alive pool, TLS, streaming, timeouts; no proxy from the environment, no redirects).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import unquote, urlsplit

import httpx

from pytest_programbench.relay.server import Refusal

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


class RelayConfigError(ValueError):
    """The relay cannot be set up as asked (bad endpoint URL, missing key variable): a usage error."""


@dataclass(frozen=True)
class Upstream:
    """The one place the relay forwards to: scheme, host, port and path prefix (no trailing slash)."""

    scheme: Literal["http", "https"]
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise RelayConfigError(f"model endpoint {url!r}: the scheme must be http or https")
        if parts.username is not None or parts.password is not None:
            raise RelayConfigError(f"model endpoint {url!r}: credentials in the URL are not supported; "
                                   "name an environment variable holding the key instead")
        if parts.query or parts.fragment:
            raise RelayConfigError(f"model endpoint {url!r}: a query or fragment is not supported")
        if not parts.hostname:
            raise RelayConfigError(f"model endpoint {url!r}: no host")
        try:
            port = parts.port
        except ValueError as exc:
            raise RelayConfigError(f"model endpoint {url!r}: {exc}") from exc
        prefix = parts.path.rstrip("/")
        if bad_path(prefix or "/"):
            raise RelayConfigError(f"model endpoint {url!r}: the path must not contain dot segments")
        return cls(cast(Literal["http", "https"], scheme), parts.hostname.lower(),
                   port or (443 if scheme == "https" else 80), prefix)

    @property
    def default_port(self) -> bool:
        return self.port == (443 if self.scheme == "https" else 80)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.default_port else f"{host}:{self.port}"

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host_header}"

    @property
    def url(self) -> str:
        return self.origin + self.prefix

    def contains(self, path: str) -> bool:
        """Whether an origin-form path (no query) lies under the endpoint's prefix."""
        return not self.prefix or path == self.prefix or path.startswith(self.prefix + "/")


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


def bad_path(path: str) -> bool:
    """Dot segments, encoded slashes or backslashes: anything an upstream might normalise out of the prefix."""
    if not path.startswith("/") or "\\" in path:
        return True
    for segment in path.split("/"):
        decoded = unquote(segment)
        if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
            return True
    return False



class UpstreamClient:
    """httpx for the upstream side: a keep-alive pool, streaming, TLS, and a read timeout long enough for a model
    that thinks for an hour before its first byte. No proxy from the environment, no redirects: the relay goes to
    the configured endpoint and nowhere else. Responses in flight are tracked so that :meth:`close` can cut them."""

    def __init__(self, upstream: Upstream, *, connect_timeout: float, read_timeout: float,
                 ssl_context: ssl.SSLContext | None) -> None:
        self.upstream = upstream
        timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=_MAX_POOLED,
                              keepalive_expiry=_POOL_IDLE_S)
        verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._client = httpx.Client(timeout=timeout, limits=limits, verify=verify, trust_env=False,
                                    follow_redirects=False)
        self._lock = threading.Lock()
        self._inflight: set[httpx.Response] = set()
        self._closed = False

    def send(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> httpx.Response:
        """One request, streamed: the response's headers read, its body not yet. A failure to get an answer is a
        :class:`Refusal` (502, 504) the agent receives."""
        if self._closed:
            raise Refusal(503, "the relay is closing")
        # The path was checked against the endpoint's prefix as sent: the URL is built from its raw bytes, so
        # nothing is re-encoded or normalised on the way.
        url = httpx.URL(scheme=self.upstream.scheme, host=self.upstream.host, port=self.upstream.port,
                        raw_path=path.encode("ascii", "surrogateescape"))
        request = self._client.build_request(method, url, headers=headers, content=body if body else None)
        origin = self.upstream.origin
        try:
            response = self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise Refusal(504, f"upstream {origin} timed out: {exc!r}") from exc
        except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
            raise Refusal(502, f"upstream {origin} unreachable: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise Refusal(502, f"upstream {origin} sent no valid response: {exc!r}") from exc
        with self._lock:
            self._inflight.add(response)
        return response

    def done(self, response: httpx.Response) -> None:
        """A response finished with: a body read to its end returns the connection to the pool."""
        with self._lock:
            self._inflight.discard(response)
        response.close()

    def cut(self) -> None:
        """Shut the sockets of responses in flight (from another thread): their readers see the end at once."""
        with self._lock:
            self._closed = True
            sockets = [sock for sock in map(socket_of, self._inflight) if sock is not None]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._client.close()
