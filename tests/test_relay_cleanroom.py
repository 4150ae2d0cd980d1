"""The cleanroom relay (issue 30 §3): model calls go through, the internet through the model API does not.

A provider-side tool (web search, web fetch, code execution, MCP, file search, a hosted shell), a server-side feature
(``web_search_options``, ``mcp_servers``, a stored response) and every API that is not a model call (files, uploads,
batches, vector stores, stored responses...) is refused with a 4xx the agent can read, never reaches the upstream, is
recorded in ``model-requests.jsonl`` and flags the item; ``--pb-model-allow-server-tools`` forwards them as they come.

Everything is real: the relay, a scripted upstream on loopback (``tests/test_relay.py``), the OpenAI SDK as an agent
uses it, and two pytest sessions (``runpytest_subprocess``) whose agent, in a real sandbox, asks the relay for each
class through the in-sandbox bridge.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from pytest_programbench.relay.apis import ANTHROPIC as ANTHROPIC_RULES
from pytest_programbench.relay.apis import CHAT, PROVIDER_TOOLS_REQUESTED, RESPONSES
from pytest_programbench.relay.body_scan import Finding, scan
from pytest_programbench.relay.relay import ModelRelay
from tests import official_catalogue
from tests.conftest import TESTBED, Testbed
from tests.test_relay import ANTHROPIC_BODY, CHAT_BODY, RESPONSES_BODY, Reply, ScriptedUpstream, settled, tcp_client

ANTHROPIC = {"anthropic-version": "2023-06-01"}
CLAUDE_BETAS = {**ANTHROPIC, "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                "context-management-2025-06-27,prompt-caching-scope-2026-01-05,effort-2025-11-24"}
USER = [{"role": "user", "content": "What is new on the web today?"}]
PNG = "data:image/png;base64,iVBORw0KGgo="


@dataclass(frozen=True)
class Call:
    """One request an agent makes: what it asks for and, when refused, the label the refusal names."""

    name: str
    method: str
    path: str
    body: Any = None  # JSON-encoded unless bytes; None: no body
    headers: dict[str, str] = field(default_factory=dict)
    refused: str | None = None  # the cleanroom's label (in the 4xx's message and the record), None: forwarded
    status: int = 403

    def encoded(self) -> bytes | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


def responses(*tools: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-5", "input": "What is new on the web today?", "tools": list(tools), **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-5", "messages": USER, **extra}


def messages(*tools: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": USER, "tools": list(tools), **extra}


def image_message(block: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, block]}]


FUNCTION = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}

# What the cleanroom refuses: provider-side tools and features in model calls, then every other API.
REFUSED = [
    Call("responses web_search", "POST", "/v1/responses", responses({"type": "web_search"}),
         refused="tool web_search"),
    Call("responses web_search_preview", "POST", "/v1/responses", responses({"type": "web_search_preview"}),
         refused="tool web_search_preview"),
    Call("responses mcp", "POST", "/v1/responses",
         responses({"type": "mcp", "server_label": "x", "server_url": "https://mcp.example.invalid/sse"}),
         refused="tool mcp"),
    Call("responses code_interpreter", "POST", "/v1/responses",
         responses({"type": "code_interpreter", "container": {"type": "auto"}}), refused="tool code_interpreter"),
    Call("responses file_search", "POST", "/v1/responses",
         responses({"type": "file_search", "vector_store_ids": ["vs_1"]}), refused="tool file_search"),
    Call("responses computer_use", "POST", "/v1/responses", responses({"type": "computer_use_preview"}),
         refused="tool computer_use_preview"),
    Call("responses image_generation", "POST", "/v1/responses", responses({"type": "image_generation"}),
         refused="tool image_generation"),
    Call("responses hosted shell", "POST", "/v1/responses",
         responses({"type": "shell", "environment": {"type": "container_auto"}}),
         refused="tool shell in a provider-hosted environment"),
    Call("responses hosted tool in a namespace", "POST", "/v1/responses",
         responses({"type": "namespace", "name": "ns", "tools": [FUNCTION, {"type": "web_search"}]}),
         refused="tool web_search"),
    Call("responses escaped tool type", "POST", "/v1/responses",
         b'{"model": "gpt-5", "input": "x", "tools": [{"type": "web\\u005fsearch"}]}', refused="tool web_search"),
    Call("responses previous_response_id", "POST", "/v1/responses",
         responses(FUNCTION, previous_response_id="resp_other_task"), refused="previous_response_id"),
    Call("responses conversation", "POST", "/v1/responses", responses(conversation="conv_1"),
         refused="conversation"),
    Call("responses item_reference", "POST", "/v1/responses",
         {"model": "gpt-5", "input": [{"type": "item_reference", "id": "msg_other_task"}]}, refused="item_reference"),
    Call("responses image by URL", "POST", "/v1/responses",
         {"model": "gpt-5", "input": [{"role": "user", "content": [
             {"type": "input_image", "image_url": "https://render.example.invalid/page.png"}]}]},
         refused="image_url 'https://render.example.invalid/page.png'"),
    Call("responses file by id", "POST", "/v1/responses",
         {"model": "gpt-5", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
         refused="file_id"),
    Call("chat web_search_options", "POST", "/v1/chat/completions", chat(web_search_options={}),
         refused="web_search_options"),
    Call("chat hosted tool", "POST", "/v1/chat/completions", chat(tools=[{"type": "web_search_preview"}]),
         refused="tool web_search_preview"),
    Call("chat openrouter plugins", "POST", "/v1/chat/completions", chat(plugins=[{"id": "web"}]),
         refused="plugins"),
    Call("chat openrouter :online", "POST", "/v1/chat/completions", {"model": "openai/gpt-5:online",
                                                                     "messages": USER}, refused="model :online"),
    Call("chat image by URL", "POST", "/v1/chat/completions",
         chat(messages=image_message({"type": "image_url", "image_url": {"url": "https://x.example.invalid/a"}})),
         refused="url 'https://x.example.invalid/a'"),
    Call("anthropic web_search", "POST", "/v1/messages",
         messages({"type": "web_search_20250305", "name": "web_search", "max_uses": 1}), ANTHROPIC,
         refused="tool web_search_20250305"),
    Call("anthropic web_fetch", "POST", "/v1/messages",
         messages({"type": "web_fetch_20250910", "name": "web_fetch"}), ANTHROPIC, refused="tool web_fetch_20250910"),
    Call("anthropic code_execution", "POST", "/v1/messages",
         messages({"type": "code_execution_20250825", "name": "code_execution"}), ANTHROPIC,
         refused="tool code_execution_20250825"),
    Call("anthropic mcp_servers", "POST", "/v1/messages",
         messages(mcp_servers=[{"type": "url", "url": "https://mcp.example.invalid/sse", "name": "x"}]), ANTHROPIC,
         refused="mcp_servers"),
    Call("anthropic escaped mcp_servers", "POST", "/v1/messages",
         b'{"model": "m", "max_tokens": 8, "messages": [], "mcp\\u005fservers": [{"type": "url"}]}', ANTHROPIC,
         refused="mcp_servers"),
    Call("anthropic container", "POST", "/v1/messages", messages(container="container_other_task"), ANTHROPIC,
         refused="container"),
    Call("anthropic document by URL", "POST", "/v1/messages",
         messages(messages=image_message({"type": "document", "source": {"type": "url",
                                                                          "url": "https://x.example.invalid/d"}})),
         ANTHROPIC, refused="url 'https://x.example.invalid/d'"),
    Call("anthropic MCP beta", "POST", "/v1/messages?beta=true", messages(),
         {**ANTHROPIC, "anthropic-beta": "interleaved-thinking-2025-05-14, mcp-client-2025-04-04"},
         refused="anthropic-beta mcp-client-2025-04-04"),
    Call("anthropic files beta", "POST", "/v1/messages", messages(),
         {**ANTHROPIC, "anthropic-beta": "files-api-2025-04-14"}, refused="anthropic-beta files-api-2025-04-14"),
    Call("anthropic count_tokens web_search", "POST", "/v1/messages/count_tokens",
         messages({"type": "web_search_20250305", "name": "web_search"}), ANTHROPIC,
         refused="tool web_search_20250305"),
    # Other APIs: stored files, uploads, batches, vector stores, stored responses, assistants, containers...
    *(Call(f"{method} {path}", method, path, body, refused=f"{method} {path}") for method, path, body in [
        ("GET", "/v1/files", None), ("POST", "/v1/files", b"--x\r\n\r\nhello\r\n--x--\r\n"),
        ("GET", "/v1/files/file-1/content", None), ("DELETE", "/v1/files/file-1", None),
        ("POST", "/v1/uploads", {"filename": "a", "purpose": "assistants", "bytes": 1, "mime_type": "text/plain"}),
        ("GET", "/v1/batches", None), ("POST", "/v1/batches", {"input_file_id": "file-1"}),
        ("POST", "/v1/vector_stores", {"name": "x"}), ("POST", "/v1/vector_stores/vs_1/search", {"query": "x"}),
        ("GET", "/v1/responses/resp_other_task", None), ("DELETE", "/v1/responses/resp_other_task", None),
        ("GET", "/v1/responses/resp_other_task/input_items", None), ("GET", "/v1/chat/completions", None),
        ("POST", "/v1/assistants", {"model": "gpt-5"}), ("POST", "/v1/threads", {}),
        ("POST", "/v1/containers", {"name": "x"}), ("GET", "/v1/skills", None),
        ("GET", "/v1/conversations/conv_1/items", None), ("POST", "/v1/fine_tuning/jobs", {}),
        ("DELETE", "/v1/models/ft:gpt-5:other", None), ("GET", "/v1/messages/batches", None),
        ("POST", "/v1/responses/compact", {"model": "gpt-5"}),
    ]),
]
# Refused because the relay cannot read them, not counted as an attempt.
UNREADABLE = [
    Call("not JSON", "POST", "/v1/chat/completions", b"model=gpt-5", refused="an unreadable body (not a JSON object)",
         status=400),
    Call("not an object", "POST", "/v1/responses", [responses()], refused="an unreadable body (not a JSON object)",
         status=400),
    Call("compressed", "POST", "/v1/chat/completions", gzip.compress(json.dumps(chat()).encode()),
         {"Content-Encoding": "gzip"}, refused="a compressed request body", status=415),
]
# What agents send: forwarded unchanged.
ALLOWED = [
    Call("chat with functions and an inline image", "POST", "/v1/chat/completions",
         chat(messages=image_message({"type": "image_url", "image_url": {"url": PNG}}),
              tools=[{"type": "function", "function": {"name": "bash", "parameters": {}}}], stream=True,
              stream_options={"include_usage": True})),
    Call("responses as codex sends it", "POST", "/v1/responses", responses(
        FUNCTION, {"type": "namespace", "name": "multi_agent_v1", "tools": [FUNCTION]},
        {"type": "custom", "name": "apply_patch", "format": {"type": "text"}}, {"type": "local_shell"},
        {"type": "shell"}, {"type": "shell", "environment": {"type": "local"}}, {"type": "apply_patch"},
        store=False, include=["reasoning.encrypted_content"], previous_response_id=None, stream=True)),
    Call("responses with an inline image", "POST", "/v1/responses", {"model": "gpt-5", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}]}),
    Call("messages as claude-code sends them", "POST", "/v1/messages?beta=true", messages(
        {"name": "Bash", "description": "run", "input_schema": {"type": "object", "properties": {
            "url": {"type": "string"}, "tools": {"type": "array"}}}},
        {"type": "custom", "name": "Read", "input_schema": {"type": "object"}},
        {"type": "bash_20250124", "name": "bash"}, {"type": "text_editor_20250728", "name": "str_replace_editor"},
        messages=image_message({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                            "data": "iVBORw0KGgo="}}),
        system=[{"type": "text", "text": "You are Claude Code."}], stream=True), CLAUDE_BETAS),
    Call("count_tokens", "POST", "/v1/messages/count_tokens", messages(), ANTHROPIC),
    Call("completions", "POST", "/v1/completions", {"model": "gpt-3.5-turbo-instruct", "prompt": "Say hi"}),
    Call("embeddings", "POST", "/v1/embeddings", {"model": "text-embedding-3-small", "input": "hi"}),
    Call("models", "GET", "/v1/models"),
    Call("a model", "GET", "/v1/models/gpt-5"),
    Call("models by HEAD", "HEAD", "/v1/models"),
]


def send(relay: ModelRelay, call: Call) -> tuple[int, bytes]:
    conn = tcp_client(relay)
    try:
        headers = {"Content-Type": "application/json", **call.headers} if call.body is not None else call.headers
        conn.request(call.method, call.path, body=call.encoded(), headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def upstream_with_routes() -> ScriptedUpstream:
    upstream = ScriptedUpstream()
    for call in [*REFUSED, *UNREADABLE, *ALLOWED]:
        reply = {"/v1/chat/completions": CHAT_BODY, "/v1/responses": RESPONSES_BODY,
                 "/v1/messages": ANTHROPIC_BODY}.get(call.path.split("?")[0], b'{"object": "list", "data": []}')
        upstream.route(call.method, call.path.split("?")[0], Reply([reply]))
    return upstream


def refusal_message(body: bytes) -> str:
    """The error as both providers' SDKs read it: ``error.message``, under ``type: error``."""
    data = json.loads(body)
    assert data["type"] == "error", data
    message = data["error"]["message"]
    assert isinstance(message, str)
    return message


