"""A scripted model server on 127.0.0.1 speaking what the real CLI agents speak, for tests without a model.

OpenAI Responses (streamed as server-sent events, codex), Chat Completions (streamed with ``include_usage``, or not;
opencode) and Anthropic Messages (streamed, or not; claude-code), plus what the CLIs probe at start (``HEAD /``,
a models list, ``count_tokens``). Every model request is answered from a fixed script of :class:`Step` s: the step
is chosen by how many tool results the conversation already holds (stateless, so side requests and retries do not
shift it), each step a shell command through whichever shell tool the request offers (``exec_command``, ``shell``,
``bash``, ``Bash``...), the last one plain text. A request that offers no tools (a title, a topic) gets a short
text. Every response carries usage; :attr:`ScriptedModels.sent` totals exactly what was sent, normalised the way the
relay counts (``input`` includes cached tokens).

:class:`Faults` make it the failing provider of a real run: 429 with ``Retry-After`` for the first N model requests
or the first seconds, 503 (or any status) for a while, a rejected key, a stream cut half-way, a delay before every
answer. The server counts the model requests it answered with each status and the most it had in flight at once.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

SHELL_TOOLS = ("exec_command", "shell_command", "shell", "bash", "Bash", "local_shell")
TOOL_RESULT_TYPES = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")


@dataclass(frozen=True)
class Step:
    """One assistant turn: a shell command (``None``: the final text turn) and the usage reported for it."""

    text: str
    command: str | None
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0


@dataclass
class Faults:
    """What the server does wrong to model requests (POSTs to a model API), counted from the first one."""

    rate_limit_first: int = 0  # the first N model requests answered 429
    rate_limit_for: float = 0.0  # ... and every one in the first this many seconds
    retry_after: str | None = "1"  # the 429s' Retry-After (None: none)
    unavailable_for: float = 0.0  # every model request in the first this many seconds answered `unavailable_status`
    unavailable_status: int = 503
    reject_key: bool = False  # every model request answered 401
    break_stream: tuple[int, ...] = ()  # these model requests (1-based) have their stream cut half-way
    delay: float = 0.0  # seconds before every model answer (in flight meanwhile)
    # Model requests whose User-Agent holds this are refused with a 400 naming the client's version, as providers
    # refuse outdated clients for newer models (empty: none).
    refuse_client: str = ""


SIDE_USAGE = Step("ok", None, 11, 2, 0)  # what a tool-less side request (a title, a probe) is answered with


@dataclass
class Totals:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    tool_calls: int = 0
    apis: list[str] = field(default_factory=list)

    def add(self, api: str, step: Step) -> None:
        self.requests += 1
        self.input_tokens += step.input_tokens
        self.output_tokens += step.output_tokens
        self.cached_tokens += step.cached_tokens
        self.apis.append(api)


class ScriptedModels:
    """``with ScriptedModels(steps) as server:`` serves ``server.base_url`` (ends in ``/v1``) until the block ends.

    ``withhold_first``: seconds the agent's first turn (the first request offering tools) waits before any byte of
    its response (not even headers)."""

    def __init__(self, steps: Sequence[Step], *, withhold_first: float = 0.0, faults: Faults | None = None) -> None:
        if not steps or steps[-1].command is not None:
            raise ValueError("a script ends with a text step")
        self.steps = list(steps)
        self.withhold_first = withhold_first
        self.faults = faults or Faults()
        self.statuses: list[int] = []  # the status of every model request, in order
        self.arrivals: list[float] = []  # when each model request arrived (time.monotonic()), in order
        self.in_flight = 0
        self.peak_in_flight = 0  # model requests in flight at once, at most
        self._first_model_request: float | None = None
        self.sent = Totals()
        self.log: list[str] = []  # "METHOD path" of every request
        self.bodies: list[dict[str, Any]] = []  # every model request's JSON body
        self.unexpected: list[str] = []
        self.keys: list[str] = []  # the API key of every model request (x-api-key, else the bearer token)
        self.user_agents: list[str] = []  # the User-Agent of every model request
        self.refused_clients: list[str] = []  # User-Agents refused as outdated (Faults.refuse_client)
        self.chosen: list[int] = []  # the script index answered for each tool-offering request
        self._lock = threading.Lock()
        self._withheld = False
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="scripted-models", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> ScriptedModels:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    # -- the script

    def _pick(self, api: str, body: dict[str, Any]) -> tuple[Step, tuple[str, dict[str, Any]] | None]:
        """The step for this request and the tool call to make (None: answer with text)."""
        tools = _tools(api, body)
        with self._lock:
            if not tools:
                self.sent.add(api, SIDE_USAGE)
                return SIDE_USAGE, None
            index = min(_tool_results(api, body), len(self.steps) - 1)
            step = self.steps[index]
            self.chosen.append(index)
            self.sent.add(api, step)
        if step.command is None:
            return step, None
        for name in SHELL_TOOLS:
            if name in tools:
                with self._lock:
                    self.sent.tool_calls += 1
                return step, (name, _arguments(tools[name], step.command))
        self.unexpected.append(f"{api}: no shell tool among {sorted(tools)}")
        return step, None

    def _wait_first(self) -> None:
        with self._lock:
            first, self._withheld = not self._withheld, True
        if first and self.withhold_first:
            self._closing.wait(self.withhold_first)  # the scripted silence (ends early only at shutdown)

    def _fault(self) -> tuple[int, int | None]:
        """(the 1-based number of this model request, the status it is answered with instead, if any)."""
        faults = self.faults
        with self._lock:
            now = time.monotonic()
            if self._first_model_request is None:
                self._first_model_request = now
            since = now - self._first_model_request
            number = len(self.statuses) + 1
            self.arrivals.append(now)
            if faults.reject_key:
                status: int | None = 401
            elif number <= faults.rate_limit_first or since < faults.rate_limit_for:
                status = 429
            elif since < faults.unavailable_for:
                status = faults.unavailable_status
            else:
                status = None
            self.statuses.append(status or 200)
        return number, status

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        models = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                models.log.append(f"HEAD {self.path}")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                models.log.append(f"GET {self.path}")
                path = self.path.split("?", 1)[0].rstrip("/")
                if models.faults.reject_key:  # a rejected key is rejected on every path (the relay's probe asks)
                    return self._json(401, {"type": "error", "error": {"type": "authentication_error",
                                                                        "message": "scripted"}})
                if path.endswith("/models"):
                    data = [{"id": "scripted", "object": "model", "type": "model", "display_name": "scripted",
                             "created": 0, "created_at": "2026-01-01T00:00:00Z", "owned_by": "pb"}]
                    return self._json(200, {"object": "list", "data": data, "has_more": False,
                                            "first_id": "scripted", "last_id": "scripted"})
                if path in ("", "/v1"):
                    return self._json(200, {"ok": True})
                models.unexpected.append(f"GET {self.path}")
                self._json(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                models.log.append(f"POST {self.path}")
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    models.unexpected.append(f"POST {self.path}: not JSON")
                    return self._json(400, {"error": {"message": "body is not JSON"}})
                path = self.path.split("?", 1)[0].rstrip("/")
                if path.endswith("/messages/count_tokens"):
                    return self._json(200, {"input_tokens": 10})
                api = {"/responses": "responses", "/chat/completions": "chat",
                       "/messages": "anthropic"}.get("/" + path.rsplit("/v1/", 1)[-1])
                if api is None:
                    models.unexpected.append(f"POST {self.path}")
                    return self._json(404, {"error": {"message": f"no route {self.path}"}})
                with models._lock:
                    models.in_flight += 1
                    models.peak_in_flight = max(models.peak_in_flight, models.in_flight)
                try:
                    self._model(api, body)
                finally:
                    with models._lock:
                        models.in_flight -= 1

            def _model(self, api: str, body: dict[str, Any]) -> None:
                faults = models.faults
                agent = self.headers.get("User-Agent") or ""
                if faults.refuse_client and faults.refuse_client in agent:
                    models.refused_clients.append(agent)
                    version = agent.split("/", 1)[-1].split(" ", 1)[0]
                    message = (f"The model requires a newer version of the client. Your version {version} is "
                               "outdated: please upgrade to the latest CLI and try again.")
                    return self._json(400, {"type": "error", "error": {"type": "invalid_request_error",
                                                                        "message": message}})
                if faults.delay:
                    models._closing.wait(faults.delay)
                number, status = models._fault()
                if status is not None:
                    headers = {"Retry-After": faults.retry_after} if status == 429 and faults.retry_after else {}
                    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "overloaded_error")
                    return self._json(status, {"type": "error", "error": {"type": kind, "message": "scripted"}},
                                      headers)
                self.cut_at = number in faults.break_stream
                models.bodies.append(body)
                models.user_agents.append(self.headers.get("User-Agent") or "")
                models.keys.append(self.headers.get("x-api-key")
                                   or (self.headers.get("Authorization") or "").removeprefix("Bearer "))
                step, call = models._pick(api, body)
                if step is not SIDE_USAGE:  # the agent's first turn, not a side request such as a title
                    models._wait_first()
                model = str(body.get("model") or "scripted")
                if api == "responses":
                    return self._sse(_responses_events(model, step, call))
                if api == "chat":
                    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    if body.get("stream"):
                        return self._sse(_chat_events(model, step, call, include_usage))
                    return self._json(200, _chat_body(model, step, call))
                if body.get("stream"):
                    return self._sse(_anthropic_events(model, step, call))
                return self._json(200, _anthropic_body(model, step, call))

            def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _sse(self, events: Iterator[tuple[str | None, Any]]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                frames = [((f"event: {name}\n" if name else "")
                           + f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n").encode()
                          for name, payload in events]
                if getattr(self, "cut_at", False):
                    # The whole stream's length announced, half of it sent, then the connection closes: a break.
                    self.send_header("Content-Length", str(sum(map(len, frames))))
                    frames = frames[:len(frames) // 2]
                self.end_headers()
                self.close_connection = True
                for frame in frames:
                    self.wfile.write(frame)
                    self.wfile.flush()

        return Handler


# -- request shapes ----------------------------------------------------------------------------------------------


def _tools(api: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Tool name -> its JSON schema, whatever the API's shape."""
    out: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        if api == "chat":
            function = tool.get("function") or {}
            out[str(function.get("name"))] = function.get("parameters") or {}
        elif api == "anthropic":
            out[str(tool.get("name"))] = tool.get("input_schema") or {}
        elif tool.get("type") == "local_shell":
            out["local_shell"] = {}
        else:
            out[str(tool.get("name"))] = tool.get("parameters") or {}
    return out


