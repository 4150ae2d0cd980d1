"""The Docker engine: one :class:`Engine` per engine and process, the run's labels and cap, and the sweep.

Every container and image the plugin makes carries ``pytest-programbench=<run id>`` plus worker and task labels,
so the controller can remove everything of its run at session end, also after a worker crashed. The run's
:class:`EngineRun` adds the run's owner (controller host, pid, start time) and a deadline, so :mod:`.reaper` can
tell a dead run's leftovers from a live run's containers by labels alone.

An :class:`Engine` holds one engine's docker-py client (made on first use: docker-py is not fork-safe, so each
process makes its own), its URL, its health and what was learnt about it. Its client is reliable by construction,
for every caller (the calls go through :class:`pytest_programbench.engine.engine_api.EngineAPIClient`):

* the first contact is a ping with a short timeout: a missing, stopped or hung engine gives one clear
  :class:`EngineUnavailable` (with :data:`HOW_TO_START`) within seconds, never a hang; a failure is remembered for
  a few seconds, so a burst of items does not probe a dead engine one by one;
* heavy operations (create, start, build, pull, commit, remove, load) take a slot of the run's
  :class:`~pytest_programbench.engine.backpressure.Backpressure`: at most N at once across all xdist workers;
* transient engine errors (connection refused or reset while the engine restarts, timeouts, 5xx) are retried by
  :class:`RetryPolicy` (tenacity) with exponential backoff, bounded by one outage budget per engine, for the
  operations where a retry cannot change the meaning of the result: the heavy ones (made idempotent: a container
  gets a name, a repeated removal that finds nothing succeeded; a create without a name is never retried) and pure
  reads. Exec and archive calls are never retried: their state dies with the engine;
* every connection failure surfaces as :class:`EngineConnectionError`, which is both an :class:`EngineUnavailable`
  (the pipeline's infrastructure error) and a ``requests`` ``ConnectionError`` (what the container layer expects);
* a container whose engine restarted under it (an exec or archive call on it answers 404/409 after an outage, or
  the daemon's pid changed) raises :class:`EngineRestarted`, so a killed container is never read as a submission
  whose command failed: an infrastructure error, never a wrong score.

A session keeps its :class:`Engines` in ``config.stash`` and hands them down. There is no process-wide default:
a caller outside a session (library use, tests, bench scripts) makes its own, ``Engines(EngineRun.from_environment())``,
and passes its client to every entry point that talks to an engine.
"""

from __future__ import annotations

import contextlib
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
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import requests.exceptions
import tenacity
from docker.errors import APIError, DockerException, NotFound

from pytest_programbench import RUN_LABEL, TASK_LABEL, WORKER_LABEL
from pytest_programbench.core.environment import (
    DOCKER_API_TIMEOUT,
    DOCKER_HOST,
    DOCKER_PING_TIMEOUT,
    DOCKER_RETRY_SECONDS,
    RUN_LIFETIME,
    SLOW_ENGINE_CALL,
)
from pytest_programbench.engine import disk
from pytest_programbench.engine.backpressure import Backpressure
from pytest_programbench.engine.container import Container
from pytest_programbench.engine.engine_api import open_client
from pytest_programbench.engine.errors import EngineConnectionError, EngineRestarted, EngineUnavailable
from pytest_programbench.engine.facts import EngineFacts
from pytest_programbench.engine.ownership import EXPIRES_LABEL, OWNER_LABEL, Owner, RunLike, boot_id
from pytest_programbench.engine.protocol import DockerEngine

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)

T = TypeVar("T")

# The socket timeout of every API call. Generous: creates and commits wait behind other workers' on a loaded 2-core
# machine. It bounds request/response calls only: no command's window depends on it (exec streams are read with no
# socket timeout and end when the command exits or its own clock fires). ``PB_DOCKER_API_TIMEOUT`` sets it.
API_TIMEOUT = DOCKER_API_TIMEOUT.number()
# The first contact: a hung engine must not hang every item.
PING_TIMEOUT = DOCKER_PING_TIMEOUT.number()
# After a failed first contact, further uses of the engine fail at once for this long (same message).
UNREACHABLE_MEMORY = 15.0
# How long one outage (the engine refusing connections, e.g. while it restarts) is waited out by retries.
OUTAGE_BUDGET = DOCKER_RETRY_SECONDS.number()
# An answer slower than this is said once per call (``PB_SLOW_ENGINE_CALL``); calls that wait on purpose are exempt.
SLOW_CALL = SLOW_ENGINE_CALL.number()
_WAITS_ON_PURPOSE = re.compile(r"/(exec/[^/]+/start|containers/[^/]+/(wait|attach|logs))$")
_OBJECT_ID = re.compile(r"/[0-9a-f]{12,64}(?=/|$)")

