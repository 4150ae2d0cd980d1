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

NOT_ASKED = object()


@dataclass
class EngineFacts:
    """What was learnt once about the engine behind one client, kept as long as that client lives: whether its
    storage driver takes a size limit (``sandbox.StorageQuota``: asked, or refused by the engine) and its data root
    on this machine (:func:`pytest_programbench.engine.disk.docker_root`). One home, instead of attributes stuck
    onto docker-py's objects by each module that asks."""

    storage_quota: object | None = None
    # Why the engine's kernel refused the evaluation containers' quick-ACK sysctl (evaluation/container_layer.py),
    # once it did: its containers are made without it from then on.
    quick_acks_refused: str | None = None
    docker_root: object = NOT_ASKED  # a Path, None (not on this machine) or NOT_ASKED
    # The default runtime and each registered runtime's path (engine/runtimes.py), once asked.
    runtimes: tuple[str, dict[str, str]] | None = None
    # The grader's read-only volumes made on this engine (evaluation/harness_material.py): (run, content) -> name.
    grader_volumes: dict[tuple[str, str], str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_facts: weakref.WeakKeyDictionary[Any, EngineFacts] = weakref.WeakKeyDictionary()
_facts_lock = threading.Lock()


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
