"""Step 4 of the pipeline: the agent's sandbox, with the reference binary behind the proxy.

A container from the task image (its id checked), with no network, CPU/memory/pids limits, ``no-new-privileges``,
a reduced capability set, a private IPC namespace with bounded shared memory, the run's labels and a lifetime after
which it stops by itself (a stopped one is removed by ``close()``, the run's sweep or the reaper). Inside:

- the agent is the unprivileged user ``pbagent`` (uid 1777) working in ``/workspace/src`` (empty, its own);
- everything the image had in ``/workspace`` except the executable is in ``/workspace/docs``, read-only;
- the reference is in ``/var/lib/pb-proxy`` (0700, root), mode 111; a root-owned daemon serves it through
  ``/workspace/binary`` (see ``proxy/daemon.py`` for the protocol and the security argument);
- hidden tests are never copied in.

The agent's window ends with ``end_agent_window()``: the container is frozen (``docker pause``), what the agent
still runs is counted, and the container is killed; its files (the submission, the call log) are then read from the
stopped container. A sandbox that stopped before that is the agent's doing when its memory limit's OOM killer ended
it, infrastructure otherwise.

The object is a context manager; ``close()`` removes the container by id on every path, and the controller's
label sweep (``docker_engine.sweep``) backs it up when a worker dies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import TYPE_CHECKING, Any

import requests.exceptions
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import Mount

from pytest_programbench.core.environment import SANDBOX_STORAGE
from pytest_programbench.engine.archive_out import CappedStream, TooLarge
from pytest_programbench.engine.container import Container, ExecReader, OutputCap, Sinks
from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.engine.facts import facts
from pytest_programbench.engine.protocol import DockerEngine
from pytest_programbench.engine.tar_in import TarIn
from pytest_programbench.sandbox.agent_log import CappedLog
from pytest_programbench.sandbox.layout import AGENT_NAME, AGENT_UID, BINARY_PATH, PROXY_DIR, SRC_DIR, WORKSPACE
from pytest_programbench.sandbox.proxy_build import DAEMON_SOURCE, ProxyClient, build_client
from pytest_programbench.text.sizes import human

if TYPE_CHECKING:
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.tasks.catalogue import Task

log = logging.getLogger(__name__)

CALL_LOG = PROXY_DIR + "/calls.jsonl"
DROPPED_LOG = PROXY_DIR + "/calls.dropped"
COUNT_LOG = PROXY_DIR + "/calls.count"  # the daemon's count of calls, and of those it could not record
# The daemon's bounds (proxy/daemon.py: LOG_MAX_BYTES, RECORD_MAX, --max-workers; a test pins them equal): the log
# stops at its cap, but each worker may still append one record after the check, and the end of a call it began.
CALL_LOG_MAX = 64 << 20
CALL_RECORD_MAX = 16 << 10
PROXY_MAX_WORKERS = 512
CALL_LOG_READ_LIMIT = CALL_LOG_MAX + 2 * PROXY_MAX_WORKERS * CALL_RECORD_MAX
TAR_OVERHEAD = 1 << 20  # headers around one file in docker's archive
LIFETIME_MARGIN = 1800  # seconds the container outlives the agent clock (packing, slow engines)
DEFAULT_PIDS_LIMIT = 8192
DEFAULT_SUBMISSION_LIMIT = 1 << 30  # bytes of uncompressed tar
# Capabilities of the container's root that neither the set-up, the daemon nor an agent set-up command needs.
# (SYS_PTRACE is not in Docker's default set either; it is dropped explicitly, as the official harness does.)
CAP_DROP = ("SYS_PTRACE", "NET_RAW", "MKNOD", "AUDIT_WRITE", "NET_BIND_SERVICE", "SYS_CHROOT")
EXEC_KILL_GRACE = 10  # seconds between TERM and KILL of a timed-out command
WATCHDOG_GRACE = 20  # seconds after the deadline before the host side kills and disconnects

# Run as root inside the container (``python3 -I``: nothing of the agent's environment or files reaches it), for a
# kill in the middle of the agent's window (a command's clock fired; the window's end stops the whole container
# instead): stops, then kills, every process whose real uid is the agent's. A stopped process cannot fork, but one
# scan of /proc can miss a fork chain whose pids keep changing (the parent gone, the child not yet listed), so each
# phase ends only after CLEAN_SCANS scans in a row found nothing left to do. The proxy's idle workers (the root
# master's forks, same command line) are left alone: the master would only replace them. Zombies are dead.
# Prints one JSON line: passes, processes stopped and killed, and what was left when the deadline passed.
_KILL_AGENT = """
import json, os, signal, time
uid, master, deadline = {uid}, {master}, time.monotonic() + {budget}
def cmdline(pid):
    try:
        with open('/proc/%s/cmdline' % pid, 'rb') as handle:
            return handle.read()
    except OSError:
        return None
master_cmd = cmdline(master)
def agent_processes():
    found = {{}}
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/' + name + '/stat') as handle:
                fields = handle.read().rsplit(')', 1)[1].split()
            with open('/proc/' + name + '/status') as handle:
                real_uid = int(next(l for l in handle if l.startswith('Uid:')).split()[1])
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        state, ppid = fields[0], int(fields[1])
        if real_uid != uid or state in 'ZX':
            continue
        if master_cmd and ppid == master and cmdline(name) == master_cmd:
            continue
        found[int(name)] = state
    return found
stats = {{'passes': 0, 'stopped': set(), 'killed': set(), 'left': []}}
for sig, todo in ((signal.SIGSTOP, lambda procs: [p for p, s in procs.items() if s not in 'tT']),
                  (signal.SIGKILL, lambda procs: list(procs))):
    clean = 0
    while clean < {clean_scans} and time.monotonic() <= deadline:
        pids = todo(agent_processes())
        if not pids:
            clean += 1
            continue
        clean = 0
        stats['passes'] += 1
        for pid in pids:
            try:
                os.kill(pid, sig)
                stats['stopped' if sig == signal.SIGSTOP else 'killed'].add(pid)
            except OSError:
                pass
        time.sleep(0.002)  # let the signals land before the next scan
