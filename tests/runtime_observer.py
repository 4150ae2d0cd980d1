"""What the sessions of tests/test_runtime_gvisor.py load (``-p tests.runtime_observer``): every container a process
of the session creates through docker-py is inspected as soon as its create returned, before anything could remove
it, and one JSON line (id, name, runtime, labels, mount targets, command) appended to the file ``$PB_TEST_CREATES``.

It observes and changes nothing: the create is docker-py's own (``create_container_from_config``, where every create
of docker-py ends, the plugin's wrapped client included). The test holds the engine's own list of the run's creates
(its event stream) against these lines, so a container made some other way is seen too.
"""

from __future__ import annotations

import json
import os
from typing import Any

import docker.api.container
import pytest

CREATES = "PB_TEST_CREATES"

_create = docker.api.container.ContainerApiMixin.create_container_from_config


def _observed(self: Any, config: Any, name: Any = None, platform: Any = None) -> Any:
    created = _create(self, config, name, platform)
    path = os.environ.get(CREATES)
    if path and isinstance(created, dict) and created.get("Id"):
        info = self.inspect_container(created["Id"])
        line = {"id": info["Id"], "name": str(info.get("Name", "")).lstrip("/"),
                "runtime": (info.get("HostConfig") or {}).get("Runtime"),
                "labels": (info.get("Config") or {}).get("Labels") or {},
                "mounts": sorted(str(m.get("Destination", "")) for m in info.get("Mounts") or []),
                "command": [*((info.get("Config") or {}).get("Entrypoint") or []),
                            *((info.get("Config") or {}).get("Cmd") or [])]}
        with open(path, "a", encoding="utf-8") as f:  # one write per line, appended: processes never interleave
            f.write(json.dumps(line) + "\n")
    return created


def pytest_configure(config: pytest.Config) -> None:
    # In the session's processes (controller and xdist workers) only: importing this module changes nothing.
    docker.api.container.ContainerApiMixin.create_container_from_config = _observed
