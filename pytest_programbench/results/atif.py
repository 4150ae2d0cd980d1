"""Each attempt's trajectory in Harbor's Agent Trajectory Interchange Format (ATIF v1.7), beside ours:
``<id>/trajectory.atif.json``, which Docent, Arize Phoenix, Grafana's plugin and Harbor's viewer open.

Built after the agent's window from what the harness itself recorded, whatever the agent: the relay's exchanges
(``model-replay.jsonl``: each model call's request and answer, in order; else ``model-requests.jsonl``'s metadata
alone) and the reference's calls (``binary-calls.jsonl``). Step 1 is the task's prompt (the first model call's first
user message); each answered model call is an agent step (its text, its tool calls with their arguments, its tokens),
whose observation holds the tool results the next call sent back; each call of ``/workspace/binary`` is a system step
at its time. Bounded: at most :data:`MAX_STEPS` model calls and :data:`MAX_CALLS` binary calls, texts clipped.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_programbench.core.atomic import atomic_write_text

ATIF_FILE = "trajectory.atif.json"
SCHEMA_VERSION = "ATIF-v1.7"
MAX_STEPS = 5000
MAX_CALLS = 2000
TEXT_MAX = 64 << 10  # characters of one message or observation kept
RESULT_TYPES = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")


@dataclass
class Answer:
    """What one model call answered: its text and its tool calls (id, name, arguments)."""

    text: str = ""
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)


def _clip(text: str) -> str:
    return text if len(text) <= TEXT_MAX else text[:TEXT_MAX] + f"... [{len(text) - TEXT_MAX} characters clipped]"


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        with contextlib.suppress(ValueError):
            parsed = json.loads(raw)
            return parsed if isinstance(parsed, dict) else {"input": parsed}
        return {"input": raw}
    return {} if raw is None else {"input": raw}


def _events(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, or the one JSON body."""
    text = data.decode("utf-8", "replace")
    if not text.lstrip().startswith("{"):
        for line in text.splitlines():
            if line.startswith("data:"):
                with contextlib.suppress(ValueError):
                    payload = json.loads(line[5:].strip())
                    if isinstance(payload, dict):
                        yield payload
        return
    with contextlib.suppress(ValueError):
        payload = json.loads(text)
        if isinstance(payload, dict):
            yield payload


def _responses_item(item: Mapping[str, Any], answer: Answer) -> None:
    kind = item.get("type")
    if kind == "message":
        answer.text += "".join(str(part.get("text") or "") for part in item.get("content") or []
                               if isinstance(part, dict))
    elif kind in ("function_call", "custom_tool_call"):
        answer.calls.append((str(item.get("call_id") or item.get("id")), str(item.get("name")),
                             _arguments(item.get("arguments", item.get("input")))))
    elif kind == "local_shell_call":
        answer.calls.append((str(item.get("call_id") or item.get("id")), "local_shell",
                             _arguments(item.get("action"))))


