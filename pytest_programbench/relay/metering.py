"""Metering: the token usage and tool calls of a response, read as it goes by, in every API shape the agents use.

* OpenAI chat completions: the body's ``usage``; streamed, the ``usage`` of the final chunk
  (``stream_options.include_usage``);
* OpenAI responses: the body's ``usage``; streamed, ``response.usage`` of ``response.completed`` (or
  ``response.incomplete`` / ``response.failed``);
* Anthropic messages: the body's ``usage``; streamed, ``message_start``'s ``message.usage`` updated by every
  ``message_delta``'s cumulative ``usage``.

Usage is ``None`` when the upstream gave none, never 0. The server-sent event decoder is ours and incremental: the
relay passes the raw bytes on as they arrive (no re-framing, no added delay) and the tap reads a copy with bounded
memory (an event past 16 MiB is dropped, not held). It stays ours rather than httpx-sse's: httpx-sse's public API
decodes only by iterating an ``httpx.Response`` itself (its line decoders are private), so it cannot be fed a copy of
the raw byte chunks the relay passes on, and it holds an event's data whole, with no bound per event.
"""

from __future__ import annotations

import contextlib
import io
import json
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

_MiB = 1 << 20


@dataclass(frozen=True)
class Usage:
    """Token usage of one response, normalised across API shapes; each field ``None`` when not reported.

    ``input_tokens`` counts every prompt token: for Anthropic it adds ``cache_creation_input_tokens`` and
    ``cache_read_input_tokens`` to ``input_tokens`` (which excludes them), so it means the same as OpenAI's
    ``prompt_tokens``. ``raw`` is the usage object exactly as the upstream sent it (merged, for Anthropic streams).
    """

    input_tokens: int | None
    output_tokens: int | None
    total_tokens: int | None
    cached_input_tokens: int | None = None
    reasoning_tokens: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.total_tokens, "cached_input_tokens": self.cached_input_tokens,
                "reasoning_tokens": self.reasoning_tokens, "raw": dict(self.raw)}


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _dig(mapping: Mapping[str, Any], *keys: str) -> Any:
    value: Any = mapping
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _sum(*values: int | None) -> int | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


def usage_from_mapping(usage: Mapping[str, Any]) -> Usage | None:
    """Normalise a ``usage`` object of any supported API shape; ``None`` when it holds no token counts."""
    if "prompt_tokens" in usage or "completion_tokens" in usage:  # chat completions, legacy completions
        inp, out = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
        total = _count(usage.get("total_tokens"))
        cached = _count(_dig(usage, "prompt_tokens_details", "cached_tokens"))
        reasoning = _count(_dig(usage, "completion_tokens_details", "reasoning_tokens"))
    elif "input_tokens" in usage or "output_tokens" in usage:  # responses API, Anthropic messages
        out = _count(usage.get("output_tokens"))
        total = _count(usage.get("total_tokens"))
        reasoning = _count(_dig(usage, "output_tokens_details", "reasoning_tokens"))
        cache_read = _count(usage.get("cache_read_input_tokens"))
        cache_write = _count(usage.get("cache_creation_input_tokens"))
        if cache_read is not None or cache_write is not None:  # Anthropic: input_tokens excludes the cache
            inp = _count(usage.get("input_tokens"))
            inp = None if inp is None else inp + (cache_read or 0) + (cache_write or 0)
            cached = cache_read
        else:
            inp = _count(usage.get("input_tokens"))
            cached = _count(_dig(usage, "input_tokens_details", "cached_tokens"))
    else:
        return None
    if inp is None and out is None and total is None:
        return None
    if total is None and inp is not None and out is not None:
        total = inp + out
    return Usage(inp, out, total, cached, reasoning, dict(usage))


_TOOL_ITEM_TYPES = ("function_call", "local_shell_call", "custom_tool_call", "shell_call", "apply_patch_call")


def tool_calls_in_body(body: Any) -> int:
    """Tool calls in a complete (non-streamed) response of any supported API shape."""
    if not isinstance(body, Mapping):
        return 0
    count = 0
    for choice in body.get("choices") or []:  # chat completions
        calls = _dig(choice, "message", "tool_calls") if isinstance(choice, Mapping) else None
        count += len(calls) if isinstance(calls, list) else 0
    content = body.get("content")  # Anthropic messages
    if isinstance(content, list):
        count += sum(1 for block in content if isinstance(block, Mapping) and block.get("type") == "tool_use")
    output = body.get("output")  # responses
    if isinstance(output, list):
        count += sum(1 for item in output if isinstance(item, Mapping) and item.get("type") in _TOOL_ITEM_TYPES)
    return count


def usage_from_body(body: Any) -> Usage | None:
    """Usage of a complete (non-streamed) JSON response body."""
    if not isinstance(body, Mapping):
        return None
    usage = body.get("usage")
    if isinstance(usage, Mapping):
        return usage_from_mapping(usage)
    response = body.get("response")  # an event or wrapper carrying a responses-API object
    if isinstance(response, Mapping) and isinstance(response.get("usage"), Mapping):
        return usage_from_mapping(response["usage"])
    return None