# A container whose lifetime cannot be read from its command, and every image, expire this long after creation.
DEFAULT_LIFETIME = RUN_LIFETIME.number()
EXPIRY_MARGIN = 600


HOW_TO_START = (
    "start one (e.g. `bash testbed/setup.sh`, or `dockerd &` after writing /etc/docker/daemon.json), "
    "or point DOCKER_HOST at it"
)

# Heavy: capped by backpressure, retried on transient errors. Streaming ones hold their slot until the stream ends.
HEAVY = ("create_container", "start", "commit", "remove_container", "remove_image", "build", "pull", "load_image",
         "import_image")
STREAMING = frozenset({"build", "pull", "load_image", "import_image"})
# 5xx of these come from a registry or a Dockerfile: retrying changes nothing.
NO_SERVER_RETRY = frozenset({"build", "pull", "import_image"})
# They write images: the engine's disk is checked first.
FETCHES = frozenset({"build", "pull", "import_image", "load_image"})
# Pure reads: retried on transient errors, no slot.
READS = ("inspect_image", "inspect_container", "containers", "images", "info", "version", "ping", "df")
# State that dies with the engine: never retried; a 404/409 after a restart is EngineRestarted.
CONTAINER_BOUND = ("exec_create", "put_archive", "get_archive")
EXEC_BOUND = ("exec_start", "exec_inspect", "exec_resize")


# ---------------------------------------------------------------------------------------------- the run


class EngineRun:
    """What a run adds to every engine call of one process: the owner and deadline labels on what it creates
    (``owner`` None: none), the cap on heavy operations shared by the run's processes, and the OCI runtime of every
    container it creates (``runtime`` None: the engine's default). The runtime is set here, on the one path every
    create takes, so no container of a task (sandbox, compile, branches, audit, helpers) can miss it."""

    def __init__(self, owner: Owner | None, slots: Backpressure, *, runtime: str | None = None) -> None:
        self.owner = owner
        self.slots = slots
        self.runtime = runtime

    @classmethod
    def for_run(cls, run: RunLike, *, concurrency: int | None = None, runtime: str | None = None) -> EngineRun:
        """The session's, in every process (controller and workers) at configure time.

        ``concurrency`` is ``--pb-docker-concurrency`` (None: ``$PB_DOCKER_CONCURRENCY`` or the default 4; 0: no cap);
        ``runtime`` is ``--pb-runtime``.
        """
        same_host = run.hostname == socket.gethostname()
        owner = Owner(run.hostname, int(run.controller_pid), float(run.started), boot_id() if same_host else "")
        slots = Backpressure.for_run(run_id=run.run_id, limit=concurrency,
                                     owner={"hostname": run.hostname, "controller_pid": run.controller_pid,
                                            "started": run.started, "boot_id": owner.boot_id})
        return cls(owner, slots, runtime=runtime)

    @classmethod
    def from_environment(cls) -> EngineRun:
        """A process outside a configured session: no owner labels, the environment's cap."""
        return cls(None, Backpressure.from_environment())

    def owner_labels(self, lifetime: float | None = None) -> dict[str, str]:
        """The labels added to everything of the run this process creates (empty without an owner)."""
        if self.owner is None:
            return {}
        expires = time.time() + (lifetime if lifetime is not None else DEFAULT_LIFETIME) + EXPIRY_MARGIN
        return {OWNER_LABEL: self.owner.label(), EXPIRES_LABEL: str(int(expires))}

    def _merged(self, labels: Any, lifetime: float | None) -> Any:
        """``labels`` of one of the run's objects with the owner's added (labels given win); others unchanged."""
        if not isinstance(labels, dict) or RUN_LABEL not in labels:
            return labels
        return {**labels, **{k: v for k, v in self.owner_labels(lifetime).items() if k not in labels}}

    def prepare_create(self, params: dict[str, Any]) -> None:
        """Owner and deadline labels on the run's containers; a name, so a retried create is idempotent; the run's
        runtime on every container (whatever the caller asked: the run's choice wins)."""
        if self.runtime:
            params["host_config"] = {**(params.get("host_config") or {}), "Runtime": self.runtime}
        labels = params.get("labels")
        if isinstance(labels, dict) and RUN_LABEL in labels:
            params["labels"] = self._merged(labels, _lifetime_of(params.get("command"), params.get("entrypoint")))
            if not params.get("name"):
                params["name"] = f"pb-{labels[RUN_LABEL]}-{uuid.uuid4().hex[:12]}"

    def prepare_build(self, params: dict[str, Any]) -> None:
        params["labels"] = self._merged(params.get("labels"), DEFAULT_LIFETIME)

    def prepare_volume(self, params: dict[str, Any]) -> None:
        """Owner and deadline labels on the run's volumes (the grader's material): a run that dies leaves them to
        the next session's reaper, as its containers."""
        params["labels"] = self._merged(params.get("labels"), DEFAULT_LIFETIME)

    def prepare_commit(self, params: dict[str, Any]) -> None:
        conf = dict(params.get("conf") or {})
        labels = dict(conf.get("Labels") or {})
        if RUN_LABEL in labels:
            conf["Labels"] = self._merged(labels, None)
            params["conf"] = conf


