"""The reliable engine client: fast clear failure, bounded retries through outages, idempotent heavy operations,
backpressure across processes, and a missing or hung engine in real sessions.

Faults are injected by :class:`FaultProxy`, a Unix-socket proxy in front of the real shared engine: it can go away
(as an engine does while it restarts), answer a request with a 5xx itself, or forward a request and drop the
response (the operation happened, the client never heard). The shared engine itself is never disturbed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest
import requests

from pytest_programbench import RUN_LABEL
from pytest_programbench.core.environment import DOCKER_CONCURRENCY, DOCKER_SLOTS_DIR
from pytest_programbench.engine import backpressure, docker_engine
from pytest_programbench.engine.backpressure import Backpressure
from pytest_programbench.engine.docker_engine import HOW_TO_START, EngineRun, Engines, RetryPolicy
from pytest_programbench.engine.errors import EngineConnectionError, EngineUnavailable
from pytest_programbench.engine.ownership import EXPIRES_LABEL, OWNER_LABEL, Owner, boot_id
from tests.conftest import Testbed

UPSTREAM = "/var/run/docker.sock"


# ---------------------------------------------------------------------------------------------- the proxy


@dataclass
class Rule:
    method: str
    path: re.Pattern[str]
    action: str  # "status:<code>" | "drop_response"
    remaining: int


@dataclass
class FaultProxy:
    path: Path
    upstream: str = UPSTREAM
    rules: list[Rule] = field(default_factory=list)
    requests_seen: list[str] = field(default_factory=list)
    _listener: socket.socket | None = None
    _conns: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """Like an engine going away: the socket disappears and every open connection is cut."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def fail(self, method: str, path: str, action: str, times: int = 1) -> None:
        self.rules.append(Rule(method, re.compile(path), action, times))

    def seen(self, method: str, path: str) -> int:
        pattern = re.compile(path)
        return sum(1 for line in self.requests_seen if line.startswith(method + " ") and pattern.search(line))

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            muted = threading.Event()  # set: the engine's answers are swallowed (a lost response)
            threading.Thread(target=self._client_to_upstream, args=(client, upstream, muted), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, muted), daemon=True).start()

    def _rule_for(self, chunk: bytes) -> Rule | None:
        match = re.match(rb"([A-Z]+) (\S+) HTTP/1\.[01]\r\n", chunk)
        if not match:
            return None
        method, target = match.group(1).decode(), match.group(2).decode()
        self.requests_seen.append(f"{method} {target}")
        with self._lock:
            for rule in self.rules:
                if rule.remaining > 0 and rule.method == method and rule.path.search(target):
                    rule.remaining -= 1
                    return rule
        return None

    def _client_to_upstream(self, client: socket.socket, upstream: socket.socket, muted: threading.Event) -> None:
        try:
            while True:
                chunk = client.recv(1 << 16)
                if not chunk:
                    break
                rule = self._rule_for(chunk)
                if rule is not None and rule.action.startswith("status:"):
                    code = int(rule.action.split(":")[1])
                    body = json.dumps({"message": f"injected fault {code}"}).encode()
                    client.sendall(f"HTTP/1.1 {code} Injected\r\nContent-Type: application/json\r\nContent-Length: "
                                   f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                    break
                if rule is not None and rule.action == "drop_response":
                    muted.set()
                upstream.sendall(chunk)
                if rule is not None and rule.action == "drop_response":
                    time.sleep(1.0)  # let the engine do it; the client never hears back
                    break
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _pump(source: socket.socket, dest: socket.socket, muted: threading.Event) -> None:
        try:
            while True:
                chunk = source.recv(1 << 16)
                if not chunk:
                    break
                if not muted.is_set():
                    dest.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dest.shutdown(socket.SHUT_RDWR)


def new_engines(**options: Any) -> Engines:
    """Engines of their own (as a session's are): new clients and health, no owner labels, no cap."""
    return Engines(EngineRun(None, Backpressure(0)), **options)


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = new_engines()
    yield made
    made.reset()


@pytest.fixture
def proxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker_client: Any) -> Iterator[FaultProxy]:
    fault = FaultProxy(Path(f"/tmp/pbfp-{uuid.uuid4().hex[:8]}.sock"))
    fault.start()
    monkeypatch.setenv("DOCKER_HOST", fault.url)
    yield fault
    fault.stop()


