"""Where the plugin keeps what outlives a run (wheels, install records, image locks, the proxy client, CLI agents):
one rule for every user of the cache."""

from __future__ import annotations

from pathlib import Path

from pytest_programbench.core import environment
from pytest_programbench.core.environment import Environ


def cache_root(environ: Environ | None = None) -> Path:
    """``$PYTEST_PROGRAMBENCH_CACHE``, else ``$XDG_CACHE_HOME/pytest-programbench``, else ``~/.cache/...``."""
    if environment.CACHE.is_set(environ):
        return Path(environment.CACHE.raw(environ)).expanduser()
    base = environment.XDG_CACHE_HOME.raw(environ) or str(Path.home() / ".cache")
    return Path(base) / "pytest-programbench"


def cache_dir(name: str, override: environment.Variable | None = None, environ: Environ | None = None) -> Path:
    """The cache's ``name`` directory, or the directory ``override`` names when it is set."""
    if override is not None and override.is_set(environ):
        return Path(override.raw(environ)).expanduser()
    return cache_root(environ) / name