# ---------------------------------------------------------------------------------------------- health


@dataclass
class EngineHealth:
    """One engine's health as this process saw it: outages, restarts, the last failed first contact, slow calls."""

    slow_call: float = SLOW_CALL
    lock: threading.Lock = field(default_factory=threading.Lock)
    outage_since: float | None = None
    epoch: int = 0  # bumped at the start of every outage
    outages: int = 0
    retries: int = 0
    contacts: int = 0  # first contacts made (each a ping)
    created: OrderedDict[str, tuple[int, int | None]] = field(default_factory=OrderedDict)  # id -> (epoch, pid)
    execs: OrderedDict[str, str] = field(default_factory=OrderedDict)  # exec id -> container id
    unreachable: tuple[float, str] | None = None  # (when, message) of the last failed first contact
    slow_calls: dict[str, float] = field(default_factory=dict)  # "POST /containers/create" -> first slow time

    def down_reason(self) -> str | None:
        """Why the engine is taken for unreachable right now (a recent failed first contact), or None."""
        remembered = self.unreachable
        if remembered is not None and time.monotonic() - remembered[0] < UNREACHABLE_MEMORY:
            return remembered[1]
        return None

    def timed(self, method: str, url: str, seconds: float) -> None:
        """Say a slow engine call once per call (method and path, ids elided), with ``pb_slow_call`` for the view."""
        path = _OBJECT_ID.sub("/{id}", urlsplit(url).path)
        path = re.sub(r"^/v[0-9.]+(?=/)", "", path)
        if seconds < self.slow_call or _WAITS_ON_PURPOSE.search(path):
            return
        call = f"{method} {path}"
        with self.lock:
            if call in self.slow_calls:
                return
            self.slow_calls[call] = seconds
        log.warning("slow Docker engine call: %s took %.1f s (said once per call)", call, seconds,
                    extra={"pb_slow_call": call, "pb_seconds": round(seconds, 1)})

    def connection_failed(self, exc: BaseException, budget: float) -> None:
        with self.lock:
            if self.outage_since is None:
                self.outage_since = time.monotonic()
                self.epoch += 1
                self.outages += 1
                log.warning("Docker engine connection failed (%s); waiting up to %.0f s for it", _short(exc),
                            budget)

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

    def remember_container(self, container_id: str, pid: int | None) -> None:
        with self.lock:
            self.created[container_id] = (self.epoch, pid)
            while len(self.created) > 4096:
                self.created.popitem(last=False)

    def remember_exec(self, exec_id: str, container_id: str) -> None:
        with self.lock:
            self.execs[exec_id] = container_id
            while len(self.execs) > 4096:
                self.execs.popitem(last=False)


# ---------------------------------------------------------------------------------------------- retries