class StreamUsage:
    """Usage of a streamed response, fed one decoded server-sent event payload at a time."""

    def __init__(self) -> None:
        self._raw: dict[str, Any] | None = None
        self.tool_calls = 0
        self._chat_calls: set[tuple[Any, Any]] = set()

    def feed(self, event: Any) -> None:
        if not isinstance(event, Mapping):
            return
        kind = event.get("type")
        self._count_tool_calls(kind, event)
        if kind == "message_start":  # Anthropic: the prompt's usage, output so far
            usage = _dig(event, "message", "usage")
            if isinstance(usage, Mapping):
                self._merge(usage, replace=True)
        elif kind == "message_delta":  # Anthropic: cumulative counts
            usage = event.get("usage")
            if isinstance(usage, Mapping):
                self._merge(usage, replace=False)
        elif isinstance(kind, str) and kind.startswith("response."):  # responses API
            usage = _dig(event, "response", "usage")
            if isinstance(usage, Mapping):
                self._merge(usage, replace=True)
        elif isinstance(event.get("usage"), Mapping):  # chat completions chunk with include_usage
            self._merge(event["usage"], replace=True)

    def _count_tool_calls(self, kind: Any, event: Mapping[str, Any]) -> None:
        """Tool calls the model made: one per Responses output item, Anthropic tool_use block or chat call index."""
        if kind == "response.output_item.done":
            self.tool_calls += _dig(event, "item", "type") in _TOOL_ITEM_TYPES
        elif kind == "content_block_start":
            self.tool_calls += _dig(event, "content_block", "type") in ("tool_use", "server_tool_use")
        elif kind is None and isinstance(event.get("choices"), list):
            for choice in event["choices"]:
                calls = _dig(choice, "delta", "tool_calls") if isinstance(choice, Mapping) else None
                for call in calls if isinstance(calls, list) else []:
                    if isinstance(call, Mapping):
                        self._chat_calls.add((choice.get("index"), call.get("index", call.get("id"))))
            self.tool_calls = len(self._chat_calls)

    def _merge(self, usage: Mapping[str, Any], *, replace: bool) -> None:
        if replace or self._raw is None:
            self._raw = {}
        self._raw.update({key: value for key, value in usage.items() if value is not None})

    @property
    def usage(self) -> Usage | None:
        return None if self._raw is None else usage_from_mapping(self._raw)


class SSEDecoder:
    """Incremental ``text/event-stream`` decoder: bytes in, each event's ``data`` out (bounded memory)."""

    def __init__(self, max_event_bytes: int = 16 * _MiB) -> None:
        self._pending = b""
        self._data: list[bytes] = []
        self._size = 0
        self._max = max_event_bytes
        self._overflow = False

    def feed(self, chunk: bytes) -> Iterator[str]:
        buffer = self._pending + chunk
        lines = buffer.splitlines(keepends=True)
        self._pending = b""
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            self._pending = lines.pop()
        elif lines and lines[-1].endswith(b"\r"):
            # "\r" may be the first half of "\r\n": keep it until the next byte tells.
            self._pending = lines.pop()
        if len(self._pending) > self._max:
            self._pending, self._overflow = b"", True
        for raw in lines:
            yield from self._line(raw.rstrip(b"\r\n"))

    def close(self) -> Iterator[str]:
        pending, self._pending = self._pending, b""
        if pending:
            yield from self._line(pending.rstrip(b"\r\n"))
        yield from self._line(b"")

    def _line(self, line: bytes) -> Iterator[str]:
        if not line:
            if self._data and not self._overflow:
                yield b"\n".join(self._data).decode("utf-8", "replace")
            self._data, self._size, self._overflow = [], 0, False
            return
        name, _, value = line.partition(b":")
        if name != b"data":
            return
        value = value.removeprefix(b" ")
        self._size += len(value)
        if self._size > self._max:
            self._data, self._overflow = [], True
        elif not self._overflow:
            self._data.append(value)


class UsageTap:
    """Watches a response body go by and extracts usage, streamed or not, without holding a stream."""

    def __init__(self, content_type: str, content_encoding: str, max_json_bytes: int = 32 * _MiB) -> None:
        self.streamed = "text/event-stream" in content_type.lower()
        encoding = content_encoding.strip().lower()
        self._inflate: Any = None
        self._unreadable = False
        if encoding in ("gzip", "x-gzip", "deflate"):
            self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, auto-detected
        elif encoding not in ("", "identity"):
            self._unreadable = True
        self._sse = SSEDecoder()
        self._stream = StreamUsage()
        self._body = io.BytesIO()
        self._max_json = max_json_bytes
        self.tool_calls: int | None = None  # after finish(): how many tool calls the response made

    def feed(self, chunk: bytes) -> None:
        if self._unreadable:
            return
        if self._inflate is not None:
            try:
                chunk = self._inflate.decompress(chunk)
            except zlib.error:
                self._unreadable = True
                return
        if self.streamed:
            for data in self._sse.feed(chunk):
                self._event(data)
        elif self._body.tell() + len(chunk) <= self._max_json:
            self._body.write(chunk)
        else:
            self._unreadable = True

    def _event(self, data: str) -> None:
        if data.strip() == "[DONE]":
            return
        with contextlib.suppress(ValueError):
            self._stream.feed(json.loads(data))

    def finish(self) -> Usage | None:
        if self._unreadable:
            return None
        if self.streamed:
            for data in self._sse.close():
                self._event(data)
            self.tool_calls = self._stream.tool_calls
            return self._stream.usage
        try:
            body = json.loads(self._body.getvalue())
        except ValueError:
            return None
        self.tool_calls = tool_calls_in_body(body)
        return usage_from_body(body)
