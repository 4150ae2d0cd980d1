"""docker-py's API client with its calls routed through their :class:`~.docker_engine.Engine`.

docker-py's high-level objects (``client.containers.run``, ``client.images.get``...) and our own callers all end in
``APIClient`` methods, so that is where the engine's policy attaches: each method below hands its call to the
engine (heavy, read, container-bound or exec-bound; see :mod:`.docker_engine`), which holds every bit of state.
Imported on first contact only: collection never imports docker-py for it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import docker
from docker.api.client import APIClient
from docker.context import ContextAPI
from docker.utils import kwargs_from_env

from pytest_programbench.engine.protocol import EngineCalls

# The heavy calls' parameters by name: the engine adds labels and a name, rewinds a build context.
_SIGNATURES = {name: inspect.signature(getattr(APIClient, name))
               for name in ("create_container", "start", "commit", "remove_container", "remove_image", "build",
                            "pull", "load_image", "import_image", "create_volume")}


class EngineAPIClient(APIClient):  # type: ignore[misc]  # docker-py has no type hints
    """``APIClient`` whose requests and calls go through ``engine``: backpressure, bounded retries, restart
    detection (:class:`~.docker_engine.Engine`)."""

    def __init__(self, engine: EngineCalls, **kwargs: Any) -> None:
        self.engine = engine  # first: the constructor's own version request goes through it
        super().__init__(**kwargs)

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:  # requests.Session.request
        return self.engine.request(super().request, method, url, *args, **kwargs)

    def inspect_once(self, container: str) -> Any:
        """One ``inspect_container``, never retried (inside a retry of another call)."""
        return APIClient.inspect_container(self, container)

    # -- heavy: capped, labelled, retried where idempotent ---------------------------------------------------

    def _heavy(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        original: Callable[..., Any] = getattr(APIClient, name)
        bound = _SIGNATURES[name].bind(self, *args, **kwargs)
        # bound.args/kwargs are read when the call runs: after the engine changed bound.arguments.
        return self.engine.heavy(self, name, bound.arguments, lambda: original(*bound.args, **bound.kwargs))

    def create_container(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("create_container", args, kwargs)

    def start(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("start", args, kwargs)

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("commit", args, kwargs)

    def remove_container(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("remove_container", args, kwargs)

    def remove_image(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("remove_image", args, kwargs)

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("build", args, kwargs)

    def pull(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("pull", args, kwargs)

    def load_image(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("load_image", args, kwargs)

    def import_image(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("import_image", args, kwargs)

    def create_volume(self, *args: Any, **kwargs: Any) -> Any:
        return self._heavy("create_volume", args, kwargs)

    # -- pure reads: retried on transient failures -------------------------------------------------------------

    def _read(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        original: Callable[..., Any] = getattr(APIClient, name)
        return self.engine.read(name, lambda: original(self, *args, **kwargs))

    def inspect_image(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("inspect_image", args, kwargs)

    def inspect_container(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("inspect_container", args, kwargs)

    def containers(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("containers", args, kwargs)

    def images(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("images", args, kwargs)

    def info(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("info", args, kwargs)

    def version(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("version", args, kwargs)

    def ping(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("ping", args, kwargs)

    def df(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("df", args, kwargs)

    # -- a container's or an exec's live state: never retried ---------------------------------------------------

    def exec_create(self, container: Any, *args: Any, **kwargs: Any) -> Any:
        return self.engine.container_bound("exec_create", container,
                                           lambda: APIClient.exec_create(self, container, *args, **kwargs))

    def put_archive(self, container: Any, *args: Any, **kwargs: Any) -> Any:
        return self.engine.container_bound("put_archive", container,
                                           lambda: APIClient.put_archive(self, container, *args, **kwargs))

    def get_archive(self, container: Any, *args: Any, **kwargs: Any) -> Any:
        return self.engine.container_bound("get_archive", container,
                                           lambda: APIClient.get_archive(self, container, *args, **kwargs))

    def exec_start(self, exec_id: Any, *args: Any, **kwargs: Any) -> Any:
        return self.engine.exec_bound("exec_start", exec_id,
                                      lambda: APIClient.exec_start(self, exec_id, *args, **kwargs))

    def exec_inspect(self, exec_id: Any, *args: Any, **kwargs: Any) -> Any:
        return self.engine.exec_bound("exec_inspect", exec_id,
                                      lambda: APIClient.exec_inspect(self, exec_id, *args, **kwargs))

    def exec_resize(self, exec_id: Any, *args: Any, **kwargs: Any) -> Any:
        return self.engine.exec_bound("exec_resize", exec_id,
                                      lambda: APIClient.exec_resize(self, exec_id, *args, **kwargs))


class EngineClient(docker.DockerClient):  # type: ignore[misc]  # docker-py has no type hints
    """``docker.DockerClient`` over an :class:`EngineAPIClient`."""

    def __init__(self, api: EngineAPIClient) -> None:
        self.api = api


def open_client(engine: EngineCalls, timeout: float) -> docker.DockerClient:
    """A client of ``engine``, configured as ``docker.from_env`` would with ``DOCKER_HOST`` = its URL: TLS settings
    (``DOCKER_TLS_VERIFY``, ``DOCKER_CERT_PATH``) still apply; ssh:// goes through the system's ssh client (its
    config and keys), as the docker CLI does. Opening fetches the engine's API version."""
    url = engine.url
    environment = dict(os.environ) if url is None else {**os.environ, "DOCKER_HOST": url}
    params = kwargs_from_env(environment=environment)
    from_context = getattr(ContextAPI, "kwargs_from_context", None)  # docker-py >= 7.2: the CLI's current context
    if "base_url" not in params and from_context is not None:
        for key, value in from_context(environment=environment).items():
            params.setdefault(key, value)
    return EngineClient(EngineAPIClient(engine, timeout=timeout, version=None,
                                        use_ssh_client=bool(url and url.startswith("ssh://")), **params))