_NOT_HANDLED = object()


class _OutageTooLong(EngineConnectionError):
    """The outage outlasted the budget: given up, never retried."""


@dataclass(frozen=True)
class RetryPolicy:
    """When a call the engine did not answer is tried again (run by tenacity): connection failures while the
    outage lasts at most ``outage_budget`` seconds, ``timeout_retries`` socket timeouts, and up to
    ``server_error_retries`` 5xx answers for the calls that allow them; backoff doubles from ``backoff_first`` up
    to ``backoff_max``. Only the caller knows whether a call is idempotent: it asks for retries only then."""

    outage_budget: float = OUTAGE_BUDGET
    server_error_retries: int = 3
    timeout_retries: int = 1
    backoff_first: float = 0.25
    backoff_max: float = 5.0

    def run(self, name: str, call: Callable[[], T], health: EngineHealth, *, server_retries: int,
            rewind: Callable[[], bool] | None = None, on_repeat: Callable[[Any], Any] | None = None) -> T:
        """``call()``, tried again on transient failures. ``rewind`` makes its input sendable again (False: it
        cannot be, so the failure stands); ``on_repeat`` may turn an API error of a repeat into a result (the
        first attempt did it: an adopted container, a removal that finds nothing)."""
        attempts = 0
        timeouts = server_failures = 0
        reason = ""

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            try:
                return call()
            except EngineRestarted:
                raise
            except EngineConnectionError as exc:
                if health.outage_seconds() > self.outage_budget:
                    raise _OutageTooLong(f"{exc} (gave up docker {name} after {health.outage_seconds():.0f} s of "
                                         f"outage, {attempts} attempt(s))") from exc
                raise
            except APIError as exc:
                if attempts > 1 and on_repeat is not None:
                    handled = on_repeat(exc)
                    if handled is not _NOT_HANDLED:
                        return handled  # type: ignore[no-any-return]
                raise

        def transient(exc: BaseException) -> bool:
            nonlocal timeouts, server_failures, reason
            if isinstance(exc, EngineRestarted | _OutageTooLong):
                return False
            if isinstance(exc, EngineConnectionError):
                reason = "engine unreachable"
            elif isinstance(exc, requests.exceptions.Timeout):
                timeouts += 1
                if timeouts > self.timeout_retries:
                    return False
                reason = f"timed out ({_short(exc)})"
            elif isinstance(exc, APIError):
                status = _status(exc) or 0
                if status < 500 or server_failures >= server_retries:
                    return False
                server_failures += 1
                reason = f"engine error {status}: {_short(_explanation(exc))}"
            else:
                return False
            return rewind is None or rewind()  # an input stream that cannot be rewound cannot be sent again

        def before_sleep(state: tenacity.RetryCallState) -> None:
            with health.lock:
                health.retries += 1
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            log.warning("docker %s: %s; retry %d in %.2f s", name, reason, state.attempt_number, delay)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(transient),
            wait=tenacity.wait_exponential(multiplier=self.backoff_first, max=self.backoff_max),
            before_sleep=before_sleep, reraise=True)
        return retrying(attempt)


# ---------------------------------------------------------------------------------------------- one engine