def restart_after(proxy: FaultProxy, seconds: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), proxy.start()), daemon=True)
    thread.start()
    return thread


def labelled(run: str) -> dict[str, str]:
    return {RUN_LABEL: run}


def remove_run(docker_client: Any, run: str) -> None:
    for info in docker_client.api.containers(all=True, filters={"label": f"{RUN_LABEL}={run}"}):
        with contextlib.suppress(Exception):
            docker_client.api.remove_container(info["Id"], force=True)


# ---------------------------------------------------------------------------------------------- first contact


def test_missing_engine_fails_fast_with_one_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          engines: Engines) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/docker.sock")
    health = engines.get().health
    with pytest.raises(EngineUnavailable) as first:
        engines.client()
    # Fast: one attempt, nothing retried or waited out.
    assert (health.contacts, health.retries, health.outages) == (1, 0, 0)
    assert str(first.value) == (f"Docker engine unreachable at unix://{tmp_path}/docker.sock: there is no socket at "
                                f"{tmp_path}/docker.sock (dockerd is not running); {HOW_TO_START}")
    # Remembered: a burst of items does not probe a dead engine one by one.
    with pytest.raises(EngineUnavailable) as second:
        engines.client()
    assert health.contacts == 1
    assert str(second.value) == str(first.value)
    assert engines.preflight() == str(first.value)
    assert health.down_reason() == str(first.value)


def test_stale_socket_is_connection_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            engines: Engines) -> None:
    path = tmp_path / "stale.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.close()  # the file stays, nobody listens: ECONNREFUSED
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    with pytest.raises(EngineUnavailable, match=r"connection refused at .*stale\.sock \(dockerd is not running\)"):
        engines.client()


def test_hung_engine_fails_within_the_ping_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hung.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(16)
    held: list[socket.socket] = []  # accepted connections, never answered
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    engines = new_engines(ping_timeout=2.0)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    health = engines.get().health
    try:
        # The ping's clock fired (the message says which), on the one connection made: not retried.
        with pytest.raises(EngineUnavailable, match=r"no answer within 2 s \(the engine is hung or overloaded\)"):
            engines.client()
        assert (health.contacts, len(held), health.retries) == (1, 1, 0)
    finally:
        stop.set()
        acceptor.join()
        for connection in held:
            connection.close()
        server.close()


def test_no_process_wide_engines() -> None:
    """Every client comes from an Engines its caller made (a session keeps its own in ``config.stash``): the module
    holds none, and the library's entry points take their engine explicitly instead of making one behind the caller."""
    import inspect

    from pytest_programbench.engine import images, reaper
    from pytest_programbench.evaluation import evaluation
    from pytest_programbench.sandbox.sandbox import Sandbox

    for name in ("client", "standalone_engines", "_standalone", "_standalone_lock"):
        assert not hasattr(docker_engine, name), name
    kinds = (Engines, docker_engine.Engine)
    for name, value in vars(docker_engine).items():
        held = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        assert not any(isinstance(v, kinds) for v in held), name
    for entry in (Sandbox, Sandbox.for_task, images.ensure_image, evaluation.evaluate, reaper.reap_dead_runs,
                  docker_engine.sweep):
        assert inspect.signature(entry).parameters["engine"].default is inspect.Parameter.empty, entry
    labels = docker_engine.Labels("r" + uuid.uuid4().hex[:7], "w")
    with pytest.raises(TypeError, match="engine"):
        Sandbox("img", labels=labels, cpus=1, memory=1 << 30, lifetime=60)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"Engines\(EngineRun\.from_environment\(\)\)"):
        Sandbox("img", labels=labels, cpus=1, memory=1 << 30, lifetime=60, engine=None)


