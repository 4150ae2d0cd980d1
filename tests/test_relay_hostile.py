"""Records grown without bound (issue 21 §3): hostile agents in real sandboxes, through one real session.

Two copies of the rpn task, one per attack, in one session (``pytester.runpytest_subprocess``, real sandboxes, the
real relay and tunnel, a scripted upstream on the host's loopback):

* ``flood``: the agent floods the model relay: hundreds of refused requests with 60 KiB paths, then dozens of
  connections each sending a large body (a JSON document ``json.loads`` would blow up twentyfold) to an upstream that
  answers slowly, and connections with megabytes of headers. The session's process (the worker) is watched with
  psutil: its resident memory grows by no more than the configured bounds allow; ``model-requests.jsonl`` stays
  under its cap, every line bounded, the drop said in one line; every request is counted.
* ``fill``: the agent fills the filesystem the proxy's call log lives on (a small host tmpfs mounted at ``/var/lib``
  stands in for the sandbox's storage limit, which this test bed's engine cannot enforce), then calls the reference:
  those calls are counted, their loss is a note and the flag ``call-log-incomplete``, never silent.

Each item is failed (never an error), its agent ran once, and no container or volume is left.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from docker.errors import ImageNotFound

from pytest_programbench.relay import relay_bridge
from pytest_programbench.relay.records import OMITTED_KEY, RECORD_MAX
from pytest_programbench.relay.relay import HEADER_MAX
from pytest_programbench.relay.relay import MAX_CONNECTIONS as RELAY_CONNECTIONS
from tests.conftest import Testbed
from tests.test_outcomes import leaked
from tests.test_relay import CHAT_BODY, Reply, ScriptedUpstream

pytestmark = pytest.mark.docker

RPN_ID = "pbfix__rpn.0b5e55e"
ATTACKS = ("flood", "fill")
REQUEST_MAX = 8 << 20
INFLIGHT_MAX = 16 << 20
RECORDS_MAX = 256 << 10
FLOOD_BODIES = 40
HEADER_FLOODS = 20
REFUSED_PATHS = 400
FILL_CALLS = 40  # more records than fit in the free end of the call log's last page
VOLUME_LABEL = "pbtest-relay-hostile"

HOSTILE_AGENT = r'''
import json, os, socket, subprocess, sys, threading

attack = os.environ["PB_TASK_ID"].split("__")[1].split(".")[0]
print("AGENT-START", attack, flush=True)
base = os.environ["PB_MODEL_RELAY_URL"]  # http://127.0.0.1:PORT/v1
port = int(base.split("//")[1].split("/")[0].split(":")[1])


def status(head, body_parts=(), *, read=True):
    """Send a request (head, then the body in parts), return the status the relay answered (0: none)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=300)
    try:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
    except OSError:
        pass  # refused before the body was read: the answer says why
    got = b""
    try:
        while b"\r\n" not in got:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    sock.close()
    try:
        return int(got.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


seen = {}


def count(code):
    seen[code] = seen.get(code, 0) + 1


if attack == "flood":
    for _ in range(REFUSED_PATHS):  # a refused request kept its whole path; records had no limit in number
        count(status(b"GET /" + b"x" * 60000 + b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"))
    # Bodies json.loads would make twentyfold bigger, from many connections at once, to a slow upstream.
    piece = b"[]," * (1 << 16)
    parts = [b'{"model": "m", "messages": ['] + [piece] * ((REQUEST_MAX - 64) // len(piece)) + [b'[]]}']
    length = sum(map(len, parts))
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % length)
    headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"h" * 60000) for i in range(90))
    jobs = [lambda: count(status(head, parts)) for _ in range(FLOOD_BODIES)]
    jobs += [lambda: count(status(b"GET /v1/models HTTP/1.1\r\n" + headers + b"\r\n")) for _ in range(HEADER_FLOODS)]
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("FLOOD-DONE", json.dumps(seen, sort_keys=True), flush=True)
elif attack == "fill":
    def call():
        subprocess.run(["/workspace/binary"], input=b"1 2 +\n", stdout=subprocess.DEVNULL)
    call()  # recorded
    os.makedirs("/var/lib/pb-fill", exist_ok=True)
    try:
        with open("/var/lib/pb-fill/fill", "wb") as sink:
            while True:
                sink.write(b"\0" * (1 << 16))
                sink.flush()
    except OSError as exc:
        print("FILLED", exc.errno, flush=True)
    for _ in range(FILL_CALLS):
        call()
    print("CALLS-DONE", flush=True)
'''

# Gives the fill task's sandbox a small filesystem at /var/lib (the proxy's call log is there) with a directory the
# agent may fill: the sandbox's storage limit, which this test bed's engine cannot enforce. A directory of its own on
# a host tmpfs (PBTEST_FILL_DIR), as a volume (so the image's /var/lib is copied in): it outlives the container's
# stop, when the harness reads the call log.
FILL_VOLUME_PLUGIN = textwrap.dedent("""
    import os
    import uuid

    from docker.models.containers import ContainerCollection
    from docker.types import DriverConfig, Mount

    from pytest_programbench.sandbox import sandbox

    create = ContainerCollection.create
    install = sandbox.Sandbox._install

    def create_with_volume(self, *args, **kwargs):
        if any("__fill." in value for value in (kwargs.get("labels") or {}).values()):
            device = os.path.join(os.environ["PBTEST_FILL_DIR"], uuid.uuid4().hex)
            os.mkdir(device)
            volume = Mount("/var/lib", None, type="volume", labels={"%(label)s": "1"},
                           driver_config=DriverConfig("local", {"type": "none", "o": "bind", "device": device}))
            kwargs["mounts"] = [*(kwargs.get("mounts") or []), volume]
        return create(self, *args, **kwargs)

    def install_with_fill_dir(self):
        install(self)
        self.exec(["sh", "-c", "mkdir -p /var/lib/pb-fill && chmod 1777 /var/lib/pb-fill"], user="root",
                  workdir="/", timeout=30)

    ContainerCollection.create = create_with_volume
    sandbox.Sandbox._install = install_with_fill_dir
""") % {"label": VOLUME_LABEL}


@pytest.fixture
def hostile_tasks(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any) -> Iterator[dict[str, str]]:
    """Copies of the rpn task, one per attack, its image tagged under each copy's name: attack -> task id."""
    root = pytester.mkdir("tasks")
    suffix = uuid.uuid4().hex[:7]
    image = docker_client.images.get(f"programbench/{RPN_ID.replace('__', '_1776_')}:task_cleanroom_v6")
    ids = {attack: f"pbrelayhostile__{attack}.{suffix}" for attack in ATTACKS}
    tags = []
    for iid in ids.values():
        shutil.copytree(testbed.tasks_dir / RPN_ID, root / iid)
        repository = f"programbench/{iid.replace('__', '_1776_')}"
        image.tag(repository, "task_cleanroom_v6")
        tags.append(f"{repository}:task_cleanroom_v6")
    agents = pytester.mkdir("hostile")
    constants = (f"REFUSED_PATHS = {REFUSED_PATHS}\nREQUEST_MAX = {REQUEST_MAX}\nFLOOD_BODIES = {FLOOD_BODIES}\n"
                 f"HEADER_FLOODS = {HEADER_FLOODS}\nFILL_CALLS = {FILL_CALLS}\n")
    (agents / "hostile.py").write_text(constants + HOSTILE_AGENT)
    try:
        yield ids
    finally:
        for tag in tags:
            with contextlib.suppress(ImageNotFound):
                docker_client.images.remove(tag, noprune=True)


@pytest.fixture
def fill_dir(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs on the host (the test bed runs as root, like CI): the fill task's storage."""
    mountpoint = tmp_path / "fill"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=755", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.fail(f"this test mounts a tmpfs on the host (it runs as root, as the engine does): {mounted.stderr}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)


class RssWatch:
    """Samples the resident memory of the session's process (this test's child) until stopped. ``baseline`` is
    the sample taken when ``start_file`` first exists (the relay of the flood task is up), ``peak`` the largest
    after that."""

    def __init__(self, start_file: Path) -> None:
        self.start_file = start_file
        self.baseline: int | None = None
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _session(self) -> psutil.Process | None:
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                if "pytest" in " ".join(child.cmdline()):
                    return child
        return None

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            session = self._session()
            if session is None:
                continue
            try:
                rss = int(session.memory_info().rss)
            except psutil.Error:
                continue
            if self.baseline is None:
                if self.start_file.exists():
                    self.baseline = rss
                continue
            self.samples += 1
            self.peak = max(self.peak, rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def memory_bound() -> int:
    """What the configured limits let the agent make the worker hold: the request bodies held at once (at least two
    of the largest), a window of bytes per bridge channel, a request line and headers per relay connection (twice:
    bytes and their decoded text), plus 96 MiB for everything else the worker does meanwhile (its sandbox, threads,
    the allocator's slack)."""
    bodies = max(INFLIGHT_MAX, 2 * REQUEST_MAX)
    tunnel = relay_bridge.MAX_CONNECTIONS * (relay_bridge.WINDOW + relay_bridge.BUFFER)
    headers = RELAY_CONNECTIONS * 2 * (HEADER_MAX + 65536)
    return bodies + tunnel + headers + (96 << 20)


@pytest.mark.usefixtures("clean_env")
def test_hostile_records_and_floods_stay_bounded(pytester: pytest.Pytester, testbed: Testbed,
                                                 hostile_tasks: dict[str, str], docker_client: Any,
                                                 monkeypatch: pytest.MonkeyPatch, fill_dir: Path) -> None:
    upstream = ScriptedUpstream()
    # Every model request is answered after a while: the bodies the relay admitted stay held meanwhile.
    slow = threading.Event()
    upstream.route("POST", "/v1/chat/completions", Reply([CHAT_BODY[:1], CHAT_BODY[1:]], gate=slow))
    monkeypatch.setenv("PB_MODEL_REQUESTS_MAX", str(RECORDS_MAX))
    monkeypatch.setenv("PB_RELAY_REQUEST_MAX", str(REQUEST_MAX))
    monkeypatch.setenv("PB_RELAY_INFLIGHT_MAX", str(INFLIGHT_MAX))
    monkeypatch.setenv("PB_RELAY_BUDGET_WAIT", "1")
    monkeypatch.setenv("PBTEST_FILL_DIR", str(fill_dir))
    pytester.makepyfile(pb_fill_volume=FILL_VOLUME_PLUGIN)
    run_dir = pytester.path / "run"
    ids = hostile_tasks
    watch = RssWatch(run_dir / ids["flood"] / "model-requests.jsonl")
    releaser = threading.Thread(target=_release_slowly, args=(slow, watch), daemon=True)
    releaser.start()
    try:
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-p", "pb_fill_volume", "--pb-tasks-dir", str(pytester.path / "tasks"),
            "--pb-blob-dir", str(testbed.blob_dir), "--pb-filter", "pbrelayhostile__",
            "--pb-agent", "python3 /pb-hostile/hostile.py",
            "--pb-agent-mount", f"{pytester.path / 'hostile'}:/pb-hostile", "--pb-pull", "never",
            "--pb-model-endpoint", f"{upstream.url}/v1", "--pb-output", str(run_dir), "--pb-cpus", "2",
            "--pb-agent-timeout", "600", timeout=1500)
    finally:
        watch.stop()
        slow.set()
        upstream.close()
    result.assert_outcomes(failed=len(ATTACKS))
    tasks = json.loads((run_dir / "summary.json").read_text())["tasks"]
    for attack, iid in ids.items():
        assert tasks[iid]["outcome"] == "failed", (attack, tasks[iid])
        assert (run_dir / iid / "agent.log").read_text().count("AGENT-START") == 1, (attack, "ran more than once")

    # The flood: the worker's memory grew by no more than the bounds allow.
    assert watch.baseline is not None, "the flood task's relay never started"
    assert watch.samples > 0
    assert watch.peak - watch.baseline <= memory_bound(), (watch.baseline, watch.peak, memory_bound())
    log = (run_dir / ids["flood"] / "agent.log").read_text()
    seen = json.loads(log.split("FLOOD-DONE", 1)[1].splitlines()[0])
    assert seen.pop("404") == REFUSED_PATHS
    # 400: the cleanroom relay reads each body before it goes upstream and refuses one past its token bound.
    assert set(seen) <= {"200", "400", "431", "503"}, seen
    assert seen.get("431") == HEADER_FLOODS
    assert sum(seen.values()) == FLOOD_BODIES + HEADER_FLOODS  # every request answered, none hung or cut

    # Its records: the file under its cap, every line bounded, the drop said once; every request counted.
    data = (run_dir / ids["flood"] / "model-requests.jsonl").read_bytes()
    assert len(data) <= RECORDS_MAX + 1024
    lines = data.splitlines()
    assert all(len(line) <= RECORD_MAX for line in lines)
    [marker] = [json.loads(line) for line in lines if OMITTED_KEY.encode() in line]
    total = REFUSED_PATHS + FLOOD_BODIES + HEADER_FLOODS
    assert marker[OMITTED_KEY] + len(lines) - 1 == total
    meta = json.loads((run_dir / ids["flood"] / "pb-meta.json").read_text())
    assert meta["relay"]["requests"] == total
    assert meta["relay_bounds"]["records_omitted"] == marker[OMITTED_KEY]
    assert meta["relay_bounds"]["inflight_peak_bytes"] <= max(INFLIGHT_MAX, 2 * REQUEST_MAX)
    assert any("model-requests.jsonl reached its cap" in reason for reason in tasks[ids["flood"]]["reasons"])

    # The fill: the calls made with the log's storage full are counted, the loss said and flagged.
    fill_log = (run_dir / ids["fill"] / "agent.log").read_text()
    assert "FILLED 28" in fill_log  # ENOSPC
    assert "CALLS-DONE" in fill_log
    meta = json.loads((run_dir / ids["fill"] / "pb-meta.json").read_text())
    assert meta["binary_calls"] == 1 + FILL_CALLS  # the daemon's own count: every call
    unrecorded = meta["binary_calls_unrecorded"]
    assert unrecorded > 0
    recorded = (run_dir / ids["fill"] / "binary-calls.jsonl").read_text().splitlines()
    # (the call whose last line was cut short is both: its first line recorded, its end counted as lost)
    assert len(recorded) + unrecorded in (1 + FILL_CALLS, 2 + FILL_CALLS)
    reasons = "\n".join(tasks[ids["fill"]]["reasons"])
    assert f"{unrecorded} call(s) of the reference could not be recorded" in reasons
    assert "call-log-incomplete" in reasons

    assert leaked(docker_client, run_dir) == []
    assert docker_client.volumes.list(filters={"label": VOLUME_LABEL}) == []


def _release_slowly(slow: threading.Event, watch: RssWatch) -> None:
    """The upstream holds its answers while the flood is under way: released some seconds after the flood task's
    relay started (a wait only makes the flood harder), so every admitted request ends."""
    while watch.baseline is None and not slow.is_set():
        time.sleep(0.1)
    slow.wait(20)
    slow.set()