def parse_answer(data: bytes) -> Answer:
    """The text and tool calls of a model answer, in any of the three APIs' shapes, streamed or not."""
    answer = Answer()
    chat_calls: dict[int, list[str]] = {}
    blocks: dict[int, list[Any]] = {}
    for event in _events(data):
        kind = event.get("type")
        if kind == "response.completed" or (event.get("object") == "response" and "output" in event):
            response = event.get("response", event)
            for item in response.get("output") or [] if isinstance(response, dict) else []:
                if isinstance(item, dict):
                    _responses_item(item, answer)
        elif "choices" in event:
            for choice in event.get("choices") or []:
                part = (choice.get("delta") or choice.get("message") or {}) if isinstance(choice, dict) else {}
                answer.text += str(part.get("content") or "")
                for call in part.get("tool_calls") or []:
                    slot = chat_calls.setdefault(int(call.get("index", len(chat_calls))), ["", "", ""])
                    function = call.get("function") or {}
                    slot[0] = slot[0] or str(call.get("id") or "")
                    slot[1] = slot[1] or str(function.get("name") or "")
                    slot[2] += str(function.get("arguments") or "")
        elif kind in {"message", "message_start"}:
            for index, block in enumerate((event.get("message") or event).get("content") or []):
                blocks[index] = [block, ""]
        elif kind == "content_block_start":
            blocks[int(event.get("index", 0))] = [event.get("content_block") or {}, ""]
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            slot = blocks.setdefault(int(event.get("index", 0)), [{}, ""])
            slot[1] += str(delta.get("text") or delta.get("partial_json") or "")
    for cid, name, raw in chat_calls.values():
        answer.calls.append((cid, name, _arguments(raw)))
    for block, streamed in (blocks[i] for i in sorted(blocks)):
        if block.get("type") == "text":
            answer.text += streamed or str(block.get("text") or "")
        elif block.get("type") == "tool_use":
            answer.calls.append((str(block.get("id")), str(block.get("name")),
                                 _arguments(streamed or block.get("input"))))
    return answer


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_content_text(part.get("text", part.get("content", ""))) if isinstance(part, dict)
                         else str(part) for part in content)
    return "" if content is None else json.dumps(content)


def tool_results(body: Mapping[str, Any]) -> dict[str, str]:
    """Tool results a model call sends back (call id -> output), in any of the three APIs' shapes."""
    out: dict[str, str] = {}
    for item in body.get("input") or [] if isinstance(body.get("input"), list) else []:
        if isinstance(item, dict) and item.get("type") in RESULT_TYPES:
            out[str(item.get("call_id"))] = _content_text(item.get("output"))
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            out[str(message.get("tool_call_id"))] = _content_text(message.get("content"))
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                out[str(block.get("tool_use_id"))] = _content_text(block.get("content"))
    return out


def first_prompt(body: Mapping[str, Any]) -> str | None:
    """The task's prompt: the last user message of the first model call's conversation (a CLI may put its own
    context in user messages before it)."""
    if isinstance(body.get("input"), str):
        return str(body["input"])
    found = body.get("input") if isinstance(body.get("input"), list) else body.get("messages")
    items = found if isinstance(found, list) else []
    users = [_content_text(item.get("content")) for item in items if isinstance(item, dict) and
             item.get("role") == "user"]
    return users[-1] if users else None


def _lines(path: Path, limit: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with contextlib.suppress(OSError), path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    out.append(entry)
            if len(out) >= limit:
                break
    return out


def _iso(value: Any) -> str | None:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC).isoformat(timespec="milliseconds")
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(value.replace("Z", "+00:00")).isoformat(timespec="milliseconds")
    return None


def _metrics(usage: Any) -> dict[str, int] | None:
    if not isinstance(usage, dict):
        return None
    names = {"prompt_tokens": "input_tokens", "completion_tokens": "output_tokens",
             "cached_tokens": "cached_input_tokens"}
    metrics = {ours: usage[theirs] for ours, theirs in names.items() if isinstance(usage.get(theirs), int)}
    return metrics or None


