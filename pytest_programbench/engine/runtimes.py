"""Docker runtimes (``--pb-runtime``): which ones an engine has registered, and the message when one is missing.

The runtime itself is set on every container by :class:`~.docker_engine.EngineRun` (the one path every create
takes); this module only asks the engine what it offers, for the session's start, ``--pb-preflight`` and each
task's ``pb-meta.json``.
"""

from __future__ import annotations

from typing import Any

from pytest_programbench.engine.facts import facts

HOW_TO_REGISTER = (
    'register it in the engine\'s /etc/docker/daemon.json, e.g. "runtimes": {"runsc": {"path": "/usr/bin/runsc", '
    '"runtimeArgs": ["--network=none"]}} (Debian: apt-get install runsc), then reload dockerd (SIGHUP)'
)


def registered(api: Any) -> tuple[str, ...]:
    """The runtimes the engine accepts in ``HostConfig.Runtime``."""
    runtimes = api.info().get("Runtimes") or {}
    return tuple(sorted(str(name) for name in runtimes))


def _table(api: Any) -> tuple[str, dict[str, str]]:
    """The engine's default runtime and each runtime's path, asked once per client (``docker info`` runs ``runc
    --version`` and ``docker-init --version`` on the engine's side, each time): every task asks both. What the user
    registered is checked afresh (:func:`registered`)."""
    known = facts(api)
    if known.runtimes is None:
        info = api.info()
        paths = {str(name): str((spec or {}).get("path") or "") for name, spec in (info.get("Runtimes") or {}).items()}
        known.runtimes = (str(info.get("DefaultRuntime") or "runc"), paths)
    return known.runtimes


def default(api: Any) -> str:
    """The engine's default runtime (what a container without ``--pb-runtime`` runs under)."""
    return _table(api)[0]


def is_gvisor(api: Any, runtime: str | None) -> bool:
    """Whether ``runtime`` (None or empty: the engine's default) is gVisor's: named ``runsc``, or at a path of that
    name (a runtime registered under a name of its own)."""
    engine_default, paths = _table(api)
    name = runtime or engine_default
    return "runsc" in name or paths.get(name, "").rsplit("/", 1)[-1] == "runsc"


def missing(api: Any, runtime: str, engine_name: str) -> str | None:
    """Why ``runtime`` cannot be used on the engine ``engine_name`` (None: it is registered there)."""
    have = registered(api)
    if runtime in have:
        return None
    return (f"--pb-runtime {runtime}: the Docker engine {engine_name} has no runtime {runtime!r} (it has: "
            f"{', '.join(have) or 'none'}); {HOW_TO_REGISTER}")
