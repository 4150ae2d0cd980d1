"""A private Docker engine for the chaos and load tests, and the tests of that engine itself.

Chaos tests restart, kill and overload an engine; they must never do that to the shared engine the rest of the suite
(and everyone else on the machine) uses. :class:`PrivateEngine` is a second ``dockerd`` with its own Unix socket,
data root, exec root (so its own managed containerd), pidfile and config file (``bridge none``, no iptables),
started and stopped by pid. Images move in from the shared engine with ``docker save | docker load`` and are checked
by id.

These modules form the serial phase: run them in their own pytest invocation, alongside the parallel suite
(scripts/test-suite.sh starts ``pytest tests/test_chaos*.py tests/test_load.py ...`` in the background while
``pytest tests -n 3 --ignore=...`` runs: nothing they restart, kill or count is the shared engine's). A module-level
file lock (:func:`serial_phase`) keeps two of them from overlapping even when someone runs everything under xdist.
They share one private engine per process (tests/conftest.py's ``private_engine``: started and given the fixture
images once, not once per module); each module takes its turn through :func:`own_engine_module`, which hands the
engine on running and emptied of what the module's runs left, as a new one would be.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

RUN_LABEL = "pytest-programbench"
SERIAL_LOCK = Path(tempfile.gettempdir()) / "pytest-programbench-serial-phase.lock"
FIXTURE_IMAGES = (
    "programbench/pbfix_1776_catlike.c47c47c:task_cleanroom_v6",
    "programbench/pbfix_1776_rpn.0b5e55e:task_cleanroom_v6",
    "programbench/pbfix_1776_tuiish.7e1a0b2:task_cleanroom_v6",
)


class EngineStartError(RuntimeError):
    pass


class PrivateEngine:
    """A ``dockerd`` of our own. ``start()``/``stop()``/``restart()`` act on the pid we started, nothing else."""

    def __init__(self, root: Path, extra_config: dict[str, Any] | None = None) -> None:
        self.root = root
        self.extra_config = dict(extra_config or {})  # more daemon.json keys (registry mirrors)
        self.socket = root / "d.sock"
        self.data_root = root / "data"
        self.exec_root = root / "exec"
        self.pidfile = root / "d.pid"
        self.config_file = root / "daemon.json"
        self.log = root / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["DOCKER_HOST"] = self.url
        return env

    def start(self, timeout: float = 90) -> None:
        if self.pid is not None:
            return
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise EngineStartError("dockerd is not installed: run `bash testbed/setup.sh`")
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(json.dumps({"bridge": "none", "iptables": False, "ip-masq": False,
                                                **self.extra_config}))
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "DOCKER_HOST")}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [dockerd, "--config-file", str(self.config_file), "--host", self.url,
                 "--data-root", str(self.data_root), "--exec-root", str(self.exec_root),
                 "--pidfile", str(self.pidfile)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(f"dockerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.ping():
                return
            time.sleep(0.2)
        raise EngineStartError(f"dockerd did not answer within {timeout} s:\n{self.log_tail()}")

    def ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(2)
                sock.connect(str(self.socket))
                sock.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
                return b"OK" in sock.recv(4096)
        except OSError:
            return False

    def _children(self, pid: int) -> list[int]:
        found = []
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                found += [int(p) for p in task.read_text().split()]
        return found

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to our dockerd (it stops its containers and its containerd), SIGKILL after ``timeout``."""
        proc = self.proc
        if proc is None:
            return
        children = self._children(proc.pid) if proc.poll() is None else []
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        for child in children:  # its containerd, should it have outlived it
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self.proc = None

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def client(self, timeout: int = 120) -> Any:
        import docker

        return docker.DockerClient(base_url=self.url, timeout=timeout)

    def load_images(self, shared: Any, refs: Sequence[str]) -> dict[str, str]:
        """``docker save`` from the shared engine, ``docker load`` here, in one stream; ids must match."""
        wanted = {ref: shared.images.get(ref).id for ref in refs}
        mine = self.client()
        try:
            missing = [ref for ref, image_id in wanted.items() if not _has_image(mine, ref, image_id)]
            if missing:
                docker_cli = shutil.which("docker")
                if docker_cli is None:
                    raise EngineStartError("the docker CLI is missing")
                save = subprocess.Popen([docker_cli, "save", *missing], stdout=subprocess.PIPE,
                                        env={**os.environ, "DOCKER_HOST": _shared_host()})
                load = subprocess.run([docker_cli, "load", "-q"], stdin=save.stdout, capture_output=True,
                                      env=self.env(), timeout=600, check=False)
                assert save.stdout is not None
                save.stdout.close()
                save.wait(60)
                if save.returncode or load.returncode:
                    raise EngineStartError(f"save|load failed: {load.stderr.decode(errors='replace')}")
            for ref, image_id in wanted.items():
                got = mine.images.get(ref).id
                if got != image_id:
                    raise EngineStartError(f"{ref}: loaded {got}, expected {image_id}")
        finally:
            mine.close()
        return wanted

    def clear(self) -> None:
        """Remove every container, and every image the plugin made (its run label), from this engine."""
        api = self.client().api
        try:
            for container in api.containers(all=True):
                api.remove_container(container["Id"], force=True, v=True)
            for image in api.images(all=True, filters={"label": RUN_LABEL}):
                with contextlib.suppress(Exception):  # a child image went first and took it along
                    api.remove_image(image["Id"], force=True)
        finally:
            api.close()

    def containers(self, label: str | None = None) -> list[dict[str, Any]]:
        api = self.client().api
        try:
            filters = {"label": label} if label else {}
            return list(api.containers(all=True, filters=filters))
        finally:
            api.close()