class Engine:
    """One Docker engine as this process uses it: ``url`` (None: the environment's, ``DOCKER_HOST``), its client
    (made at first use, after a ping), its health, what was learnt about it (:class:`EngineFacts`), the retry
    policy and the run whose labels and cap its calls carry."""

    def __init__(self, url: str | None, run: EngineRun, *, retry: RetryPolicy | None = None,
                 api_timeout: float = API_TIMEOUT, ping_timeout: float = PING_TIMEOUT, slow_call: float = SLOW_CALL,
                 opener: Callable[[Engine, float], docker.DockerClient] | None = None) -> None:
        """``opener(engine, timeout)`` makes the client (default: from the environment, as ``docker.from_env``;
        a test gives one over its own transport)."""
        self.url = url
        self._opener = opener
        self.run = run
        self.retry = retry or RetryPolicy()
        self.api_timeout = api_timeout
        self.ping_timeout = ping_timeout
        self.health = EngineHealth(slow_call=slow_call)
        self.facts = EngineFacts()
        self._client: docker.DockerClient | None = None
        self._ready = False  # False while the first contact is made: no retries, no outage accounting
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.url or _docker_host()

    @property
    def client(self) -> docker.DockerClient:
        """The docker-py client; the first use makes first contact (:class:`EngineUnavailable` when it fails)."""
        known = self._client
        if known is not None:
            return known
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    @property
    def api(self) -> Any:
        """The low-level client (an :class:`~pytest_programbench.engine.engine_api.EngineAPIClient`)."""
        return self.client.api

    def _connect(self) -> docker.DockerClient:
        down = self.health.down_reason()
        if down is not None:
            raise EngineUnavailable(down)
        self._ready = False
        self.health.contacts += 1
        candidate: docker.DockerClient | None = None
        try:
            candidate = (self._opener or open_client)(self, self.ping_timeout)
            candidate.api.ping()  # opening also fetched the API version
        except (DockerException, requests.exceptions.RequestException, OSError) as exc:
            if candidate is not None:
                with contextlib.suppress(Exception):
                    candidate.close()
            message = describe_unreachable(exc, self.url, ping_timeout=self.ping_timeout)
            self.health.unreachable = (time.monotonic(), message)
            raise EngineUnavailable(message) from exc
        candidate.api.timeout = self.api_timeout
        self._ready = True  # from now on: retries, outage accounting
        self.health.unreachable = None
        return candidate

    def close(self, *, forget_down: bool = False) -> None:
        """Drop the client (the engine went away or restarted): the next use makes first contact again."""
        with self._lock:
            known, self._client = self._client, None
            self._ready = False
            if forget_down:
                self.health.unreachable = None
        if known is not None:
            with contextlib.suppress(Exception):  # closing a dead connection is best effort
                known.close()

    # -- what the API client's calls go through ----------------------------------------------------------------

    def request(self, send: Callable[..., T], method: str, url: str, *args: Any, **kwargs: Any) -> T:
        """Every HTTP request: a connection failure becomes one described :class:`EngineConnectionError`."""
        started = time.monotonic()
        try:
            response = send(method, url, *args, **kwargs)
        except EngineConnectionError:
            raise
        except requests.exceptions.ConnectionError as exc:
            if isinstance(exc, requests.exceptions.ConnectTimeout):
                raise
            if self._ready:
                self.health.connection_failed(exc, self.retry.outage_budget)
            raise EngineConnectionError(describe_unreachable(exc, self.url, ping_timeout=self.ping_timeout)) \
                from exc
        if self._ready:
            self.health.answered()
        self.health.timed(method, url, time.monotonic() - started)
        return response

    def read(self, name: str, call: Callable[[], T]) -> T:
        """A pure read: retried on transient failures (never a 5xx: the engine said what it knows)."""
        if not self._ready:
            return call()
        return self.retry.run(name, call, self.health, server_retries=0)

    def heavy(self, api: Any, name: str, params: dict[str, Any], call: Callable[[], T]) -> T | Iterator[Any]:
        """A heavy call (``params`` its bound arguments, read by ``call`` when it runs): labelled, capped by the
        run's slots, retried only where a repeat cannot change the result."""
        rewind: Callable[[], bool] | None = None
        on_repeat: Callable[[Any], Any] | None = None
        if name == "create_container":
            self.run.prepare_create(params)
            on_repeat = self._adopter(api, params)
        elif name == "build":
            self.run.prepare_build(params)
            rewind = _rewinder(params.get("fileobj"))
        elif name == "commit":
            self.run.prepare_commit(params)
        elif name == "create_volume":
            self.run.prepare_volume(params)
        elif name in ("remove_container", "remove_image"):
            on_repeat = _removed_already
        if name in FETCHES:
            what = {"build": f"build {params.get('tag') or 'an image'}",
                    "pull": f"pull {params.get('repository')}:{params.get('tag') or 'latest'}"}.get(name, name)
            disk.require_for_image(what, engine_api=api)
        # A create without a name cannot be told apart from its repeat: never retried blindly.
        idempotent = self._ready and (name != "create_container" or bool(params.get("name")))
        held = self.run.slots.acquire(name)
        try:
            if idempotent:
                server_retries = 0 if name in NO_SERVER_RETRY else self.retry.server_error_retries
                result = self.retry.run(name, call, self.health, server_retries=server_retries, rewind=rewind,
                                        on_repeat=on_repeat)
            else:
                result = call()
        except BaseException:
            held.release()
            raise
        if name in STREAMING and isinstance(result, Iterator):
            return _held_stream(result, held)
        held.release()
        if name == "create_container" and isinstance(result, dict) and result.get("Id"):
            # The engine's pid now, not at client creation: it may have restarted since.
            self.health.remember_container(str(result["Id"]), engine_pid(self.url))
        return result

    def container_bound(self, name: str, container: Any, call: Callable[[], T]) -> T:
        """A call on a container's live state: never retried; a 404/409 after a restart is EngineRestarted."""
        container_id = str(container.get("Id") if isinstance(container, dict) else container)
        try:
            result = call()
        except APIError as exc:
            self._raise_if_restarted(exc, container_id, name)
            raise
        if name == "exec_create" and isinstance(result, dict) and result.get("Id"):
            self.health.remember_exec(str(result["Id"]), container_id)
        return result

    def exec_bound(self, name: str, exec_id: Any, call: Callable[[], T]) -> T:
        key = str(exec_id.get("Id") if isinstance(exec_id, dict) else exec_id)
        try:
            return call()
        except APIError as exc:
            self._raise_if_restarted(exc, self.health.execs.get(key, ""), name)
            raise

    def _adopter(self, api: Any, params: dict[str, Any]) -> Callable[[Any], Any]:
        """A create retried after its first attempt may have happened: adopt the container of that name."""
        def adopt(exc: Any) -> Any:
            name = params.get("name")
            if _status(exc) != 409 or not name:
                return _NOT_HANDLED
            try:
                info = api.inspect_once(name)
            except APIError:
                return _NOT_HANDLED
            wanted = params.get("labels") or {}
            have = info.get("Config", {}).get("Labels") or {}
            if isinstance(wanted, dict) and all(have.get(k) == v for k, v in wanted.items()):
                log.info("docker create_container: adopted %s, created by the attempt that failed", name)
                return {"Id": info["Id"], "Warnings": []}
            return _NOT_HANDLED

        return adopt

    def _raise_if_restarted(self, exc: Any, container_id: str, name: str) -> None:
        """404/409 on a container (or exec) this process created before an engine outage or restart."""
        if _status(exc) not in (404, 409) or not container_id:
            return
        created = self.health.created.get(container_id)
        if created is None:
            return
        epoch, pid = created
        now_pid = engine_pid(self.url) if pid is not None else None
        # Same engine process: not a restart. No pid to compare (a TCP engine): any outage since creation counts.
        restarted = now_pid != pid if pid is not None and now_pid is not None else self.health.epoch != epoch
        if restarted:
            raise EngineRestarted(
                f"the Docker engine restarted while container {container_id[:12]} was in use ({name}: "
                f"{_short(_explanation(exc))}); what ran in it is lost") from exc


