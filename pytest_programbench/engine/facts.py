"""What was learnt once about the engine behind one docker-py client, kept as long as that client lives.

Its own module because both the client (:mod:`docker_engine`) and the disk checks (:mod:`disk`) ask it, and the
client calls the disk checks: here neither imports the other for it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

NOT_ASKED = object()


@dataclass
class EngineFacts:
    """What was learnt once about the engine behind one client, kept as long as that client lives: whether its
    storage driver takes a size limit (``sandbox.StorageQuota``: asked, or refused by the engine) and its data root
    on this machine (:func:`pytest_programbench.engine.disk.docker_root`). One home, instead of attributes stuck
    onto docker-py's objects by each module that asks."""

    storage_quota: object | None = None
    docker_root: object = NOT_ASKED  # a Path, None (not on this machine) or NOT_ASKED


_facts: weakref.WeakKeyDictionary[Any, EngineFacts] = weakref.WeakKeyDictionary()
_facts_lock = threading.Lock()


def facts(api: Any) -> EngineFacts:
    """The :class:`EngineFacts` of the engine client ``api`` (a ``docker.APIClient``; created empty)."""
    with _facts_lock:
        known = _facts.get(api)
        if known is None:
            known = _facts[api] = EngineFacts()
        return known
