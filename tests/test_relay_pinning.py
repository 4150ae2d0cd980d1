"""The relay pins the model and owns the key (issue 38, attack 4).

Only the models the run was configured with may be requested: every field that names a model (``model``,
OpenRouter's ``models``), compared after full JSON decoding; a model key given twice, a value that is not a name, or
no model at all is refused too. The key's header comes from the configuration, never from the agent's headers, and
an upstream 401/403 is the agent's answer unless the relay's own probe finds the key rejected.

Everything is real: the relay, a scripted upstream on loopback (``tests/test_relay.py``) or a scripted provider that
checks its key as OpenAI does (below), and a pytest session whose agent, in a real sandbox, sends the attacks through
the in-sandbox bridge.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.relay.apis import PROVIDER_TOOLS_REQUESTED
from pytest_programbench.relay.contract import MODEL_REJECTED, configured_key_style
from pytest_programbench.relay.relay import ModelRelay
from tests.conftest import TESTBED, Testbed
from tests.test_relay import ANTHROPIC_BODY, CHAT_BODY, RESPONSES_BODY, Reply, ScriptedUpstream, settled, tcp_client
from tests.test_relay_cleanroom import refusal_message

KEY = "sk-host-only-4a7e19"
ANTHROPIC = {"anthropic-version": "2023-06-01"}
USER = [{"role": "user", "content": "hi"}]
# 43 characters: every one \u-escaped is 258 bytes, past the 256 the old check decoded of a model name.
ONLINE = "anthropic/claude-3.5-sonnet-20241022:online"


def escaped(text: str) -> str:
    """``text`` as a JSON string literal with every character ``\\u``-escaped."""
    return '"' + "".join(f"\\u{ord(char):04x}" for char in text) + '"'


def post(relay: ModelRelay, path: str, body: bytes | dict[str, Any],
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = tcp_client(relay)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    for path, reply in (("/v1/chat/completions", CHAT_BODY), ("/v1/responses", RESPONSES_BODY),
                        ("/v1/messages", ANTHROPIC_BODY), ("/v1/messages/count_tokens", b'{"input_tokens": 3}'),
                        ("/v1/completions", b"{}"), ("/v1/embeddings", b"{}")):
        server.route("POST", path, Reply([reply]))
    yield server
    server.close()


# -- the model: only the run's -----------------------------------------------------------------------------------

# What an agent sends for another model than the run's (gpt-4o), each with the label its refusal names.
OFF_PIN = [
    ("escaped :online", b'{"model": ' + escaped(ONLINE).encode() + b', "messages": []}', "model :online"),
    ("models fallback :online", {"model": "gpt-4o", "models": ["gpt-4o", "openai/gpt-4o:online"],
                                 "messages": USER}, "models :online"),
    ("models fallback to another model", {"model": "gpt-4o", "models": ["gpt-4o", "perplexity/sonar"],
                                          "messages": USER}, "models 'perplexity/sonar'"),
    ("a search model", {"model": "gpt-4o-search-preview", "messages": USER}, "model 'gpt-4o-search-preview'"),
    ("an escaped search model", b'{"model": ' + escaped("gpt-4o-search-preview").encode() + b', "messages": []}',
     "model 'gpt-4o-search-preview'"),
    ("the run's model with a suffix", {"model": "gpt-4o ", "messages": USER}, "model 'gpt-4o '"),
    ("model twice, the run's last", b'{"model": "gpt-4o-search-preview", "messages": [], "model": "gpt-4o"}',
     "model given twice"),
    ("model twice, the run's first", b'{"model": "gpt-4o", "messages": [], "m\\u006fdel": "o3-deep-research"}',
     "model given twice"),
    ("models twice", b'{"model": "gpt-4o", "models": ["gpt-4o"], "messages": [], "models": ["sonar"]}',
     "models given twice"),
    ("no model", {"messages": USER}, "a request naming no model"),
    ("a null model", {"model": None, "messages": USER}, "a request naming no model"),
    ("a model that is not a string", {"model": ["gpt-4o", "sonar"], "messages": USER}, "model (not a name)"),
    ("a model object", {"model": {"id": "sonar"}, "messages": USER}, "model (not a name)"),
    ("models that is not a list", {"model": "gpt-4o", "models": "sonar", "messages": USER},
     "models (not a list of names)"),
    ("models holding an object", {"model": "gpt-4o", "models": [{"id": "sonar"}], "messages": USER},
     "models (not a list of names)"),
]


@pytest.mark.parametrize(("body", "label"), [case[1:] for case in OFF_PIN], ids=[case[0] for case in OFF_PIN])
def test_a_model_other_than_the_runs_is_refused_recorded_and_flagged(upstream: ScriptedUpstream, tmp_path: Path,
                                                                      body: bytes | dict[str, Any],
                                                                      label: str) -> None:
    records = tmp_path / "model-requests.jsonl"
    with ModelRelay(f"{upstream.url}/v1", tcp=True, records_path=records, models=["gpt-4o"]) as relay:
        status, answer = post(relay, "/v1/chat/completions", body)
        [record] = settled(relay, 1)
        tally = relay.cleanroom()
    assert status == 403, answer
    assert f"the cleanroom relay refuses {label}" in refusal_message(answer)
    assert upstream.received == [], "a request for another model reached the upstream"
    assert record.cleanroom_refused is not None
    assert record.cleanroom_refused.startswith(label), record
    assert json.loads(records.read_text())["cleanroom_refused"] == record.cleanroom_refused
    flag = tally.flag()
    assert flag is not None
    assert flag.startswith(f"{PROVIDER_TOOLS_REQUESTED}: the cleanroom relay refused 1 request(s)"), flag


@pytest.mark.parametrize(("path", "body", "headers"), [
    ("/v1/chat/completions", {"model": "gpt-5", "messages": USER}, {}),
    ("/v1/responses", {"model": "gpt-5", "input": "hi"}, {}),
    ("/v1/messages", {"model": "gpt-5", "max_tokens": 8, "messages": USER}, ANTHROPIC),
    ("/v1/messages/count_tokens", {"model": "gpt-5", "messages": USER}, ANTHROPIC),
    ("/v1/completions", {"model": "gpt-5", "prompt": "hi"}, {}),
    ("/v1/embeddings", {"model": "gpt-5", "input": "hi"}, {}),
])
def test_every_model_call_is_pinned(upstream: ScriptedUpstream, path: str, body: dict[str, Any],
                                    headers: dict[str, str]) -> None:
    """Each API the relay forwards: the run's model (bare, as litellm sends ``openai/gpt-5``, or whole) goes
    through byte for byte, another is refused before a byte goes upstream."""
    other = {**body, "model": "gpt-5-search-api"}
    with ModelRelay(f"{upstream.url}/v1", tcp=True, models=["openai/gpt-5"]) as relay:
        bare = post(relay, path, body, headers)
        whole = post(relay, path, {**body, "model": "openai/gpt-5"}, headers)
        refused = post(relay, path, other, headers)
        settled(relay, 3)
    assert (bare[0], whole[0], refused[0]) == (200, 200, 403), (bare, whole, refused)
    assert "the cleanroom relay refuses model 'gpt-5-search-api'" in refusal_message(refused[1])
    assert [r.body for r in upstream.received] == [json.dumps(body).encode(),
                                                   json.dumps({**body, "model": "openai/gpt-5"}).encode()]


def test_the_name_is_compared_decoded() -> None:
    """An escaped spelling of the run's model is the run's model (forwarded); the comparison is of what the
    provider's parser reads, never of the bytes."""
    upstream = ScriptedUpstream()
    upstream.route("POST", "/v1/chat/completions", Reply([CHAT_BODY]))
    body = b'{"model": ' + escaped("gpt-4o").encode() + b', "messages": []}'
    try:
        with ModelRelay(f"{upstream.url}/v1", tcp=True, models=["gpt-4o"]) as relay:
            status, _ = post(relay, "/v1/chat/completions", body)
            settled(relay, 1)
    finally:
        upstream.close()
    assert status == 200
    assert [r.body for r in upstream.received] == [body]