def engine_of(api: Any) -> Engine | None:
    """The :class:`Engine` whose client ``api`` is (None: a plain docker-py client)."""
    engine = getattr(api, "engine", None)
    return engine if isinstance(engine, Engine) else None


def url_of(api: Any) -> str | None:
    """The ``--pb-docker-host`` URL the client ``api`` was made for (None: the environment's engine)."""
    engine = engine_of(api)
    return engine.url if engine is not None else None


# ---------------------------------------------------------------------------------------------- a process's engines


class Engines:
    """The engines one process uses for one run, by URL; a session keeps them in ``config.stash``."""

    def __init__(self, run: EngineRun, **options: Any) -> None:
        self.run = run
        self._options = options  # Engine's keyword arguments (timeouts, retry policy)
        self._engines: dict[str | None, Engine] = {}
        self._lock = threading.Lock()

    def get(self, url: str | None = None) -> Engine:
        """The engine at ``url`` (None: the environment's); made on first use, its client on its first call."""
        if url is not None and url == DOCKER_HOST.raw():
            url = None  # the environment's engine under its explicit name: one client, one health
        with self._lock:
            engine = self._engines.get(url)
            if engine is None:
                engine = self._engines[url] = Engine(url, self.run, **self._options)
            return engine

    def client(self, url: str | None = None) -> docker.DockerClient:
        return self.get(url).client

    def preflight(self) -> str | None:
        """For the controller at session start: None when the engine answers, else the one message every item gets."""
        try:
            self.client()
        except EngineUnavailable as exc:
            return str(exc)
        return None

    def forget(self, url: str | None) -> None:
        """Drop the client of one engine (it went away): the next use makes first contact again."""
        self.get(url).close()

    def reset(self) -> None:
        """Forget every client and every remembered failure (an engine was restarted or replaced)."""
        with self._lock:
            engines = list(self._engines.values())
        for engine in engines:
            engine.close(forget_down=True)


