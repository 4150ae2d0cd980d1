"""What the rest of the plugin knows of the model relay without running one: the endpoint's parsing, the key's header,
the placeholder key agents get, the bridge's script and port, the words that stop a session. No HTTP stack: a run
without a model endpoint never imports one (a session's start stays light; relay/relay.py is the relay itself)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast
from urllib.parse import unquote, urlsplit

from pytest_programbench.core import environment
from pytest_programbench.sandbox.layout import RELAY_PORT

#: The bridge script, to be copied into the sandbox (stdlib only, Python 3.7+).
BRIDGE_SCRIPT = Path(__file__).with_name("relay_bridge.py")
#: The container-loopback port the bridge listens on (the sandbox layout's).
SANDBOX_BRIDGE_PORT = RELAY_PORT
#: What SDKs get as their API key when the relay adds the real one (they refuse to start without one).
PLACEHOLDER_KEY = "pb-relay-adds-the-key"
#: How :meth:`ModelRelay.unavailable` begins when the upstream rejected the key (the session stops on it).
MODEL_REJECTED = "model API rejected the key"
#: The exchanges a task's relay records for ``--pb-agent-replay``, beside its ``model-requests.jsonl``.
REPLAY_FILE = "model-replay.jsonl"


def replay_limit() -> int:
    """The bytes a task's replay file may hold (``PB_MODEL_REPLAY_MAX``)."""
    return environment.MODEL_REPLAY_MAX.size()


class RelayConfigError(ValueError):
    """The relay cannot be set up as asked (bad endpoint URL, missing key variable): a usage error."""


def bad_path(path: str) -> bool:
    """Dot segments, encoded slashes or backslashes: anything an upstream might normalise out of the prefix."""
    if not path.startswith("/") or "\\" in path:
        return True
    for segment in path.split("/"):
        decoded = unquote(segment)
        if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
            return True
    return False


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


def configured_key_style(endpoint: str, *, anthropic_client: bool = False) -> Literal["bearer", "x-api-key"]:
    """The header a run's key goes in, from its configuration alone: ``x-api-key`` for Anthropic's own API or an
    agent configured to speak Anthropic Messages (``anthropic_client``: claude-code, a litellm ``anthropic/`` model),
    else ``Authorization: Bearer`` (OpenAI, OpenRouter, every OpenAI-compatible server)."""
    host = Upstream.parse(endpoint).host
    anthropic = host == "anthropic.com" or host.endswith(".anthropic.com")
    return "x-api-key" if anthropic or anthropic_client else "bearer"
