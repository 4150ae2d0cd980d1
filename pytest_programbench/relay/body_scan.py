"""What a model request's body asks the provider to do besides answering: read in one bounded pass, never parsed.

The cleanroom relay (``apis.py``) forwards a model call only when its body asks for nothing provider-side: no hosted
tool (web search, code execution, MCP, file search...), no server-side feature (``web_search_options``,
``mcp_servers``, a stored response or conversation...) and no content the provider would fetch (an image or document
by URL, a file by id, a stored item by reference). :func:`scan` answers that for one body and one API's
:class:`BodyRules`.

It must agree with the provider's JSON parser on every body it passes, and cost no more than the body: so it walks the
body's tokens (strings, structure, literals) with a strict JSON grammar (anything the grammar refuses, the relay
refuses: a lenient parser upstream could read it otherwise), decodes only keys and the few short values it checks
(escapes included: ``"mcp\\u005fservers"`` is ``mcp_servers``), keeps one frame per open container, and gives up
past :data:`MAX_TOKENS` tokens or :data:`MAX_DEPTH` levels. A duplicated key counts in every copy (parsers differ on
which one wins).

:func:`read` also returns every model the body names (top-level :data:`MODEL_KEYS`), each decoded in full by the JSON
parser itself, so the relay can pin them (``apis.ModelPin``): a model-naming key given twice, or a value that is not a
name (a string; for ``models`` a list of strings), is refused here, whatever the names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

MAX_TOKENS = 1_000_000  # strings and structure of one body (~2 s; a long agent conversation has tens of thousands)
MAX_DEPTH = 256  # nesting levels (provider parsers stop far earlier)
KEY_MAX = 512  # bytes of a key token decoded (every key checked here is far shorter)
HEAD_MAX = 256  # bytes of a checked string value decoded (its type name or a URL's scheme)

# A JSON string (escapes included) or a structural character; between two of them only blanks and one literal.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]:,]')
_GAP = re.compile(rb"[ \t\n\r]*(?:(true|false|null|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)[ \t\n\r]*)?")

# Keys whose string value the provider fetches when it is not inline data (chat ``image_url.url``, Responses
# ``image_url`` / ``file_url``, Anthropic ``source.url``), and keys naming an object stored at the provider.
URL_KEYS = frozenset({"url", "image_url", "file_url", "audio_url", "video_url", "document_url"})
STORED_KEYS = frozenset({"file_id"})
STORED_TYPES = frozenset({"item_reference"})  # a Responses input item read from a stored response
#: Top-level keys that name a model: ``model`` (every API) and OpenRouter's fallback list ``models``.
MODEL_KEYS = frozenset({"model", "models"})
MODEL_MAX = 1024  # bytes of a model name's token (escapes included): every real name is far shorter


@dataclass(frozen=True)
class BodyRules:
    """What one API's request body may hold. ``tool_types``: the ``type`` of each ``tools`` entry the client runs
    itself (``None``: an entry without one); ``tool_pattern``: more such types by pattern (versioned names);
    ``local_only``: tool types the provider runs unless their ``environment`` is absent or ``local``;
    ``refused_keys``: top-level keys (with a value other than ``null``) that make the provider do the work, and why;
    ``conversation``: top-level keys holding the conversation, where fetched and stored content is looked for."""

    tool_types: frozenset[str | None] = frozenset()
    tool_pattern: re.Pattern[str] | None = None
    local_only: frozenset[str] = frozenset()
    refused_keys: Mapping[str, str] = field(default_factory=dict)
    conversation: frozenset[str] = frozenset()

    def allows_tool(self, kind: str | None) -> bool:
        if kind in self.tool_types:
            return True
        return kind is not None and self.tool_pattern is not None and self.tool_pattern.fullmatch(kind) is not None


@dataclass(frozen=True)
class Finding:
    """Why a body is refused. ``kind``: ``tool``, ``feature``, ``fetch`` (the agent asked for something
    provider-side), ``model`` (a model-naming field given twice or holding no name) or ``unreadable`` (the relay
    cannot tell: not a JSON object, too deep...); ``what``: a short label (``tool web_search``)."""

    kind: str
    what: str

    @property
    def attempt(self) -> bool:
        return self.kind != "unreadable"


@dataclass(frozen=True)
class Scan:
    """What :func:`read` found: why the body may not go upstream (``None``: nothing), and the models it names as
    ``(key, name)`` pairs in body order (complete only when ``finding`` is ``None``)."""

    finding: Finding | None
    models: tuple[tuple[str, str], ...] = ()


class _Found(Exception):
    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.what)
        self.finding = finding


def _unreadable(why: str) -> _Found:
    return _Found(Finding("unreadable", why))


def _string(token: bytes, limit: int) -> str | None:
    """A string token decoded, or its first ``limit`` bytes decoded when it is longer; ``None`` when invalid."""
    if len(token) <= limit + 2:
        try:
            value = json.loads(token)
        except ValueError:  # an escape JSON does not have, bytes that are not UTF-8, a raw control character
            return None
        return value if isinstance(value, str) else None
    head = token[1:limit + 1]
    for cut in range(12):  # the cut may split an escape (6 bytes) or a UTF-8 sequence (4)
        try:
            value = json.loads(b'"' + head[:len(head) - cut] + b'"')
        except ValueError:
            continue
        return value if isinstance(value, str) else None
    return None


def _model_name(key: str, token: bytes) -> str:
    """A model name's string token decoded in full (escapes and all), or the refusal of one that cannot be a name."""
    if len(token) > MODEL_MAX + 2:
        raise _Found(Finding("model", f"{key} (a name longer than {MODEL_MAX} bytes)"))
    name = _string(token, MODEL_MAX)
    if name is None:
        raise _unreadable(f"a {key} that is not valid JSON")
    return name


