"""Docker runtimes (``--pb-runtime``): which ones an engine has registered, and the message when one is missing.

The runtime itself is set on every container by :class:`~.docker_engine.EngineRun` (the one path every create
takes); this module only asks the engine what it offers, for the session's start, ``--pb-preflight`` and each
task's ``pb-meta.json``.
"""

from __future__ import annotations

from typing import Any

HOW_TO_REGISTER = (
    'register it in the engine\'s /etc/docker/daemon.json, e.g. "runtimes": {"runsc": {"path": "/usr/bin/runsc", '
    '"runtimeArgs": ["--network=none"]}} (Debian: apt-get install runsc), then reload dockerd (SIGHUP)'
)


def registered(api: Any) -> tuple[str, ...]:
    """The runtimes the engine accepts in ``HostConfig.Runtime``."""
    runtimes = api.info().get("Runtimes") or {}
    return tuple(sorted(str(name) for name in runtimes))


def default(api: Any) -> str:
    """The engine's default runtime (what a container without ``--pb-runtime`` runs under)."""
    return str(api.info().get("DefaultRuntime") or "runc")


def is_gvisor(api: Any, runtime: str | None) -> bool:
    """Whether ``runtime`` (None or empty: the engine's default) is gVisor's: named ``runsc``, or at a path of that
    name (a runtime registered under a name of its own)."""
    info = api.info()
    name = runtime or str(info.get("DefaultRuntime") or "runc")
    path = str(((info.get("Runtimes") or {}).get(name) or {}).get("path") or "")
    return "runsc" in name or path.rsplit("/", 1)[-1] == "runsc"


def missing(api: Any, runtime: str, engine_name: str) -> str | None:
    """Why ``runtime`` cannot be used on the engine ``engine_name`` (None: it is registered there)."""
    have = registered(api)
    if runtime in have:
        return None
    return (f"--pb-runtime {runtime}: the Docker engine {engine_name} has no runtime {runtime!r} (it has: "
            f"{', '.join(have) or 'none'}); {HOW_TO_REGISTER}")