class AtifBuilder:
    """One attempt's ATIF document from its task directory (see the module doc)."""

    def __init__(self, task_dir: Path, *, session_id: str, agent: str, agent_version: str, model: str | None) -> None:
        self.task_dir = task_dir
        self.session_id = session_id
        self.agent = agent
        self.agent_version = agent_version
        self.model = model

    def _model_steps(self) -> list[dict[str, Any]]:
        records = [r for r in _lines(self.task_dir / "model-requests.jsonl", MAX_STEPS * 2)
                   if r.get("api") in ("responses", "chat.completions", "anthropic.messages", "completions")]
        exchanges = [e for e in _lines(self.task_dir / "model-replay.jsonl", MAX_STEPS * 2) if "request_b64" in e]
        bodies: list[dict[str, Any]] = []
        answers: list[Answer | None] = []
        for exchange in exchanges:
            try:
                body = json.loads(base64.b64decode(exchange.get("request_b64") or ""))
            except ValueError:
                body = {}
            if not isinstance(body, dict) or "model" not in body:
                continue
            bodies.append(body)
            raw = exchange.get("response_b64")
            answers.append(parse_answer(base64.b64decode(raw)) if isinstance(raw, str) else None)
        steps: list[dict[str, Any]] = []
        prompt = next((p for p in (first_prompt(b) for b in bodies) if p), None)
        steps.append({"source": "user", "timestamp": _iso(records[0]["started_at"]) if records else None,
                      "message": _clip(prompt or "(the task's prompt: /workspace/prompt.md)")})
        for index, record in enumerate(records[:MAX_STEPS]):
            answer = answers[index] if index < len(answers) else None
            step: dict[str, Any] = {"source": "agent", "timestamp": _iso(record.get("started_at")),
                                    "model_name": record.get("model") or self.model,
                                    "message": _clip(answer.text if answer else "")}
            if answer is not None and answer.calls:
                step["tool_calls"] = [{"tool_call_id": cid, "function_name": name, "arguments": args}
                                      for cid, name, args in answer.calls]
                results = tool_results(bodies[index + 1]) if index + 1 < len(bodies) else {}
                known = [(cid, results[cid]) for cid, _, _ in answer.calls if cid in results]
                if known:
                    step["observation"] = {"results": [{"source_call_id": cid, "content": _clip(text)}
                                                       for cid, text in known]}
            metrics = _metrics(record.get("usage"))
            if metrics:
                step["metrics"] = metrics
            step["extra"] = {"status": record.get("status"), "api": record.get("api"),
                             "first_byte_s": record.get("first_byte_s"), "error": record.get("error")}
            steps.append(step)
        return steps

    def _binary_steps(self) -> list[dict[str, Any]]:
        steps = []
        for call in _lines(self.task_dir / "binary-calls.jsonl", MAX_CALLS):
            argv = call.get("argv") if isinstance(call.get("argv"), list) else []
            ended = f"exit {call.get('exit')}" if call.get("signal") is None else f"signal {call.get('signal')}"
            steps.append({"source": "system", "timestamp": _iso(call.get("at") or call.get("time")),
                          "message": _clip(f"/workspace/binary called: {json.dumps(argv)} ({ended}, "
                                           f"{call.get('duration_s')} s, cwd {call.get('cwd')})"),
                          "extra": {"binary_call": {k: call.get(k) for k in ("argv", "exit", "signal", "duration_s",
                                                                              "cwd", "tty", "flags")}}})
        return steps

    def build(self) -> dict[str, Any]:
        model_steps = self._model_steps()
        head, rest = model_steps[:1], model_steps[1:] + self._binary_steps()
        rest.sort(key=lambda s: s.get("timestamp") or "")  # ISO 8601 in UTC: sorts by time
        steps = [dict(step, step_id=n) for n, step in enumerate(head + rest, 1)]
        for step in steps:
            if step.get("timestamp") is None:
                del step["timestamp"]
        agent_steps = [s for s in steps if s["source"] == "agent"]
        totals = {name: sum(s.get("metrics", {}).get(name, 0) for s in agent_steps)
                  for name in ("prompt_tokens", "completion_tokens", "cached_tokens")}
        return {"schema_version": SCHEMA_VERSION, "session_id": self.session_id,
                "agent": {"name": self.agent, "version": self.agent_version, "model_name": self.model},
                "steps": steps,
                "notes": "Written by pytest-programbench from its model relay's records and the reference's call "
                         "log; each /workspace/binary call is a system step.",
                "final_metrics": {"total_prompt_tokens": totals["prompt_tokens"],
                                  "total_completion_tokens": totals["completion_tokens"],
                                  "total_cached_tokens": totals["cached_tokens"], "total_steps": len(steps)}}

    def write(self) -> Path:
        path = self.task_dir / ATIF_FILE
        atomic_write_text(path, json.dumps(self.build(), indent=1, ensure_ascii=False))
        return path
