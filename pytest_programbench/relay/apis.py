"""The model APIs the relay knows, in one table, and the cleanroom rule built on it.

:data:`MODEL_CALLS` lists every call the relay forwards: its method, its path below the endpoint's prefix (an
optional ``/v1`` after the prefix is the same path: OpenAI SDKs put it in the base URL, Anthropic's in the path), the
name records give it and the rules its body must meet (``body_scan.py``). The calls are those of the three APIs
(OpenAI Chat Completions and Responses, Anthropic Messages), the legacy completions and embeddings, and what the
agents' start-up needs (a model list, Anthropic's token count, claude-code's ``HEAD /``). Any other method or path
(files, uploads, batches, vector stores, stored responses and their input items, assistants, threads, containers,
skills, fine-tuning...) is refused; so is a call whose body asks for a tool the provider runs (web search, web fetch,
code execution, MCP, file search, hosted shell, computer use...), a server-side feature (``web_search_options``,
``mcp_servers``, ``container``, ``previous_response_id``, ``conversation``, a stored ``prompt``, OpenRouter's
``plugins`` and ``:online``) or content the provider fetches (a URL, a file id, a stored item), a model other than
the run's (:class:`ModelPin`: every model-naming field, decoded in full; none named at all; one named twice), and an
``anthropic-beta`` header that turns on MCP, files, code execution, web fetch or skills. Refusing a header is
clearer than stripping it: the agent is told what it cannot have. A body the relay cannot read (not a JSON object,
compressed, past the scan's bounds) is refused too, but is not counted as an attempt.

Each refusal is a 403 (400 / 415 for an unreadable body) in the provider's error shape, names what was refused and
the option that allows it, never reaches the upstream, and is recorded with ``cleanroom_refused`` in
``model-requests.jsonl``; attempts raise the item's flag ``provider_tools_requested``. ``--pb-model-allow-server-tools``
forwards everything inside the endpoint as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pytest_programbench.relay.body_scan import BodyRules, Finding, read
from pytest_programbench.relay.server import Headers, Refusal

#: The option that lets provider-side tools and every other API through.
ALLOW_OPTION = "--pb-model-allow-server-tools"
#: The item's flag when the agent asked for something the cleanroom refuses.
PROVIDER_TOOLS_REQUESTED = "provider_tools_requested"

CHAT = BodyRules(
    tool_types=frozenset({"function", "custom"}),
    refused_keys={"web_search_options": "web search", "plugins": "OpenRouter plugins: web search, file parsing"},
    conversation=frozenset({"messages"}),
)
RESPONSES = BodyRules(
    # What codex sends (function, custom, namespace of functions) and the client-run shell and patch tools.
    tool_types=frozenset({"function", "custom", "namespace", "local_shell", "shell", "apply_patch"}),
    local_only=frozenset({"shell"}),  # "shell" with environment container_auto runs in OpenAI's container
    refused_keys={"previous_response_id": "a stored response", "conversation": "a stored conversation",
                  "prompt": "a stored prompt", "plugins": "OpenRouter plugins: web search, file parsing"},
    conversation=frozenset({"input"}),
)
ANTHROPIC = BodyRules(
    # claude-code's tools have no type; "custom" is the explicit spelling. Anthropic's bash, text editor, computer
    # and memory tools are run by the client; every other versioned type (web_search_20250305, web_fetch_*,
    # code_execution_*, tool_search_tool_*, mcp_toolset) runs at Anthropic.
    tool_types=frozenset({None, "custom"}),
    tool_pattern=re.compile(r"(?:bash|text_editor|computer|memory)_[0-9]{8}"),
    refused_keys={"mcp_servers": "MCP connectors", "container": "a code execution container"},
    conversation=frozenset({"messages", "system"}),
)
PLAIN = BodyRules(refused_keys={"plugins": "OpenRouter plugins: web search, file parsing"})


@dataclass(frozen=True)
class ModelCall:
    """One call the relay forwards: ``method`` on ``path`` (below the prefix and an optional ``/v1``; a path ending
    in ``/*`` takes any rest), named ``api`` in the records; ``rules``: what its body may hold (``None``: no body)."""

    api: str
    method: str
    path: str
    rules: BodyRules | None

    def matches(self, method: str, rest: str) -> bool:
        if method != self.method and not (method == "HEAD" and self.method == "GET"):  # HEAD: a GET without body
            return False
        if self.path.endswith("/*"):
            return rest.startswith(self.path[:-1]) and len(rest) > len(self.path) - 1
        return rest == self.path


#: The allow-list (first match wins; ``api_of`` reads the same names by suffix, longest first).
MODEL_CALLS = (
    ModelCall("chat.completions", "POST", "/chat/completions", CHAT),
    ModelCall("responses", "POST", "/responses", RESPONSES),
    ModelCall("anthropic.messages", "POST", "/messages", ANTHROPIC),
    ModelCall("anthropic.count_tokens", "POST", "/messages/count_tokens", ANTHROPIC),
    ModelCall("completions", "POST", "/completions", PLAIN),
    ModelCall("embeddings", "POST", "/embeddings", PLAIN),
    ModelCall("models", "GET", "/models", None),
    ModelCall("models", "GET", "/models/*", None),
    ModelCall("probe", "HEAD", "/", None),  # claude-code's connectivity check (endpoints without a prefix)
)

# anthropic-beta values (by prefix) that turn on what runs or is stored at Anthropic.
REFUSED_BETAS = ("mcp-client-", "files-api-", "code-execution-", "web-fetch-", "web-search-", "skills-")


def api_of(path: str) -> str | None:
    """The API a request path names (for records), by its ending: also right for paths outside the allow-list."""
    path = path.split("?", 1)[0].rstrip("/")
    for call in sorted((c for c in MODEL_CALLS if c.rules is not None), key=lambda c: -len(c.path)):
        if path.endswith(call.path):
            return call.api
    return None


class CleanroomRefusal(Refusal):
    """A request the cleanroom relay does not forward. ``what``: a short label for records and the flag;
    ``attempt``: the agent asked for something provider-side (an unreadable body is not counted as one)."""

    def __init__(self, status: int, what: str, why: str, *, attempt: bool = True) -> None:
        super().__init__(status, f"the cleanroom relay refuses {what}: {why}; the run would need {ALLOW_OPTION} "
                                 "to forward it")
        self.what = what
        self.attempt = attempt


def below_prefix(path: str, prefix: str) -> str:
    """``path`` (no query) relative to the endpoint's ``prefix`` and an optional ``/v1`` after it."""
    rest = path[len(prefix):] if prefix and path.startswith(prefix) else path
    if rest == "/v1" or rest.startswith("/v1/"):
        rest = rest[3:]
    return rest or "/"


def allowed_call(method: str, target: str, prefix: str) -> ModelCall:
    """The model call ``method target`` is (``target`` inside the prefix, query included), or a refusal."""
    path = target.split("?", 1)[0]
    rest = below_prefix(path, prefix)
    for call in MODEL_CALLS:
        if call.matches(method, rest):
            return call
    raise CleanroomRefusal(403, f"{method} {path[:200]}", "it is not a model call (the relay forwards chat "
                                                           "completions, responses, messages and the model list)")


def check_headers(call: ModelCall, headers: Headers) -> None:
    """Refuse beta flags that turn on provider-side work, and bodies the relay could not read (compressed)."""
    for value in headers.get_all("anthropic-beta"):
        for beta in (item.strip().lower() for item in value.split(",")):
            if beta.startswith(REFUSED_BETAS):
                raise CleanroomRefusal(403, f"anthropic-beta {beta[:80]}", "it turns on a provider-side tool or "
                                                                           "stored files")
    encodings = {item.strip().lower() for value in headers.get_all("Content-Encoding") for item in value.split(",")}
    if call.rules is not None and encodings - {"", "identity"}:
        raise CleanroomRefusal(415, "a compressed request body", "the relay reads every model request body to check "
                                                                 "it asks for no provider-side tool", attempt=False)


@dataclass(frozen=True)
class ModelPin:
    """The models a run may ask for: the names it was configured with (``--pb-model``, else a CLI preset's default),
    each also without a leading ``provider/`` (litellm and ``provider/model`` clients send the rest: ``openai/gpt-5``
    asks for ``gpt-5``). Compared exactly, after full JSON decoding."""

    configured: tuple[str, ...]
    names: frozenset[str]

    @classmethod
    def of(cls, models: Iterable[str]) -> ModelPin | None:
        """The pin of ``models`` (empty strings ignored), ``None`` when none is named: the run pins nothing."""
        configured = tuple(dict.fromkeys(model for model in models if model))
        if not configured:
            return None
        names = set(configured)
        names.update(rest for model in configured if (rest := model.partition("/")[2]))
        return cls(configured, frozenset(names))

    def check(self, named: Iterable[tuple[str, str]]) -> None:
        """Refuse a body that names no model, or any model (in any field) other than the run's."""
        run = " or ".join(repr(model) for model in self.configured)
        why = f"the run's model is {run} (--pb-model), and the relay forwards requests for it only"
        named = tuple(named)
        if not named:
            raise CleanroomRefusal(403, "a request naming no model", why)
        for key, name in named:
            if name not in self.names:
                raise CleanroomRefusal(403, f"{key} {name[:80]!r}", why)


def check_body(call: ModelCall, body: bytes, pin: ModelPin | None = None) -> None:
    """Refuse a body that asks for provider-side work or for a model other than the pinned ones (``pin``; ``None``:
    the run named no model), or that the relay cannot read."""
    if call.rules is None:
        return
    scanned = read(body, call.rules)
    if scanned.finding is not None:
        raise _refusal(scanned.finding)
    if pin is not None:
        pin.check(scanned.models)


def _refusal(finding: Finding) -> CleanroomRefusal:
    if not finding.attempt:
        return CleanroomRefusal(400, f"an unreadable body ({finding.what})", "the relay reads every model request "
                                                                             "body to check it asks for no "
                                                                             "provider-side tool", attempt=False)
    why = {"tool": "the provider would run it (web search, code execution, MCP...: the internet)",
           "feature": "it makes the provider search the web, connect elsewhere or read what it stored",
           "fetch": "the provider would fetch it or read what it stored",
           "model": "a request names its model once, as a string (models: a list of strings)"}[finding.kind]
    return CleanroomRefusal(403, finding.what, why)


@dataclass
class CleanroomTally:
    """The refusals of one relay, by label (bounded: the first :data:`LABELS` labels, the rest counted apart)."""

    LABELS = 32

    allowed: bool = False  # --pb-model-allow-server-tools: nothing refused
    attempts: dict[str, int] = field(default_factory=dict)
    other_attempts: int = 0
    unreadable: int = 0

    def add(self, refusal: CleanroomRefusal) -> None:
        if not refusal.attempt:
            self.unreadable += 1
        elif refusal.what in self.attempts or len(self.attempts) < self.LABELS:
            self.attempts[refusal.what] = self.attempts.get(refusal.what, 0) + 1
        else:
            self.other_attempts += 1

    @property
    def attempted(self) -> int:
        return sum(self.attempts.values()) + self.other_attempts

    def flag(self) -> str | None:
        """The item's flag when the agent asked for something provider-side, ``None`` when it did not."""
        if not self.attempted:
            return None
        shown = sorted(self.attempts.items(), key=lambda item: -item[1])[:5]
        what = ", ".join(f"{n} x {label}" for label, n in shown)
        more = self.attempted - sum(n for _, n in shown)
        return (f"{PROVIDER_TOOLS_REQUESTED}: the cleanroom relay refused {self.attempted} request(s) for "
                f"provider-side tools or APIs ({what}{f', {more} more' if more else ''}; each in model-requests.jsonl)")

    def as_dict(self) -> dict[str, Any]:
        return {"server_tools": "allowed" if self.allowed else "refused", "refused": self.attempted + self.unreadable,
                "attempts": dict(self.attempts), "other_attempts": self.other_attempts,
                "unreadable": self.unreadable}