def _not_a_name(key: str) -> _Found:
    return _Found(Finding("model", f"{key} (not {'a list of names' if key == 'models' else 'a name'})"))


# Roles of a container, for what is checked inside it.
_TOOLS, _TOOL, _ENV, _CONVERSATION, _MODELS = "tools", "tool", "environment", "conversation", "models"


class _Frame:
    __slots__ = ("array", "env_types", "key", "owner", "role", "tool_types")

    def __init__(self, array: bool, role: str | None, owner: _Frame | None = None) -> None:
        self.array = array
        self.role = role
        self.owner = owner  # an environment's tool
        self.key: str | None = None  # the current key (objects)
        self.tool_types: list[str | None] = []  # a tool entry's "type" values (None: a null one)
        self.env_types: list[str] = []  # a tool's (or an environment's) environment types ("": not a named one)


# What the parser expects next.
_VALUE, _VALUE_OR_END, _KEY, _KEY_OR_END, _COLON, _COMMA_OR_END, _DONE = range(7)


class _Walk:
    def __init__(self, rules: BodyRules) -> None:
        self.rules = rules
        self.stack: list[_Frame] = []
        self.models: list[tuple[str, str]] = []  # (key, name) of every model named, in body order
        self.model_keys: set[str] = set()  # the model-naming keys seen at the top level

    def key(self, token: bytes) -> None:
        frame = self.stack[-1]
        if len(token) > KEY_MAX:
            frame.key = None  # longer than any key checked here, even escaped
            return
        key = _string(token, KEY_MAX)
        if key is None:
            raise _unreadable("a key that is not valid JSON")
        frame.key = key
        if len(self.stack) == 1 and key in MODEL_KEYS:
            if key in self.model_keys:  # json.loads keeps the last copy, another parser may keep the first
                raise _Found(Finding("model", f"{key} given twice"))
            self.model_keys.add(key)

    def value(self, token: bytes, literal: bool) -> None:
        """A scalar value (a string token, or a literal's text) under the current frame."""
        frame = self.stack[-1]
        key = None if frame.array else frame.key
        if frame.role == _TOOLS:
            raise _unreadable("a tools entry that is not an object")
        if frame.role == _MODELS:
            if literal:
                raise _not_a_name("models")
            self.models.append(("models", _model_name("models", token)))
            return
        if len(self.stack) == 1 and key is not None:
            self._top_level_value(key, token, literal)
        if literal:
            self._literal_in(frame, key, token)
        else:
            self._string_in(frame, key, token)

    def _top_level_value(self, key: str, token: bytes, literal: bool) -> None:
        self._top_level(key, null=literal and token == b"null")
        if key in MODEL_KEYS and token != b"null":  # null: no model named (as when the key is absent)
            if literal or key == "models":
                raise _not_a_name(key)
            self.models.append((key, _model_name(key, token)))

    @staticmethod
    def _literal_in(frame: _Frame, key: str | None, token: bytes) -> None:
        """A literal (``null``, ``true``, a number) in a tool or an environment: no tool type, no named environment."""
        if frame.role == _TOOL and key == "type":
            frame.tool_types.append(None)
        elif (frame.role == _TOOL and key == "environment" and token != b"null") or \
                (frame.role == _ENV and key == "type"):
            frame.env_types.append("")  # not a named environment: not the local one

    def _string_in(self, frame: _Frame, key: str | None, token: bytes) -> None:
        """A string value: a tool's type or environment, an environment's type, or what the conversation holds."""
        if frame.role == _TOOL and key in ("type", "environment"):
            text = _string(token, HEAD_MAX)
            if key == "type":
                frame.tool_types.append("<unreadable>" if text is None else text)
            else:
                frame.env_types.append("")  # an environment named by a string: not the local one
        elif frame.role == _ENV and key == "type":
            frame.env_types.append(_string(token, HEAD_MAX) or "")
        elif frame.role == _CONVERSATION and key is not None:
            self._conversation(key, token)

    def _top_level(self, key: str, *, null: bool) -> None:
        why = self.rules.refused_keys.get(key)
        if why is not None and not null:
            raise _Found(Finding("feature", f"{key} ({why})"))

    def _conversation(self, key: str, token: bytes) -> None:
        if key in STORED_KEYS:
            raise _Found(Finding("fetch", f"{key} (a file stored at the provider)"))
        if key in URL_KEYS:
            head = _string(token, HEAD_MAX)
            if head is None:
                raise _unreadable(f"a {key} that is not valid JSON")
            if not head.lstrip().lower().startswith("data:"):  # inline data is the only kind the provider keeps local
                raise _Found(Finding("fetch", f"{key} {head[:80]!r} (fetched by the provider)"))
        elif key == "type" and _string(token, HEAD_MAX) in STORED_TYPES:
            raise _Found(Finding("fetch", "item_reference (an item of a stored response)"))

    def open(self, array: bool) -> None:
        if len(self.stack) >= MAX_DEPTH:
            raise _unreadable(f"nested deeper than {MAX_DEPTH} levels")
        if not self.stack:
            if array:
                raise _unreadable("not a JSON object")
            self.stack.append(_Frame(False, None))
            return
        parent = self.stack[-1]
        key = None if parent.array else parent.key
        top = len(self.stack) == 1
        role: str | None = None
        owner = None
        if top and key is not None:
            self._top_level(key, null=False)
            if key in MODEL_KEYS and not (array and key == "models"):
                raise _not_a_name(key)
        if parent.role == _MODELS:
            raise _not_a_name("models")
        if parent.role == _TOOLS:
            if array:
                raise _unreadable("a tools entry that is not an object")
            role = _TOOL
        elif array and key == "tools" and (top or parent.role == _TOOL):  # a namespace's tools are tools too
            role = _TOOLS
        elif top and key == "models":
            role = _MODELS
        elif parent.role == _TOOL and key == "environment":
            if array:
                parent.env_types.append("")
            else:
                role, owner = _ENV, parent
        elif parent.role == _CONVERSATION or (top and key in self.rules.conversation):
            role = _CONVERSATION
        self.stack.append(_Frame(array, role, owner))

    def close(self) -> None:
        frame = self.stack.pop()
        if frame.role == _ENV and frame.owner is not None:
            frame.owner.env_types.extend(frame.env_types or [""])  # an environment without a type: not "local"
        if frame.role != _TOOL:
            return
        rules = self.rules
        for kind in frame.tool_types or [None]:
            if not rules.allows_tool(kind):
                raise _Found(Finding("tool", f"tool {kind or '(no type)'}"[:120]))
            if kind in rules.local_only and any(env != "local" for env in frame.env_types):
                raise _Found(Finding("tool", f"tool {kind} in a provider-hosted environment"))