@pytest.mark.parametrize("call", REFUSED + UNREADABLE, ids=lambda call: call.name)
def test_refused_with_a_readable_4xx_recorded_and_never_upstream(call: Call, tmp_path: Path) -> None:
    upstream = upstream_with_routes()
    records = tmp_path / "model-requests.jsonl"
    try:
        with ModelRelay(f"{upstream.url}/v1", tcp=True, records_path=records) as relay:
            status, body = send(relay, call)
            [record] = settled(relay, 1)
            tally = relay.cleanroom()
    finally:
        upstream.close()
    assert status == call.status, body
    message = refusal_message(body)
    assert call.refused is not None
    assert f"the cleanroom relay refuses {call.refused}" in message, message
    assert "--pb-model-allow-server-tools" in message
    assert upstream.received == [], "a refused request reached the upstream"
    assert upstream.connections == 0
    assert record.status == call.status
    assert record.cleanroom_refused is not None
    assert record.cleanroom_refused.startswith(call.refused), record
    [line] = [json.loads(line) for line in records.read_text().splitlines()]
    assert line["cleanroom_refused"] == record.cleanroom_refused
    assert relay.stats().cleanroom_refused == 1
    attempt = call.status == 403
    assert (tally.attempted, tally.unreadable) == ((1, 0) if attempt else (0, 1))
    flag = tally.flag()
    if attempt:
        assert flag is not None
        assert flag.startswith(f"{PROVIDER_TOOLS_REQUESTED}: the cleanroom relay refused 1 "), flag
        assert call.refused.split(" '")[0] in flag
    else:
        assert flag is None  # nothing provider-side was asked for that the relay could see: refused, not flagged


