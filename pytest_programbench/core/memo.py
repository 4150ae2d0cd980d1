"""One rule for what a process remembers across items: ``Memo``, a thread-safe map whose value for a key is made once
(under that key's own lock: a slow computation never blocks other keys, and two threads never make the same value
twice) and kept for the process's life. Each user holds its own, keyed so that a stale answer cannot be given (an
image's id, a file's size, mtime and inode, a cache directory)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Memo(Generic[K, V]):
    """``get(key, make)``: the remembered value, else ``make()``'s, remembered unless it raised."""

    def __init__(self) -> None:
        self._values: dict[K, V] = {}
        self._making: dict[K, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        with self._lock:
            if key in self._values:
                return self._values[key]
            making = self._making.setdefault(key, threading.Lock())
        with making:
            with self._lock:
                if key in self._values:  # made by the thread this one waited for
                    return self._values[key]
            value = make()
            with self._lock:
                self._values[key] = value
                self._making.pop(key, None)
            return value

    def clear(self) -> None:
        """Forget every value (a test standing in for a new process)."""
        with self._lock:
            self._values.clear()
