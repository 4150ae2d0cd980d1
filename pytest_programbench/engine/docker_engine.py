"""The Docker engine: one lazily created SDK client per process, the run's labels, and the sweep.

Every container and image the plugin makes carries ``pytest-programbench=<run id>`` plus worker and task labels,
so the controller can remove everything of its run at session end, also after a worker crashed. Once the session
called :func:`configure_run`, they also carry the run's owner (controller host, pid, start time) and a deadline,
so :mod:`.reaper` can tell a dead run's leftovers from a live run's containers by labels alone.

The client :func:`client` returns is reliable by construction, for every caller:

* the first contact is a ping with a short timeout: a missing, stopped or hung engine gives one clear
  :class:`EngineUnavailable` (with :data:`HOW_TO_START`) within seconds, never a hang; a failure is remembered for
  a few seconds, so a burst of items does not probe a dead engine one by one;
* heavy operations (create, start, build, pull, commit, remove, load) go through
  :mod:`pytest_programbench.engine.backpressure`: at most N at once across all xdist workers of the run;
* transient engine errors (connection refused or reset while the engine restarts, timeouts, 5xx) are retried with
  exponential backoff, bounded by one outage budget per process, for the operations where a retry cannot change
  the meaning of the result: the heavy ones (made idempotent: containers get a name, a repeated removal that finds
  nothing succeeded) and pure reads. Exec and archive calls are never retried: their state dies with the engine;
* every connection failure surfaces as :class:`EngineConnectionError`, which is both an :class:`EngineUnavailable`
  (the pipeline's infrastructure error) and a ``requests`` ``ConnectionError`` (what the container layer expects);
* a container whose engine restarted under it (an exec or archive call on it answers 404/409 after an outage, or
  the daemon's pid changed) raises :class:`EngineRestarted`, so a killed container is never read as a submission
  whose command failed: an infrastructure error, never a wrong score.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import socket
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import requests.exceptions

from pytest_programbench import RUN_LABEL, TASK_LABEL, WORKER_LABEL
from pytest_programbench.engine import backpressure, disk
from pytest_programbench.engine.errors import EngineConnectionError, EngineRestarted, EngineUnavailable
from pytest_programbench.engine.ownership import EXPIRES_LABEL, OWNER_LABEL, Owner, RunLike, boot_id

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)

_client: docker.DockerClient | None = None
_client_lock = threading.Lock()

# The socket timeout of every API call. Generous: creates and commits wait behind other workers' on a loaded 2-core
# machine. It bounds request/response calls only: no command's window depends on it (exec streams are read with no
# socket timeout and end when the command exits or its own clock fires). ``PB_DOCKER_API_TIMEOUT`` sets it.
API_TIMEOUT = float(os.environ.get("PB_DOCKER_API_TIMEOUT", "300"))
# The first contact: a hung engine must not hang every item.
PING_TIMEOUT = float(os.environ.get("PB_DOCKER_PING_TIMEOUT", "10"))
# After a failed first contact, further client() calls fail at once for this long (same message).
UNREACHABLE_MEMORY = 15.0
# How long one outage (the engine refusing connections, e.g. while it restarts) is waited out by retries.
OUTAGE_BUDGET = float(os.environ.get("PB_DOCKER_RETRY_SECONDS", "60"))
# An answer slower than this is said once per call (``PB_SLOW_ENGINE_CALL``); calls that wait on purpose are exempt.
SLOW_CALL = float(os.environ.get("PB_SLOW_ENGINE_CALL", "30"))
_WAITS_ON_PURPOSE = re.compile(r"/(exec/[^/]+/start|containers/[^/]+/(wait|attach|logs))$")
_OBJECT_ID = re.compile(r"/[0-9a-f]{12,64}(?=/|$)")
SERVER_ERROR_RETRIES = 3
TIMEOUT_RETRIES = 1
BACKOFF_FIRST = 0.25
BACKOFF_MAX = 5.0

# A container whose lifetime cannot be read from its command, and every image, expire this long after creation.
DEFAULT_LIFETIME = float(os.environ.get("PB_RUN_LIFETIME", str(7 * 24 * 3600)))
EXPIRY_MARGIN = 600


HOW_TO_START = (
    "start one (e.g. `bash testbed/setup.sh`, or `dockerd &` after writing /etc/docker/daemon.json), "
    "or point DOCKER_HOST at it"
)


# ---------------------------------------------------------------------------------------------- the run's owner


_owner: Owner | None = None


def configure_run(run: RunLike, *, concurrency: int | None = None) -> None:
    """Once per process (controller and every worker) at configure time: the run's owner labels and the cap.

    ``concurrency`` is ``--pb-docker-concurrency`` (None: ``$PB_DOCKER_CONCURRENCY`` or the default 4; 0: no cap).
    """
    global _owner  # noqa: PLW0603 - process-wide, set once by the session
    same_host = run.hostname == socket.gethostname()
    _owner = Owner(run.hostname, int(run.controller_pid), float(run.started), boot_id() if same_host else "")
    backpressure.configure(run_id=run.run_id, limit=concurrency,
                           owner={"hostname": run.hostname, "controller_pid": run.controller_pid,
                                  "started": run.started, "boot_id": _owner.boot_id})


def owner() -> Owner | None:
    return _owner


def owner_labels(lifetime: float | None = None) -> dict[str, str]:
    """The labels :func:`configure_run` adds to everything this process creates (empty when not configured)."""
    if _owner is None:
        return {}
    expires = time.time() + (lifetime if lifetime is not None else DEFAULT_LIFETIME) + EXPIRY_MARGIN
    return {OWNER_LABEL: _owner.label(), EXPIRES_LABEL: str(int(expires))}


# ---------------------------------------------------------------------------------------------- the client


@dataclass
class _EngineState:
    """Process-wide view of the engine's health, shared by every client call."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outage_since: float | None = None
    epoch: int = 0  # bumped at the start of every outage
    outages: int = 0
    retries: int = 0
    created: OrderedDict[str, tuple[int, int | None]] = field(default_factory=OrderedDict)  # id -> (epoch, pid)
    execs: OrderedDict[str, str] = field(default_factory=OrderedDict)  # exec id -> container id
    unreachable: tuple[float, str] | None = None  # (when, message) of the last failed first contact
    slow_calls: dict[str, float] = field(default_factory=dict)  # "POST /containers/create" -> first slow time

    def timed(self, method: str, url: str, seconds: float) -> None:
        """Say a slow engine call once per call (method and path, ids elided), with ``pb_slow_call`` for the view."""
        path = _OBJECT_ID.sub("/{id}", urlsplit(url).path)
        path = re.sub(r"^/v[0-9.]+(?=/)", "", path)
        if seconds < SLOW_CALL or _WAITS_ON_PURPOSE.search(path):
            return
        call = f"{method} {path}"
        with self.lock:
            if call in self.slow_calls:
                return
            self.slow_calls[call] = seconds
        log.warning("slow Docker engine call: %s took %.1f s (said once per call)", call, seconds,
                    extra={"pb_slow_call": call, "pb_seconds": round(seconds, 1)})

    def connection_failed(self, exc: BaseException) -> None:
        with self.lock:
            if self.outage_since is None:
                self.outage_since = time.monotonic()
                self.epoch += 1
                self.outages += 1
                log.warning("Docker engine connection failed (%s); waiting up to %.0f s for it", _short(exc),
                            OUTAGE_BUDGET)

    def answered(self) -> None:
        if self.outage_since is None:
            return
        with self.lock:
            if self.outage_since is not None:
                log.warning("Docker engine answers again after %.1f s", time.monotonic() - self.outage_since)
                self.outage_since = None

    def outage_seconds(self) -> float:
        since = self.outage_since
        return 0.0 if since is None else time.monotonic() - since

    def remember_container(self, container_id: str, url: str | None = None) -> None:
        pid = engine_pid(url)  # now, not at client creation: the engine may have restarted since
        with self.lock:
            self.created[container_id] = (self.epoch, pid)
            while len(self.created) > 4096:
                self.created.popitem(last=False)

    def remember_exec(self, exec_id: str, container_id: str) -> None:
        with self.lock:
            self.execs[exec_id] = container_id
            while len(self.execs) > 4096:
                self.execs.popitem(last=False)