@pytest.mark.parametrize("prefix", ["/v1", "/api/v1", ""])
def test_model_calls_are_forwarded_unchanged(prefix: str, tmp_path: Path) -> None:
    """What the agents send (codex's namespaces and shells, claude-code's typeless tools and betas, inline images,
    the model list) goes through, at the endpoint's own prefix (OpenRouter's ``/api/v1``, none at all)."""
    def at(path: str) -> str:  # where the SDKs put it below this endpoint (the relay mirrors the upstream's paths)
        return prefix + path.removeprefix("/v1") if prefix else path

    upstream = ScriptedUpstream()
    for call in ALLOWED:
        upstream.route(call.method, at(call.path.split("?")[0]), Reply([b"{}"]))
    try:
        with ModelRelay(f"{upstream.url}{prefix}", tcp=True, records_path=tmp_path / "r.jsonl") as relay:
            for call in ALLOWED:
                status, body = send(relay, Call(call.name, call.method, at(call.path), call.body, call.headers))
                assert status == 200, (call.name, body)
            if not prefix:  # claude-code's probe of an endpoint without a prefix goes upstream
                assert send(relay, Call("probe", "HEAD", "/"))[0] in (200, 404)
            records = settled(relay, len(ALLOWED) + (0 if prefix else 1))
            assert relay.cleanroom().flag() is None
    finally:
        upstream.close()
    assert all(record.cleanroom_refused is None for record in records)
    assert len(upstream.received) == len(records)
    for call, received in zip(ALLOWED, upstream.received, strict=False):
        assert received.method == call.method
        assert received.body == (call.encoded() or b"")  # byte for byte