# ---------------------------------------------------------------------------------------------- diagnosis


def _short(exc: BaseException | str) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "..."


def _docker_host() -> str:
    return DOCKER_HOST.raw() or "unix:///var/run/docker.sock"


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


def describe_unreachable(exc: BaseException, url: str | None = None, *, ping_timeout: float = PING_TIMEOUT) -> str:
    """One line: where the engine was looked for, why it did not answer, and how to start one."""
    causes = _causes(exc)
    described = next((e for e in causes if isinstance(e, EngineConnectionError)), None)
    if described is not None:  # already said (the client's own layer raised it): never say it twice
        return str(described)
    host = url or _docker_host()
    why = _why_unreachable(causes, host, _socket_path(url), ping_timeout) or _short(exc)
    return f"Docker engine unreachable at {host}: {why}; {HOW_TO_START}"


def _why_unreachable(causes: list[BaseException], host: str, path: str | None, ping_timeout: float) -> str | None:
    """Why the engine at ``host`` (its socket ``path``) did not answer, from the exception's ``causes`` (None: no
    known cause)."""
    text = " ".join(str(e) for e in causes)

    def seen(kind: type[BaseException], words: str) -> bool:
        return any(isinstance(e, kind) for e in causes) or words in text

    if "path too long" in text:
        return f"the socket path {path} is too long for a Unix socket (at most 107 bytes)"
    if seen(FileNotFoundError, "No such file or directory"):
        return f"there is no socket at {path} (dockerd is not running)" if path else "its address does not exist"
    if seen(ConnectionRefusedError, "Connection refused"):
        return f"connection refused at {path or host} (dockerd is not running)"
    if seen(PermissionError, "Permission denied"):
        return f"permission denied on {path or host} (run as root or join the docker group)"
    if any(isinstance(e, requests.exceptions.Timeout | TimeoutError) for e in causes) or "timed out" in text.lower():
        return f"no answer within {ping_timeout:g} s (the engine is hung or overloaded)"
    if seen(ConnectionResetError, "reset by peer"):
        return f"the connection to {path or host} was reset (the engine stopped or restarted)"
    return None


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


def _removed_already(exc: Any) -> Any:
    """A removal retried after an attempt that may have succeeded: "not found" / "in progress" mean done."""
    status = _status(exc)
    if status == 404 or (status == 409 and "already in progress" in _explanation(exc)):
        return None
    return _NOT_HANDLED


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
    volumes: list[str] = field(default_factory=list)


def sweep(run_id: str, *, engine: DockerEngine, task: str | None = None) -> SweepReport:
    """Remove every container, then every image, labelled with this run (optionally one task only) from ``engine``
    (a client)."""
    report = SweepReport()
    api = engine.api
    filters = [f"{RUN_LABEL}={run_id}"]
    if task is not None:
        filters.append(f"{TASK_LABEL}={task}")
    for info in api.containers(all=True, filters={"label": filters}):
        try:
            Container(api, info["Id"]).remove(paused=info.get("State") == "paused")
            report.containers.append(info["Id"][:12])
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
    if task is None:  # the grader's volumes (evaluation/harness_material.py) are the run's, not a task's
        for info in (api.volumes(filters={"label": filters}) or {}).get("Volumes") or []:
            try:
                api.remove_volume(info["Name"], force=True)
                report.volumes.append(str(info["Name"]))
            except NotFound:
                pass
            except APIError as exc:
                report.errors.append(f"volume {info['Name']}: {exc}")
    if report.containers or report.images or report.volumes:
        log.info("swept run %s: %d containers, %d images, %d volumes", run_id, len(report.containers),
                 len(report.images), len(report.volumes))
    return report