def scan(body: bytes, rules: BodyRules) -> Finding | None:
    """Why ``body`` may not go upstream under ``rules``, ``None`` when it may. Total: any input gives an answer."""
    return read(body, rules).finding


def read(body: bytes, rules: BodyRules) -> Scan:
    """:func:`scan`'s answer and the models ``body`` names. Total: any input gives an answer."""
    grammar = _Grammar(rules)
    try:
        _scan(body, grammar)
        for key, name in grammar.walk.models:
            if name.endswith(":online"):  # OpenRouter's web search by model name (compared decoded, in full)
                raise _Found(Finding("feature", f"{key} :online"))
    except _Found as found:
        return Scan(found.finding)
    return Scan(None, tuple(grammar.walk.models))


def _scan(body: bytes, grammar: _Grammar) -> None:
    gap, steps = grammar.gap, grammar.steps  # bound once: this loop runs up to MAX_TOKENS times
    end = 0
    for count, match in enumerate(_TOKEN.finditer(body), 1):
        if count > MAX_TOKENS:
            raise _unreadable(f"more than {MAX_TOKENS} JSON tokens")
        if match.start() != end:  # blanks or a literal before the token
            gap(body, end, match.start())
        end = match.end()
        token = match.group()
        steps[token[:1]](token)
    grammar.finish(body, end)