def test_allowing_server_tools_forwards_everything(tmp_path: Path) -> None:
    """--pb-model-allow-server-tools: every refused class reaches the upstream as it came, nothing is counted."""
    upstream = upstream_with_routes()
    try:
        with ModelRelay(f"{upstream.url}/v1", tcp=True, allow_server_tools=True) as relay:
            statuses = [send(relay, call)[0] for call in REFUSED]
            settled(relay, len(REFUSED))
            tally = relay.cleanroom()
    finally:
        upstream.close()
    assert statuses == [200] * len(REFUSED)
    assert [(r.method, r.path, r.body) for r in upstream.received] == [
        (call.method, call.path, call.encoded() or b"") for call in REFUSED]
    assert tally.flag() is None
    assert tally.as_dict() == {"server_tools": "allowed", "refused": 0, "attempts": {}, "other_attempts": 0,
                               "unreadable": 0}


# A comma where JSON has none, one per state of the scanner's grammar (body_scan.py): after ``{``, after another
# comma (object and array), after ``[``, after a key, after a colon, after the whole object. A scanner accepting one
# reads on as if it were not there, and a lenient parser upstream may read the body otherwise.
MISPLACED_COMMAS = [
    b'{, "model": "gpt-5", "input": "x"}',
    b'{"model": "gpt-5",, "input": "x"}',
    b'{"model": "gpt-5", "input": "x", "tools": [, {"type": "custom"}]}',
    b'{"model": "gpt-5", "input": "x", "tools": [{"type": "custom"},, {"type": "custom"}]}',
    b'{"model", : "gpt-5", "input": "x"}',
    b'{"model": , "gpt-5", "input": "x"}',
    b'{"model": "gpt-5", "input": "x"},',
]


