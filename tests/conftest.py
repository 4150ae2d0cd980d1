"""Shared fixtures of the project's own suite, and the network guard.

The guard fails any test that opens a socket to a non-loopback address: the harness must never send traffic out.
It raises before the connection is attempted, so a violating test sends nothing.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTBED = REPO / "testbed"

# No test may reach the Hugging Face hub: every pytest session a test starts inherits this.
os.environ["HF_HUB_OFFLINE"] = "1"


class NonLoopbackConnection(AssertionError):
    """A test tried to reach an address outside this machine's loopback."""


def _is_loopback(address: Any) -> bool:
    host = address[0] if isinstance(address, tuple) else address
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname other than localhost would need DNS: not on this machine


def _guarded(original: Any) -> Any:
    def guarded(self: socket.socket, address: Any, *args: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
            raise NonLoopbackConnection(f"test opened a socket to non-loopback address {address!r}")
        return original(self, address, *args)

    return guarded


@pytest.fixture(autouse=True)
def _network_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, _guarded(getattr(socket.socket, name)))
    monkeypatch.setattr(socket.socket, "sendto", _guarded_sendto(socket.socket.sendto))


def _guarded_sendto(original: Any) -> Any:
    def sendto(self: socket.socket, data: bytes, *args: Any) -> Any:
        address = args[-1]
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
            raise NonLoopbackConnection(f"test sent a datagram to non-loopback address {address!r}")
        return original(self, data, *args)

    return sendto


# -- Docker-backed tests: they fail, never skip, when the engine or the test bed is missing --------------------


@dataclass(frozen=True)
class Testbed:
    __test__ = False
    blob_dir: Path
    tasks_dir: Path
    submissions: Path
    solutions: Path
    bad: Path
    base_image: str


def _read_env_sh(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip().removeprefix("export ")
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip().strip("'\"")
    return values


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except DockerException as exc:
        pytest.fail(f"Docker engine unavailable ({exc}): run `bash testbed/setup.sh` first", pytrace=False)
    yield client
    client.close()


@pytest.fixture(scope="session")
def testbed(docker_client: Any) -> Testbed:
    env_sh = TESTBED / ".state" / "env.sh"
    if not env_sh.is_file():
        pytest.fail(f"{env_sh} is missing: run `bash testbed/setup.sh` first", pytrace=False)
    env = _read_env_sh(env_sh)
    bed = Testbed(
        blob_dir=Path(env["PB_TESTBED_BLOB_DIR"]),
        tasks_dir=Path(env["PB_TESTBED_TASKS_DIR"]),
        submissions=Path(env["PB_TESTBED_SUBMISSIONS"]),
        solutions=TESTBED / "solutions",
        bad=TESTBED / "bad",
        base_image=env["PB_TESTBED_BASE"],
    )
    for path in (bed.blob_dir, bed.tasks_dir, bed.submissions):
        if not path.is_dir():
            pytest.fail(f"test bed path {path} is missing: run `bash testbed/setup.sh`", pytrace=False)
    return bed


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the developer's PROGRAMBENCH_* settings out of pytester sessions."""
    for key in list(os.environ):
        if key.startswith("PROGRAMBENCH_"):
            monkeypatch.delenv(key)
