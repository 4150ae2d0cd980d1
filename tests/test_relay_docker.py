"""The model relay from inside a real network-less sandbox: only the relay answers.

A container of the test bed's base image with ``network_mode="none"`` and every capability dropped gets the relay
tunnel (the bridge started as root, one exec stream to the relay's socket on the host, nothing mounted); an
unprivileged user inside then reaches the scripted upstream on the host's loopback through it, and nothing else.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench import RUN_LABEL
from pytest_programbench.relay.contract import BRIDGE_SCRIPT, PLACEHOLDER_KEY, SANDBOX_BRIDGE_PORT
from pytest_programbench.relay.relay import ModelRelay
from pytest_programbench.relay.relay_bridge import connect_unix
from pytest_programbench.relay.relay_tunnel import RelayTunnel
from tests.conftest import Testbed
from tests.test_relay import (
    ANTHROPIC_STREAM,
    CHAT_BODY,
    CHAT_STREAM,
    Reply,
    ScriptedUpstream,
    settled,
)

pytestmark = pytest.mark.docker

PROBE = r"""
import errno, json, os, socket, urllib.request

def post(url, payload, headers):
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers=dict({"Content-Type": "application/json"}, **headers))
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.read().decode()

def connect(family, address):
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(address)
        return "connected"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))
    finally:
        sock.close()

out = {"uid": os.getuid(), "interfaces": sorted(os.listdir("/sys/class/net"))}
out["chat"] = post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                   {"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]},
                   {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
out["chat_stream"] = post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                          {"model": "gpt-4o-mini", "stream": True, "stream_options": {"include_usage": True}}, {})
out["anthropic_stream"] = post(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages",
                               {"model": "claude", "stream": True},
                               {"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"})
out["probes"] = {str(port): connect(socket.AF_INET, ("127.0.0.1", port)) for port in PORTS}
out["secret_in_env"] = any(SECRET in value for value in os.environ.values())
bridges = [pid for pid in os.listdir("/proc") if pid.isdigit() and int(pid) != os.getpid()
           and b"relay_bridge.py" in open("/proc/%s/cmdline" % pid, "rb").read()]
out["bridges"] = len(bridges)
try:
    os.kill(int(bridges[0]), 15)
    out["kill_bridge"] = "killed"
except OSError as exc:
    out["kill_bridge"] = errno.errorcode.get(exc.errno, str(exc))
print(json.dumps(out))
"""


@pytest.fixture
def sandbox(docker_client: Any, testbed: Testbed) -> Iterator[Any]:
    made: list[str] = []

    def create() -> Any:
        container = docker_client.containers.create(
            testbed.base_image, ["sleep", "600"], network_mode="none", cap_drop=["ALL"],
            security_opt=["no-new-privileges"], labels={RUN_LABEL: f"relay-test-{uuid.uuid4().hex[:12]}"})
        made.append(container.id)
        container.start()
        return container

    yield create
    for container_id in made:
        docker_client.api.remove_container(container_id, force=True)


def test_only_the_relay_answers_inside_the_sandbox(sandbox: Any, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    secret = f"sk-host-{uuid.uuid4().hex}"
    monkeypatch.setenv("PB_TEST_MODEL_KEY", secret)
    upstream = ScriptedUpstream()
    upstream.route("POST", "/v1/chat/completions",
                   [Reply([CHAT_BODY]), Reply(CHAT_STREAM, content_type="text/event-stream", chunked=True)])
    upstream.route("POST", "/v1/messages", Reply(ANTHROPIC_STREAM, content_type="text/event-stream", chunked=True))
    records = tmp_path / "model-requests.jsonl"
    try:
        with ModelRelay(f"{upstream.url}/v1", api_key_env="PB_TEST_MODEL_KEY", records_path=records,
                        tcp=True) as relay:
            socket_path, tcp_address = relay.socket_path, relay.tcp_address
            assert socket_path is not None
            assert tcp_address is not None
            container = sandbox()
            tunnel = RelayTunnel(container.client.api, container.id, lambda: connect_unix(str(socket_path))).open(
                SANDBOX_BRIDGE_PORT, script=BRIDGE_SCRIPT.read_bytes())
            try:
                probe = (f"PORTS = {[upstream.port, tcp_address[1], 80, 443, SANDBOX_BRIDGE_PORT + 1]!r}\n"
                         f"SECRET = {secret!r}\n" + PROBE)
                result = container.exec_run(["python3", "-c", probe], user="65534:65534",
                                            environment=relay.sandbox_env())
            finally:
                tunnel.close()
            output = result.output.decode()
            assert result.exit_code == 0, output
            assert container.client.api.inspect_container(container.id)["Mounts"] == []
            [first, streamed, anthropic] = settled(relay, 3)
    finally:
        upstream.close()
    out = json.loads(output)
    assert out["uid"] == 65534
    assert out["interfaces"] == ["lo"]  # no interface but loopback: no other address exists to reach
    assert out["chat"] == [200, CHAT_BODY.decode()]
    assert out["chat_stream"] == [200, b"".join(CHAT_STREAM).decode()]
    assert out["anthropic_stream"] == [200, b"".join(ANTHROPIC_STREAM).decode()]
    # the host's loopback (the upstream, the relay's TCP listener) is not the sandbox's: nothing answers there
    assert out["probes"] == {str(port): "ECONNREFUSED" for port in
                             (upstream.port, tcp_address[1], 80, 443, SANDBOX_BRIDGE_PORT + 1)}
    assert out["secret_in_env"] is False
    assert out["bridges"] == 1
    assert out["kill_bridge"] == "EPERM"  # a root daemon: the agent user cannot stop or ptrace it
    assert all(r.listener == "unix" for r in (first, streamed, anthropic))
    assert first.usage is not None
    assert first.usage.total_tokens == 29
    assert streamed.usage is not None
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (12, 3)
    assert anthropic.usage is not None
    assert (anthropic.usage.input_tokens, anthropic.usage.output_tokens) == (472, 15)
    received = upstream.received
    assert received[0].headers["authorization"] == f"Bearer {secret}"
    assert received[1].headers["authorization"] == f"Bearer {secret}"  # the client sent no key at all
    assert received[2].headers["x-api-key"] == secret
    assert all(PLACEHOLDER_KEY not in str(r.header_items) for r in received)
    assert secret not in records.read_text()
    assert len(records.read_text().splitlines()) == 3