@pytest.mark.parametrize("body", MISPLACED_COMMAS)
def test_a_misplaced_comma_is_unreadable(body: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(body)  # not JSON: the case is what it says
    for rules in (CHAT, RESPONSES, ANTHROPIC_RULES):
        assert scan(body, rules) == Finding("unreadable", "not valid JSON")


def test_a_tool_whose_type_is_null_has_no_type() -> None:
    """``"type": null`` in a tools entry is a tool without a type: refused where the API has no such tool (OpenAI),
    forwarded where it has (Anthropic's client tools), and counted beside a duplicated ``type`` (either order)."""

    def body(tool: bytes) -> bytes:
        return b'{"model": "m", "input": "x", "tools": [' + tool + b"]}"

    no_type = Finding("tool", "tool (no type)")
    for tool in (b'{"type": null}', b'{"type": null, "name": "bash"}', b'{"type": null, "type": "function"}',
                 b'{"type": "function", "type": null}'):
        assert scan(body(tool), CHAT) == no_type, tool
        assert scan(body(tool), RESPONSES) == no_type, tool
    assert scan(body(b'{"type": null, "name": "bash"}'), ANTHROPIC_RULES) is None
    assert scan(body(b'{"type": null, "type": "custom"}'), ANTHROPIC_RULES) is None
    assert scan(body(b'{"type": null, "type": "web_search_20250305"}'), ANTHROPIC_RULES) == \
        Finding("tool", "tool web_search_20250305")
    assert scan(body(b'{"type": null, "type": "function"}'), ANTHROPIC_RULES) == Finding("tool", "tool function")


def test_the_openai_sdk_reads_the_refusal() -> None:
    """What an agent built on the OpenAI SDK sees: a PermissionDeniedError that says what was refused and why."""
    upstream = upstream_with_routes()
    try:
        with ModelRelay(f"{upstream.url}/v1", tcp=True) as relay:
            client = openai.OpenAI(base_url=f"{relay.tcp_url}/v1", api_key="sk-placeholder", max_retries=0)
            with pytest.raises(openai.PermissionDeniedError) as searched:
                client.responses.create(model="gpt-5", input="news?", tools=[{"type": "web_search"}])
            with pytest.raises(openai.PermissionDeniedError) as listed:
                client.files.list()
            answered = client.responses.create(model="gpt-5", input="hi")  # a plain call still works
    finally:
        upstream.close()
    assert "the cleanroom relay refuses tool web_search" in str(searched.value)
    assert "the cleanroom relay refuses GET /v1/files" in str(listed.value)
    assert answered.output_text == "Hi."
    assert [r.path for r in upstream.received] == ["/v1/responses"]


# ---------------------------------------------------------------------------------------------- real sessions


RPN = "pbfix__rpn.0b5e55e"
ATTEMPTS = [call for call in REFUSED if call.name in (
    "responses web_search", "chat web_search_options", "anthropic web_search", "anthropic mcp_servers",
    "GET /v1/files", "POST /v1/files", "POST /v1/batches", "POST /v1/vector_stores",
    "GET /v1/responses/resp_other_task")]
PLAIN = [Call("chat", "POST", "/v1/chat/completions", chat()),
         Call("responses", "POST", "/v1/responses", responses(FUNCTION)),
         Call("messages", "POST", "/v1/messages", messages(model="gpt-5"), ANTHROPIC)]  # the run's --pb-model
# The agent: asks the relay (through the sandbox's bridge) for each call, prints what it got, then solves the task.
AGENT = r'''
import json, os, sys, urllib.request, urllib.error

base = os.environ["PB_MODEL_RELAY_URL"].rstrip("/")  # http://127.0.0.1:PORT/v1
root = base[:-len("/v1")]
got = {}
for call in json.load(open("/pb-cleanroom/calls.json")):
    data = None if call["body"] is None else call["body"].encode("latin-1")
    request = urllib.request.Request(root + call["path"], data=data, method=call["method"],
                                     headers={"Content-Type": "application/json", **call["headers"]})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            got[call["name"]] = [response.status, response.read().decode()]
    except urllib.error.HTTPError as error:
        got[call["name"]] = [error.code, error.read().decode()]
print("CLEANROOM " + json.dumps(got), flush=True)
'''


def cleanroom_session(pytester: pytest.Pytester, testbed: Testbed, monkeypatch: pytest.MonkeyPatch,
                      upstream: ScriptedUpstream, name: str, *extra: str) -> tuple[pytest.RunResult, Path]:
    agent_dir = pytester.mkdir(f"agent-{name}")
    (agent_dir / "agent.py").write_text(AGENT)
    (agent_dir / "calls.json").write_text(json.dumps([
        {"name": call.name, "method": call.method, "path": call.path, "headers": call.headers,
         "body": None if call.encoded() is None else (call.encoded() or b"").decode("latin-1")}
        for call in [*ATTEMPTS, *PLAIN]]))
    agent_dir.chmod(0o755)
    for path in agent_dir.iterdir():
        path.chmod(0o644)
    monkeypatch.setenv(official_catalogue.ENV, str(testbed.tasks_dir))  # the session's in-process package_run
    run_dir = pytester.path / f"run-{name}"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "tests.official_catalogue", "--pb-tasks-dir", str(testbed.tasks_dir),
        "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2",
        "--pb-output", str(run_dir), "--pb-model", "gpt-5", "--pb-model-endpoint", f"{upstream.url}/v1",
        "--pb-agent", f"python3 /pb-cleanroom/agent.py && cp -r /pb-testbed/solutions/{RPN}/. /workspace/src/",
        "--pb-agent-mount", f"{agent_dir}:/pb-cleanroom", "--pb-agent-mount", f"{TESTBED}:/pb-testbed",
        "--pb-agent-timeout", "600", "--pb-package", "--junitxml", str(pytester.path / f"{name}.xml"), *extra,
        timeout=900)
    return result, run_dir