def _shared_host() -> str:
    return os.environ.get("PB_SHARED_DOCKER_HOST") or "unix:///var/run/docker.sock"


def _has_image(engine: Any, ref: str, image_id: str) -> bool:
    from docker.errors import ImageNotFound

    try:
        return bool(engine.images.get(ref).id == image_id)
    except ImageNotFound:
        return False


@contextlib.contextmanager
def serial_phase() -> Iterator[None]:
    """Hold the serial-phase lock: chaos and load modules never overlap, whatever the scheduler."""
    from filelock import FileLock

    with FileLock(str(SERIAL_LOCK)):
        yield


@contextlib.contextmanager
def private_engine_running(shared: Any, images: Sequence[str] = FIXTURE_IMAGES) -> Iterator[PrivateEngine]:
    root = Path(tempfile.mkdtemp(prefix="pbc-", dir="/tmp"))  # short: containerd's socket paths live under it
    engine = PrivateEngine(root)
    try:
        engine.start()
        engine.load_images(shared, images)
        yield engine
    finally:
        engine.stop()
        _remove_tree(root)


@contextlib.contextmanager
def own_engine_module(engine: PrivateEngine, shared: Any,
                      images: Sequence[str] = FIXTURE_IMAGES) -> Iterator[PrivateEngine]:
    """A module's turn on the process's one private engine (tests/conftest.py's ``private_engine``): under the
    serial-phase lock, running, the images it needs there (checked by id). On the way out it is started again if the
    module left it down, and cleared (:meth:`PrivateEngine.clear`), so the next module finds it as a new one."""
    with serial_phase():
        engine.start()
        engine.load_images(shared, images)
        try:
            yield engine
        finally:
            engine.start()
            engine.clear()


def _remove_tree(root: Path) -> None:
    """The data root holds overlay mounts only while dockerd runs; after stop() it is plain files."""
    for _ in range(3):
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            return
        time.sleep(1)


# ---------------------------------------------------------------------------------------------- its own tests

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(private_engine: PrivateEngine, docker_client: Any) -> Iterator[PrivateEngine]:
    with own_engine_module(private_engine, docker_client, FIXTURE_IMAGES[:1]) as private:
        yield private


def test_private_engine_is_separate_and_restartable(engine: PrivateEngine, docker_client: Any) -> None:
    private = engine.client()
    try:
        assert private.info()["DockerRootDir"] == str(engine.data_root)
        assert docker_client.info()["DockerRootDir"] != str(engine.data_root)
        container = private.containers.run(FIXTURE_IMAGES[0], ["sleep", "300"], detach=True, network_mode="none")
        old_pid = engine.pid
        engine.restart()
        assert engine.pid != old_pid
        container.reload()
        assert container.status != "running", "a restart without live-restore stops containers"
        container.remove(force=True)
    finally:
        private.close()
    assert engine.containers() == []
