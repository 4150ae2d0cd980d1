"""What the relay learns of the agent's own loop from its model calls: whether the loop can run commands at all,
when the agent gave its final answer, and whether the provider refused the agent's client as outdated.

* **No shell tool.** A CLI agent that works by tool calls and offers the model no shell tool cannot do the task: the
  model invents command output and the run "completes" (codex 0.144.0 and later with a custom provider and no explicit
  model, openai/codex #34758). The first model call offering any tool is the agent's loop (side calls such as
  opencode's title request offer none); when ``require_shell`` and that call offers no shell or exec tool, it and
  every later model call are refused, and the task is an error of the agent's configuration, never a score.
* **The final answer.** A model call that offered tools answered (2xx) without a tool call is the agent's final
  answer. :meth:`LoopWatch.answered_idle` says how long ago the last model call ended after one, while no other is
  in flight: the agent's window ends once that passes its grace (codex can hang after its final message behind a
  proxy, openai/codex-action #169).
* **An outdated client.** A 400 whose message names the client's version (from its ``User-Agent``) or says the
  client must be upgraded: the provider refuses this build of the CLI, an infrastructure error of the run's pins.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: Tool names (lower case) and tool types that run a shell command, across the CLIs and APIs.
SHELL_TOOLS = frozenset({"shell", "exec_command", "shell_command", "local_shell", "unified_exec", "container.exec",
                         "bash", "run_shell_command", "execute_command", "terminal"})
#: Anthropic's client-run bash tool types are versioned (``bash_20250124``).
_VERSIONED_BASH = re.compile(r"bash_[0-9]{8}")
#: A body past this many bytes is not parsed for its tools: it is a long conversation, the loop's by then.
PARSE_MAX = 16 << 20
#: The APIs whose calls carry an agent's loop (``apis.ModelCall.api``).
LOOP_APIS = frozenset({"chat.completions", "responses", "anthropic.messages"})
_VERSION = re.compile(r"\b([0-9]+\.[0-9]+\.[0-9]+(?:[-+][0-9A-Za-z.-]+)?)\b")
_OUTDATED = re.compile(r"(requires?|needs?) a (newer|more recent|later) (version|release)|"
                       r"(outdated|unsupported|deprecated|too old|old) (client|version|cli|app)|"
                       r"(please|you must|must) (upgrade|update)|upgrade (to|your) (the )?(latest|newer|client|cli)",
                       re.IGNORECASE)
#: Bytes of a 400's body kept to read its message.
ERROR_HEAD = 8192


def tool_names(body: Mapping[str, Any]) -> list[str] | None:
    """The names (else types) of the tools a model call's body offers, namespaces opened; ``None`` when it offers
    none (no ``tools``, or an empty list)."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    names: list[str] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else tool.get("name")
        kind = tool.get("type")
        names.append(str(name if isinstance(name, str) and name else kind))
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            names += tool_names({"tools": tool["tools"]}) or []
        if isinstance(kind, str) and kind != "function" and kind not in names:
            names.append(kind)  # a typed tool (local_shell, bash_20250124) named otherwise still counts by type
    return names or None


def offers_shell(names: Iterable[str]) -> bool:
    return any(name.lower() in SHELL_TOOLS or _VERSIONED_BASH.fullmatch(name) for name in names)


def client_version(user_agent: str) -> str | None:
    """The version a client names in its ``User-Agent`` (``codex_cli_rs/0.171.0 ...``, ``claude-cli/2.1.332``)."""
    match = _VERSION.search(user_agent)
    return match.group(1) if match else None


def refuses_client(status: int, body: bytes, user_agent: str) -> str | None:
    """The provider's message when a 400 refuses the client as outdated (it names the client's version, or says
    to upgrade), else ``None``."""
    if status != 400 or not body:
        return None
    text = body[:ERROR_HEAD].decode("utf-8", "replace")
    message = text
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        found = error.get("message") if isinstance(error, dict) else payload.get("message")
        if isinstance(found, str):
            message = found
    version = client_version(user_agent)
    named = version is not None and version in message
    if not named and not _OUTDATED.search(message):
        return None
    return " ".join(message.split())[:300]


@dataclass(frozen=True)
class LoopRefusal:
    """Why the agent's loop cannot do the task: the tools its first loop call offered (none a shell)."""

    api: str
    offered: tuple[str, ...]

    def message(self) -> str:
        shown = ", ".join(self.offered[:20]) + (", ..." if len(self.offered) > 20 else "")
        return (f"the agent's configuration offers the model no shell tool: its first {self.api} call offered "
                f"[{shown}] and none runs a command (a CLI that lost its shell tool, e.g. codex with a custom "
                "provider and no explicit model: openai/codex #34758); the model would invent command output")


class LoopWatch:
    """The relay's view of one agent's loop (thread-safe: every exchange of the relay reports here).

    ``require_shell``: the agent is a CLI preset that works by tool calls, judged by its first loop call."""

    def __init__(self, *, require_shell: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.require_shell = require_shell
        self._clock = clock
        self._lock = threading.Lock()
        self._decided = False  # the first call offering tools was seen
        self.refusal: LoopRefusal | None = None
        self._in_flight = 0
        self._final_at: float | None = None  # when the last final answer ended (None: the last loop call was not one)
        self._last_end: float | None = None
        self.final_answers = 0
        self.outdated: str | None = None  # the provider's message refusing the client
        self.outdated_client: str = ""

    def admit(self, api: str | None, body: bytes) -> bool:
        """A model call is about to go upstream: whether it offers tools (the loop's). Raises nothing: the relay asks
        :attr:`refusal` afterwards."""
        offers = False
        if api in LOOP_APIS:
            names = self._names(body)
            offers = names is not None
            with self._lock:
                if offers and not self._decided:
                    self._decided = True
                    if self.require_shell and not offers_shell(names or ()):
                        self.refusal = LoopRefusal(api or "", tuple(names or ()))
        with self._lock:
            self._in_flight += 1
        return offers

    def _names(self, body: bytes) -> list[str] | None:
        if len(body) > PARSE_MAX:
            return ["(a body too large to read its tools)"] if self._decided else None
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        return tool_names(parsed) if isinstance(parsed, dict) else None

    def ended(self, *, offered_tools: bool, status: int, tool_calls: int | None) -> None:
        """A model call admitted by :meth:`admit` ended (answered, refused or cut)."""
        now = self._clock()
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._last_end = now
            if offered_tools and 200 <= status < 300:
                final = tool_calls == 0
                self._final_at = now if final else None
                self.final_answers += int(final)

    def outdated_refusal(self, message: str, user_agent: str) -> None:
        with self._lock:
            if self.outdated is None:
                self.outdated, self.outdated_client = message, user_agent[:120]

    def answered_idle(self) -> float | None:
        """Seconds since the last model call ended, when the agent's last loop call got its final answer and no call
        is in flight; ``None`` otherwise."""
        with self._lock:
            if self._final_at is None or self._in_flight or self._last_end is None:
                return None
            return max(0.0, self._clock() - self._last_end)

    @property
    def refused(self) -> bool:
        with self._lock:
            return self.refusal is not None