def agent_got(run_dir: Path) -> dict[str, list[Any]]:
    log = (run_dir / RPN / "agent.log").read_text()
    assert "CLEANROOM " in log, log[-3000:]
    got: dict[str, list[Any]] = json.loads(log.split("CLEANROOM ", 1)[1].splitlines()[0])
    return got


def harness_of(run_dir: Path) -> dict[str, Any]:
    harness: dict[str, Any] = yaml.safe_load((run_dir / "submission.yaml").read_text())["harness"]
    return harness


@pytest.mark.usefixtures("clean_env")
def test_a_session_refuses_provider_tools_and_flags_the_item(pytester: pytest.Pytester, testbed: Testbed,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent asks for each class and then solves the task: each ask gets a 4xx naming the refusal, nothing of it
    reaches the upstream, each is a record, the plain model calls are answered, and the item (score 1.0) fails on
    the flag ``provider_tools_requested``. The run's package says server tools were refused."""
    upstream = upstream_with_routes()
    try:
        result, run_dir = cleanroom_session(pytester, testbed, monkeypatch, upstream, "cleanroom")
    finally:
        upstream.close()
    result.assert_outcomes(failed=1)
    got = agent_got(run_dir)
    for call in ATTEMPTS:
        status, body = got[call.name]
        assert status == 403, (call.name, body)
        assert f"the cleanroom relay refuses {call.refused}" in refusal_message(body.encode()), (call.name, body)
    assert {name: got[name][0] for name in ("chat", "responses", "messages")} == {
        "chat": 200, "responses": 200, "messages": 200}
    assert json.loads(got["chat"][1]) == json.loads(CHAT_BODY)
    # The upstream saw the plain calls and nothing else.
    assert [(r.method, r.path) for r in upstream.received] == [(c.method, c.path) for c in PLAIN]
    assert not any(b"web_search" in r.body or b"mcp_servers" in r.body for r in upstream.received)

    records = [json.loads(line) for line in (run_dir / RPN / "model-requests.jsonl").read_text().splitlines()]
    # A record is written when its exchange ends, so a refusal's linger can put it after the agent's next request:
    # each attempt is matched to one record of its own, in any order.
    refused = [r for r in records if r["cleanroom_refused"]]
    assert len(refused) == len(ATTEMPTS) == len(records) - len(PLAIN), records
    for call in ATTEMPTS:
        assert call.refused is not None
        match = next((r for r in refused if (r["method"], r["path"], r["status"]) == (call.method, call.path, 403)
                      and r["cleanroom_refused"].startswith(call.refused)), None)
        assert match is not None, (call.name, refused)
        refused.remove(match)

    task = json.loads((run_dir / "summary.json").read_text())["tasks"][RPN]
    assert task["outcome"] == "failed"
    assert task["score"] == 1.0  # solved: only the flag keeps it from passing
    reasons = "\n".join(task["reasons"])
    assert f"integrity flags: {PROVIDER_TOOLS_REQUESTED}: the cleanroom relay refused {len(ATTEMPTS)} " \
           "request(s)" in reasons, reasons
    junit = (pytester.path / "cleanroom.xml").read_text()
    assert f'name="integrity_flags" value="{PROVIDER_TOOLS_REQUESTED}: ' in junit
    meta = json.loads((run_dir / RPN / "pb-meta.json").read_text())
    assert meta["relay"]["cleanroom_refused"] == len(ATTEMPTS)
    assert meta["cleanroom"]["server_tools"] == "refused"
    assert meta["cleanroom"]["refused"] == len(ATTEMPTS)
    assert sum(meta["cleanroom"]["attempts"].values()) == len(ATTEMPTS)
    assert harness_of(run_dir)["model_server_tools"] == "refused"
    assert json.loads((run_dir / "pb-run.json").read_text())["fingerprint"]["model_allow_server_tools"] is False


@pytest.mark.usefixtures("clean_env")
def test_a_session_allowing_server_tools_forwards_them(pytester: pytest.Pytester, testbed: Testbed,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--pb-model-allow-server-tools: the same asks all reach the upstream, nothing is flagged, the item passes, and
    the run's identity and package say server tools were allowed."""
    upstream = upstream_with_routes()
    try:
        result, run_dir = cleanroom_session(pytester, testbed, monkeypatch, upstream, "allowed",
                                            "--pb-model-allow-server-tools")
    finally:
        upstream.close()
    result.assert_outcomes(passed=1)
    got = agent_got(run_dir)
    assert {name: status for name, (status, _) in got.items()} == {call.name: 200 for call in [*ATTEMPTS, *PLAIN]}
    assert [(r.method, r.path) for r in upstream.received] == [(c.method, c.path) for c in [*ATTEMPTS, *PLAIN]]
    records = [json.loads(line) for line in (run_dir / RPN / "model-requests.jsonl").read_text().splitlines()]
    assert not any(r["cleanroom_refused"] for r in records)
    meta = json.loads((run_dir / RPN / "pb-meta.json").read_text())
    assert meta["cleanroom"]["server_tools"] == "allowed"
    assert meta["relay"]["cleanroom_refused"] == 0
    assert harness_of(run_dir)["model_server_tools"] == "allowed"
    record = json.loads((run_dir / "pb-run.json").read_text())
    assert record["fingerprint"]["model_allow_server_tools"] is True
    assert record["settings"]["model_allow_server_tools"] is True
