"""Shared fixtures of the project's own suite; the network guard (tests/network_guard.py) for every session.

The guard fails any test that opens a socket to a non-loopback address: the harness must never send traffic out.
It raises before the connection is attempted, so a violating test sends nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy  # noqa: F401 - see below
import pytest
import scipy.stats  # noqa: F401 - see below

from tests import durations
from tests.network_guard import install as install_network_guard
from tests.proxy_support import engine, probe_image, run_labels  # noqa: F401 - fixtures of the proxy/sandbox tests
from tests.session_defaults import KEEP_AUDIT

REPO = Path(__file__).resolve().parent.parent
TESTBED = REPO / "testbed"

# numpy and scipy are imported here, before any in-process pytester session: pytester takes its snapshot of
# sys.modules then and removes what a session imported when it ends, and numpy's C core cannot be loaded twice in a
# process ("cannot load module more than once per process"), so a second inline session computing an interval failed.

# No test may reach the Hugging Face hub: every pytest session a test starts inherits this.
os.environ["HF_HUB_OFFLINE"] = "1"


GUARD_PLUGIN = "tests.network_guard"
SESSION_DEFAULTS_PLUGIN = "tests.session_defaults"  # the audit off in the sessions a test starts

# The machine's cache, as this process found it: pytester points HOME at each test's directory, which would make every
# session it starts download the rerunfailures wheels again (five `pip download`s), rebuild the proxy client and
# reinstall a CLI agent preset from npm (hundreds of MB), where a user's sessions find them in their cache.
MACHINE_CACHE = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "users_defaults: the sessions this test starts keep the hidden-test audit on, "
                                       "as users get it (tests/session_defaults.py)")


@pytest.fixture(autouse=True)
def _guard_the_sessions_a_test_starts(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Every pytest session a test starts loads the guard too: the plugin under test runs in those. And the suite's
    session defaults (the audit off) unless the test is marked ``users_defaults``.

    Set per test (not at import) so the suite's own xdist workers start as usual; PYTEST_PLUGINS, not
    PYTEST_ADDOPTS, because pytester clears the latter.
    """
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    ours = (GUARD_PLUGIN, SESSION_DEFAULTS_PLUGIN)
    plugins = [p for p in os.environ.get("PYTEST_PLUGINS", "").split(",") if p and p not in ours]
    monkeypatch.setenv("PYTEST_PLUGINS", ",".join([*plugins, *ours]))
    if request.node.get_closest_marker("users_defaults"):
        monkeypatch.setenv(KEEP_AUDIT, "1")
    else:
        monkeypatch.delenv(KEEP_AUDIT, raising=False)
    # Sessions share the machine's plugin cache as a user's do (a test wanting a fresh one sets PB_AGENT_CACHE,
    # PB_PROXY_CACHE or PYTEST_PROGRAMBENCH_CACHE, which win).
    monkeypatch.setenv("XDG_CACHE_HOME", MACHINE_CACHE)


install_network_guard()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules longest first, by tests/durations.json (tests/durations.py): with ``--dist loadfile
    --no-loadscope-reorder`` (scripts/test-suite.sh) xdist hands modules out in this order, as the plugin schedules
    tasks, so no long module starts last. Within a module the order is pytest's."""
    path_of: dict[int, str] = {}
    for item in items:
        try:
            path_of[id(item)] = item.path.resolve().relative_to(REPO).as_posix()
        except ValueError:
            path_of[id(item)] = str(item.path)
    items[:] = durations.order_modules(items, durations.load(), path_of)


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


@pytest.fixture(scope="session")
def private_engine(docker_client: Any) -> Iterator[Any]:
    """One private ``dockerd`` for every module of this process that needs an engine of its own (chaos, load,
    several engines): started, and given the fixture images, on first use; each module takes it through
    tests/test_chaos_engine.py's own_engine_module (the serial-phase lock; handed on running and cleared)."""
    from tests.test_chaos_engine import FIXTURE_IMAGES, private_engine_running

    with private_engine_running(docker_client, FIXTURE_IMAGES) as private:
        yield private


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the developer's PROGRAMBENCH_* settings out of pytester sessions."""
    for key in list(os.environ):
        if key.startswith("PROGRAMBENCH_"):
            monkeypatch.delenv(key)