# ---------------------------------------------------------------------------------------------- outages, retries


def test_a_read_waits_out_an_outage(proxy: FaultProxy, engines: Engines, testbed: Testbed) -> None:
    api = engines.client().api
    proxy.stop()
    restart_after(proxy, 1.5)
    started = time.monotonic()
    assert api.inspect_image(testbed.base_image)["Id"].startswith("sha256:")
    assert time.monotonic() - started >= 1.0
    state = engines.get().health
    assert state.outages == 1
    assert state.retries >= 1
    assert state.outage_since is None, "the engine answered: the outage is over"


def test_the_outage_budget_bounds_the_wait(proxy: FaultProxy, testbed: Testbed) -> None:
    engines = new_engines(retry=RetryPolicy(outage_budget=2.0))
    api = engines.client().api
    proxy.stop()
    started = time.monotonic()
    with pytest.raises(EngineConnectionError, match="gave up docker inspect_image after") as caught:
        api.inspect_image(testbed.base_image)
    assert time.monotonic() - started >= 2.0  # the budget was waited out, then given up on (the message says so)
    assert isinstance(caught.value, EngineUnavailable)
    assert isinstance(caught.value, requests.exceptions.ConnectionError)
    assert HOW_TO_START in str(caught.value)
    # Still the same outage: the next call does not wait again (no retry).
    retries = engines.get().health.retries
    with pytest.raises(EngineConnectionError):
        api.images()
    assert engines.get().health.retries == retries


def test_exec_calls_are_never_retried(proxy: FaultProxy, engines: Engines) -> None:
    api = engines.client().api
    proxy.stop()
    started = time.monotonic()
    with pytest.raises(EngineConnectionError):
        api.exec_inspect("0123456789ab")
    with pytest.raises(EngineConnectionError):
        api.exec_create("0123456789ab", ["true"])
    assert time.monotonic() - started < 30  # a retried call would wait out the 60 s outage budget
    assert engines.get().health.retries == 0


def test_create_through_an_outage_makes_exactly_one_container(proxy: FaultProxy, engines: Engines,
                                                              testbed: Testbed,
                                                              docker_client: Any) -> None:
    run = "r" + uuid.uuid4().hex[:7]
    api = engines.client().api
    try:
        proxy.stop()
        restart_after(proxy, 1.0)
        created = api.create_container(testbed.base_image, command=["sleep", "60"], labels=labelled(run),
                                       host_config=api.create_host_config(network_mode="none"))
        found = docker_client.api.containers(all=True, filters={"label": f"{RUN_LABEL}={run}"})
        assert [c["Id"] for c in found] == [created["Id"]]
    finally:
        remove_run(docker_client, run)


def test_create_whose_response_was_lost_is_adopted_not_duplicated(proxy: FaultProxy, engines: Engines,
                                                                  testbed: Testbed,
                                                                  docker_client: Any) -> None:
    run = "r" + uuid.uuid4().hex[:7]
    api = engines.client().api
    proxy.fail("POST", r"/containers/create", "drop_response")
    try:
        created = api.create_container(testbed.base_image, command=["sleep", "60"], labels=labelled(run),
                                       host_config=api.create_host_config(network_mode="none"))
        assert proxy.seen("POST", r"/containers/create") == 2
        found = docker_client.api.containers(all=True, filters={"label": f"{RUN_LABEL}={run}"})
        assert [c["Id"] for c in found] == [created["Id"]], "the retry must adopt the first attempt's container"
        assert found[0]["Names"][0].startswith(f"/pb-{run}-")
    finally:
        remove_run(docker_client, run)