@pytest.mark.parametrize(("body", "label"), [OFF_PIN[0][1:], OFF_PIN[1][1:], OFF_PIN[6][1:]],
                         ids=["escaped :online", "models :online", "model twice"])
def test_without_a_configured_model_the_known_attacks_are_still_refused(upstream: ScriptedUpstream,
                                                                         body: bytes | dict[str, Any],
                                                                         label: str) -> None:
    """No model configured (a command agent without --pb-model): nothing is pinned, but an ``:online`` name in any
    model field, decoded in full, and a model key given twice are refused all the same."""
    with ModelRelay(f"{upstream.url}/v1", tcp=True) as relay:
        assert relay.pin is None
        status, answer = post(relay, "/v1/chat/completions", body)
        forwarded, _ = post(relay, "/v1/chat/completions", {"model": "any-model", "messages": USER})
        settled(relay, 2)
    assert status == 403, answer
    assert f"the cleanroom relay refuses {label}" in refusal_message(answer)
    assert forwarded == 200
    assert [json.loads(r.body)["model"] for r in upstream.received] == ["any-model"]


# -- the key: the relay's ------------------------------------------------------------------------------------------


class KeyedProvider:
    """A provider on loopback that checks its key as OpenAI does: ``Authorization: Bearer KEY`` or a 401; a request
    naming another organisation is a 401 too (what an agent can cause with a header); the model list and chat
    completions answered. ``seen``: (method, path, headers) of every request."""

    def __init__(self) -> None:
        provider = self
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.key = KEY

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {name.lower(): value for name, value in self.headers.items()}
                provider.seen.append((self.command, self.path, headers))
                if headers.get("authorization") != f"Bearer {provider.key}":
                    return self._send(401, b'{"error": {"message": "You didn\'t provide an API key.", '
                                           b'"type": "invalid_request_error", "code": "invalid_api_key"}}')
                if "openai-organization" in headers:
                    return self._send(401, b'{"error": {"message": "mismatched organization", '
                                           b'"code": "mismatched_organization"}}')
                if self.path == "/v1/models":
                    return self._send(200, b'{"object": "list", "data": []}')
                return self._send(200, CHAT_BODY)

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[KeyedProvider]:
    monkeypatch.setenv("PB_TEST_MODEL_KEY", KEY)
    server = KeyedProvider()
    yield server
    server.close()


