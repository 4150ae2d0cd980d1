"""What the engine's callers rely on, as Protocols (in the style of pytest-xdist's ``scheduler/protocol.py``).

:class:`DockerEngine` is an engine as the harness holds it: docker-py's client of one engine (a
:class:`~pytest_programbench.engine.engine_api.EngineClient` in a session, a plain ``docker.DockerClient`` in a test
or a bench script), with exactly what its callers use.

:class:`EngineCalls` is what docker-py's API client hands its calls to (:mod:`.engine_api`), implemented by
:class:`~pytest_programbench.engine.docker_engine.Engine`: naming it here keeps :mod:`.engine_api` from importing
:mod:`.docker_engine`, which opens its clients through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class EngineCalls(Protocol):
    """One engine's policy for the API client's calls: each request, pure reads, heavy and container- or
    exec-bound calls (see :class:`~pytest_programbench.engine.docker_engine.Engine`)."""

    url: str | None

    def request(self, send: Callable[..., T], method: str, url: str, *args: Any, **kwargs: Any) -> T: ...

    def read(self, name: str, call: Callable[[], T]) -> T: ...

    def heavy(self, api: Any, name: str, params: dict[str, Any], call: Callable[[], T]) -> T | Iterator[Any]: ...

    def container_bound(self, name: str, container: Any, call: Callable[[], T]) -> T: ...

    def exec_bound(self, name: str, exec_id: Any, call: Callable[[], T]) -> T: ...


class DockerEngine(Protocol):
    """One engine's docker-py client, as the harness uses it: the low-level API client (every call the harness makes
    itself), and docker-py's container and image collections."""

    @property
    def api(self) -> Any:
        """docker-py's ``APIClient`` (an ``EngineAPIClient`` in a session)."""

    @property
    def containers(self) -> Any: ...

    @property
    def images(self) -> Any: ...

    def info(self) -> dict[str, Any]: ...