def test_removal_whose_response_was_lost_succeeds(proxy: FaultProxy, engines: Engines, testbed: Testbed,
                                                  docker_client: Any) -> None:
    run = "r" + uuid.uuid4().hex[:7]
    created = docker_client.api.create_container(testbed.base_image, command=["sleep", "60"], labels=labelled(run))
    api = engines.client().api
    proxy.fail("DELETE", r"/containers/", "drop_response")
    try:
        assert api.remove_container(created["Id"], force=True) is None
        assert proxy.seen("DELETE", r"/containers/") == 2
        assert docker_client.api.containers(all=True, filters={"label": f"{RUN_LABEL}={run}"}) == []
    finally:
        remove_run(docker_client, run)


def test_server_errors_are_retried_for_heavy_operations(proxy: FaultProxy, engines: Engines, testbed: Testbed,
                                                        docker_client: Any) -> None:
    run = "r" + uuid.uuid4().hex[:7]
    api = engines.client().api
    proxy.fail("POST", r"/containers/create", "status:500", times=2)
    proxy.fail("POST", r"/containers/[0-9a-f]+/start", "status:503", times=1)
    try:
        created = api.create_container(testbed.base_image, command=["sleep", "60"], labels=labelled(run),
                                       host_config=api.create_host_config(network_mode="none"))
        api.start(created["Id"])
        assert proxy.seen("POST", r"/containers/create") == 3
        assert proxy.seen("POST", r"/containers/[0-9a-f]+/start") == 2
        assert docker_client.api.inspect_container(created["Id"])["State"]["Running"]
    finally:
        remove_run(docker_client, run)


def test_server_errors_of_a_pull_are_not_retried(proxy: FaultProxy, engines: Engines) -> None:
    from docker.errors import APIError

    api = engines.client().api
    proxy.fail("POST", r"/images/create", "status:500", times=5)
    with pytest.raises(APIError, match="injected fault 500"):
        api.pull("programbench/does-not-exist", tag="nope")
    assert proxy.seen("POST", r"/images/create") == 1


def test_client_errors_are_not_retried(proxy: FaultProxy, engines: Engines) -> None:
    from docker.errors import ImageNotFound

    api = engines.client().api
    with pytest.raises(ImageNotFound):
        api.create_container("programbench/does-not-exist:nope", labels=labelled("r0000000"))
    assert proxy.seen("POST", r"/containers/create") == 1


# ---------------------------------------------------------------------------------------------- labels


@dataclass
class _Run:
    run_id: str
    controller_pid: int
    hostname: str
    started: float