_state = _EngineState()  # the environment's engine
_states: dict[str, _EngineState] = {}  # engines named by URL (--pb-docker-host)
_clients: dict[str, docker.DockerClient] = {}


def engine_state(url: str | None = None) -> _EngineState:
    """The process's health counters of one engine (for reports and tests)."""
    return _state if url is None else _states.setdefault(url, _EngineState())


def url_of(api: Any) -> str | None:
    """The ``--pb-docker-host`` URL the client ``api`` was made for (None: the environment's engine)."""
    url = getattr(api, "_pb_url", None)
    return url if isinstance(url, str) else None


def _short(exc: BaseException | str) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "..."


def _docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _socket_path(url: str | None = None) -> str | None:
    host = url or _docker_host()
    for prefix in ("unix://", "http+unix://"):
        if host.startswith(prefix):
            return "/" + host.removeprefix(prefix).lstrip("/")
    return None


def engine_pid(url: str | None = None) -> int | None:
    """The engine's process id, from the peer credentials of its Unix socket (None for TCP or when hidden)."""
    path = _socket_path(url)
    if path is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(path)
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid = struct.unpack("3i", creds)[0]
    return pid or None


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and exceptions nested in their args (requests wraps urllib3 wraps OSError)."""
    found: list[BaseException] = []
    queue: list[BaseException] = [exc]
    while queue and len(found) < 20:
        current = queue.pop(0)
        if any(current is seen for seen in found):
            continue
        found.append(current)
        queue.extend(a for a in current.args if isinstance(a, BaseException))
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                queue.append(linked)
    return found


def describe_unreachable(exc: BaseException, url: str | None = None) -> str:
    """One line: where the engine was looked for, why it did not answer, and how to start one."""
    host = url or _docker_host()
    path = _socket_path(url)
    causes = _causes(exc)
    described = next((e for e in causes if isinstance(e, EngineConnectionError)), None)
    if described is not None:  # already said (the client's own layer raised it): never say it twice
        return str(described)
    text = " ".join(str(e) for e in causes)
    if "path too long" in text:
        why = f"the socket path {path} is too long for a Unix socket (at most 107 bytes)"
    elif any(isinstance(e, FileNotFoundError) for e in causes) or "No such file or directory" in text:
        why = f"there is no socket at {path} (dockerd is not running)" if path else "its address does not exist"
    elif any(isinstance(e, ConnectionRefusedError) for e in causes) or "Connection refused" in text:
        why = f"connection refused at {path or host} (dockerd is not running)"
    elif any(isinstance(e, PermissionError) for e in causes) or "Permission denied" in text:
        why = f"permission denied on {path or host} (run as root or join the docker group)"
    elif any(isinstance(e, requests.exceptions.Timeout | TimeoutError) for e in causes) \
            or "timed out" in text.lower():
        why = f"no answer within {PING_TIMEOUT:g} s (the engine is hung or overloaded)"
    elif any(isinstance(e, ConnectionResetError) for e in causes) or "reset by peer" in text:
        why = f"the connection to {path or host} was reset (the engine stopped or restarted)"
    else:
        why = _short(exc)
    return f"Docker engine unreachable at {host}: {why}; {HOW_TO_START}"


def client(url: str | None = None) -> docker.DockerClient:
    """The process's client of the engine at ``url`` (``None``: the environment's, ``DOCKER_HOST``); created on
    first use so collection never touches an engine. Each engine has its own health state (outages, restarts)."""
    if url is not None and url == os.environ.get("DOCKER_HOST"):
        url = None  # the environment's engine under its explicit name: one client, one state
    global _client  # noqa: PLW0603 - one client per engine and process, created lazily
    with _client_lock:
        existing = _client if url is None else _clients.get(url)
        if existing is not None:
            return existing
        state = _state if url is None else _states.setdefault(url, _EngineState())
        remembered = state.unreachable
        if remembered is not None and time.monotonic() - remembered[0] < UNREACHABLE_MEMORY:
            raise EngineUnavailable(remembered[1])
        from docker.errors import DockerException

        candidate: docker.DockerClient | None = None
        try:
            # from_env with DOCKER_HOST replaced: TLS settings (DOCKER_TLS_VERIFY, DOCKER_CERT_PATH) still apply;
            # ssh:// goes through the system's ssh client (its config and keys), as the docker CLI does.
            environment = None if url is None else {**os.environ, "DOCKER_HOST": url}
            candidate = _client_class().from_env(timeout=PING_TIMEOUT, environment=environment,
                                                 use_ssh_client=bool(url and url.startswith("ssh://")))
            candidate.api.ping()  # from_env also fetched the API version
        except (DockerException, requests.exceptions.RequestException, OSError) as exc:
            if candidate is not None:
                with contextlib.suppress(Exception):
                    candidate.close()
            message = describe_unreachable(exc, url)
            state.unreachable = (time.monotonic(), message)
            raise EngineUnavailable(message) from exc
        candidate.api.timeout = API_TIMEOUT
        candidate.api._pb_url = url
        candidate.api._pb_state = None if url is None else state  # None: the module's (tests replace it)
        candidate.api._pb_ready = True  # from now on: retries, outage accounting
        state.unreachable = None
        if url is None:
            _client = candidate
        else:
            _clients[url] = candidate
        return candidate


def preflight() -> str | None:
    """For the controller at session start: None when the engine answers, else the one message every item gets."""
    try:
        client()
    except EngineUnavailable as exc:
        return str(exc)
    return None


def forget_client(url: str | None) -> None:
    """Drop the client of one engine (it went away): the next :func:`client` call makes first contact again."""
    global _client  # noqa: PLW0603 - one client per engine and process, created lazily
    with _client_lock:
        known = _client if url is None else _clients.pop(url, None)
        if url is None:
            _client = None
    if known is not None:
        with contextlib.suppress(Exception):  # closing a dead connection is best effort
            known.close()


def reset_client() -> None:
    """Forget every client (after fork, or when an engine was restarted)."""
    global _client  # noqa: PLW0603 - one client per engine and process, created lazily
    with _client_lock:
        for known in [_client, *_clients.values()]:
            if known is not None:
                with contextlib.suppress(Exception):  # closing a dead connection is best effort
                    known.close()
        _client = None
        _clients.clear()
        _state.unreachable = None
        for state in _states.values():
            state.unreachable = None


# ---------------------------------------------------------------------------------------------- the API layer

# Heavy: capped by backpressure, retried on transient errors. Streaming ones hold their slot until the stream ends.
HEAVY = ("create_container", "start", "commit", "remove_container", "remove_image", "build", "pull", "load_image",
         "import_image")
STREAMING = frozenset({"build", "pull", "load_image", "import_image"})
# 5xx of these come from a registry or a Dockerfile: retrying changes nothing.
NO_SERVER_RETRY = frozenset({"build", "pull", "import_image"})
# Pure reads: retried on transient errors, no slot.
READS = ("inspect_image", "inspect_container", "containers", "images", "info", "version", "ping", "df")
# State that dies with the engine: never retried; a 404/409 after a restart is EngineRestarted.
CONTAINER_BOUND = ("exec_create", "put_archive", "get_archive")
EXEC_BOUND = ("exec_start", "exec_inspect", "exec_resize")


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return int(code) if isinstance(code, int) else None


def _explanation(exc: BaseException) -> str:
    return str(getattr(exc, "explanation", None) or exc)


def _lifetime_of(command: Any, entrypoint: Any) -> float | None:
    """``sleep N`` as command, or entrypoint ``sleep`` with command ``N``: the container's own lifetime."""
    def as_list(value: Any) -> list[str]:
        if value is None:
            return []
        return value.split() if isinstance(value, str) else [str(v) for v in value]

    argv = as_list(entrypoint) + as_list(command)
    if len(argv) == 2 and os.path.basename(argv[0]) == "sleep":
        try:
            return float(argv[1])
        except ValueError:
            return None
    return None