stats['left'] = sorted(agent_processes())
print(json.dumps({{k: len(v) if isinstance(v, set) else v for k, v in stats.items()}}))
"""
KILL_BUDGET = 30  # seconds the stop-and-kill loop may take
CLEAN_SCANS = 5  # scans in a row that must find nothing left before a phase ends
# The container's shared memory (SysV segments, POSIX /dev/shm, message queues) is charged to its memory limit and
# outlives the processes that made it: unbounded, the agent could fill the limit with memory nothing can reclaim, and
# the OOM killer would end the container's init. A private IPC namespace, at most a quarter of the memory limit
# (1 GiB at most) in SysV segments and as much in /dev/shm, segments removed when their last user is gone
# (shm_rmid_forced), few message queues.
IPC_SHARE = 4
IPC_MAX = 1 << 30
IPC_PAGE = 4096  # kernel.shmall counts pages (4 KiB on x86-64 and most arm64 kernels; larger pages loosen it)
STOP_WAIT = 60  # seconds for a killed sandbox to be reported stopped
FREEZE_ATTEMPTS = 10


def ipc_limits(memory: int) -> tuple[int, dict[str, str]]:
    """``shm_size`` and the IPC namespace's sysctls for a sandbox of ``memory`` bytes."""
    size = max(16 << 20, min(memory // IPC_SHARE, IPC_MAX))
    return size, {"kernel.shmmax": str(size), "kernel.shmall": str(size // IPC_PAGE), "kernel.shmmni": "256",
                  "kernel.shm_rmid_forced": "1", "kernel.msgmni": "64"}


@dataclass(frozen=True)
class StorageQuota:
    """Whether sandboxes get a size limit on their writable layer (``storage_opt size``), and why not."""

    supported: bool
    reason: str

    def describe(self, limit: int) -> str:
        if self.supported:
            return f"writable layer limited to {human(limit)} per sandbox (PB_SANDBOX_STORAGE)"
        return f"no size limit on the writable layer: {self.reason} (a residual risk, see docs/security.md)"


# Storage drivers that take a per-container size (docker's --storage-opt size): overlay2 only on xfs mounted with
# pquota (which `docker info` does not show: tried, and on refusal not again).
_QUOTA_DRIVERS = {"btrfs", "zfs", "devicemapper", "windowsfilter"}


def storage_limit() -> int:
    """``PB_SANDBOX_STORAGE`` (a size; default 10g; 0: no limit asked)."""
    return SANDBOX_STORAGE.size()


def storage_quota(api: Any) -> StorageQuota:
    """What the engine's storage driver allows (``docker info``), remembered on the client."""
    known = facts(api)
    cached = known.storage_quota
    if isinstance(cached, StorageQuota):
        return cached
    try:
        info = api.info()
    except Exception as exc:
        return StorageQuota(False, f"the engine's storage driver is unknown ({exc})")
    driver = str(info.get("Driver") or "?")
    backing = dict((str(k), str(v)) for k, v in (info.get("DriverStatus") or []) if isinstance(k, str))
    backing_fs = backing.get("Backing Filesystem", "?")
    if driver in _QUOTA_DRIVERS or (driver in ("overlay2", "overlay") and backing_fs == "xfs"):
        quota = StorageQuota(True, f"{driver} on {backing_fs}")
    else:
        quota = StorageQuota(False, f"the engine's {driver} storage driver on {backing_fs} has no per-container "
                                    "size limit (it needs xfs with pquota, btrfs, zfs or devicemapper)")
    known.storage_quota = quota
    return quota


def sandbox_storage_need(engine_api: Any) -> int:
    """The sandbox's writable-layer limit when the engine enforces one; 0 when it cannot (then nothing bounds what
    an agent writes there: docs/security.md, residual risks)."""
    limit = storage_limit()
    return limit if limit and storage_quota(engine_api).supported else 0


class SandboxError(Exception):
    """The sandbox could not be provided: an infrastructure error, never a score."""


class SubmissionTooLarge(Exception):
    """``/workspace/src`` exceeds the size limit: the agent's doing, so the item fails (score 0)."""


class SubmissionUnpackable(Exception):
    """``/workspace/src`` could not be packed while the sandbox was alive: the agent's files, so score 0."""


@dataclass(frozen=True)
class WindowEnd:
    """How the agent's window ended for its sandbox (``Sandbox.end_agent_window``)."""

    died: str | None = None  # why the sandbox had stopped before the window's end (None: it was alive)
    agent_caused: bool = False  # that death was the agent's doing (its memory limit's OOM killer ended it)
    survivors: int | None = None  # processes of the agent's uid still running at the end (None: not counted)
    problem: str | None = None  # what could not be done while ending it (the sandbox was stopped all the same)

    def notes(self) -> list[str]:
        out = []
        if self.died and self.agent_caused:
            out.append(f"the sandbox stopped during the agent's window: {self.died}; the agent's doing (it filled "
                       "its memory limit): what /workspace/src held is packed and scored, the agent is not re-run")
        if self.survivors:
            out.append(f"{self.survivors} process(es) of the agent were still running at the end of its window "
                       "(frozen, then killed with the sandbox before packing)")
        if self.problem:
            out.append(f"ending the agent's window: {self.problem}")
        return out


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command in the sandbox."""

    exit_code: int | None  # None when the host side had to disconnect before the command ended
    output: bytes  # stdout and stderr interleaved (empty when streamed to a file)
    duration: float
    timed_out: bool
    truncated: bool = False
    notes: tuple[str, ...] = ()  # what the harness saw happen to the command (e.g. its stream broke)
    stopped: str | None = None  # why the harness ended the command before its clock (``exec(stop=...)``)

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")


@dataclass(frozen=True)
class Layout:
    """What the in-container set-up did (its JSON report)."""

    agent_name: str
    agent_uid: int
    agent_gid: int
    agent_home: str
    reference_kind: str  # "elf", "script" (cannot run from an execute-only file) or "other"
    reference_sha256: str
    reference_size: int
    docs: tuple[str, ...]
    daemon_pid: int
    client_kind: str
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> Layout:
        return cls(
            agent_name=str(report["agent_name"]), agent_uid=int(report["agent_uid"]),
            agent_gid=int(report["agent_gid"]), agent_home=str(report["agent_home"]),
            reference_kind=str(report["reference_kind"]), reference_sha256=str(report["reference_sha256"]),
            reference_size=int(report["reference_size"]), docs=tuple(report.get("docs", ())),
            daemon_pid=int(report["daemon_pid"]), client_kind=str(report["client_kind"]), raw=dict(report))


@dataclass
class _ExecClock:
    """One command's clock. With seconds given back (``extension``) the host keeps it: at the extended ``end`` it
    does what the inside ``timeout`` would (TERM, then KILL after its grace); without, the inside ``timeout`` does
    it and the host watchdog (``deadline``) only backs it up."""

    started: float
    timeout: float
    use_timeout: bool
    extension: Callable[[], float] | None
    extension_cap: float
    termed_at: float | None = None  # when the host sent TERM at the extended end
    stop: Callable[[], str | None] | None = None  # asked as the command runs: a reason ends it now
    stopped: str | None = None

    def end(self) -> float:
        return self.started + self.timeout + (min(self.extension_cap, self.extension())
                                              if self.extension is not None else 0.0)

    def deadline(self) -> float:
        if self.termed_at is not None:
            return self.termed_at + EXEC_KILL_GRACE + 2
        return self.end() + (WATCHDOG_GRACE if self.use_timeout else 0)


class Sandbox:
    """One agent sandbox. ``with Sandbox(...) as box:`` or ``box.start()`` ... ``box.close()``."""

    def __init__(
        self,
        image: str,
        *,
        labels: Labels,
        cpus: float,
        memory: int,
        lifetime: float,
        expected_image_id: str | None = None,
        pids_limit: int = DEFAULT_PIDS_LIMIT,
        proxy_client: ProxyClient | None = None,
        engine: DockerEngine,
        mounts: Sequence[tuple[str, str]] = (),
        copies: Sequence[tuple[str, str]] = (),
        allow_uids: Sequence[int] = (),
        name: str | None = None,
    ) -> None:
        if engine is None:  # no hidden default: it would miss the session's run labels, cap and health
            raise TypeError("Sandbox needs an engine client: a session's (config.stash), or outside one "
                            "Engines(EngineRun.from_environment()).client()")
        self.image = image
        self.labels = labels
        self.cpus = cpus
        self.memory = memory
        self.lifetime = lifetime
        self.expected_image_id = expected_image_id
        self.pids_limit = pids_limit
        self.mounts = tuple(mounts)
        self.copies = tuple(copies)  # (host dir, dir inside): copied in by the API where no bind mount can be
        self.allow_uids = tuple(allow_uids)
        self.name = name
        self._client = proxy_client
        self._engine = engine
        self._container: Any | None = None
        self._container_id: str | None = None
        self._image_id: str | None = None
        self._layout: Layout | None = None
        self._closed = False
        self._window_end: WindowEnd | None = None
        self.storage_quota: StorageQuota | None = None  # whether its writable layer got a size limit, and why not
        self.ipc_bounded = False  # whether the engine took the IPC namespace's sysctls

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_task(cls, task: Task, settings: Settings, labels: Labels, *, image_id: str | None = None,
                 engine: DockerEngine, proxy_client: ProxyClient | None = None, remote: bool = False) -> Sandbox:
        """The sandbox of ``task`` with the session's limits; lives agent timeout + margin at most.

        ``remote``: the engine does not share this machine's filesystem, so ``--pb-agent-mount`` directories are
        copied in (root-owned, not writable by the agent) instead of bind-mounted."""
        mounts: list[tuple[str, str]] = []
        for spec in settings.agent_mounts:
            host, _, inside = spec.partition(":")
            mounts.append((str(Path(host).expanduser().resolve()), inside or str(Path(host).expanduser().resolve())))
        return cls(f"{task.image_name}:{settings.image_tag}", labels=labels.for_task(task.instance_id),
                   cpus=settings.sandbox_cpus, memory=settings.sandbox_memory,
                   lifetime=settings.agent_timeout + LIFETIME_MARGIN, expected_image_id=image_id,
                   proxy_client=proxy_client, engine=engine, mounts=() if remote else mounts,
                   copies=mounts if remote else ())

    # ------------------------------------------------------------------ properties
    @property
    def id(self) -> str:
        if self._container_id is None:
            raise SandboxError("the sandbox is not started")
        return self._container_id

    @property
    def image_id(self) -> str:
        if self._image_id is None:
            raise SandboxError("the sandbox is not started")
        return self._image_id

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise SandboxError("the sandbox is not started")
        return self._layout

    @property
    def proxy_client(self) -> ProxyClient:
        """The client installed at /workspace/binary (``.label`` for the report header)."""
        if self._client is None:
            raise SandboxError("the sandbox is not started")
        return self._client

    @property
    def engine(self) -> Any:
        return self._engine

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> Sandbox:
        """Create the container, lay it out and start the proxy. Raises SandboxError / EngineUnavailable."""
        if self._container is not None:
            return self
        if self._closed:
            raise SandboxError("a closed sandbox cannot be restarted")
        try:
            try:
                image = self.engine.images.get(self.image)
            except ImageNotFound as exc:
                raise SandboxError(f"image {self.image} is not present") from exc
            self._image_id = str(image.id)
            if self.expected_image_id and self._image_id != self.expected_image_id:
                raise SandboxError(f"image {self.image} is {self._image_id[:19]}, expected the pristine "
                                   f"{self.expected_image_id[:19]}")
            if self._client is None:
                self._client = build_client(engine=self.engine, labels=self.labels,
                                            builder_images=(self._image_id,))
            self._create()
            self._install()
            for host, inside in self.copies:
                self._copy_in(Path(host), inside)
        except BaseException as exc:
            self.close()
            if isinstance(exc, SandboxError | EngineUnavailable):
                raise
            if isinstance(exc, DockerException):
                raise SandboxError(f"sandbox for {self.image}: {exc}") from exc
            raise
        return self

    def _create(self) -> None:
        limit = storage_limit()
        quota = storage_quota(self.engine.api) if limit else StorageQuota(False, "disabled (PB_SANDBOX_STORAGE=0)")
        options: dict[str, Any] = {"storage_opt": {"size": str(limit)}} if quota.supported else {}
        try:
            self._create_container(options)
        except APIError as exc:
            if not options or "storage" not in str(exc).lower():
                raise
            # The driver looked able (e.g. overlay2 on xfs) but refused (no pquota): said once, then without.
            reason = f"the engine refused a size limit: {getattr(exc, 'explanation', None) or exc}"
            facts(self.engine.api).storage_quota = StorageQuota(False, reason)
            log.warning("sandbox storage cannot be limited: %s (see docs/security.md)", reason)
            quota = StorageQuota(False, reason)
            if self._container_id is not None:  # refused at start rather than at create
                with contextlib.suppress(Exception):
                    self.engine.api.remove_container(self._container_id, force=True)
                self._container = self._container_id = None
            self._create_container({})
        self.storage_quota = quota

    def _create_container(self, options: dict[str, Any]) -> None:
        shm_size, sysctls = ipc_limits(self.memory)
        try:
            self._create_bounded(dict(options, shm_size=shm_size, sysctls=sysctls))
            self.ipc_bounded = True
        except APIError as exc:
            if "sysctl" not in str(exc).lower():
                raise
            # An engine (or kernel) that refuses the IPC namespace's sysctls: /dev/shm stays bounded, the SysV
            # limits are the kernel's defaults (docs/security.md, residual risks).
            log.warning("sandbox IPC sysctls refused (%s); /dev/shm bounded only", exc)
            if self._container_id is not None:
                with contextlib.suppress(Exception):
                    self.engine.api.remove_container(self._container_id, force=True)
                self._container = self._container_id = None
            self._create_bounded(dict(options, shm_size=shm_size))

    def _create_bounded(self, options: dict[str, Any]) -> None:
        container = self.engine.containers.create(
            self._image_id,
            **options,
            command=[str(int(self.lifetime))],
            entrypoint=["sleep"],  # the sandbox expires by itself if the harness dies
            user="0:0",
            working_dir=WORKSPACE,
            labels=self.labels.as_dict(),
            network_mode="none",
            nano_cpus=int(self.cpus * 1e9),
            mem_limit=self.memory,
            memswap_limit=self.memory,
            pids_limit=self.pids_limit,
            security_opt=["no-new-privileges"],
            cap_drop=list(CAP_DROP),
            init=True,
            ipc_mode="private",
            # Not auto-removed: a sandbox that stopped (the agent filled its memory) still has the agent's files.
            auto_remove=False,
            hostname="sandbox",
            name=self.name,
            mounts=[Mount(target=inside, source=host, type="bind", read_only=True) for host, inside in self.mounts],
            detach=True,
        )
        self._container = container
        self._container_id = str(container.id)
        container.start()

    def _install(self) -> None:
        proxy = self.proxy_client
        archive = (TarIn().directory(PROXY_DIR, 0o700)
                   .file(PROXY_DIR + "/daemon.py", DAEMON_SOURCE.read_bytes(), 0o600)
                   .file(PROXY_DIR + "/client", proxy.read_bytes(), 0o755))
        if not self._put(archive, "/"):
            raise SandboxError("could not copy the proxy into the sandbox")
        command = ["python3", f"{PROXY_DIR}/daemon.py", "setup", "--agent-name", AGENT_NAME,
                   "--agent-uid", str(AGENT_UID), "--client-kind", proxy.kind]
        for uid in self.allow_uids:
            command += ["--allow-uid", str(uid)]
        result = self.exec(command, user="root", workdir="/", timeout=120, use_timeout=False)
        report = _last_json_line(result.output)
        if result.exit_code != 0 or report is None or "error" in report:
            detail = (report or {}).get("error") or result.text.strip()[-2000:] or f"exit {result.exit_code}"
            raise SandboxError(f"sandbox set-up failed in {self.image}: {detail}")
        self._layout = Layout.from_report(report)

    def _copy_in(self, source: Path, dest: str) -> None:
        """``source``'s tree at ``dest`` by the API: root-owned and not writable, like a read-only mount."""
        def read_only(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mode &= 0o555
            return info

        if not self._put(TarIn().tree(source, dest.lstrip("/") or ".", read_only), "/"):
            raise SandboxError(f"could not copy {source} into the sandbox at {dest}")

    def _put(self, archive: TarIn, dest: str) -> bool:
        self._container_obj()  # running
        return self._handle.put(archive, dest)

    @property
    def _handle(self) -> Container:
        """The container's exec and file path (:mod:`pytest_programbench.engine.container`)."""
        return Container(self.engine.api, self.id)

    def close(self) -> None:
        """Remove the container (by id); safe to call twice and on every path."""
        self._closed = True
        container_id = self._container_id
        self._container = None
        if container_id is None:
            return
        try:
            Container(self.engine.api, container_id).remove()
        except APIError as exc:
            if exc.response is not None and exc.response.status_code == 409:
                return  # removal already in progress (auto-remove)
            log.warning("could not remove sandbox %s: %s (the run's sweep will)", container_id[:12], exc)
        except Exception as exc:  # the engine went away: the label sweep or the lifetime will clean up
            log.warning("could not remove sandbox %s: %s", container_id[:12], exc)

    def _container_obj(self) -> Any:
        if self._container is None:
            raise SandboxError("the sandbox is not running")
        return self._container

    # ------------------------------------------------------------------ commands
    def _user(self, user: str) -> str:
        if user == "agent":
            layout = self.layout
            return f"{layout.agent_uid}:{layout.agent_gid}"
        if user == "root":
            return "0:0"
        return user

    def agent_env(self) -> dict[str, str]:
        layout = self.layout
        return {"HOME": layout.agent_home, "USER": layout.agent_name, "LOGNAME": layout.agent_name}

    def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float,
        user: str = "agent",
        workdir: str = SRC_DIR,
        env: Mapping[str, str] | None = None,
        output: Path | None = None,
        stdin: bytes | None = None,
        max_output: int = 64 << 20,
        use_timeout: bool = True,
        extension: Callable[[], float] | None = None,
        extension_cap: float = 0.0,
        stop: Callable[[], str | None] | None = None,
    ) -> ExecResult:
        """Run ``command`` (argv, or a string for ``sh -c``) as ``user`` ("agent", "root" or uid[:gid]).

        The wall clock is enforced inside (coreutils ``timeout``, TERM then KILL after a grace) and by a host
        watchdog that kills the agent's processes and disconnects. Output (stdout and stderr interleaved) is
        streamed to ``output`` when given, else returned (at most ``max_output`` bytes, the rest dropped).

        ``extension()``: seconds the clock is given back so far (never more than ``extension_cap``), read as the
        command runs; the host watchdog decides then, the inside ``timeout`` sits ``extension_cap`` further out.

        ``stop()``: asked as the command runs; a reason (not ``None``) ends the agent's processes at once, and the
        result's ``stopped`` says it (never a timeout).
        """
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        if use_timeout and self._layout is not None and not self._layout.raw.get("timeout_command"):
            use_timeout = False  # no coreutils timeout in the image: the host watchdog alone enforces it
        if extension is None:
            extension_cap = 0.0
        if use_timeout:
            argv = ["timeout", "-k", str(EXEC_KILL_GRACE), str(max(1, int(timeout + extension_cap))), *argv]
        environment = dict(self.agent_env()) if user == "agent" and self._layout is not None else {}
        environment.update(env or {})
        try:
            return self._exec(argv, timeout=timeout, user=user, workdir=workdir, environment=environment,
                              output=output, stdin=stdin, max_output=max_output, use_timeout=use_timeout,
                              extension=extension, extension_cap=extension_cap, stop=stop)
        except APIError as exc:  # the container or its exec vanished under a running command: not the agent's doing
            raise SandboxError(f"the engine lost the command of sandbox container {self.id[:12]} "
                               f"({shell_join(argv)[:200]}): {exc}") from exc

    def binary(self, args: Sequence[str] = (), *, stdin: bytes | None = None, timeout: float = 60,
               user: str = "agent", workdir: str = SRC_DIR) -> ExecResult:
        """Call the reference through the proxy (``/workspace/binary``), as the agent would (the call is logged)."""
        return self.exec([BINARY_PATH, *args], stdin=stdin, timeout=timeout, user=user, workdir=workdir)

    def _exec(self, argv: list[str], *, timeout: float, user: str, workdir: str, environment: dict[str, str],
              output: Path | None, stdin: bytes | None, max_output: int, use_timeout: bool,
              extension: Callable[[], float] | None = None, extension_cap: float = 0.0,
              stop: Callable[[], str | None] | None = None) -> ExecResult:
        box = self._handle
        clock = _ExecClock(time.monotonic(), timeout, use_timeout, extension, extension_cap, stop=stop)
        exec_id, reader = box.start_exec(argv, user=self._user(user), workdir=workdir, environment=environment,
                                         stdin=stdin is not None)
        sink: CappedLog | None = None
        captured = OutputCap(max_output, tail=0)  # stdout and stderr interleaved, the rest dropped
        notes: list[str] = []
        try:
            sink = CappedLog(output) if output is not None else None  # agent.log: capped, closed below
            if stdin is not None:
                with contextlib.suppress(OSError):  # a command that does not read its stdin is its business
                    reader.send(stdin)
            write: Callable[[bytes], object] = sink.write if sink is not None else captured.write
            # (a file is flushed while in its head, its tail held until close)
            timed_out = self._follow(exec_id, reader, {1: write, 2: write}, clock)
            if not timed_out:
                timed_out = self._outlive_broken_stream(exec_id, clock.deadline, notes)
        finally:
            reader.close()
            if sink is not None:
                for note in notes:
                    sink.write(f"\n[pytest-programbench] {note}\n".encode())
                sink.close()
        info = box.exec_info(exec_id)
        exit_code = None if info.get("Running") else info.get("ExitCode")
        duration = time.monotonic() - clock.started
        if clock.termed_at is not None or (use_timeout and exit_code in (124, 137) and duration >= timeout):
            timed_out = True
        return ExecResult(exit_code, bytes(captured.head), duration, timed_out and clock.stopped is None,
                          captured.omitted > 0, tuple(notes), clock.stopped)

    def _follow(self, exec_id: str, reader: ExecReader, sinks: Sinks, clock: _ExecClock) -> bool:
        """Hand the command's output to ``sinks`` until its stream ends; True when its clock fired."""
        box = self._handle
        timed_out = False
        finished_at: float | None = None
        # Quick answers for short commands, few engine calls for a six-hour agent run.
        while not reader.pump(time.monotonic() + min(2.0, 0.1 + (time.monotonic() - clock.started) / 30), sinks):
            now = time.monotonic()
            if finished_at is None and not box.running(exec_id):
                finished_at = now  # the command ended; a background process may still hold the stream
            if finished_at is not None and now - finished_at > 2.0:
                reader.shutdown()
            elif finished_at is None and clock.stopped is None and clock.stop is not None and \
                    (reason := clock.stop()) is not None:
                clock.stopped = reason
                self.kill_agent_processes()
                reader.shutdown()
            elif clock.extension is not None and clock.termed_at is None and now > clock.end():
                clock.termed_at = now
                self._term_agent_processes()
            elif now > clock.deadline():
                timed_out = True
                self.kill_agent_processes()
                reader.shutdown()
        return timed_out

    def _outlive_broken_stream(self, exec_id: str, deadline: Callable[[], float], notes: list[str]) -> bool:
        """The connection ended while the command still runs: wait for the command itself (an exec cannot be
        re-attached), up to its clock. True when the clock fired. Engine trouble while waiting propagates: an
        infrastructure error, never a score."""
        box = self._handle
        if not box.running(exec_id):
            return False
        notes.append(f"the output stream of a running command broke at {time.strftime('%H:%M:%S')} UTC; "
                     "its further output was not captured; the harness waited for it to end")
        log.warning("exec %s: the output stream broke while the command runs; polling until it ends", exec_id[:12])
        delay = 0.5
        while box.running(exec_id):
            if time.monotonic() > deadline():
                self.kill_agent_processes()
                return True
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
        return False

    def _term_agent_processes(self) -> None:
        """SIGTERM to every process of the agent user, sent as that user (``kill -TERM -1``): the clock's end, as
        coreutils ``timeout`` would signal it; the KILL follows from the watchdog."""
        with contextlib.suppress(Exception):  # the sandbox is gone: nothing of the agent's runs either
            layout = self.layout
            api = self.engine.api
            api.exec_start(api.exec_create(self.id, ["sh", "-c", "kill -TERM -1 2>/dev/null; true"],
                                           user=f"{layout.agent_uid}:{layout.agent_gid}", workdir="/")["Id"])

    def kill_agent_processes(self) -> dict[str, Any]:
        """Stop, then SIGKILL, every process of the agent user until none is left (see ``_KILL_AGENT``), in a
        sandbox that goes on (a command's clock fired). The window's end uses :meth:`end_agent_window` instead.

        Returns the loop's counts (``passes``, ``stopped``, ``killed``, ``left``: pids still there when its budget
        ran out; ``error`` when it could not run). The proxy master's idle workers are spared. Only root runs here:
        a process of the agent's uid could be killed, traced or steered (its user site) by the agent.
        """
        try:
            api = self.engine.api
            layout = self.layout
            script = _KILL_AGENT.format(uid=layout.agent_uid, master=layout.daemon_pid, budget=KILL_BUDGET,
                                        clean_scans=CLEAN_SCANS)
            output = api.exec_start(api.exec_create(self.id, ["python3", "-I", "-c", script], user="0:0",
                                                    workdir="/")["Id"])
        except Exception as exc:  # the sandbox is gone: nothing of the agent's is left running either
            return {"error": str(exc)}
        report = _last_json_line(output if isinstance(output, bytes) else b"")
        return report if report is not None else {"error": output.decode("utf-8", "replace")[-500:]}

    def end_agent_window(self) -> WindowEnd:
        """The agent's window is over: freeze the whole container (``docker pause``, the cgroup freezer: no process
        of it runs or forks again), count what the agent still runs (``docker top``, from the engine's host), and
        kill the container (its pid namespace goes with its init, every process at once). Nothing runs inside it
        for this, so nothing the agent left can interfere. Its files stay readable (``get_archive`` of a stopped
        container): the submission and the call log are read afterwards.

        A sandbox found already stopped says why (``died``): the agent's doing when its memory limit's OOM killer
        ended it (``agent_caused``), infrastructure otherwise. Idempotent. Engine trouble propagates
        (``EngineUnavailable``/``SandboxError``): an infrastructure error, never a score.
        """
        if self._window_end is None:
            self._window_end = self._end_window()
        return self._window_end

    def _end_window(self) -> WindowEnd:
        api = self.engine.api
        state = self._state()
        if state is None:
            return WindowEnd(died=f"sandbox container {self.id[:12]} disappeared during the agent run")
        if not state.get("Running"):
            return self._death(state)
        # An engine that is shutting down still answers inspections on open connections while it stops the
        # container: a new command run to its end shows the sandbox outlived the agent. One that cannot run in a
        # sandbox that still runs is the agent's doing (its memory or process limit is full): frozen and killed as
        # usual; an engine that is going away fails the freeze or the kill below.
        problems: list[str] = []
        try:
            probe = self.exec(["true"], user="root", workdir="/", timeout=60, use_timeout=False)
            failed = None if probe.exit_code == 0 else f"exit {probe.exit_code}: {probe.text.strip()[-300:]}"
        except SandboxError as exc:
            failed = str(exc)
        if failed is not None:
            state = self._state()
            if state is None or not state.get("Running"):
                return self._death(state) if state is not None else WindowEnd(
                    died=f"sandbox container {self.id[:12]} disappeared during the agent run")
            problems.append(f"a command could not run in the sandbox at the end of the agent's window ({failed}): "
                            "its memory or process limit was full")
        survivors: int | None = None
        frozen = self._freeze(problems)
        try:
            survivors = self._count_agent_processes(api.top(self.id, ps_args="-eo pid,ppid,ruid,stat,args"))
        except (APIError, KeyError, ValueError) as exc:  # no `ps` on the engine's host: the kill is the same
            problems.append(f"the agent's processes could not be counted ({_explanation(exc)})")
        if not frozen and survivors is not None:
            problems.append(f"{survivors} process(es) of the agent counted while the sandbox ran (not exact)")
        try:
            self._kill(frozen, problems)
        except NotFound:
            return WindowEnd(died=f"sandbox container {self.id[:12]} disappeared during the agent run")
        except APIError as exc:
            state = self._state()
            if state is None or state.get("Running"):
                raise SandboxError(f"cannot stop sandbox container {self.id[:12]}: {_explanation(exc)}") from exc
            return self._death(state)  # it stopped by itself between the probe and the kill
        try:
            api.wait(self.id, timeout=STOP_WAIT)
        except (APIError, OSError) as exc:  # (requests' timeouts are OSErrors)
            raise SandboxError(f"sandbox container {self.id[:12]} was killed but not reported stopped: {exc}") \
                from exc
        return WindowEnd(survivors=survivors, problem="; ".join(problems) or None)

    def _kill(self, frozen: bool, problems: list[str]) -> None:
        """SIGKILL; a paused container is killed too (the engine thaws it after the signal). A frozen runsc sandbox
        is thawed and killed at once, in two calls (``Container.thaw_under_gvisor`` says why). Elsewhere a refused
        kill of a frozen sandbox is thawed and killed too, and said."""
        if frozen and self._handle.thaw_under_gvisor():
            self._handle.kill("SIGKILL")
            return
        try:
            self._handle.kill("SIGKILL")
            return
        except APIError:
            state = self._state()
            if not (frozen and state is not None and state.get("Paused")):
                raise
        # The refused kill may still be stopping it: neither step then has anything left to do (the wait that
        # follows says whether it stopped).
        with contextlib.suppress(APIError):
            self.engine.api.unpause(self.id)
        with contextlib.suppress(APIError):
            self._handle.kill("SIGKILL")
        problems.append("the engine would not kill the frozen sandbox: it was thawed and killed at once")

    def _freeze(self, problems: list[str]) -> bool:
        """``docker pause``, tried FREEZE_ATTEMPTS times: cgroup v1's freezer gives up on a cgroup whose processes
        keep forking ("unable to freeze") where v2's does not. Unfrozen, the kill that follows is still complete
        (the pid namespace goes with its init); only the count is then approximate."""
        for attempt in range(FREEZE_ATTEMPTS):
            try:
                self.engine.api.pause(self.id)
                return True
            except APIError as exc:  # (a sandbox that died just now is still killed; its state says why)
                if attempt + 1 == FREEZE_ATTEMPTS:
                    problems.append(f"the sandbox could not be frozen ({_explanation(exc)}); it was killed "
                                    "unfrozen")
                else:
                    time.sleep(0.5)
        return False

    def _state(self) -> dict[str, Any] | None:
        """The container's ``State`` (None: it is gone)."""
        try:
            return dict(self.engine.api.inspect_container(self.id)["State"])
        except NotFound:
            return None

    def _death(self, state: Mapping[str, Any]) -> WindowEnd:
        """A sandbox found stopped: the agent's doing only when the OOM killer of its memory limit ended it (an
        unprivileged agent can stop it no other way; an engine that stops, or an operator, is not the agent)."""
        oom = bool(state.get("OOMKilled"))
        detail = f"exit {state.get('ExitCode')}, OOM killed: {oom}"
        if oom:
            return WindowEnd(died=f"its memory limit's OOM killer ended it ({detail})", agent_caused=True)
        return WindowEnd(died=f"sandbox container {self.id[:12]} stopped during the agent run ({detail})")

    def _count_agent_processes(self, top: Mapping[str, Any]) -> int:
        """Live processes of the agent's uid in a ``docker top`` listing (frozen: the listing is exact), the
        proxy's workers (children of its root master) apart; zombies are dead."""
        titles = [str(t) for t in top.get("Titles") or []]
        rows = [[str(v) for v in row] for row in top.get("Processes") or []]
        column = {name: titles.index(name) for name in ("PID", "PPID", "RUID", "STAT", "COMMAND")}
        masters = {row[column["PID"]] for row in rows
                   if row[column["RUID"]] == "0" and f"{PROXY_DIR}/daemon.py" in row[column["COMMAND"]]}
        return sum(1 for row in rows if row[column["RUID"]] == str(self.layout.agent_uid)
                   and not row[column["STAT"]].startswith(("Z", "X")) and row[column["PPID"]] not in masters)

    # ------------------------------------------------------------------ files
    def put_file(self, data: bytes | Path, dest: str, *, mode: int = 0o644, owner: str = "agent") -> None:
        """Write one file into the sandbox (its directory must exist)."""
        payload = data.read_bytes() if isinstance(data, Path) else data
        target = PurePosixPath(dest)
        uid = gid = 0
        if owner == "agent":
            uid, gid = self.layout.agent_uid, self.layout.agent_gid
        if not self._put(TarIn().file(target.name, payload, mode, uid=uid, gid=gid), str(target.parent)):
            raise SandboxError(f"could not write {dest}")

    def pack_src(self, dest: Path, *, max_bytes: int = DEFAULT_SUBMISSION_LIMIT,
                 exclude: Sequence[str] = ()) -> int:
        """Pack ``/workspace/src`` into ``dest`` (tar.gz whose root is the contents of src); returns its size.

        Regular files, directories, symlinks and hard links are kept with their permission bits and mtimes;
        setuid, setgid and sticky bits are cleared and owners normalised to root. ``exclude`` holds top-level names
        to leave out (e.g. ``target``). More than ``max_bytes`` of tar stream raises :class:`SubmissionTooLarge`;
        a stream that breaks while the sandbox is alive (the agent's files changed under the packer)
        :class:`SubmissionUnpackable`; the engine failing :class:`SandboxError`. Every path leaves no file behind
        and closes the archive stream (an open one holds the engine's lock on the container).
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        try:
            with self._archive(SRC_DIR) as (stream, _stat):
                source = CappedStream(stream, max_bytes)
                with tarfile.open(fileobj=source, mode="r|") as tar_in, tarfile.open(partial, "w:gz") as tar_out:
                    for member in tar_in:
                        name = _strip_root(member.name)
                        if not name or name.split("/", 1)[0] in exclude:
                            continue
                        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
                            continue
                        member.name = name
                        if member.islnk():
                            member.linkname = _strip_root(member.linkname)
                        member.mode &= 0o777  # no setuid/setgid/sticky: the submission is extracted as root
                        member.uid = member.gid = 0
                        member.uname = member.gname = "root"
                        member.pax_headers = {}
                        tar_out.addfile(member, tar_in.extractfile(member) if member.isreg() else None)
            os.replace(partial, dest)
        except TooLarge as exc:
            partial.unlink(missing_ok=True)
            raise SubmissionTooLarge(f"{SRC_DIR} is larger than {max_bytes} bytes (as a tar stream)") from exc
        except DockerException as exc:
            partial.unlink(missing_ok=True)
            raise SandboxError(f"cannot pack {SRC_DIR}: {exc}") from exc
        except EngineUnavailable:  # before OSError: requests' connection errors are OSErrors too
            partial.unlink(missing_ok=True)
            raise
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            partial.unlink(missing_ok=True)
            # A stopping engine still answers on pooled connections while refusing new ones: only a broken
            # stream with no engine trouble anywhere in its causes is the agent's doing.
            if _engine_trouble(exc) or not self._alive():
                raise SandboxError(f"cannot pack {SRC_DIR}: {exc} (the sandbox is gone)") from exc
            raise SubmissionUnpackable(f"{SRC_DIR} could not be packed: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return dest.stat().st_size

    def _alive(self) -> bool:
        """Whether the engine answers and the container is there, running or stopped at the window's end (after a
        broken stream: whose fault was it?)."""
        try:
            state = self.engine.api.inspect_container(self.id)["State"]
        except Exception:
            return False
        return bool(state.get("Running")) or self._window_end is not None

    def _archive(self, path: str) -> contextlib.AbstractContextManager[
            tuple[Iterator[bytes], dict[str, Any] | None]]:
        """``GET /containers/{id}/archive``: the tar stream and the path's stat; the response is closed on exit."""
        return self._handle.archive(path)

    def read_file(self, path: str, *, max_bytes: int = 256 << 20) -> bytes:
        """One file's bytes, read as root (e.g. the proxy's call log); at most ``max_bytes``, else SandboxError."""
        try:
            with self._archive(path) as (stream, _stat), \
                    tarfile.open(fileobj=CappedStream(stream, max_bytes + TAR_OVERHEAD), mode="r|") as tar:
                for member in tar:
                    handle = tar.extractfile(member)
                    if handle is not None:
                        return handle.read()
        except NotFound as exc:
            raise FileNotFoundError(path) from exc
        except EngineUnavailable:  # the engine, not the file: an infrastructure error
            raise
        except (DockerException, TooLarge, tarfile.TarError, EOFError, OSError) as exc:
            if _engine_trouble(exc):
                raise EngineUnavailable(f"cannot read {path}: {exc}") from exc
            raise SandboxError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
        raise SandboxError(f"{path} is not a regular file")

    def newest_file(self, directory: str, suffix: str, *, max_bytes: int = 256 << 20) -> str | None:
        """The most recently modified regular file named ``*suffix`` under ``directory`` (read from the archive, so
        a stopped sandbox answers too); None when there is none, or the directory is unreadable or too large."""
        newest: tuple[float, str] | None = None
        parent = PurePosixPath(directory.rstrip("/")).parent
        with contextlib.suppress(Exception), self._archive(directory) as (stream, _stat), \
                tarfile.open(fileobj=CappedStream(stream, max_bytes), mode="r|") as tar:
            for member in tar:
                if member.isreg() and member.name.endswith(suffix) and (newest is None or member.mtime > newest[0]):
                    newest = (member.mtime, str(parent / member.name))
        return None if newest is None else newest[1]

    def read_call_log(self) -> CallLog:
        """Every proxied call so far, oldest first: one record per call, its ``ended`` line, or its ``started``
        line marked ``interrupted`` when the call never ended (its worker was killed, or it still runs).

        Never raises for what the agent can cause: an unreadable log comes back as ``problem`` (the pipeline turns
        it into a note and a flag, and the item is scored as usual).
        """
        made, unrecorded = self._call_count()
        try:
            data = self.read_file(CALL_LOG, max_bytes=CALL_LOG_READ_LIMIT)
        except FileNotFoundError:
            return CallLog([], 0, None, made, unrecorded)
        except SandboxError as exc:
            return CallLog([], 0, f"the proxy's call log could not be read: {exc}", made, unrecorded)
        dropped = 0
        with contextlib.suppress(Exception), self._archive(DROPPED_LOG) as (_stream, stat):
            dropped = int((stat or {}).get("size", 0))  # one byte per call: its size is the count, nothing read
        return CallLog(merge_call_records(data), dropped, None, made, unrecorded)

    def _call_count(self) -> tuple[int | None, int]:
        """The daemon's own count (``calls=N unrecorded=M``): calls made, and calls whose record it could not write
        (the storage the agent shares with the log was full). ``None`` calls when it cannot be read."""
        try:
            text = self.read_file(COUNT_LOG, max_bytes=4096).decode("ascii", "replace")
            fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
            return int(fields["calls"]), int(fields["unrecorded"])
        except (FileNotFoundError, SandboxError, KeyError, ValueError):
            return None, 0

    def call_log(self) -> list[dict[str, Any]]:
        """Every proxied call so far (argv, cwd, exit, signal, duration, flags), oldest first."""
        return self.read_call_log().records

    def copy_call_log(self, dest: Path) -> int:
        """Write ``binary-calls.jsonl`` (one JSON object per line); returns the number of calls."""
        return self.save_call_log(dest).count

    def save_call_log(self, dest: Path) -> CallLog:
        """Write ``binary-calls.jsonl`` (one JSON object per line) and return what was read."""
        read = self.read_call_log()
        dest.parent.mkdir(parents=True, exist_ok=True)
        # ensure_ascii=False: the copy stays as large as the log the daemon bounded, not up to 3x (\\uXXXX)
        dest.write_text("".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in read.records),
                        encoding="utf-8", errors="replace")
        return read


@dataclass(frozen=True)
class CallLog:
    """The proxy's call log as read after the agent's window."""

    records: list[dict[str, Any]]
    dropped: int  # calls made after the log reached its cap (counted, not recorded)
    problem: str | None  # why the log could not be read (None: it was)
    made: int | None = None  # calls the daemon accepted, by its own count (None: not known)
    unrecorded: int = 0  # calls whose record the daemon could not write (storage full): counted, not recorded

    @property
    def count(self) -> int:
        return max(len(self.records) + self.dropped, self.made or 0)

    def notes(self) -> list[str]:
        out = []
        if self.problem:
            out.append(self.problem)
        if self.dropped:
            out.append(f"the proxy's call log reached its cap ({CALL_LOG_MAX >> 20} MiB): {self.dropped} later "
                       "call(s) counted, not recorded")
        if self.unrecorded:
            out.append(f"{self.unrecorded} call(s) of the reference could not be recorded: the proxy's call log "
                       "could not be written (the sandbox's storage, which the agent shares, was full); counted by "
                       "the proxy, not recorded")
        interrupted = sum(1 for r in self.records if r.get("interrupted"))
        if interrupted:
            why = "their proxy worker was killed" + (", or their end could not be recorded" if self.unrecorded else "")
            out.append(f"{interrupted} call(s) of the reference never ended ({why})")
        return out


def merge_call_records(data: bytes) -> list[dict[str, Any]]:
    """One record per call from the log's lines: ``ended`` wins; a lone ``started`` becomes ``interrupted``."""
    records: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        call = record.get("call")
        if not isinstance(call, str):
            records.append(record)
            continue
        phase = record.pop("phase", "ended")
        if call in index:
            if phase == "ended":
                records[index[call]] = record
            continue
        if phase == "started":
            record.update(interrupted=True, exit=None, signal=None)
        index[call] = len(records)
        records.append(record)
    return records


# ---------------------------------------------------------------------------------------------- helpers
def _engine_trouble(exc: BaseException) -> bool:
    """Whether the engine connection failed somewhere in ``exc``'s causes (never the agent's doing)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < 20 and not any(current is s for s in seen):
        if isinstance(current, EngineUnavailable | requests.exceptions.ConnectionError):
            return True
        seen.append(current)
        current = current.__cause__ or current.__context__
    return False


def _explanation(exc: BaseException) -> str:
    return str(getattr(exc, "explanation", None) or exc)


def _strip_root(name: str) -> str:
    """``src/a/b`` -> ``a/b``; ``src`` -> ``""`` (docker's archive of a directory is rooted at its name)."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    return "/".join(parts[1:])


def _last_json_line(data: bytes) -> dict[str, Any] | None:
    for raw_line in reversed(data.decode("utf-8", "replace").splitlines()):
        line = raw_line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                if isinstance(value, dict):
                    return value
    return None


def shell_join(argv: Sequence[str]) -> str:
    """For messages: an argv as a shell would read it."""
    return " ".join(shlex.quote(a) for a in argv)