class _Grammar:
    """The strict JSON grammar over the body's tokens: what may come next (``state``), each token checked against it
    and handed to the walk; anything the grammar refuses is unreadable."""

    def __init__(self, rules: BodyRules) -> None:
        self.walk = _Walk(rules)
        self.state = _VALUE
        # The step for each token, by its first byte (a string or one structural character).
        self.steps: dict[bytes, Callable[[bytes], None]] = {
            b'"': self.string, b"{": self.open, b"[": self.open, b"}": self.close, b"]": self.close,
            b",": self.comma, b":": self.colon}

    def _refused(self) -> _Found:
        return _unreadable("not a JSON object" if not self.walk.stack else "not valid JSON")

    def gap(self, body: bytes, start: int, stop: int) -> None:
        """What lies between two tokens: blanks and at most one literal."""
        gap = _GAP.fullmatch(body, start, stop)
        if gap is None:
            raise _unreadable("not valid JSON")
        literal = gap.group(1)
        if literal is not None:
            if self.state not in (_VALUE, _VALUE_OR_END) or not self.walk.stack:
                raise self._refused()
            self.walk.value(literal, True)
            self.state = _COMMA_OR_END

    def string(self, token: bytes) -> None:
        if self.state in (_KEY, _KEY_OR_END):
            self.walk.key(token)
            self.state = _COLON
        elif self.state in (_VALUE, _VALUE_OR_END) and self.walk.stack:
            self.walk.value(token, False)
            self.state = _COMMA_OR_END
        else:
            raise self._refused()

    def open(self, token: bytes) -> None:
        if self.state not in (_VALUE, _VALUE_OR_END):
            raise _unreadable("not valid JSON")
        array = token == b"["
        self.walk.open(array)
        self.state = _VALUE_OR_END if array else _KEY_OR_END

    def close(self, token: bytes) -> None:
        array = token == b"]"
        stack = self.walk.stack
        if not stack or stack[-1].array != array or \
                self.state not in ((_VALUE_OR_END, _COMMA_OR_END) if array else (_KEY_OR_END, _COMMA_OR_END)):
            raise _unreadable("not valid JSON")
        self.walk.close()
        self.state = _COMMA_OR_END if stack else _DONE

    def comma(self, token: bytes) -> None:  # token unused: one signature for every step
        if self.state != _COMMA_OR_END or not self.walk.stack:
            raise _unreadable("not valid JSON")
        self.state = _VALUE if self.walk.stack[-1].array else _KEY

    def colon(self, token: bytes) -> None:  # token unused: one signature for every step
        if self.state != _COLON:
            raise _unreadable("not valid JSON")
        self.state = _VALUE

    def finish(self, body: bytes, end: int) -> None:
        """After the last token: one whole object, then blanks only."""
        tail = _GAP.fullmatch(body, end)
        if self.state != _DONE or tail is None or tail.group(1) is not None:
            raise _unreadable("not a JSON object" if self.state == _VALUE else "not valid JSON")
