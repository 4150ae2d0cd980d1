"""A scripted OpenAI-compatible chat-completions server on 127.0.0.1, for agent tests without a model.

It replays a fixed list of assistant turns, one per ``POST .../chat/completions``, each a ``bash`` tool call (the
request shape of mini-swe-agent's default litellm model class) with a ``usage`` block of known token numbers, and
records every request body so a test can check what the agent saw. Once the script is exhausted it keeps answering
with its last turn (a well-behaved agent has stopped by then; the request count shows if it did not). A turn with
``hang`` seconds is answered only after that long, unless the client hangs up first (``abandoned`` records which
requests the client gave up on: a model call that outlived no clock).
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One assistant response: some reasoning text and one bash command, with the usage the server reports."""

    thought: str
    command: str
    prompt_tokens: int
    completion_tokens: int
    hang: float = 0.0  # seconds before the answer (the client may hang up first)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ScriptedLLM:
    """``with ScriptedLLM(turns) as llm:`` serves ``llm.base_url`` (ends in ``/v1``) until the block ends."""

    def __init__(self, turns: Sequence[Turn], *, model: str = "scripted") -> None:
        if not turns:
            raise ValueError("a script needs at least one turn")
        self.turns = list(turns)
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.authorizations: list[str] = []
        self.unexpected: list[str] = []
        self.abandoned: list[int] = []  # indexes of requests whose client hung up while the server held them
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="scripted-llm", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def served(self) -> list[Turn]:
        """The turns answered so far, in order (the last one repeated past the end of the script)."""
        with self._lock:
            return [self.turns[min(i, len(self.turns) - 1)] for i in range(len(self.requests))]

    def __enter__(self) -> ScriptedLLM:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._closing.set()  # held requests are let go
        self._server.shutdown()
        self._server.server_close()

    def _hold(self, connection: socket.socket, seconds: float) -> bool:
        """Wait ``seconds`` before answering; False when the client hung up meanwhile (or the server is closing)."""
        deadline = time.monotonic() + seconds
        while not self._closing.is_set() and time.monotonic() < deadline:
            readable, _, _ = select.select([connection], [], [], 0.2)
            if readable and not connection.recv(1, socket.MSG_PEEK):
                return False  # EOF: the client closed the connection
        return not self._closing.is_set()

    def _next(self, body: dict[str, Any], path: str) -> tuple[int, Turn, dict[str, Any]]:
        with self._lock:
            index = len(self.requests)
            self.requests.append(body)
            self.paths.append(path)
        turn = self.turns[min(index, len(self.turns) - 1)]
        call_id = f"call_{index:03d}"
        return index, turn, {
            "id": f"chatcmpl-scripted-{index:03d}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [{
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": turn.thought,
                    "tool_calls": [{"id": call_id, "type": "function",
                                    "function": {"name": "bash",
                                                 "arguments": json.dumps({"command": turn.command})}}],
                },
            }],
            "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
                      "total_tokens": turn.total_tokens},
        }

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        llm = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    llm.unexpected.append(f"POST {self.path}")
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                try:
                    body = json.loads(raw)
                except ValueError:
                    llm.unexpected.append(f"POST {self.path}: not JSON")
                    return self._send(400, {"error": {"message": "body is not JSON"}})
                if body.get("stream"):
                    llm.unexpected.append(f"POST {self.path}: stream=true")
                    return self._send(400, {"error": {"message": "the scripted server does not stream"}})
                llm.authorizations.append(self.headers.get("Authorization") or "")
                index, turn, answer = llm._next(body, self.path)
                if turn.hang and not llm._hold(self.connection, turn.hang):
                    if not llm._closing.is_set():
                        with llm._lock:
                            llm.abandoned.append(index)
                    self.close_connection = True
                    return None
                return self._send(200, answer)

            def do_GET(self) -> None:
                llm.unexpected.append(f"GET {self.path}")
                self._send(404, {"error": {"message": f"no route {self.path}"}})

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