def test_configured_runs_label_owner_and_deadline(testbed: Testbed, docker_client: Any,
                                                  monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(backpressure, "slots_root", lambda: tmp_path / "slots")
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    for name in (DOCKER_SLOTS_DIR.name, DOCKER_CONCURRENCY.name):
        monkeypatch.delenv(name, raising=False)
    run = _Run("r" + uuid.uuid4().hex[:7], os.getpid(), socket.gethostname(), time.time())
    engines = Engines(EngineRun.for_run(run, concurrency=3))
    try:
        assert (engines.run.slots.limit, engines.run.slots.directory) == (3, tmp_path / "slots" / run.run_id)
        # Exported: workers started from here share the run's slots; a process outside the session reads them.
        assert os.environ[DOCKER_SLOTS_DIR.name] == str(tmp_path / "slots" / run.run_id)
        assert Backpressure.from_environment().directory == tmp_path / "slots" / run.run_id
        api = engines.client().api
        before = time.time()
        created = api.create_container(testbed.base_image, entrypoint=["sleep"], command=["120"],
                                       labels=labelled(run.run_id))
        labels = docker_client.api.inspect_container(created["Id"])["Config"]["Labels"]
        owner = Owner.parse(labels[OWNER_LABEL])
        assert owner is not None
        assert (owner.hostname, owner.pid, owner.boot_id) == (run.hostname, run.controller_pid,
                                                              boot_id())
        expires = float(labels[EXPIRES_LABEL])
        margin = docker_engine.EXPIRY_MARGIN
        assert before + 120 + margin - 1 <= expires <= time.time() + 120 + margin + 1
        owner_json = json.loads((tmp_path / "slots" / run.run_id / backpressure.OWNER_FILE).read_text())
        assert owner_json["controller_pid"] == os.getpid()
        # The run's volumes (the grader's material) too: a dead run's are the next session's reaper's to remove.
        volume = f"pb-test-{run.run_id}"
        api.create_volume(volume, labels=labelled(run.run_id))
        volume_labels = docker_client.api.inspect_volume(volume)["Labels"]
        assert Owner.parse(volume_labels.get(OWNER_LABEL)) == owner
        assert float(volume_labels[EXPIRES_LABEL]) > time.time()
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.api.remove_volume(f"pb-test-{run.run_id}", force=True)
        remove_run(docker_client, run.run_id)
        engines.reset()


# ---------------------------------------------------------------------------------------------- backpressure

_WORKER = textwrap.dedent("""
    import json, sys, threading, time
    from docker.api.client import APIClient

    intervals = []
    lock = threading.Lock()

    def recorded(name):
        original = getattr(APIClient, name)
        def call(self, *args, **kwargs):
            started = time.time()
            try:
                time.sleep(0.05)  # make overlaps likely
                return original(self, *args, **kwargs)
            finally:
                with lock:
                    intervals.append((name, started, time.time()))
        return call

    for name in ("create_container", "start", "remove_container"):
        setattr(APIClient, name, recorded(name))

    from pytest_programbench.engine import docker_engine
    image, run, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    api = docker_engine.Engines(docker_engine.EngineRun.from_environment()).client().api  # the environment's cap

    def one(k):
        created = api.create_container(image, command=["sleep", "30"], labels={"pytest-programbench": run},
                                       host_config=api.create_host_config(network_mode="none"))
        api.start(created["Id"])
        api.remove_container(created["Id"], force=True)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(count)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(json.dumps(intervals))
""")


def max_overlap(intervals: list[tuple[str, float, float]]) -> int:
    events = sorted([(start, 1) for _n, start, _e in intervals] + [(end, -1) for _n, _s, end in intervals])
    current = peak = 0
    for _when, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def test_heavy_operations_are_capped_across_processes(tmp_path: Path, testbed: Testbed,
                                                      docker_client: Any) -> None:
    run = "r" + uuid.uuid4().hex[:7]
    env = {**os.environ, DOCKER_SLOTS_DIR.name: str(tmp_path / "slots"), DOCKER_CONCURRENCY.name: "2"}
    env.pop("DOCKER_HOST", None)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, testbed.base_image, run, "4"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
        results = [p.communicate(timeout=300) for p in procs]
        for proc, (_out, err) in zip(procs, results, strict=True):
            assert proc.returncode == 0, err
        intervals = [tuple(i) for out, _err in results for i in json.loads(out.strip().splitlines()[-1])]
        assert len(intervals) == 4 * 4 * 3
        assert max_overlap(intervals) == 2, "16 workers' worth of heavy calls, never more than 2 at once"  # type: ignore[arg-type]
        assert docker_client.api.containers(all=True, filters={"label": f"{RUN_LABEL}={run}"}) == []
    finally:
        remove_run(docker_client, run)


def test_a_dead_holder_frees_its_slot(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from pytest_programbench.engine.backpressure import Backpressure
        held = Backpressure(1, Path(sys.argv[1])).acquire("create")
        print("held", flush=True)
        time.sleep(600)
    """), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        assert backpressure.in_use(tmp_path) == 1
    finally:
        holder.kill()
        holder.wait()
    assert backpressure.in_use(tmp_path) == 0


def test_a_streamed_build_holds_its_slot_until_the_stream_ends(tmp_path: Path, testbed: Testbed, docker_client: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.delenv("DOCKER_HOST", raising=False)
    (tmp_path / "slots").mkdir()
    engines = Engines(EngineRun(None, Backpressure(2, tmp_path / "slots")))
    tag = f"pbtest-build/{uuid.uuid4().hex[:8]}:x"
    try:
        api = engines.client().api
        dockerfile = f"FROM {testbed.base_image}\nLABEL pbtest=1\n".encode()
        stream = api.build(fileobj=io.BytesIO(dockerfile), tag=tag, network_mode="none", rm=True, decode=True)
        assert backpressure.in_use(tmp_path / "slots") == 1
        chunks = list(stream)
        assert backpressure.in_use(tmp_path / "slots") == 0
        assert any("aux" in c or "stream" in c for c in chunks)
    finally:
        with contextlib.suppress(Exception):
            docker_client.api.remove_image(tag, force=True)
        engines.reset()


def test_a_thread_holding_a_slot_does_not_deadlock_on_a_nested_call(tmp_path: Path) -> None:
    slots = Backpressure(1, tmp_path)
    with slots.slot("build"), slots.slot("create"):
        assert backpressure.in_use(tmp_path) == 1
    assert backpressure.in_use(tmp_path) == 0


# ---------------------------------------------------------------------------------------------- the retry policy


class ScriptedTransport(requests.adapters.BaseAdapter):
    """A transport that answers the API client itself: ``faults`` ("METHOD path-regex" -> "reset" or a status,
    each used once, in order) first, else a plausible answer; every request is recorded."""

    def __init__(self, faults: list[tuple[str, str]]) -> None:
        super().__init__()
        self.faults = faults
        self.seen: list[str] = []

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        line = f"{request.method} {re.sub(r'^/v[0-9.]+', '', request.path_url)}"  # the API version elided
        self.seen.append(line)
        for index, (pattern, fault) in enumerate(self.faults):
            if re.search(pattern, line):
                del self.faults[index]
                if fault == "reset":
                    raise requests.exceptions.ConnectionError(ConnectionResetError(104, "Connection reset by peer"))
                return self._answer(request, int(fault), {"message": f"scripted {fault}"})
        body: Any = "OK" if "/_ping" in line else {"Id": "c" * 64, "Warnings": [], "Config": {"Labels": {}}}
        return self._answer(request, 201 if "/create" in line else 200, body)

    @staticmethod
    def _answer(request: requests.PreparedRequest, status: int, body: Any) -> requests.Response:
        response = requests.Response()
        response.status_code = status
        response._content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        response.headers["Content-Type"] = "text/plain" if isinstance(body, str) else "application/json"
        response.request = request
        response.url = request.url or ""
        return response

    def close(self) -> None:
        pass

    def count(self, pattern: str) -> int:
        return sum(1 for line in self.seen if re.search(pattern, line))


def scripted_engine(*faults: tuple[str, str]) -> tuple[Any, ScriptedTransport]:
    """An :class:`Engine` whose client talks to a :class:`ScriptedTransport` (first contact made), its API client."""
    from pytest_programbench.engine.engine_api import EngineAPIClient, EngineClient

    transport = ScriptedTransport(list(faults))

    def opener(engine: docker_engine.Engine, timeout: float) -> Any:
        api = EngineAPIClient(engine, base_url="tcp://127.0.0.1:9", version="1.43", timeout=timeout)
        api.mount("http://", transport)  # never a socket: the transport answers
        return EngineClient(api)

    engine = docker_engine.Engine(None, EngineRun(None, Backpressure(0)), opener=opener,
                                  retry=RetryPolicy(backoff_first=0.01))
    return engine, transport


def test_retry_policy_retries_a_transient_error_on_an_idempotent_call_only() -> None:
    from docker.errors import APIError

    engine, transport = scripted_engine(("GET /containers/x/json", "reset"), ("GET /images/y/json", "503"),
                                        ("POST /containers/create", "reset"), ("POST /containers/create", "500"),
                                        ("POST /exec/e/start", "reset"))
    api = engine.api
    # A read: the reset connection is retried and the read answers; the outage is over. A read's 5xx stands.
    assert api.inspect_container("x")["Id"] == "c" * 64
    assert transport.count("GET /containers/x/json") == 2
    assert (engine.health.retries, engine.health.outages, engine.health.outage_since) == (1, 1, None)
    with pytest.raises(APIError, match="scripted 503"):
        api.inspect_image("y")
    # A create without a name cannot be told from its repeat: never retried, neither a reset nor a 5xx.
    with pytest.raises(EngineConnectionError):
        api.create_container("image", command=["true"])
    with pytest.raises(APIError, match="scripted 500"):
        api.create_container("image", command=["true"])
    assert transport.count("POST /containers/create") == 2
    # An exec start: its state dies with the engine, never retried.
    with pytest.raises(EngineConnectionError):
        api.exec_start("e")
    assert transport.count("POST /exec/e/start") == 1
    assert engine.health.retries == 1


def test_retry_policy_repeats_a_named_create_under_the_same_name() -> None:
    engine, transport = scripted_engine(("POST /containers/create", "reset"), ("POST /containers/create", "500"))
    created = engine.api.create_container("image", command=["true"], labels=labelled("r1234567"))
    assert created["Id"] == "c" * 64
    creates = [line for line in transport.seen if line.startswith("POST /containers/create")]
    assert len(creates) == 3
    assert len(set(creates)) == 1, creates  # one name (in the query) for every attempt
    assert "name=pb-r1234567-" in creates[0]
    assert engine.health.retries == 2


# ---------------------------------------------------------------------------------------------- real sessions

pytestmark = pytest.mark.usefixtures("clean_env")


def _session(pytester: pytest.Pytester, testbed: Testbed, docker_host: str, *extra: str,
             env: dict[str, str] | None = None) -> tuple[pytest.RunResult, float]:
    for key, value in {"DOCKER_HOST": docker_host, **(env or {})}.items():
        os.environ[key] = value  # pytester's subprocess inherits it; monkeypatch restores below
    started = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-submissions", str(testbed.submissions), "--pb-filter", "pbfix__", "--pb-output",
        str(pytester.path / "run"), *extra, timeout=300)
    return result, time.monotonic() - started


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["single", "xdist"])
def test_session_with_no_engine_errors_every_item_with_the_message(pytester: pytest.Pytester, testbed: Testbed,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   xdist: list[str]) -> None:
    socket_path = Path(f"/tmp/pbnone-{uuid.uuid4().hex[:8]}.sock")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{socket_path}")
    result, seconds = _session(pytester, testbed, f"unix://{socket_path}", *xdist)
    result.assert_outcomes(errors=3)
    message = (f"Docker engine unreachable at unix://{socket_path}: there is no socket at {socket_path} "
               f"(dockerd is not running); {HOW_TO_START}")
    assert result.stdout.str().count(message) >= 3, result.stdout.str()[-3000:]
    assert seconds < 120


def test_session_with_a_hung_engine_does_not_hang(pytester: pytest.Pytester, testbed: Testbed,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(f"/tmp/pbhung-{uuid.uuid4().hex[:8]}.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(64)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    monkeypatch.setenv("PB_DOCKER_PING_TIMEOUT", "3")
    try:
        result, seconds = _session(pytester, testbed, f"unix://{path}", "-n", "2",
                                   env={"PB_DOCKER_PING_TIMEOUT": "3"})
    finally:
        server.close()
        path.unlink()
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines([f"*Docker engine unreachable at unix://{path}: no answer within 3 s (the engine is "
                                 "hung or overloaded)*"])
    assert seconds < 120