def test_the_key_style_comes_from_the_configuration() -> None:
    assert configured_key_style("https://api.openai.com/v1") == "bearer"
    assert configured_key_style("https://openrouter.ai/api/v1") == "bearer"
    assert configured_key_style("http://127.0.0.1:8000/v1") == "bearer"
    assert configured_key_style("https://api.anthropic.com") == "x-api-key"
    assert configured_key_style("http://127.0.0.1:8000", anthropic_client=True) == "x-api-key"


@pytest.mark.parametrize("key_style", ["auto", "configured"])
def test_an_anthropic_header_does_not_choose_the_key_header(provider: KeyedProvider, key_style: str) -> None:
    """The attack: one chat request carrying ``anthropic-version`` (and an ``x-api-key`` of its own). The key goes
    as the configuration says (Bearer to an OpenAI-style endpoint), the provider answers 200, nothing is an
    outage; the agent's own key header never goes upstream."""
    style = configured_key_style(f"{provider.url}/v1") if key_style == "configured" else "auto"
    with ModelRelay(f"{provider.url}/v1", tcp=True, api_key_env="PB_TEST_MODEL_KEY", key_style=style,
                    models=["gpt-4o"]) as relay:
        status, _ = post(relay, "/v1/chat/completions", {"model": "gpt-4o", "messages": USER},
                         {**ANTHROPIC, "x-api-key": "agent-made-up"})
        settled(relay, 1)
    assert status == 200
    [(method, path, headers)] = provider.seen
    assert (method, path, headers["authorization"]) == ("POST", "/v1/chat/completions", f"Bearer {KEY}")
    assert "x-api-key" not in headers
    assert relay.unavailable() is None


def test_a_401_the_agent_caused_is_its_answer_not_an_outage(provider: KeyedProvider) -> None:
    """An agent's request the provider answers 401 (here: it names another organisation) goes back to the agent as
    it came; the relay's own probe (its model list, its own headers) finds the key accepted, so the task is not an
    error of it: the answer counts against the agent."""
    with ModelRelay(f"{provider.url}/v1", tcp=True, api_key_env="PB_TEST_MODEL_KEY",
                    key_style=configured_key_style(f"{provider.url}/v1"), models=["gpt-4o"]) as relay:
        statuses = [post(relay, "/v1/chat/completions", {"model": "gpt-4o", "messages": USER},
                         {"OpenAI-Organization": "org-someone-else"})[0] for _ in range(2)]
        settled(relay, 2)
    assert statuses == [401, 401]
    assert relay.key_verdict() == "accepted"
    assert relay.unavailable() is None
    assert any("relay's own probe found the key accepted" in note for note in relay.notes()), relay.notes()
    probes = [(path, headers) for method, path, headers in provider.seen if method == "GET"]
    assert len(probes) == 1, provider.seen  # one probe, at most, per relay
    [(path, headers)] = probes
    assert path == "/v1/models"
    assert headers["authorization"] == f"Bearer {KEY}"
    assert "openai-organization" not in headers  # the probe carries nothing of the agent's


def test_a_key_the_probe_finds_rejected_is_an_outage(provider: KeyedProvider) -> None:
    """The same 401 with a key the provider does not take: the probe is answered 401 too, and the task is an error
    (the model API rejected the key), as before."""
    provider.key = "sk-the-provider-has-another"
    with ModelRelay(f"{provider.url}/v1", tcp=True, api_key_env="PB_TEST_MODEL_KEY",
                    key_style=configured_key_style(f"{provider.url}/v1"), models=["gpt-4o"]) as relay:
        status, _ = post(relay, "/v1/chat/completions", {"model": "gpt-4o", "messages": USER})
        settled(relay, 1)
    assert status == 401
    assert relay.key_verdict() == "rejected"
    assert relay.unavailable() == f"{MODEL_REJECTED}: 1 request(s) (1 answered 401)"