_client_classes: list[type[docker.DockerClient]] = []


def _client_class() -> type[docker.DockerClient]:
    """``docker.DockerClient`` whose ``.api`` is the reliable API client (built once, on first use)."""
    if _client_classes:
        return _client_classes[0]
    import docker
    from docker.api.client import APIClient
    from docker.errors import APIError

    def heavy(name: str) -> Callable[..., Any]:
        original = getattr(APIClient, name)
        signature = inspect.signature(original)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._pb_heavy(name, original, signature, args, kwargs)

        method.__name__ = name
        method.__doc__ = original.__doc__
        return method

    def read(name: str) -> Callable[..., Any]:
        original = getattr(APIClient, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._pb_retrying(name, lambda: original(self, *args, **kwargs), server_retries=0)

        method.__name__ = name
        method.__doc__ = original.__doc__
        return method

    def container_bound(name: str) -> Callable[..., Any]:
        original = getattr(APIClient, name)

        def method(self: Any, container: Any, *args: Any, **kwargs: Any) -> Any:
            container_id = str(container.get("Id") if isinstance(container, dict) else container)
            try:
                result = original(self, container, *args, **kwargs)
            except APIError as exc:
                _raise_if_restarted(self, exc, container_id, name)
                raise
            if name == "exec_create" and isinstance(result, dict) and result.get("Id"):
                self._pb_engine_state().remember_exec(str(result["Id"]), container_id)
            return result

        method.__name__ = name
        method.__doc__ = original.__doc__
        return method

    def exec_bound(name: str) -> Callable[..., Any]:
        original = getattr(APIClient, name)

        def method(self: Any, exec_id: Any, *args: Any, **kwargs: Any) -> Any:
            key = str(exec_id.get("Id") if isinstance(exec_id, dict) else exec_id)
            try:
                return original(self, exec_id, *args, **kwargs)
            except APIError as exc:
                _raise_if_restarted(self, exc, self._pb_engine_state().execs.get(key, ""), name)
                raise

        method.__name__ = name
        method.__doc__ = original.__doc__
        return method

    class ReliableAPIClient(APIClient):  # type: ignore[misc]
        """``APIClient`` with backpressure, bounded retries and restart detection (see the module docstring)."""

        _pb_ready = False  # False while client() makes first contact: no retries, no outage accounting
        _pb_url: str | None = None  # None: the environment's engine
        _pb_state: _EngineState | None = None  # None: the module's state of the environment's engine

        def _pb_engine_state(self) -> _EngineState:
            return self._pb_state if self._pb_state is not None else _state

        def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:  # requests.Session.request
            started = time.monotonic()
            try:
                response = super().request(method, url, *args, **kwargs)
            except EngineConnectionError:
                raise
            except requests.exceptions.ConnectionError as exc:
                if isinstance(exc, requests.exceptions.ConnectTimeout):
                    raise
                if self._pb_ready:
                    self._pb_engine_state().connection_failed(exc)
                raise EngineConnectionError(describe_unreachable(exc, self._pb_url)) from exc
            if self._pb_ready:
                self._pb_engine_state().answered()
            self._pb_engine_state().timed(method, url, time.monotonic() - started)
            return response

        # -- retries --------------------------------------------------------------------------------------

        def _pb_retrying(self, name: str, call: Callable[[], Any], *, server_retries: int,
                         before_retry: Callable[[], bool] | None = None,
                         on_repeat: Callable[[APIError], Any] | None = None) -> Any:
            if not self._pb_ready:
                return call()
            attempt = 0
            server_failures = timeouts = 0
            last: BaseException
            while True:
                attempt += 1
                try:
                    return call()
                except EngineConnectionError as exc:
                    if isinstance(exc, EngineRestarted):
                        raise
                    state = self._pb_engine_state()
                    if state.outage_seconds() > OUTAGE_BUDGET:
                        raise EngineConnectionError(
                            f"{exc} (gave up docker {name} after {state.outage_seconds():.0f} s of outage, "
                            f"{attempt} attempt(s))") from exc
                    reason, last = "engine unreachable", exc
                except requests.exceptions.Timeout as exc:
                    timeouts += 1
                    if timeouts > TIMEOUT_RETRIES:
                        raise
                    reason, last = f"timed out ({_short(exc)})", exc
                except APIError as exc:
                    if attempt > 1 and on_repeat is not None:
                        handled = on_repeat(exc)
                        if handled is not _NOT_HANDLED:
                            return handled
                    status = _status(exc) or 0
                    if status < 500 or server_failures >= server_retries:
                        raise
                    server_failures += 1
                    reason, last = f"engine error {status}: {_short(_explanation(exc))}", exc
                if before_retry is not None and not before_retry():
                    raise last  # its input stream is consumed: it cannot be sent again
                delay = min(BACKOFF_MAX, BACKOFF_FIRST * (2 ** (attempt - 1)))
                state = self._pb_engine_state()
                with state.lock:
                    state.retries += 1
                log.warning("docker %s: %s; retry %d in %.2f s", name, reason, attempt, delay)
                time.sleep(delay)

        def _pb_heavy(self, name: str, original: Callable[..., Any], signature: inspect.Signature,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            bound = signature.bind(self, *args, **kwargs)
            params = bound.arguments
            before_retry: Callable[[], bool] | None = None
            on_repeat: Callable[[APIError], Any] | None = None
            if name == "create_container":
                _prepare_create(params)
                on_repeat = self._pb_adopt_created(params)
            elif name == "build":
                _add_labels(params, "labels", DEFAULT_LIFETIME)
                before_retry = _rewinder(params.get("fileobj"))
            elif name == "commit":
                conf = dict(params.get("conf") or {})
                labels = dict(conf.get("Labels") or {})
                if RUN_LABEL in labels:
                    conf["Labels"] = {**labels, **{k: v for k, v in owner_labels().items() if k not in labels}}
                    params["conf"] = conf
            elif name in ("remove_container", "remove_image"):
                on_repeat = _removed_already
            if name in ("build", "pull", "import_image", "load_image"):
                self._pb_check_disk(name, params)
            call_args, call_kwargs = bound.args[1:], bound.kwargs

            def call() -> Any:
                return original(self, *call_args, **call_kwargs)

            server_retries = 0 if name in NO_SERVER_RETRY else SERVER_ERROR_RETRIES
            held = backpressure.acquire(name)
            try:
                result = self._pb_retrying(name, call, server_retries=server_retries, before_retry=before_retry,
                                           on_repeat=on_repeat)
            except BaseException:
                held.release()
                raise
            if name in STREAMING and isinstance(result, Iterator):
                return _held_stream(result, held)
            held.release()
            if name == "create_container" and isinstance(result, dict) and result.get("Id"):
                self._pb_engine_state().remember_container(str(result["Id"]), self._pb_url)
            return result

        def _pb_adopt_created(self, params: dict[str, Any]) -> Callable[[APIError], Any]:
            """A create retried after its first attempt may have happened: adopt the container of that name."""
            def adopt(exc: APIError) -> Any:
                name = params.get("name")
                if _status(exc) != 409 or not name:
                    return _NOT_HANDLED
                try:
                    info = APIClient.inspect_container(self, name)
                except APIError:
                    return _NOT_HANDLED
                wanted = params.get("labels") or {}
                have = info.get("Config", {}).get("Labels") or {}
                if isinstance(wanted, dict) and all(have.get(k) == v for k, v in wanted.items()):
                    log.info("docker create_container: adopted %s, created by the attempt that failed", name)
                    return {"Id": info["Id"], "Warnings": []}
                return _NOT_HANDLED

            return adopt

        def _pb_check_disk(self, name: str, params: dict[str, Any]) -> None:
            what = {"build": f"build {params.get('tag') or 'an image'}",
                    "pull": f"pull {params.get('repository')}:{params.get('tag') or 'latest'}"}.get(name, name)
            disk.require_for_image(what, engine_api=self)

    class ReliableDockerClient(docker.DockerClient):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.api = ReliableAPIClient(*args, **kwargs)

    for name in HEAVY:
        setattr(ReliableAPIClient, name, heavy(name))
    for name in READS:
        setattr(ReliableAPIClient, name, read(name))
    for name in CONTAINER_BOUND:
        setattr(ReliableAPIClient, name, container_bound(name))
    for name in EXEC_BOUND:
        setattr(ReliableAPIClient, name, exec_bound(name))
    _client_classes.append(ReliableDockerClient)
    return ReliableDockerClient


_NOT_HANDLED = object()


def _removed_already(exc: Any) -> Any:
    """A removal retried after an attempt that may have succeeded: "not found" / "in progress" mean done."""
    status = _status(exc)
    if status == 404 or (status == 409 and "already in progress" in _explanation(exc)):
        return None
    return _NOT_HANDLED


def _raise_if_restarted(api: Any, exc: Any, container_id: str, name: str) -> None:
    """404/409 on a container (or exec) this process created before an engine outage or restart."""
    if _status(exc) not in (404, 409) or not container_id:
        return
    state = api._pb_engine_state()
    created = state.created.get(container_id)
    if created is None:
        return
    epoch, pid = created
    now_pid = engine_pid(api._pb_url) if pid is not None else None
    # Same engine process: not a restart. No pid to compare (a TCP engine): any outage since creation counts.
    restarted = now_pid != pid if pid is not None and now_pid is not None else state.epoch != epoch
    if restarted:
        raise EngineRestarted(
            f"the Docker engine restarted while container {container_id[:12]} was in use ({name}: "
            f"{_short(_explanation(exc))}); what ran in it is lost") from exc


def _prepare_create(params: dict[str, Any]) -> None:
    """Owner and deadline labels on the run's containers; a name, so a retried create is idempotent."""
    labels = params.get("labels")
    if isinstance(labels, dict) and RUN_LABEL in labels:
        lifetime = _lifetime_of(params.get("command"), params.get("entrypoint"))
        params["labels"] = {**labels, **{k: v for k, v in owner_labels(lifetime).items() if k not in labels}}
        if not params.get("name"):
            params["name"] = f"pb-{labels[RUN_LABEL]}-{uuid.uuid4().hex[:12]}"


def _add_labels(params: dict[str, Any], key: str, lifetime: float) -> None:
    labels = params.get(key)
    if isinstance(labels, dict) and RUN_LABEL in labels:
        params[key] = {**labels, **{k: v for k, v in owner_labels(lifetime).items() if k not in labels}}


def _rewinder(fileobj: Any) -> Callable[[], bool] | None:
    if fileobj is None:
        return None

    def rewind() -> bool:
        try:
            fileobj.seek(0)
        except (AttributeError, OSError, ValueError):
            return False
        return True

    return rewind


def _held_stream(stream: Iterator[Any], held: Any) -> Iterator[Any]:
    try:
        yield from stream
    finally:
        held.release()


# ---------------------------------------------------------------------------------------------- labels, sweep


@dataclass(frozen=True)
class Labels:
    """The labels of one run, worker and task."""

    run_id: str
    worker: str = "controller"
    task: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)

    def for_task(self, task: str) -> Labels:
        return Labels(self.run_id, self.worker, task, self.extra)

    def as_dict(self) -> dict[str, str]:
        labels = {RUN_LABEL: self.run_id, WORKER_LABEL: self.worker, **self.extra}
        if self.task:
            labels[TASK_LABEL] = self.task
        return labels


@dataclass
class SweepReport:
    containers: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def sweep(run_id: str, *, engine: Any | None = None, task: str | None = None) -> SweepReport:
    """Remove every container, then every image, labelled with this run (optionally one task only)."""
    from docker.errors import APIError, NotFound

    report = SweepReport()
    api = (engine or client()).api
    filters = [f"{RUN_LABEL}={run_id}"]
    if task is not None:
        filters.append(f"{TASK_LABEL}={task}")
    for info in api.containers(all=True, filters={"label": filters}):
        try:
            api.remove_container(info["Id"], force=True, v=True)
            report.containers.append(info["Id"][:12])
        except NotFound:
            pass
        except APIError as exc:
            report.errors.append(f"container {info['Id'][:12]}: {exc}")
    for info in api.images(all=True, filters={"label": filters}):
        try:
            api.remove_image(info["Id"], force=True, noprune=False)
            report.images.append(info["Id"][:19])
        except NotFound:
            pass
        except APIError as exc:
            report.errors.append(f"image {info['Id'][:19]}: {exc}")
    if report.containers or report.images:
        log.info("swept run %s: %d containers, %d images", run_id, len(report.containers), len(report.images))
    return report
