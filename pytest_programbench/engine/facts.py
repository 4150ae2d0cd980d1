"""What was learnt once about one engine: held by its :class:`~.docker_engine.Engine` (a plain docker-py client's,
kept as long as that client lives).

Its own module because both the engine (:mod:`docker_engine`) and the disk checks (:mod:`disk`) ask it, and the
engine calls the disk checks: here neither imports the other for it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from docker.errors import NotFound

NOT_ASKED = object()


@dataclass
class EngineFacts:
    """What was learnt once about the engine behind one client, kept as long as that client lives: whether its
    storage driver takes a size limit (``sandbox.StorageQuota``: asked, or refused by the engine), its data root on
    this machine (:func:`pytest_programbench.engine.disk.docker_root`) and whether it has a bridge network. One home,
    instead of attributes stuck onto docker-py's objects by each module that asks."""

    storage_quota: object | None = None
    has_bridge: bool | None = None  # a "bridge" network, what network mode "default" names (None: not asked)
    docker_root: object = NOT_ASKED  # a Path, None (not on this machine) or NOT_ASKED
    # The grader's read-only volumes made on this engine (evaluation/harness_material.py): (run, content) -> name.
    grader_volumes: dict[tuple[str, str], str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_facts: weakref.WeakKeyDictionary[Any, EngineFacts] = weakref.WeakKeyDictionary()
_facts_lock = threading.Lock()


def network_mode_for(api: Any, asked: str) -> str:
    """The network mode to give the engine behind ``api`` for ``asked``. Mode ``default`` on an engine without a
    bridge network (``"bridge": "none"``) is loopback only, the same container as ``none``; yet dockerd 20.10 keeps
    each such container's network sandbox after its removal, and its next start removes them one by one (0.1 s each:
    six minutes for 4,689 on this project's CI engine). There it is asked for by that name, ``none``; with a bridge,
    ``default`` stays."""
    if asked != "default":
        return asked
    known = facts(api)
    if known.has_bridge is None:
        try:
            api.inspect_network("bridge")
            known.has_bridge = True
        except NotFound:
            known.has_bridge = False
    return "default" if known.has_bridge else "none"


def facts(api: Any) -> EngineFacts:
    """The :class:`EngineFacts` of the engine client ``api``: its engine's, or (a plain ``docker.APIClient``) the
    client's own, created empty."""
    held = getattr(getattr(api, "engine", None), "facts", None)  # an EngineAPIClient's Engine
    if isinstance(held, EngineFacts):
        return held
    with _facts_lock:
        known = _facts.get(api)
        if known is None:
            known = _facts[api] = EngineFacts()
        return known