def test_no_probe_without_a_401(provider: KeyedProvider) -> None:
    with ModelRelay(f"{provider.url}/v1", tcp=True, api_key_env="PB_TEST_MODEL_KEY", models=["gpt-4o"]) as relay:
        assert post(relay, "/v1/chat/completions", {"model": "gpt-4o", "messages": USER})[0] == 200
        settled(relay, 1)
    assert relay.key_verdict() is None
    assert [method for method, _, _ in provider.seen] == ["POST"]


# -- a real session ------------------------------------------------------------------------------------------------

RPN = "pbfix__rpn.0b5e55e"
ATTACKS = [
    ("escaped :online", "/v1/chat/completions", (b'{"model": ' + escaped(ONLINE).encode()
                                                 + b', "messages": []}').decode(), {}),
    ("models :online", "/v1/chat/completions",
     json.dumps({"model": "gpt-4o", "models": ["openai/gpt-4o:online"], "messages": USER}), {}),
    ("search model", "/v1/chat/completions", json.dumps({"model": "gpt-4o-search-preview", "messages": USER}), {}),
    ("anthropic header", "/v1/chat/completions", json.dumps({"model": "gpt-4o", "messages": USER}), ANTHROPIC),
    ("another organisation", "/v1/chat/completions", json.dumps({"model": "gpt-4o", "messages": USER}),
     {"OpenAI-Organization": "org-someone-else"}),
]
AGENT = r'''
import json, os, urllib.request, urllib.error

root = os.environ["PB_MODEL_RELAY_URL"].rstrip("/")[:-len("/v1")]
got = {}
for name, path, body, headers in json.load(open("/pb-pinning/attacks.json")):
    request = urllib.request.Request(root + path, data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            got[name] = response.status
    except urllib.error.HTTPError as error:
        got[name] = error.code
print("PINNING " + json.dumps(got), flush=True)
'''


@pytest.mark.usefixtures("clean_env")
def test_a_session_scores_the_attacks_and_never_errs(pytester: pytest.Pytester, testbed: Testbed,
                                                      provider: KeyedProvider) -> None:
    """An agent in a sandbox sends the attacks through the bridge, then solves the task: the three other-model
    requests are refused (never upstream) and flag the item, the ``anthropic-version`` request is answered with the
    key as Bearer, the 401 it causes itself is its own answer: the task is scored (1.0, failed on the flag), not an
    error, and the session goes on."""
    agent_dir = pytester.mkdir("agent")
    (agent_dir / "agent.py").write_text(AGENT)
    (agent_dir / "attacks.json").write_text(json.dumps(ATTACKS))
    agent_dir.chmod(0o755)
    for path in agent_dir.iterdir():
        path.chmod(0o644)
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2", "--pb-output", str(run_dir),
        "--pb-model", "gpt-4o", "--pb-model-endpoint", f"{provider.url}/v1", "--pb-model-key-env", "PB_TEST_MODEL_KEY",
        "--pb-agent", f"python3 /pb-pinning/agent.py && cp -r /pb-testbed/solutions/{RPN}/. /workspace/src/",
        "--pb-agent-mount", f"{agent_dir}:/pb-pinning", "--pb-agent-mount", f"{TESTBED}:/pb-testbed",
        "--pb-agent-timeout", "600", timeout=900)
    log = (run_dir / RPN / "agent.log").read_text(errors="replace")
    assert "PINNING " in log, "\n".join(result.outlines[-40:]) + log[-3000:]
    got = json.loads(log.split("PINNING ", 1)[1].splitlines()[0])
    assert got == {"escaped :online": 403, "models :online": 403, "search model": 403, "anthropic header": 200,
                   "another organisation": 401}, got
    result.assert_outcomes(failed=1)
    task = json.loads((run_dir / "summary.json").read_text())["tasks"][RPN]
    assert (task["outcome"], task["score"]) == ("failed", 1.0), task
    assert f"{PROVIDER_TOOLS_REQUESTED}: the cleanroom relay refused 3 request(s)" in "\n".join(task["reasons"])
    posts = [(path, headers) for method, path, headers in provider.seen if method == "POST"]
    assert len(posts) == 2, provider.seen  # the other-model requests never went upstream
    assert all(headers["authorization"] == f"Bearer {KEY}" and "x-api-key" not in headers for _, headers in posts)
    meta = json.loads((run_dir / RPN / "pb-meta.json").read_text())
    assert "model_unavailable" not in meta, meta