def _tool_results(api: str, body: dict[str, Any]) -> int:
    if api == "responses":
        return sum(1 for item in body.get("input") or [] if isinstance(item, dict)
                   and item.get("type") in TOOL_RESULT_TYPES)
    if api == "chat":
        return sum(1 for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "tool")
    count = 0
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            count += sum(1 for block in content if isinstance(block, dict) and block.get("type") == "tool_result")
    return count


def _arguments(schema: dict[str, Any], command: str) -> dict[str, Any]:
    """Arguments for a shell tool, from its schema: ``cmd`` / ``command`` (a string, or an argv array)."""
    props = schema.get("properties") or {}
    args: dict[str, Any] = {}
    for key in ("cmd", "command"):
        if key in props:
            args[key] = ["bash", "-lc", command] if props[key].get("type") == "array" else command
            break
    else:
        args["command"] = command
    if "description" in props:
        args["description"] = "scripted step"
    return args


# -- response shapes ---------------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def _responses_usage(step: Step) -> dict[str, Any]:
    return {"input_tokens": step.input_tokens, "input_tokens_details": {"cached_tokens": step.cached_tokens},
            "output_tokens": step.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": step.input_tokens + step.output_tokens}


def _responses_events(model: str, step: Step, call: tuple[str, dict[str, Any]] | None
                      ) -> Iterator[tuple[str | None, Any]]:
    rid = _id("resp")
    shell = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "output": []}
    yield "response.created", {"type": "response.created", "response": {**shell, "status": "in_progress"}}
    items: list[dict[str, Any]] = []
    mid = _id("msg")
    message = {"type": "message", "id": mid, "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": step.text, "annotations": []}]}
    yield "response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                         "item": {**message, "status": "in_progress", "content": []}}
    yield "response.output_text.delta", {"type": "response.output_text.delta", "item_id": mid, "output_index": 0,
                                         "content_index": 0, "delta": step.text}
    yield "response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": message}
    items.append(message)
    if call is not None:
        name, args = call
        if name == "local_shell":
            item: dict[str, Any] = {"type": "local_shell_call", "id": _id("lsh"), "call_id": _id("call"),
                                    "status": "completed", "action": {"type": "exec", "command": args["command"]}}
        else:
            item = {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": name,
                    "arguments": json.dumps(args), "status": "completed"}
        yield "response.output_item.added", {"type": "response.output_item.added", "output_index": 1, "item": item}
        yield "response.output_item.done", {"type": "response.output_item.done", "output_index": 1, "item": item}
        items.append(item)
    done = {**shell, "status": "completed", "output": items, "usage": _responses_usage(step)}
    yield "response.completed", {"type": "response.completed", "response": done}


def _chat_usage(step: Step) -> dict[str, Any]:
    return {"prompt_tokens": step.input_tokens, "completion_tokens": step.output_tokens,
            "total_tokens": step.input_tokens + step.output_tokens,
            "prompt_tokens_details": {"cached_tokens": step.cached_tokens}}


def _chat_body(model: str, step: Step, call: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": step.text}
    if call is not None:
        message["tool_calls"] = [{"id": _id("call"), "type": "function",
                                  "function": {"name": call[0], "arguments": json.dumps(call[1])}}]
    return {"id": _id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if call else "stop"}],
            "usage": _chat_usage(step)}


def _chat_events(model: str, step: Step, call: tuple[str, dict[str, Any]] | None, include_usage: bool
                 ) -> Iterator[tuple[str | None, Any]]:
    base = {"id": _id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield None, chunk({"role": "assistant", "content": ""})
    yield None, chunk({"content": step.text})
    if call is not None:
        yield None, chunk({"tool_calls": [{"index": 0, "id": _id("call"), "type": "function",
                                           "function": {"name": call[0], "arguments": json.dumps(call[1])}}]})
    yield None, chunk({}, "tool_calls" if call else "stop")
    # Usage last, in a chunk of its own, as OpenAI does with include_usage (sent always: it is what we count).
    yield None, {**base, "choices": [], "usage": _chat_usage(step)}
    del include_usage
    yield None, "[DONE]"


def _anthropic_usage(step: Step) -> dict[str, Any]:
    # input_tokens excludes the cache: the relay adds cache_read_input_tokens back, so the totals match.
    return {"input_tokens": step.input_tokens - step.cached_tokens, "cache_read_input_tokens": step.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": step.output_tokens}


def _anthropic_body(model: str, step: Step, call: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": step.text}]
    if call is not None:
        content.append({"type": "tool_use", "id": _id("toolu"), "name": call[0], "input": call[1]})
    return {"id": _id("msg"), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": "tool_use" if call else "end_turn", "stop_sequence": None, "usage": _anthropic_usage(step)}


def _anthropic_events(model: str, step: Step, call: tuple[str, dict[str, Any]] | None
                      ) -> Iterator[tuple[str | None, Any]]:
    usage = _anthropic_usage(step)
    start: dict[str, Any] = {"id": _id("msg"), "type": "message", "role": "assistant", "model": model,
                             "content": [], "stop_reason": None, "stop_sequence": None,
                             "usage": {**usage, "output_tokens": 1}}
    yield "message_start", {"type": "message_start", "message": start}
    yield "content_block_start", {"type": "content_block_start", "index": 0,
                                  "content_block": {"type": "text", "text": ""}}
    yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                  "delta": {"type": "text_delta", "text": step.text}}
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    if call is not None:
        yield "content_block_start", {"type": "content_block_start", "index": 1,
                                      "content_block": {"type": "tool_use", "id": _id("toolu"), "name": call[0],
                                                        "input": {}}}
        yield "content_block_delta", {"type": "content_block_delta", "index": 1,
                                      "delta": {"type": "input_json_delta", "partial_json": json.dumps(call[1])}}
        yield "content_block_stop", {"type": "content_block_stop", "index": 1}
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": "tool_use" if call else "end_turn", "stop_sequence": None},
                            "usage": {"output_tokens": step.output_tokens}}
    yield "message_stop", {"type": "message_stop"}
