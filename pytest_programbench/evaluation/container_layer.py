"""The official evaluator on a Docker-SDK container layer.

``programbench.eval.eval.Evaluator`` (1.2.5) drives every scoring decision. It talks to Docker only through
``programbench.container.ContainerEnvironment`` (the docker CLI via subprocess), two ``Evaluator`` methods
(``_new_env``, ``_copy_file_from_container``) and the module-level ``remove_image``. This module replaces exactly
those with docker-py equivalents, so the semantics stay the official code's:

* :class:`SdkContainerEnvironment` offers ``ContainerEnvironment``'s interface: ``execute`` (``bash -lc`` in
  ``cwd``, stdout then stderr, the official timeout behaviour), ``copy_in``, ``copy_in_tar`` (streamed into the
  container's own ``tar`` so escaping symlinks survive, as the official does), ``commit``, ``cleanup``,
  ``container_id`` and ``executable``.
* :class:`SdkEvaluator` subclasses the official ``Evaluator``: ``_new_env`` (same env and addopts logic),
  ``_copy_file_from_container`` (SDK ``get_archive``, same log entry shape), ``_run_step`` (only to map the
  hard-coded compile/run timeouts to ours and to hook the harness around named official steps).
* ``programbench.eval.eval.remove_image`` is wrapped by a dispatcher that removes images committed by this layer
  through the SDK and hands every other reference to the original function unchanged.

Networks as the official: every container gets the engine's default network (``docker run`` without
``--network``) and the official ``internet_control`` blackholes DNS around ``compile.sh``; ``--pb-strict`` gives every
container ``network_mode="none"`` instead. Command output is decoded strictly, as ``subprocess.run(text=True)`` does:
undecodable bytes raise :class:`UndecodableOutput` (a ``UnicodeDecodeError``), which the official scores 0.

Deliberate differences, each documented at its site and in README's evaluation section: a pids limit, labels, a
self-expiring lifetime (counted from each container's start); each next branch's container made ready while the
branch before it runs (:meth:`SdkEvaluator._warm`); the ``pytest-rerunfailures`` install step runs
against a host-provided wheel directory with ``--no-index``; command output in the log is capped with a marker
(``results_read`` never is, but a results file past ``RESULTS_MAX_BYTES`` is not read: ``results_read_failed``);
a device or a FIFO at ``eval/results.xml`` scores the instance 0 (``EmptyTestResultError``), where the official
scores 0, reads the host's device or hangs.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import shlex
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import programbench
import requests.exceptions
from docker.errors import APIError, NotFound
from programbench.constants import DOCKER_CP_TIMEOUT, DOCKER_EXECUTABLE, DOCKER_RUN_TIMEOUT, WORKSPACE_DIR
from programbench.eval import eval as official_eval
from programbench.eval.eval import EvaluationResult, Evaluator
from programbench.eval.pytest_timeout_retry import (
    PYTEST_TIMEOUT_RETRY_PLUGIN_DIR,
    PYTEST_TIMEOUT_RETRY_PLUGIN_PATH,
    PYTEST_TIMEOUT_RETRY_PLUGIN_SOURCE,
)
from programbench.exceptions import EvalStepError

from pytest_programbench.core.environment import PREFETCH
from pytest_programbench.engine.archive_out import (
    DIRECTORY,
    HARDLINK,
    REGULAR,
    SPECIAL,
    SYMLINK,
    Member,
    TooLarge,
)
from pytest_programbench.engine.container import Container, ExecReader, OutputCap, decode_for_display
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.engine.facts import facts
from pytest_programbench.engine.tar_in import TarIn
from pytest_programbench.evaluation import harness_material
from pytest_programbench.evaluation.step_batch import UNCAPPED, Step, StepResult, collect, driver_argv, new_nonce
from pytest_programbench.sandbox.sandbox import StorageQuota, storage_quota

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)
progress = logging.getLogger("pytest_programbench")  # the pipeline's progress logger

# Per stream (stdout, stderr) of one command: keep this many bytes from the start and as many from the end.
DEFAULT_OUTPUT_CAP = 256 * 1024
PIDS_LIMIT = 32768
# The most of eval/results.xml this harness reads (the official reads any size): a sparse file costs the container
# nothing and would otherwise be read whole into the worker and into eval.json. Past it: results_read_failed.
RESULTS_MAX_BYTES = 32 << 20
# Seconds a container outlives the longest step it can run; `sleep <lifetime>` then ends and the container
# stops by itself, so a container leaked by a crash expires even if no sweep ever runs.
LIFETIME_MARGIN = 3600
# "0": each branch's container made when the official asks for it, not ahead (SdkEvaluator._warm).
# The official teardown after a timed-out command (ContainerEnvironment.execute): SIGKILL everything but pid 1.
KILL_ALL_BUT_INIT = "kill -KILL -1 2>/dev/null; sleep 0.2; kill -KILL -1 2>/dev/null; true"
KILL_TIMEOUT = 30
# Every process but init, this shell and the container's command (the one started first) stopped at once, then
# killed; the command continued; prints how many were killed. Bash builtins only: nothing forks while it runs.
STOP_ALL_BUT_INIT = r"""
me=$$; main=; first=
kill -STOP -1 2>/dev/null
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = 1 ] || [ "$p" = "$me" ] || {
    read -r line 2>/dev/null <"$d/stat" || continue
    set -- ${line##*) }
    if [ -z "$first" ] || [ "${20}" -lt "$first" ]; then first=${20}; main=$p; fi
  }
done
n=0
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  case $p in 1|"$me"|"$main") continue ;; esac
  read -r line 2>/dev/null <"$d/stat" || continue
  set -- ${line##*) }
  [ "$1" = Z ] && continue
  kill -KILL "$p" 2>/dev/null && n=$((n + 1))
done
[ -n "$main" ] && kill -CONT "$main" 2>/dev/null
echo "$n"
"""
# After the kill, how long the attached stream may take to close before we stop reading it.
DRAIN_GRACE = 10.0
HARNESS_OUTPUT_LIMIT = 4096  # bytes of a harness command's output read by default
EXIT_POLL_SECONDS = 5.0
# Bounds of the upper-directory walk (docker diff): levels below / and entries listed.
DIFF_MAX_DEPTH = 256
DIFF_MAX_ENTRIES = 400_000


# The official sources this layer was written against (programbench 1.2.5), with what to re-check if one changes.
AUDITED_SOURCES: dict[str, tuple[str, str]] = {
    "eval/eval.py": (
        "8904e2947de17d166a2c579b9d55684ed15143c692024413e24d80645f30d5f9",
        "Evaluator: the names and order of _run_step steps, the hard-coded compile/run_tests timeouts mapped in "
        "SdkEvaluator._run_step, the _new_env env/addopts logic copied into SdkEvaluator._official_env, the "
        "_copy_file_from_container log entry shape, the module-level remove_image call, the rerunfailures pin",
    ),
    "container.py": (
        "e0faa1d3e846ba725c19b53cf2cff754bf3c6cd4c6f70b07309b75d239dea506",
        "ContainerEnvironment: constructor arguments, `docker run` flags (--init, --cpus, -w, env), execute() "
        "(bash -lc, stdout+stderr, the timeout teardown), copy_in/copy_in_tar semantics, commit, cleanup",
    ),
    "utils/internet_control.py": (
        "1f4bbcec7d4457f4ee2f237717de0739c28ad1a366eee751e367b67ec4382751",
        "block/restore_build_internet_dns: they call env.execute() on our environment",
    ),
    "eval/pytest_timeout_retry.py": (
        "d9792db721ba8c0a85b7ad6a117a52375963e3e1deee935596be78c67ab22b95",
        "the plugin copied in with copy_in(); its module name and directory",
    ),
    "utils/load_data.py": (
        "10355cc12bad16fe6dea699d8b271a56e4bd1525e752554359ca1dac27bcda10",
        "get_active_branches / get_ignored_tests / get_ignored_branches used for the score",
    ),
    "eval/eval_batch.py": (
        "31facfb195aa405f3a8bd6335978e0ff8408fff40e9570f91c36ed56604d36c2",
        "_evaluate_instance: how `programbench eval` builds the Evaluator (mirrored in evaluation.evaluate) and "
        "scores an instance whose pipeline raised (0, error_code = exception type)",
    ),
}


def audit_official_sources() -> list[str]:
    """One message per installed official source file that differs from the audited one."""
    root = Path(programbench.__file__).parent
    problems = []
    for rel, (digest, recheck) in AUDITED_SOURCES.items():
        path = root / rel
        try:
            with path.open("rb") as f:
                actual = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            problems.append(f"{path}: unreadable ({exc}); re-check {recheck}")
            continue
        if actual != digest:
            problems.append(f"{path} changed (sha256 {actual}, audited {digest}): re-check {recheck}, then update "
                            f"AUDITED_SOURCES in pytest_programbench/evaluation/container_layer.py")
    return problems


class HarnessError(Exception):
    """A self-check of the harness failed: an infrastructure error, never a score."""


def _engine_unavailable(exc: BaseException) -> EngineUnavailable:
    return EngineUnavailable(f"Docker engine connection failed during evaluation: {exc}")


def _is_connection_failure(exc: BaseException) -> bool:
    return isinstance(exc, requests.exceptions.ConnectionError | ConnectionRefusedError | FileNotFoundError)


def _api_error_text(exc: Exception) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc)


# --------------------------------------------------------------------------------------------- output capture


class UndecodableOutput(UnicodeDecodeError):
    """A command printed bytes that are not UTF-8: ``subprocess.run(text=True)`` raises here, and the official
    evaluator scores the instance 0 (error ``UnicodeDecodeError``). ``output`` keeps what was printed, the bytes
    that could not be decoded written as ``\\xNN`` escapes, for the log."""

    def __init__(self, cause: UnicodeDecodeError, *, stream: str, output: str) -> None:
        super().__init__(cause.encoding, cause.object, cause.start, cause.end, cause.reason)
        self.stream = stream
        self.output = output

    def __str__(self) -> str:
        return f"{self.stream} of the command is not UTF-8: {super().__str__()}"


def _strict_output(out: OutputCap, err: OutputCap) -> str:
    """stdout then stderr as the official's ``result.stdout + result.stderr``; raises as its decoding would."""
    text = out.text("stdout") + err.text("stderr")
    for buffer, stream in ((out, "stdout"), (err, "stderr")):
        problem = buffer.finish()
        if problem is not None:
            raise UndecodableOutput(problem, stream=stream, output=text)
    return text


# --------------------------------------------------------------------------------------------- exec plumbing


class Reaper:
    """Removes containers and images in the background, in submission order; ``drain`` waits for all of it."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pb-reaper")
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if not self._closed:
                self._pending.append(self._pool.submit(job))
                return
        job()

    def drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            with contextlib.suppress(Exception):
                future.result()

    def close(self) -> None:
        self.drain()
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)


# --------------------------------------------------------------------------------------------- the environment


@dataclass
class Diff:
    """A container's filesystem changes (``docker diff`` entries) and where the walk that listed them stopped."""

    changes: list[dict[str, Any]]
    bounded: list[str]


@dataclass
class UpperWalk:
    """An overlay2 upper directory as ``docker diff`` entries: iterative, at most ``max_depth`` levels and
    ``max_entries`` entries; directories under ``prune`` listed, not descended into."""

    upper: str
    lowers: list[str]
    prune: tuple[str, ...]
    max_depth: int
    max_entries: int
    watch: tuple[str, ...] = ()  # name prefixes walked whole even below a pruned directory

    def run(self) -> Diff:
        result = Diff([], [])
        pending: list[tuple[str, int]] = [("", 0)]  # (directory relative to the upper dir, its depth)
        while pending:
            directory, depth = pending.pop()
            try:
                with os.scandir(self.upper + directory) as entries:
                    for entry in entries:
                        if len(result.changes) >= self.max_entries:
                            result.bounded.append(f"more than {self.max_entries} changed entries")
                            return result
                        below = self._entry(result, entry, directory)
                        if below is None:
                            continue
                        if depth + 1 >= self.max_depth:
                            result.bounded.append(f"{below}: deeper than {self.max_depth} levels")
                        else:
                            pending.append((below, depth + 1))
            except FileNotFoundError:
                continue  # removed while walked
            except OSError as exc:  # unreadable, or a path past PATH_MAX: said, never skipped silently
                result.bounded.append(f"{directory or '/'}: not readable ({exc.strerror or exc})")
        return result

    def _entry(self, result: Diff, entry: os.DirEntry[str], directory: str) -> str | None:
        """Lists one entry; the path to descend into when it is a directory to walk."""
        rel = f"{directory}/{entry.name}"
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return None
        lower = next((lower + rel for lower in self.lowers if os.path.lexists(lower + rel)), None)
        whiteout = stat.S_ISCHR(st.st_mode) and st.st_rdev == 0  # deleted
        kind = 2 if whiteout else 0 if lower is not None else 1
        is_dir = stat.S_ISDIR(st.st_mode)
        stamp = None if kind == 2 or is_dir else (st.st_mtime_ns, st.st_size, st.st_mode)
        if is_dir and lower is not None and _directory_replaced(self.upper + rel, lower, st):
            stamp = (0, 0, st.st_mode)  # a change of its own, not merely a copy-up: stable while nothing else changes
        result.changes.append({"Path": rel, "Kind": kind, "Stamp": stamp})
        if not is_dir:
            return None
        watched = any(rel.startswith(w) or w.startswith(rel + "/") for w in self.watch)
        if not watched and any(rel == p or rel.startswith(p + "/") for p in self.prune):
            return None
        return rel


OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")


def _directory_replaced(upper: str, lower: str, st: os.stat_result) -> bool:
    """Whether an upper directory over an image's directory is more than its copy-up: opaque (removed and made
    again: the image's contents below it are hidden with no whiteout listed) or of another mode or owner."""
    for name in OPAQUE_XATTRS:
        try:
            if os.getxattr(upper, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    try:
        below = os.stat(lower, follow_symlinks=False)
    except OSError:
        return False
    return (below.st_mode, below.st_uid, below.st_gid) != (st.st_mode, st.st_uid, st.st_gid)


def storage_limit_option(api: Any, size: int) -> dict[str, str] | None:
    """``storage_opt`` for a container whose writable layer may hold ``size`` bytes, when the engine's storage
    driver enforces one (overlay2 on xfs with pquota, btrfs, zfs, devicemapper); None otherwise or for 0."""
    if size <= 0:
        return None
    return {"size": str(size)} if storage_quota(api).supported else None


def storage_refused(api: Any, exc: Exception) -> None:
    """The driver looked able but refused (overlay2 on xfs without pquota): remembered on the client, said once."""
    reason = f"the engine refused a size limit: {_api_error_text(exc)}"
    log.warning("evaluation containers' storage cannot be limited: %s (see docs/security.md)", reason)
    facts(api).storage_quota = StorageQuota(False, reason)


# Delayed ACKs in an evaluation container's own network namespace. A TCP socket that answers soon after it receives
# enters "pingpong" mode after this many exchanges and then holds its ACKs up to 40 ms, so the peer's next small write
# waits for them (Nagle). pytest-rerunfailures' status exchange between the xdist controller and each worker (a set,
# then a get, per test, over loopback) meets that on every test of every branch: 40 ms a test, 3.4 s of a 170-test
# branch's 4.2 s (the tests themselves: 0.8 s). The threshold is the host kernel's (its default has changed between
# kernels; a per-namespace sysctl in recent ones), so the official's time here is the host's, never its score: the
# official's timeout-retry plugin re-arms each test's timeout at its setup, after the exchange. A kernel without the
# sysctl refuses the container at its start: made again without.
QUICK_ACK_SYSCTL = "net.ipv4.tcp_pingpong_thresh"
QUICK_ACK_EXCHANGES = "255"  # its largest value: a socket falls back into the mode after 255 quick answers at most


def quick_acks_refused(api: Any, exc: Exception) -> None:
    """The engine's kernel has no such sysctl: remembered on the client, said once."""
    reason = _api_error_text(exc)
    log.warning("evaluation containers keep the kernel's delayed ACKs: the engine refused %s (%s)", QUICK_ACK_SYSCTL,
                reason[:300])
    facts(api).quick_acks_refused = reason


@dataclass(frozen=True)
class _Spec:
    """What a container of the layer is made with besides its image and mounts (kept for :meth:`renew`)."""

    cwd: str
    cpus: int
    memory: int | None
    lifetime: int
    network_mode: str
    environment: dict[str, str]
    quick_acks: bool


def _parse_run_args(run_args: list[str]) -> bool:
    """The official passes ``[*DOCKER_RUN_ARGS, "--init"]``; only ``--init`` has an SDK meaning here."""
    init = False
    for arg in run_args:
        if arg == "--init":
            init = True
        else:
            raise ValueError(f"SdkContainerEnvironment: unsupported docker run argument {arg!r}")
    return init


class SdkContainerEnvironment:
    """A drop-in for ``programbench.container.ContainerEnvironment`` on docker-py.

    Same constructor semantics (``image``, ``cwd``, ``executable`` kept for log strings, ``timeout`` as the
    default command timeout, ``cpus`` as ``--cpus`` and ``PYTEST_XDIST_AUTO_NUM_WORKERS``, ``env`` layered over
    that, ``run_args`` of which ``--init`` is honoured), plus the harness's own: labels, memory, lifetime (counted
    from the container's start), output cap, the engine and the network mode (``"default"``: what ``docker run``
    without ``--network`` gets; ``"none"`` under ``--pb-strict``).
    """

    def __init__(
        self,
        *,
        image: str,
        cwd: str = "/",
        executable: str = "docker",
        timeout: int = 30,
        cpus: int = 10,
        env: dict[str, str] | None = None,
        run_args: list[str] | None = None,
        engine: docker.DockerClient,
        labels: Mapping[str, str] | None = None,
        memory: int | None = None,
        lifetime: int = 7200,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        name_prefix: str = "pb-eval",
        reaper: Reaper | None = None,
        network_mode: str = "default",
        storage: int = 0,
        mounts: Sequence[harness_material.GraderMount] = (),
        quick_acks: bool = True,
    ) -> None:

        self.cwd = cwd
        self.executable = executable
        self.default_timeout = timeout
        self.cpus = cpus
        self.image = image
        self.labels = dict(labels or {})
        self.output_cap = output_cap
        self._engine = engine
        self._api = engine.api
        self._removed = False
        self.container_id = ""
        self.box = Container(self._api, "")
        self.exec_env: dict[str, str] | None = None  # extra environment for the next execute() only
        # The next execute() only: a result had without running the command (None: run it after all).
        self.exec_override: Callable[[str, int], dict[str, Any] | None] | None = None
        self.batched: collections.deque[StepResult] = collections.deque()  # run_steps' results, not yet asked for
        self.preloaded: tuple[Path, str] | None = None  # a tar already copied in ahead: (archive, destination)
        self.preloaded_files: dict[str, tuple[bytes, int]] = {}  # files copied in ahead: path -> (content, mode)
        self.before_commit: Callable[[SdkContainerEnvironment], None] | None = None
        self.committed: str | None = None  # the image this container was committed to
        self.paused = False
        self.reaper: Reaper | None = reaper
        self.before_image_removal: Callable[[], None] | None = reaper.drain if reaper is not None else None
        self._name = f"{name_prefix}-{uuid.uuid4().hex[:12]}"
        # The grader's read-only volumes, mounted at creation: in place before any command runs here.
        self.mounts = tuple(mounts)
        # Validates run_args; the official passes --init on its command line in any case.
        _parse_run_args(list(run_args or []))
        self._spec = _Spec(cwd=cwd, cpus=cpus, memory=memory, lifetime=int(lifetime), network_mode=network_mode,
                           environment={"PYTEST_XDIST_AUTO_NUM_WORKERS": str(cpus), **(env or {})},
                           quick_acks=quick_acks)
        # A size limit on the writable layer where the storage driver takes one (the committed image's layer is the
        # compile container's): a submission cannot fill the host's disk. Elsewhere none (docs/security.md).
        self._storage_size = storage
        self._storage_opt = storage_limit_option(self._api, storage)
        self.storage_limited = self._storage_opt is not None
        self.renewed: list[str] = []  # the images this container was renewed from (renew), removed by the evaluator
        self._create_and_start(image)

    def _create(self, image: str, storage_opt: dict[str, str] | None) -> str:
        spec = self._spec
        host_config = self._api.create_host_config(
            init=True,
            network_mode=spec.network_mode,
            nano_cpus=int(spec.cpus * 1_000_000_000),
            pids_limit=PIDS_LIMIT,
            mem_limit=spec.memory,
            storage_opt=storage_opt,
            mounts=[m.mount() for m in self.mounts] or None,
            sysctls=self._sysctls(),
        )
        created = self._api.create_container(
            image,
            command=["sleep", str(spec.lifetime)],
            name=self._name,
            working_dir=spec.cwd,
            environment=spec.environment,
            labels=self.labels,
            host_config=host_config,
            detach=True,
        )
        return str(created["Id"])

    def _sysctls(self) -> dict[str, str] | None:
        if not self._spec.quick_acks or facts(self._api).quick_acks_refused is not None:
            return None
        return {QUICK_ACK_SYSCTL: QUICK_ACK_EXCHANGES}

    def _create_and_start(self, image: str) -> None:
        with self._as_docker_run():
            try:
                self.container_id = self._create(image, self._storage_opt)
            except Exception as exc:
                if self._storage_opt is None or "storage" not in _api_error_text(exc).lower():
                    raise
                storage_refused(self._api, exc)
                self.storage_limited = False
                self._storage_opt = None
                self.container_id = self._create(image, None)
        self.box = Container(self._api, self.container_id)
        self._check_grader_volumes()
        with self._as_docker_run():
            self._start(image)

    def _start(self, image: str) -> None:
        """Start the created container (its `sleep <lifetime>` counts from here); one the kernel refused for the
        quick-ACK sysctl is made again without it."""
        try:
            self._api.start(self.container_id)
        except APIError as exc:
            text = _api_error_text(exc)
            if self._sysctls() is None or not any(form in text for form in (QUICK_ACK_SYSCTL,
                                                                           QUICK_ACK_SYSCTL.replace(".", "/"))):
                raise  # runc names the file it could not open: /proc/sys/net/ipv4/tcp_pingpong_thresh
            quick_acks_refused(self._api, exc)
            self.box.remove()
            self.container_id = self._create(image, self._storage_opt)
            self.box = Container(self._api, self.container_id)
            self._check_grader_volumes()
            self._api.start(self.container_id)

    def _check_grader_volumes(self) -> None:
        """The container, created and not started, holds the grader volumes made for it: one removed since it was
        made was replaced by an empty stand-in of the engine's, and is an infrastructure error, never a run without
        the grader's material. The container goes first: the stand-in is then free to remove."""
        replaced = harness_material.replaced_volumes(self._api, self.mounts) if self.mounts else []
        if not replaced:
            return
        self._remove_now()
        for name in replaced:
            harness_material.remove_stand_in(self._api, name)
        raise HarnessError(f"the grader volume {', '.join(replaced)} was removed before container {self._name} "
                           f"was made (the run's sweep or a reaper): its tests would run without the grader's files")

    @property
    def engine(self) -> docker.DockerClient:
        return self._engine

    def sibling(self, image: str) -> SdkContainerEnvironment:
        """A new container of ``image`` made as this one was (settings, labels, mounts)."""
        spec = self._spec
        return SdkContainerEnvironment(
            image=image, cwd=spec.cwd, executable=self.executable, timeout=self.default_timeout, cpus=spec.cpus,
            env=spec.environment, engine=self._engine, labels=self.labels, memory=spec.memory,
            lifetime=spec.lifetime, output_cap=self.output_cap, reaper=self.reaper, network_mode=spec.network_mode,
            storage=self._storage_size, mounts=self.mounts, quick_acks=spec.quick_acks)

    def renew(self, image_ref: str, *, mounts: Sequence[harness_material.GraderMount] = ()) -> str | None:
        """Commit this container as ``image_ref``, remove it with every process in it, and go on as a fresh container
        made from that image (same settings, ``mounts`` added): nothing that ran here runs in the new one. When the
        new container cannot have ``mounts`` (a path the image made unusable for them) it is made without them and
        the engine's reason is returned; otherwise None. Errors of the commit propagate as ``commit``'s."""
        self._commit_image(image_ref)
        self.renewed.append(image_ref)
        old = self.container_id
        try:
            self._remove_box()
        except APIError as exc:
            raise RuntimeError(f"removing the container {old[:12]} after its commit failed: "
                               f"{_api_error_text(exc)}") from exc
        self.paused = False
        self._removed = False
        self._name = f"{self._name.rsplit('-', 1)[0]}-{uuid.uuid4().hex[:12]}"
        self.mounts = tuple(mounts)
        self.batched.clear()
        refused: str | None = None
        try:
            self._create_and_start(image_ref)
        except RuntimeError as exc:
            if not self.mounts:
                raise
            refused = str(exc)
            self.mounts = ()
            self._removed = False
            self._name = f"{self._name.rsplit('-', 1)[0]}-{uuid.uuid4().hex[:12]}"
            self._create_and_start(image_ref)
        self.image = image_ref
        return refused

    @contextlib.contextmanager
    def _as_docker_run(self) -> Iterator[None]:
        """Creating or starting fails as the official's ``docker run`` would (the container removed first)."""
        try:
            yield
        except APIError as exc:
            self.cleanup()
            raise RuntimeError(f"Failed to start container: {_api_error_text(exc)}") from exc
        except requests.exceptions.Timeout as exc:
            self.cleanup()
            # The official's `docker run` runs under DOCKER_RUN_TIMEOUT: the same exception, so the same outcome.
            raise subprocess.TimeoutExpired(["docker", "run", self.image], DOCKER_RUN_TIMEOUT) from exc
        except Exception as exc:
            self.cleanup()
            if _is_connection_failure(exc):
                raise _engine_unavailable(exc) from exc
            raise

    # ----------------------------------------------------------------------------------------- execute

    def execute(self, command: str, *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``bash -lc command`` in ``cwd``: ``{"output", "returncode", "exception_info"}`` as the official."""
        timeout = timeout or self.default_timeout
        extra_env, self.exec_env = self.exec_env, None
        override, self.exec_override = self.exec_override, None
        if override is not None:
            replayed = override(command, timeout)
            if replayed is not None:
                return replayed
        if self.batched:
            if self.batched[0].step.command == command:
                return self._batched_result(self.batched.popleft())
            log.warning("container %s: the official asked for %r, not the batched %r: running it by itself",
                        self.container_id[:12], command[:80], self.batched[0].step.name)
            self.batched.clear()
        # A step whose output the official parses (the executable's hash) is read whole, as the official reads it.
        cap = UNCAPPED if command in PARSED_COMMANDS else self.output_cap
        out = OutputCap(cap)
        err = OutputCap(cap)
        started = self._start_exec(["bash", "-lc", command], environment=extra_env, workdir=self.cwd)
        if isinstance(started, dict):
            return started
        exec_id, stream = started
        deadline = time.monotonic() + timeout
        try:
            finished = stream.pump(deadline, {1: out.write, 2: err.write})
            if not finished:
                self._kill_after_timeout(stream)
                return {"output": "", "returncode": -1, "exception_info": f"Command timed out after {timeout}s"}
        finally:
            stream.close()
        returncode = self._exit_code(exec_id)
        return {"output": _strict_output(out, err), "returncode": returncode, "exception_info": ""}

    def path_variable(self) -> str | None:
        """The container's configured ``PATH`` (what every exec starts from), None when it sets none."""
        config = self._api.inspect_container(self.container_id).get("Config") or {}
        return next((str(v)[5:] for v in config.get("Env") or [] if str(v).startswith("PATH=")), None)

    def run_steps(self, steps: list[Step]) -> None:
        """Run ``steps`` in one exec (:mod:`.step_batch`); :meth:`execute` then answers each of them, in order,
        from what it gave. Steps the batch did not reach run by themselves when asked for."""
        self.batched.clear()
        started = self._start_exec(driver_argv(steps, nonce := new_nonce()), workdir=self.cwd)
        if isinstance(started, dict):
            log.debug("step batch not started (%s): the steps run one by one", started.get("output"))
            return
        exec_id, stream = started
        try:
            results, stop_driver = collect(stream, steps, nonce, output_cap=self.output_cap,
                                           started=time.monotonic())
            if stop_driver:
                self._kill_after_timeout(stream)
            elif results and results[-1].problem:
                # The driver's streams ended before its step did. An engine that went away or restarted (the exec
                # gone with it) raises here, as for a command run by itself once its stream ends: never a step's
                # failure, scored.
                self._exit_code(exec_id)
        finally:
            stream.close()
        self.batched.extend(results)

    @staticmethod
    def _batched_result(result: StepResult) -> dict[str, Any]:
        if result.problem:
            return {"output": "", "returncode": -1, "exception_info": result.problem, "wall_time": result.seconds}
        return {"output": _strict_output(result.out, result.err), "returncode": result.returncode,
                "exception_info": "", "wall_time": result.seconds}

    def _start_exec(
        self,
        cmd: list[str],
        *,
        environment: Mapping[str, str] | None = None,
        workdir: str | None = None,
        stdin: bool = False,
    ) -> tuple[str, ExecReader] | dict[str, Any]:
        """Create and start an exec; a failed start is reported like the CLI would (exit 1, daemon message)."""
        try:
            return self.box.start_exec(cmd, stdin=stdin, environment=environment, workdir=workdir)
        except NotFound as exc:
            return {"output": f"Error: No such container: {self.container_id}\n" if "container" in
                    _api_error_text(exc).lower() else f"Error response from daemon: {_api_error_text(exc)}\n",
                    "returncode": 1, "exception_info": ""}
        except APIError as exc:
            return {"output": f"Error response from daemon: {_api_error_text(exc)}\n", "returncode": 1,
                    "exception_info": ""}
        except Exception as exc:
            if _is_connection_failure(exc):
                raise _engine_unavailable(exc) from exc
            raise

    def _exit_code(self, exec_id: str) -> int:
        """The exec's exit status once the daemon recorded it (the CLI's ``getExecExitStatus``)."""
        try:
            return self.box.exit_code(exec_id, wait=EXIT_POLL_SECONDS)
        except APIError as exc:
            log.warning("exec_inspect %s failed: %s", exec_id[:12], exc)
            return 1
        except Exception as exc:
            if _is_connection_failure(exc):
                raise _engine_unavailable(exc) from exc
            raise

    def _kill_after_timeout(self, stream: ExecReader) -> None:
        """The official teardown: SIGKILL every process but pid 1 from inside; the host kills as a fallback."""
        killed = False
        try:
            started = self._start_exec(["bash", "-c", KILL_ALL_BUT_INIT])
            if not isinstance(started, dict):
                _kill_id, kill_stream = started
                try:
                    killed = kill_stream.pump(time.monotonic() + KILL_TIMEOUT, {})
                finally:
                    kill_stream.close()
        except EngineUnavailable:
            raise
        except Exception as exc:
            log.warning("in-container teardown after execute() timeout failed: %s", exc)
        drained = stream.pump(time.monotonic() + (DRAIN_GRACE if killed else 1.0), {})
        if not killed or not drained:
            # The in-container kill could not run (pids exhausted, container wedged) or the stream stays
            # open: stop the container from the host, the watchdog of last resort.
            log.warning("container %s: in-container kill did not end the command; killing the container",
                        self.container_id[:12])
            self._host_kill()

    def stop_processes(self, *, timeout: float = KILL_TIMEOUT) -> int | None:
        """SIGKILL every process of the container but init and its own command (``sleep``): how many, or None
        when that could not be done. What the official pipeline runs next (each step its own exec) needs nothing
        the previous command left running.

        Runs ``bash -c`` (not a login shell: no profile the submission wrote runs) with builtins only (no fork):
        one ``kill -STOP -1`` stops every other process in a single kernel pass (a fork in flight is restarted,
        so no chain can outrun it), then each one is killed, and the container's command continued."""
        ran = self._harness_output(["bash", "-c", STOP_ALL_BUT_INIT], timeout=timeout)
        if isinstance(ran, str):
            log.warning("container %s: could not stop its processes: %s", self.container_id[:12], ran)
            return None
        _exec_id, finished, text = ran
        last = text.splitlines()[-1] if text else ""
        if not finished or not last.isdigit():
            log.warning("container %s: stopping its processes did not finish: %r", self.container_id[:12], text[:200])
            return None
        return int(last)

    def pause(self) -> bool:
        """Freeze every process of the container (the cgroup freezer); False when the engine refused."""
        try:
            self._api.pause(self.container_id)
        except APIError as exc:
            log.warning("container %s: pause failed: %s", self.container_id[:12], _api_error_text(exc))
            return False
        self.paused = True
        return True

    def unpause(self) -> None:
        try:
            self._api.unpause(self.container_id)
        except APIError as exc:
            log.warning("container %s: unpause failed: %s", self.container_id[:12], _api_error_text(exc))
        self.paused = False

    def _host_kill(self) -> None:
        with contextlib.suppress(APIError):
            self.box.kill()

    # ----------------------------------------------------------------------------------------- files in

    def copy_in(self, local_path: Path, container_path: str) -> None:
        """A file like ``docker cp`` (owned by root, mode kept); a directory streamed into the container's tar."""
        if local_path.is_dir():
            with _dir_tar(local_path) as archive:
                self._stream_tar_in(container_path, archive, compressed=False)
            return
        if container_path.endswith("/"):
            directory, name = container_path.rstrip("/") or "/", local_path.name
        else:
            directory, name = os.path.dirname(container_path) or "/", os.path.basename(container_path)
        st = local_path.stat()
        ahead = self.preloaded_files.pop(os.path.join(directory, name), None)
        if ahead is not None and ahead == (local_path.read_bytes(), st.st_mode & 0o7777):
            return  # the very file was copied in ahead (:meth:`SdkEvaluator._warm`)
        if any(m.provides(os.path.join(directory, name), local_path.read_bytes()) for m in self.mounts):
            return  # a grader volume of this container stands for it (harness_material.timeout_retry_mount)
        with local_path.open("rb") as f:
            one_file = TarIn().file(name, f, st.st_mode & 0o7777, size=st.st_size, mtime=int(st.st_mtime))
        try:
            ok = self.box.put(one_file, directory)
        except APIError as exc:
            raise RuntimeError(f"docker cp failed: {_api_error_text(exc)}") from exc
        except Exception as exc:
            if _is_connection_failure(exc):
                raise _engine_unavailable(exc) from exc
            raise
        if not ok:
            raise RuntimeError(f"docker cp failed: put_archive into {directory} refused")
        if harness_material.is_grader_path(os.path.join(directory, name)):
            # The grader's own file (the official's timeout-retry plugin) is checked where it landed.
            try:
                harness_material.verify_file(self, os.path.join(directory, name), local_path.read_bytes(),
                                             st.st_mode & 0o7777)
            except harness_material.MaterialRefused as exc:
                raise RuntimeError(f"docker cp failed: {exc}") from exc

    def copy_in_tar(self, tar_path: Path, container_path: str) -> None:
        """Stream an on-disk tar(.gz) into ``tar -x`` inside the container (no host-side extraction); the copy
        made ahead (:meth:`SdkEvaluator._warm`) of this very archive to this very place is not made twice."""
        if self.preloaded == (tar_path, container_path):
            self.preloaded = None
            return
        is_gz = tar_path.name.endswith((".tar.gz", ".tgz")) or tar_path.suffix == ".gz"
        with tar_path.open("rb") as f:
            self._stream_tar_in(container_path, f, compressed=is_gz)

    def _stream_tar_in(self, container_path: str, source: IO[bytes], *, compressed: bool) -> None:
        """``mkdir -p DEST`` then ``tar -C DEST -x[z]f -`` fed from ``source``, as the official does.

        The official runs the two as separate ``docker exec``s; here one ``bash -c`` runs both (same binaries,
        same user, same order) to save a round trip. The container's tar unpacks the stream itself, so the
        daemon's symlink validation (``put_archive``) never sees it and escaping symlinks survive.
        """
        tar_flags = "-xzf" if compressed else "-xf"
        script = ('mkdir -p -- "$1" || { echo "mkdir -p $1 in container failed" >&2; exit 97; }; '
                  f'exec tar -C "$1" {tar_flags} -')
        started = self._start_exec(["bash", "-c", script, "pb-copy", container_path], stdin=True)
        if isinstance(started, dict):
            raise RuntimeError(f"tar stream into container failed: {started['output'].strip()}")
        exec_id, stream = started
        out = OutputCap(self.output_cap)
        err = OutputCap(self.output_cap)
        deadline = time.monotonic() + DOCKER_CP_TIMEOUT
        # Output is read while the input is sent (as subprocess.run's communicate does): a tar that warns once
        # per member (an archive made on macOS) would otherwise block on its full stderr and stop reading stdin.
        box: list[bool] = []
        failures: list[BaseException] = []

        def read() -> None:
            try:
                box.append(stream.pump(deadline, {1: out.write, 2: err.write}))
            except BaseException as exc:  # re-raised in the caller's thread
                failures.append(exc)

        reader = threading.Thread(target=read, name="pb-tar-output", daemon=True)
        reader.start()
        try:
            send_error = stream.send_file(source, deadline)
            reader.join(max(0.0, deadline - time.monotonic()) + DRAIN_GRACE)
        finally:
            if reader.is_alive():
                stream.close()  # unblocks the reader
                reader.join(DRAIN_GRACE)
            stream.close()
        if failures:
            raise failures[0]
        finished = bool(box and box[0])
        if not finished:
            self._host_kill()
            raise RuntimeError(f"tar stream into container timed out after {DOCKER_CP_TIMEOUT}s")
        code = self._exit_code(exec_id)
        _strict_output(out, err)  # the official decodes tar's output (text=True) whatever its exit status
        if code != 0:
            detail = err.text("stderr").strip()
            if code == 97:
                raise RuntimeError(detail)
            raise RuntimeError(f"tar stream into container failed: {detail or send_error or f'exit {code}'}")

    def apply_tree(self, archive: Path) -> None:
        """Unpack a tar made by :meth:`export_tree` at ``/`` through the engine's archive API (modes and mtimes
        kept): no tool of the container runs. RuntimeError when the engine refuses it."""
        try:
            with archive.open("rb") as f:
                ok = self._api.put_archive(self.container_id, "/", f)
        except APIError as exc:
            raise RuntimeError(f"put_archive at / failed: {_api_error_text(exc)}") from exc
        except Exception as exc:
            if _is_connection_failure(exc):
                raise _engine_unavailable(exc) from exc
            raise
        if not ok:
            raise RuntimeError("put_archive at / refused")

    def export_tree(self, paths: list[str], dest: IO[bytes], *, max_bytes: int, timeout: float = 120) -> str | None:
        """``paths`` (absolute, parents first; directories without their contents) as a tar written to ``dest`` by
        the container's own ``tar``; an error text, or None."""
        if not paths:
            with tarfile.open(fileobj=dest, mode="w"):
                return None
        started = self._start_exec(["tar", "-C", "/", "--no-recursion", "-cf", "-", "--",
                                    *(p.lstrip("/") for p in paths)])
        if isinstance(started, dict):
            return str(started["output"]).strip()
        exec_id, stream = started
        written = [0]
        err = OutputCap(4096)

        def sink(data: bytes) -> None:
            written[0] += len(data)
            if written[0] <= max_bytes:
                dest.write(data)

        try:
            finished = stream.pump(time.monotonic() + timeout, {1: sink, 2: err.write})
        finally:
            stream.close()
        if not finished:
            return f"tar did not finish within {timeout:.0f} s"
        if written[0] > max_bytes:
            return f"more than {max_bytes} bytes"
        code = self._exit_code(exec_id)
        return None if code == 0 else f"tar exited {code}: {decode_for_display(bytes(err.head)).strip()[:500]}"

    def _harness_output(self, argv: list[str], *, timeout: float,
                        limit: int = HARNESS_OUTPUT_LIMIT) -> tuple[str, bool, str] | str:
        """Run a harness command (argv as given: no login profile) and read its output (the first ``limit`` bytes,
        stdout and stderr together) until it ends or ``timeout``: (exec id, whether it ended, the output), or the
        engine's text when it could not start."""
        started = self._start_exec(argv)
        if isinstance(started, dict):
            return str(started["output"]).strip()
        exec_id, stream = started
        out = OutputCap(limit)
        try:
            finished = stream.pump(time.monotonic() + timeout, {1: out.write, 2: out.write})
        finally:
            stream.close()
        return exec_id, finished, decode_for_display(bytes(out.head)).strip()

    def harness_run(self, argv: list[str], *, timeout: float,
                    limit: int = HARNESS_OUTPUT_LIMIT) -> tuple[int | None, str]:
        """A harness command (no shell, no profile): its exit status (None when it could not start or did not end
        within ``timeout``) and its output (the first ``limit`` bytes)."""
        ran = self._harness_output(argv, timeout=timeout, limit=limit)
        if isinstance(ran, str):
            return None, ran
        exec_id, finished, text = ran
        return (self._exit_code(exec_id) if finished else None), text

    def _harness_exec(self, argv: list[str], *, timeout: float) -> str | None:
        """A harness command (no shell, no profile); its error text, or None when it exited 0."""
        ran = self._harness_output(argv, timeout=timeout)
        if isinstance(ran, str):
            return ran
        exec_id, finished, text = ran
        if not finished:
            return f"did not finish within {timeout:.0f} s"
        code = self._exit_code(exec_id)
        return None if code == 0 else f"exit {code}: {text[:500]}"

    def put_files(self, directory: str, files: Mapping[str, bytes], *, mode: int = 0o644,
                  subdir: str = "") -> None:
        """Harness files (not submission data) into an existing directory (optionally a new subdir), root-owned."""
        archive = TarIn()
        if subdir:
            archive.directory(subdir, 0o755)
        for base, data in files.items():
            archive.file(f"{subdir}/{base}" if subdir else base, data, mode)
        try:
            self.box.put(archive, directory)
        except APIError as exc:
            raise RuntimeError(f"put_archive into {directory} failed: {_api_error_text(exc)}") from exc

    # ----------------------------------------------------------------------------------------- files out

    def read_member(self, container_path: str, *, timeout: int = 60,
                    max_bytes: int | None = None) -> tuple[int, Member | str]:
        """What ``docker cp`` of ``container_path`` would bring out: ``(0, Member)`` (its bytes only for a regular
        file within ``max_bytes``), or ``(returncode, message)`` like ``docker cp`` failing. Streamed, never whole:
        at most ``max_bytes`` plus the archive's headers are read, however big the file claims to be."""
        try:
            member = self.box.first_member(container_path, timeout=timeout, max_bytes=max_bytes)
        except NotFound:
            return 1, f"Error: No such container:path: {self.container_id}:{container_path}"
        except APIError as exc:
            return 1, f"Error response from daemon: {_api_error_text(exc)}"
        except TooLarge as exc:
            return 1, f"{container_path}: the engine sent more than {max_bytes} bytes ({exc} read)"
        except (tarfile.TarError, EOFError) as exc:
            return 1, f"{container_path}: unreadable archive from the engine: {exc}"
        except Exception as exc:
            if _is_connection_failure(exc):
                raise _engine_unavailable(exc) from exc
            raise
        if isinstance(member, str):
            return -1, f"docker cp {member}"
        if member is None:
            return 1, f"{container_path}: empty archive from the engine"
        return 0, member

    def path_kind(self, container_path: str, *, timeout: int = 60) -> str | None:
        """What is at ``container_path`` as the engine's archive API sees it (``archive_out``'s kinds; None: nothing),
        no tool of the container run. Raises ``RuntimeError`` when the engine cannot say."""
        try:
            member = self.box.first_member(container_path, timeout=timeout, max_bytes=0)
        except NotFound:
            return None
        except APIError as exc:
            raise RuntimeError(f"{container_path}: {_api_error_text(exc)}") from exc
        except (tarfile.TarError, EOFError, TooLarge) as exc:
            raise RuntimeError(f"{container_path}: unreadable archive from the engine: {exc}") from exc
        except Exception as exc:
            if _is_connection_failure(exc):
                raise _engine_unavailable(exc) from exc
            raise
        if not isinstance(member, Member):
            raise RuntimeError(f"{container_path}: {member or 'empty archive from the engine'}")
        return member.kind

    def read_file(self, container_path: str, *, timeout: int = 60,
                  max_bytes: int | None = None) -> tuple[int, bytes | str]:
        """``(0, bytes)`` of a regular file (of at most ``max_bytes``), or ``(returncode, message)``."""
        rc, found = self.read_member(container_path, timeout=timeout, max_bytes=max_bytes)
        if isinstance(found, str):
            return rc, found
        return _regular_bytes(found, container_path, max_bytes)

    def diff(self, *, prune: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """``docker diff``: the container's changes against its image, ``{"Path", "Kind"[, "Stamp"]}``."""
        return self.bounded_diff(prune=prune).changes

    def bounded_diff(self, *, prune: tuple[str, ...] = (), watch: tuple[str, ...] = (),
                     max_depth: int = DIFF_MAX_DEPTH, max_entries: int = DIFF_MAX_ENTRIES) -> Diff:
        """``docker diff``, bounded: the container's changes and where the walk stopped.

        The engine computes it by comparing the whole image with the container (~0.5 s for a 500 MB image on
        overlay2 with naive diff). When the overlay2 upper directory is readable from here (a local engine, as
        root) it is walked instead: same paths and kinds in milliseconds, plus a stamp per entry (mtime, size,
        mode) so a file changed twice is seen changing. The walk is iterative (a tree 10,000 levels deep is data,
        not a ``RecursionError``), descends at most ``max_depth`` levels and lists at most ``max_entries``
        entries; directories under ``prune`` are listed but not descended into, except those on the way to or
        below a name prefix in ``watch`` (the grader's own paths in /tmp). Each bound reached and each
        directory that could not be read is named in ``bounded``. Otherwise the engine's answer is used (cut at
        ``max_entries``).
        """
        walked = self._walk_upper(prune, watch, max_depth, max_entries)
        if walked is None:
            changes = list(self._api.diff(self.container_id) or [])
            walked = Diff(changes[:max_entries], [f"the engine listed {len(changes)} changes, more than "
                                                  f"{max_entries}"] if len(changes) > max_entries else [])
        # A mount point of the grader's volumes (and the directories the engine made for it) is the engine's.
        targets = {m.target for m in self.mounts}
        if targets:
            walked.changes = [c for c in walked.changes if not _mount_point(c, targets)]
        return walked

    def _walk_upper(self, prune: tuple[str, ...], watch: tuple[str, ...], max_depth: int,
                    max_entries: int) -> Diff | None:
        try:
            driver = self._api.inspect_container(self.container_id).get("GraphDriver") or {}
        except Exception:
            return None
        data = driver.get("Data") or {}
        if driver.get("Name") != "overlay2" or not data.get("UpperDir"):
            return None
        upper = str(data["UpperDir"])
        lowers = [d for d in str(data.get("LowerDir") or "").split(":") if d]
        if not os.path.isdir(upper) or not os.access(upper, os.R_OK | os.X_OK):
            return None
        return UpperWalk(upper, lowers, prune, max_depth, max_entries, watch).run()

    # ----------------------------------------------------------------------------------------- lifecycle

    def commit(self, image_ref: str) -> str:
        """Commit to ``image_ref``, labelled like every image the plugin makes; returns the reference.

        ``before_commit`` (set by the evaluator for the compile container) runs first, once; it may leave the
        container paused, so that what it saw is exactly what is committed. The container is unpaused after."""
        hook, self.before_commit = self.before_commit, None
        try:
            if hook is not None:
                hook(self)
            return self._commit(image_ref)
        finally:
            if self.paused:
                self.unpause()

    def _commit(self, image_ref: str) -> str:
        self._commit_image(image_ref)
        self.committed = image_ref
        register_committed_image(image_ref, self._engine, self.before_image_removal)
        return image_ref

    def _commit_image(self, image_ref: str) -> None:
        repository, _, tag = image_ref.rpartition(":")
        if not repository or "/" in tag:
            repository, tag = image_ref, "latest"
        try:
            self._api.commit(self.container_id, repository=repository, tag=tag,
                             conf={"Labels": dict(self.labels)})
        except APIError as exc:
            raise RuntimeError(f"docker commit failed: {_api_error_text(exc)}") from exc
        except requests.exceptions.Timeout as exc:
            # The official's `docker commit` runs under DOCKER_RUN_TIMEOUT: the same exception, so the same 0.
            raise subprocess.TimeoutExpired(["docker", "commit", self.container_id, image_ref],
                                            DOCKER_RUN_TIMEOUT) from exc
        except Exception as exc:
            if _is_connection_failure(exc):
                raise _engine_unavailable(exc) from exc
            raise

    def cleanup(self) -> None:
        """Remove the container (force: no ``docker stop`` grace period is needed for ``sleep``).

        With a reaper the removal is queued and this returns at once; the evaluator drains the reaper before it
        returns, so every container is gone by then all the same.
        """
        if self._removed or not self.container_id:
            return
        if self.reaper is not None:
            self._removed = True
            self.reaper.submit(self._remove_now)
            return
        self._remove_now()

    def _remove_now(self) -> None:
        try:
            self._removed = self._remove_box()
        except Exception as exc:
            log.warning("removing container %s failed (the sweep will retry): %s", self.container_id[:12], exc)

    def _remove_box(self) -> bool:
        """``docker rm -f``; a paused one thawed first under gVisor (``Container.thaw_under_gvisor``): its processes
        run for that moment, its image already committed."""
        return self.box.remove(paused=self.paused)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            if not self._removed and self.container_id:
                self._remove_now()


def _mount_point(change: Mapping[str, Any], targets: set[str]) -> bool:
    path = str(change.get("Path", ""))
    return path in targets or (change.get("Stamp") is None and change.get("Kind") != 2
                               and any(t.startswith(path.rstrip("/") + "/") for t in targets))


def _regular_bytes(member: Member, container_path: str, max_bytes: int | None) -> tuple[int, bytes | str]:
    if member.kind in (SYMLINK, HARDLINK):
        # docker cp would copy the link itself and the official then reads whatever the link names on
        # the host; we never follow a link out of the container.
        return 1, f"{container_path}: is a {member.kind} (to {member.linkname!r}); not followed"
    if member.kind != REGULAR:
        return 1, f"cannot copy {container_path}: not a regular file ({member.kind})"
    if member.data is None:
        return 1, (f"{container_path}: {member.size} bytes, more than the {max_bytes} this harness reads "
                   f"(a deliberate difference from the official evaluator, which reads any size)")
    return 0, member.data


@contextlib.contextmanager
def _dir_tar(directory: Path) -> Iterator[IO[bytes]]:
    """A tar of a host directory on disk (symlinks kept), for ``copy_in`` of directories."""
    with tempfile.TemporaryFile() as spool:
        with tarfile.open(fileobj=spool, mode="w") as tar:
            tar.add(str(directory), arcname=".")
        spool.seek(0)
        yield spool


# --------------------------------------------------------------------------------------------- image removal

_committed: dict[str, tuple[docker.DockerClient, Callable[[], None] | None]] = {}
_committed_lock = threading.Lock()
_original_remove_image: list[Callable[..., None]] = []  # the official function, once replaced


def register_committed_image(image_ref: str, engine: docker.DockerClient,
                             before_remove: Callable[[], None] | None = None) -> None:
    """Remember an image this layer committed; ``before_remove`` runs first (its containers must be gone)."""
    with _committed_lock:
        _committed[image_ref] = (engine, before_remove)


def remove_committed_image(image_ref: str) -> bool:
    """Remove an image this layer committed (True), or leave it to the caller (False)."""
    with _committed_lock:
        entry = _committed.pop(image_ref, None)
    if entry is None:
        return False
    engine, before_remove = entry
    try:
        if before_remove is not None:
            before_remove()  # containers made from the image go first (or the engine refuses), then the audit's
    finally:  # the image goes even when that raised (the engine going away during the audit)
        try:
            engine.api.remove_image(image_ref, force=True)
        except NotFound:
            pass
        except APIError as exc:
            log.warning("removing image %s failed (the sweep will retry): %s", image_ref, exc)
        except Exception as exc:
            log.warning("removing image %s failed (the sweep will retry): %s", image_ref, exc)
    return True


def _dispatching_remove_image(image_ref: str, *, executable: str = "docker") -> None:
    """Stands in for ``programbench.eval.eval.remove_image``: ours through the SDK, all others unchanged."""
    if remove_committed_image(image_ref):
        return
    _original_remove_image[0](image_ref, executable=executable)


def install_remove_image_dispatch() -> None:
    """Idempotent; safe while the official Evaluator runs elsewhere in the process (it keeps its behaviour)."""
    with _committed_lock:
        current = getattr(official_eval, "remove_image")  # noqa: B009 - not re-exported for mypy
        if current is _dispatching_remove_image:
            return
        _original_remove_image[:] = [current]
        setattr(official_eval, "remove_image", _dispatching_remove_image)  # noqa: B010


# --------------------------------------------------------------------------------------------- the evaluator

# The official hard-codes these two windows in `_run_step(..., timeout=...)`; we map them by step name.
COMPILE_STEP = "compile"
RUN_TESTS_STEP = "run_tests"
RESTORE_STEP = "restore_executable"
TIMEOUT_RETRY_STEP = "install_pytest_timeout_retry"
SEED_GIT_COMMAND = (
    "if [ ! -d .git ]; then "
    "GIT_AUTHOR_DATE='2000-01-01T00:00:00Z' "
    "GIT_COMMITTER_DATE='2000-01-01T00:00:00Z' "
    "git -c init.defaultBranch=gold init -q && "
    "git -c user.email=gold@local -c user.name=gold "
    "-c commit.gpgsign=false add -A && "
    "GIT_AUTHOR_DATE='2000-01-01T00:00:00Z' "
    "GIT_COMMITTER_DATE='2000-01-01T00:00:00Z' "
    "git -c user.email=gold@local -c user.name=gold "
    "-c commit.gpgsign=false commit -q --allow-empty -m gold; "
    "fi"
)
INSTALL_RERUNS_STEP = "install_rerunfailures"
# The steps whose output the official parses (output.split()[0], the executable's hash): never capped.
HASH_COMMAND = f"sha256sum {Evaluator._stashed_executable}"
VERIFY_HASH_COMMAND = "sha256sum ./executable"
PARSED_COMMANDS = frozenset({HASH_COMMAND, VERIFY_HASH_COMMAND})

# Every clock of the official pipeline (eval.py, container.py, internet_control.py of 1.2.5), in seconds: what one
# step may take at most. tests/test_results_reading.py reads the official source and checks that none is missing.
# compile and run_tests are ours (--pb-compile-timeout, --pb-test-timeout); the docker CLI's own clocks
# (DOCKER_RUN_TIMEOUT, DOCKER_CP_TIMEOUT) stand for the SDK calls doing the same work.
COMPILE_PHASE_CLOCKS: dict[str, int] = {
    "docker run": DOCKER_RUN_TIMEOUT, "wipe_workspace": 300, "copy_in_tar": DOCKER_CP_TIMEOUT,
    "remove_hashed_files": 20, "clear_stale_executable": 20, "seed_git": 20, "block_build_internet_dns": 20,
    "restore_build_internet_dns": 20, "copy_executable": 300, "hash_executable": 300, INSTALL_RERUNS_STEP: 120,
    "docker commit": DOCKER_RUN_TIMEOUT, "remove_image": 60,
}
BRANCH_CLOCKS: dict[str, int] = {
    "docker run": DOCKER_RUN_TIMEOUT, "copy_in_tar": DOCKER_CP_TIMEOUT, "restore_executable": 300,
    "verify_executable_hash": 300, "clean_stale_results": 120, "patch_timeout_method": 10,
    "install_pytest_timeout_retry": 10, "copy_in": DOCKER_CP_TIMEOUT, "results_read": 60,
}
# The harness's own work around the steps (reference hash, compile diffs, stopping processes, --pb-strict's removal,
# the wheel directory), and after any step that timed out: the teardown, the stream's drain, the exit status poll.
HARNESS_CLOCKS = 120 + 120 + 60 + 2 * KILL_TIMEOUT
STEP_OVERHEAD = KILL_TIMEOUT + int(DRAIN_GRACE) + int(EXIT_POLL_SECONDS) + 15
# The audit of the hidden tests (evaluation/audit.py) adds to each of its branch attempts: the plugin placed
# (harness_material: processes stopped, mkdir, put, verify at 60 s each) and its report read.
AUDIT_REPORT_TIMEOUT = 60
AUDIT_CLOCKS = KILL_TIMEOUT + 60 + DOCKER_CP_TIMEOUT + 60 + AUDIT_REPORT_TIMEOUT
AUDIT_RUNS = 2  # the audit's run of every branch, and the second run of those whose tests failed


def evaluation_budget(*, compile_timeout: int, test_timeout: int, branches: int, branch_workers: int,
                      branch_retries: int, audit: bool = False) -> int:
    """The longest one evaluation can take when every step runs to its own clock: the compile phase, then each
    branch with every attempt the official allows (``branch_retries`` more after a failed or crashed one), the
    branches ``branch_workers`` at a time; with ``audit``, the audit's runs of the branches the same way."""
    compile_phase = (sum(COMPILE_PHASE_CLOCKS.values()) + compile_timeout
                     + (len(COMPILE_PHASE_CLOCKS) + 1) * STEP_OVERHEAD + HARNESS_CLOCKS)
    attempt = sum(BRANCH_CLOCKS.values()) + test_timeout + (len(BRANCH_CLOCKS) + 1) * STEP_OVERHEAD
    rounds = -(-max(1, branches) // max(1, branch_workers)) * (1 + max(0, branch_retries))
    audit_part = AUDIT_RUNS * rounds * (attempt + AUDIT_CLOCKS) if audit else 0
    return compile_phase + rounds * attempt + audit_part


@dataclass
class StepHooks:
    """Harness callbacks around named official steps; none of them may change what the step does."""

    before_step: Callable[[str, SdkContainerEnvironment], None] | None = None
    after_step: Callable[[str, SdkContainerEnvironment, dict[str, Any]], None] | None = None
    step_env: Callable[[str, SdkContainerEnvironment], dict[str, str] | None] | None = None
    before_commit: Callable[[SdkContainerEnvironment], None] | None = None  # the compile container's commit
    # One official branch finished, its result merged: the branch and the committed image (the audit starts its
    # run of that branch beside the next ones when it is sure to audit it; evaluation/audit.py). Never raises.
    after_branch: Callable[[str, str], None] | None = None
    # The branches ended, before the committed image is removed: its reference and whether every branch ran (none
    # raised); the audit concludes, or stops what it started.
    after_branches: Callable[[str, bool], None] | None = None


@dataclass
class LayerConfig:
    """What the SDK layer needs beyond the official constructor arguments."""

    engine: docker.DockerClient
    image: str  # the resolved image (id or reference) standing for f"{image_name}:{image_tag}"
    labels: Mapping[str, str] = field(default_factory=dict)
    memory: int | None = None
    compile_timeout: int = 900
    test_timeout: int = 3600
    output_cap: int = DEFAULT_OUTPUT_CAP
    hooks: StepHooks = field(default_factory=StepHooks)
    prefetch: bool = True  # make the next branch's container ready while the branch before it runs
    batch_steps: bool = True  # a branch's small steps before its tests in one exec (evaluation/step_batch.py)
    # "default" = the official network behaviour (the engine's default network; DNS blackholed around
    # compile.sh by the official internet_control); "none" under --pb-strict.
    network_mode: str = "default"
    results_max_bytes: int = RESULTS_MAX_BYTES
    storage: int = 0  # bytes each container's writable layer may hold, where the engine can limit it (0: no limit)
    quick_acks: bool = True  # QUICK_ACK_SYSCTL in every container (PYTEST_PROGRAMBENCH_QUICK_ACKS=0: the kernel's)
    # The grader's read-only volumes (harness_material.grader_mount) every branch container gets when it is created:
    # the audit's plugin directory, for one.
    branch_mounts: tuple[harness_material.GraderMount, ...] = ()


def prefetch_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return PREFETCH.enabled(environ)


@dataclass(frozen=True)
class _Warming:
    """A branch's container being made ready ahead of its turn (:meth:`SdkEvaluator._warm`)."""

    image: str
    branch: str
    future: Future[SdkContainerEnvironment]


class SdkEvaluator(Evaluator):
    """The official ``Evaluator`` with its container layer replaced; every scoring decision stays upstream."""

    # The word of a branch run's progress line, which results.progress reads as the task's phase ("branch 2/3").
    branch_phase_word = "branch"

    def __init__(self, *, layer: LayerConfig, **official_kwargs: Any) -> None:
        super().__init__(**official_kwargs)
        install_remove_image_dispatch()
        self.layer = layer
        self.envs: list[SdkContainerEnvironment] = []
        self.compile_env_started = False
        self.timed_out: list[str] = []  # "compile" or "test:<branch>", one per timed-out window
        self.crash_log: list[dict[str, Any]] = []  # a branch step's entry that raised (its log dies with it)
        # Per branch attempt: (branch, the JUnit text read, its run_tests log entry), for the cross-check.
        self.attempts: list[tuple[str, str, dict[str, Any] | None]] = []
        self.results_notes: list[str] = []  # why a results file scored what it did (a device, a FIFO)
        # When compile.sh, each branch's tests and the audit started and how long they took (report.html's timeline).
        self.clock: list[dict[str, Any]] = []
        self.reaper = Reaper()
        self._envs_lock = threading.Lock()
        self._current = threading.local()
        self._prefetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pb-prefetch")
        self._warming: list[_Warming] = []  # at most one: the next branch's container, made ready ahead
        self._claimed: set[str] = set()  # branches whose first container was handed out
        self.branches_done = 0  # branches whose _evaluate_branch returned
        # The timeout-retry plugin's read-only volume for the branches (decided at the commit; None: the official's
        # copy is made in each branch container).
        self.timeout_retry_mount: harness_material.GraderMount | None = None

    @staticmethod
    def _official_env(serial_pytest: bool) -> dict[str, str]:
        # The official `_new_env`: --max-worker-restart=4 always; one xdist worker on the serial retry.
        addopts = "--max-worker-restart=4"
        env = {"PYTEST_ADDOPTS": addopts}
        if serial_pytest:
            env["PYTEST_XDIST_AUTO_NUM_WORKERS"] = "1"
        return env

    def _make_env(self, image: str, *, serial_pytest: bool, compile_phase: bool,
                  lifetime: int | None = None,
                  mounts: Sequence[harness_material.GraderMount] | None = None) -> SdkContainerEnvironment:
        window = self.layer.compile_timeout if compile_phase else self.layer.test_timeout
        if mounts is None:
            mounts = () if compile_phase else self.branch_mounts()
        container = SdkContainerEnvironment(
            image=image,
            cwd=WORKSPACE_DIR,
            executable=DOCKER_EXECUTABLE,
            timeout=600,
            cpus=self.docker_cpus,
            env=self._official_env(serial_pytest),
            run_args=["--init"],
            engine=self.layer.engine,
            labels=self.layer.labels,
            memory=self.layer.memory,
            lifetime=lifetime or window + LIFETIME_MARGIN,
            output_cap=self.layer.output_cap,
            reaper=self.reaper,
            network_mode=self.layer.network_mode,
            storage=self.layer.storage,
            mounts=mounts,
            quick_acks=self.layer.quick_acks,
        )
        with self._envs_lock:
            self.envs.append(container)
        if compile_phase:
            container.before_image_removal = lambda: self._before_image_removal(container)
            container.before_commit = self._before_commit
        return container

    def branch_mounts(self) -> tuple[harness_material.GraderMount, ...]:
        """The grader's read-only volumes of each branch container: the layer's, and the timeout-retry plugin's."""
        plugin = self.timeout_retry_mount
        return (*self.layer.branch_mounts, *((plugin,) if plugin is not None else ()))

    def _before_commit(self, env: SdkContainerEnvironment) -> None:
        """The probe's look before the commit, then how the branches get the timeout-retry plugin (what it saw is what
        is committed: the hook leaves the container paused, and only the harness's steps ran in it since compile.sh's
        container was renewed)."""
        hook = self.layer.hooks.before_commit
        if hook is not None:
            hook(env)
        self.timeout_retry_mount = self._timeout_retry_volume(env)

    def _timeout_retry_volume(self, env: SdkContainerEnvironment) -> harness_material.GraderMount | None:
        """The official's timeout-retry plugin as a read-only volume for every branch container of the image ``env`` is
        committed to, when the official will copy it in (reruns on) and that image has ``/tmp`` as a directory with
        nothing at the plugin directory: the official's copy lands in a directory of its own there, and the volume
        gives the same. Otherwise (what the submission left there stays in the official's directory, the scan flags
        it) None: the official's copy is made, through the engine's archive API."""
        if not self._has_rerunfailures:
            return None
        try:
            fresh = env.path_kind("/tmp") == DIRECTORY and env.path_kind(PYTEST_TIMEOUT_RETRY_PLUGIN_DIR) is None
            if not fresh:
                return None
            return harness_material.timeout_retry_mount(self.layer.engine, labels=self.layer.labels,
                                                        image=self.layer.image)
        except (RuntimeError, harness_material.MaterialRefused) as exc:
            log.warning("the timeout-retry plugin goes in by the official's copy: %s", exc)
            return None

    # The official signature and env/addopts logic (eval.py `_new_env`), returning our environment.
    def _new_env(self, image: str, *, serial_pytest: bool = False) -> SdkContainerEnvironment:  # type: ignore[override]
        if image == f"{self.image_name}:{self.image_tag}":
            container = self._make_env(self.layer.image, serial_pytest=serial_pytest, compile_phase=True)
            self.compile_env_started = True  # from here on, failures happen where the submission is in control
            return container
        branch = getattr(self._current, "branch", None)
        if serial_pytest or not self.layer.prefetch or branch is None:
            return self._make_env(image, serial_pytest=serial_pytest, compile_phase=False)
        with self._envs_lock:
            ready = next((w for w in self._warming if w.image == image and w.branch == branch), None)
            if ready is not None:
                self._warming.remove(ready)
            self._claimed.add(branch)
            self._warm_next(image)
        if ready is not None:
            try:
                return ready.future.result()
            except EngineUnavailable:
                raise
            except Exception as exc:  # made again the official way, where the same failure shows as the official's
                log.debug("branch %s: its container made ahead failed (%s); making one now", branch, exc)
        return self._make_env(image, serial_pytest=False, compile_phase=False)

    def _warm_next(self, image: str) -> None:
        """Start making the next unclaimed branch's container ready (under ``_envs_lock``)."""
        if self._warming:
            return  # one ahead at a time
        following = next((b for b in self.tests_branches if b not in self._claimed), None)
        if following is not None:
            self._warming.append(_Warming(image, following, self._prefetch_pool.submit(self._warm, image, following)))

    def _warm(self, image: str, branch: str) -> SdkContainerEnvironment:
        """``branch``'s fresh container, started, its test archive copied in and the steps before its tests run
        (their results kept for when the official asks), while the branch before it runs: what its
        ``_run_test_branch`` does first, in the same order, on a container nobody else touches.

        Started ahead, it may wait for the branch before it: for that branch's window, the margin and its retries
        at most. Its lifetime adds that wait, so it still holds its own whole window when its tests start."""
        window = self.layer.test_timeout + LIFETIME_MARGIN
        container = self._make_env(image, serial_pytest=False, compile_phase=False,
                                   lifetime=(2 + self.branch_retries) * window)
        try:
            assert self.blob_dir is not None
            destination = f"{WORKSPACE_DIR}/"
            archive = self.blob_dir / "tests" / f"{branch}.tar.gz"
            container.copy_in_tar(archive, destination)
            container.preloaded = (archive, destination)
            steps = self._batch_from(RESTORE_STEP) if self.layer.batch_steps else None
            if steps:
                container.run_steps(steps)
                last = container.batched[-1] if len(container.batched) == len(steps) else None
                if (last is not None and last.step.name == TIMEOUT_RETRY_STEP and last.returncode == 0
                        and not last.problem):
                    self._copy_timeout_retry_plugin(container)
        except BaseException:
            container.cleanup()
            raise
        return container

    @staticmethod
    def _copy_timeout_retry_plugin(container: SdkContainerEnvironment) -> None:
        """What the official's ``_run_test_branch`` copies in once ``install_pytest_timeout_retry`` succeeded, as it
        makes it (a temporary ``.py`` file of the plugin's source: its mode, its bytes), remembered so the official's
        own copy of the same file is not made twice."""
        with tempfile.NamedTemporaryFile(mode="w", suffix=".py") as plugin:
            plugin.write(PYTEST_TIMEOUT_RETRY_PLUGIN_SOURCE)
            plugin.flush()
            local = Path(plugin.name)
            container.copy_in(local, PYTEST_TIMEOUT_RETRY_PLUGIN_PATH)
            container.preloaded_files[PYTEST_TIMEOUT_RETRY_PLUGIN_PATH] = (local.read_bytes(),
                                                                           local.stat().st_mode & 0o7777)

    def _retire(self) -> None:
        """Before the committed image goes: no prefetch in flight, every container removed."""
        self._prefetch_pool.shutdown(wait=True)
        self.cleanup_all()
        self.reaper.drain()

    def _before_image_removal(self, compile_env: SdkContainerEnvironment) -> None:
        """The official removes the committed image in its ``finally``: its containers go first, then, when every
        branch ran, ``after_branches`` sees the image."""
        self._retire()
        hook = self.layer.hooks.after_branches
        if hook is None or not compile_env.committed:
            return
        if self.branches_done == len(self.tests_branches):
            with self._clocked({"phase": "audit"}):
                hook(compile_env.committed, True)
        else:
            hook(compile_env.committed, False)

    @contextlib.contextmanager
    def _clocked(self, entry: dict[str, Any]) -> Iterator[None]:
        """``entry`` joins the clock with its start (epoch seconds) and its seconds, however the block ends."""
        at, started = time.time(), time.monotonic()
        try:
            yield
        finally:
            with self._envs_lock:
                self.clock.append({**entry, "at": round(at, 3), "seconds": round(time.monotonic() - started, 3)})

    def _evaluate_branch(self, branch: str, image: str) -> None:
        super()._evaluate_branch(branch, image)
        with self._envs_lock:
            self.branches_done += 1
        if self.layer.hooks.after_branch is not None and image:
            self.layer.hooks.after_branch(branch, image)

    def _position(self, branch: str) -> tuple[int, int]:
        """The branch's place in this run's phases (k of n; 0 for one it does not list)."""
        index = self.tests_branches.index(branch) + 1 if branch in self.tests_branches else 0
        return index, len(self.tests_branches)

    def _run_step(  # type: ignore[override]
        self,
        command: str,
        *,
        env: SdkContainerEnvironment,
        log_buf: list[dict[str, Any]],
        step_name: str,
        accept_failure: bool = False,
        timeout: int = 20,
    ) -> dict[str, Any]:
        timeout = self._step_timeout(step_name, timeout)
        self._prepare_step(step_name, env)
        n_before = len(log_buf)
        t0, at = time.monotonic(), time.time()
        try:
            result: dict[str, Any] = super()._run_step(
                command, env=cast(Any, env), log_buf=log_buf, step_name=step_name, accept_failure=accept_failure,
                timeout=timeout,
            )
        except UndecodableOutput as exc:
            self._log_undecodable(exc, command, step_name, log_buf, seconds=time.monotonic() - t0)
            raise
        finally:
            env.exec_env = None
            self._step_ended(step_name, log_buf[n_before:], at=at, seconds=time.monotonic() - t0)
        if self.layer.hooks.after_step is not None:
            self.layer.hooks.after_step(step_name, env, result)
        return result

    def _step_timeout(self, step_name: str, timeout: int) -> int:
        """The compile and test clocks are ours (the layer's); every other step keeps the official's."""
        if step_name == COMPILE_STEP:
            progress.info("[%s] compile (compile.sh, no network, %d s clock)", self.instance_id,
                          self.layer.compile_timeout)
            return self.layer.compile_timeout
        if step_name == RUN_TESTS_STEP:
            return self.layer.test_timeout
        return timeout

    def _prepare_step(self, step_name: str, env: SdkContainerEnvironment) -> None:
        """The probe's hook before the step, the batch of steps it starts (unless run ahead by ``_warm``, or a
        probe gives one of them its own environment), and the step's environment."""
        hooks = self.layer.hooks
        steps = self._batch_from(step_name) if self.layer.batch_steps else None
        ran_ahead = bool(steps and env.batched and env.batched[0].step == steps[0])  # by _warm
        if hooks.before_step is not None:  # first: the probe's baseline comes before seed_git runs any git
            hooks.before_step(step_name, env)
        if steps and not ran_ahead and (hooks.step_env is None
                                        or all(hooks.step_env(step.name, env) is None for step in steps)):
            env.run_steps(steps)
        if hooks.step_env is not None:
            env.exec_env = hooks.step_env(step_name, env)

    def _log_undecodable(self, exc: UndecodableOutput, command: str, step_name: str, log_buf: list[dict[str, Any]],
                         *, seconds: float) -> None:
        """The official raises here too (and scores 0); the step's output stays in the log, escaped."""
        entry = {"step": step_name, "command": command, "wall_time": seconds,
                 "output": exc.output, "returncode": None, "exception_info": f"UnicodeDecodeError: {exc}"}
        log_buf.append(entry)
        if log_buf is not self.result.log:
            self.crash_log.append(entry)

    def _step_ended(self, step_name: str, logged: list[dict[str, Any]], *, at: float, seconds: float) -> None:
        """The compile phase on the clock; a compile or test clock that ran out (the step's last log entry says)."""
        if step_name == COMPILE_STEP:
            with self._envs_lock:
                self.clock.append({"phase": "compile", "at": round(at, 3), "seconds": round(seconds, 3)})
        if not logged or not str(logged[-1].get("exception_info", "")).startswith("Command timed out"):
            return
        if step_name == COMPILE_STEP:
            self.timed_out.append("compile")
        elif step_name == RUN_TESTS_STEP:
            self.timed_out.append(f"test:{getattr(self._current, 'branch', '?')}")

    def _batch_from(self, step_name: str) -> list[Step] | None:
        """The official steps (eval.py, audited; pinned by tests/test_step_batch.py) that follow each other with
        nothing between them, as it runs them when each succeeds, when ``step_name`` is the first of such a run:
        before compile.sh (after the submission is in and hashed files removed), after it (the executable put
        aside and hashed), and before each branch's tests. The probe's hooks act on none of them."""
        if step_name == "clear_stale_executable":
            return [Step(step_name, "rm -f ./executable", 20), Step("seed_git", SEED_GIT_COMMAND, 20)]
        if step_name == "copy_executable":
            return [Step(step_name, f"mv ./executable {self._stashed_executable}", 300),
                    Step("hash_executable", HASH_COMMAND, 300, uncapped=True)]
        if step_name != RESTORE_STEP:
            return None
        steps = [
            Step(RESTORE_STEP, f"rm -f ./executable && mv {self._stashed_executable} ./executable && chmod +x "
                               "./executable", 300),
            Step("verify_executable_hash", VERIFY_HASH_COMMAND, 300, uncapped=True),
            Step("clean_stale_results", "rm -f eval/results.xml results.xml", 120),
            Step("patch_timeout_method", "test -f eval/run.sh && sed -i "
                 "'s/--timeout-method=thread/--timeout-method=signal/g' eval/run.sh || true", 10, accept_failure=True),
        ]
        if self._has_rerunfailures:
            steps.append(Step(TIMEOUT_RETRY_STEP,
                              f"mkdir -p {shlex.quote(PYTEST_TIMEOUT_RETRY_PLUGIN_DIR)} "
                              f"&& rm -f {shlex.quote(PYTEST_TIMEOUT_RETRY_PLUGIN_PATH)}", 10))
        return steps

    def _run_test_branch(self, branch: str, image: str, log_buf: list[dict[str, Any]], *,
                         serial_pytest: bool = False) -> str:
        """Pass-through that remembers which branch this thread runs (to name a timed-out clock) and what the
        attempt's JUnit file and pytest's own output were (for :mod:`.results_check`)."""
        self._current.branch = branch
        # Live progress (--log-cli-level=INFO), named by task like the pipeline's phases.
        position, of = self._position(branch)
        progress.info("[%s] %s %d/%d: %s%s", self.instance_id, self.branch_phase_word, position, of, branch,
                      " (serial retry)" if serial_pytest else "")
        n_before = len(log_buf)
        try:
            with self._clocked({"phase": "branch", "branch": branch, "serial": serial_pytest}):
                xml = str(super()._run_test_branch(branch, image, log_buf, serial_pytest=serial_pytest))
        finally:
            self._current.branch = None
        runs = [e for e in log_buf[n_before:] if e.get("step") == RUN_TESTS_STEP]
        with self._envs_lock:
            self.attempts.append((branch, xml, runs[-1] if runs else None))
        return xml

    def _copy_file_from_container(  # type: ignore[override]
        self,
        *,
        env: SdkContainerEnvironment,
        log_buf: list[dict[str, Any]],
        container_path: str,
        step_name: str,
        timeout: int = 60,
    ) -> str:
        """SDK ``get_archive`` in place of ``docker cp``; the same log entry shape; at most ``results_max_bytes``.

        A device or a FIFO is what the official makes of it where that is a score: its ``docker cp`` copies the node
        onto the host and ``read_text`` reads the host's device there. ``/dev/null``'s numbers give an empty text,
        on which ``EmptyTestResultError`` escapes the pipeline: the instance's 0. Other numbers read whatever the
        host's device gives (``/dev/zero`` never ends) and a FIFO blocks forever: we give them that same 0.
        """
        cmd_str = f"{env.executable} cp {env.container_id}:{container_path} -"
        log.debug("Running step: %s", cmd_str)
        t0 = time.monotonic()
        rc, found = env.read_member(container_path, timeout=timeout, max_bytes=self.layer.results_max_bytes)
        wall_time = time.monotonic() - t0
        if isinstance(found, Member) and found.kind in SPECIAL:
            branch = getattr(self._current, "branch", None) or "?"
            with self._envs_lock:
                self.results_notes.append(
                    f"branch {branch}: {container_path} is a {found.kind}; the official's docker cp copies the node "
                    f"to the host and reads it there (empty for /dev/null's numbers: EmptyTestResultError, the "
                    f"instance 0; other devices read the host's, a FIFO blocks forever): scored that 0")
            payload: bytes | str = b""
        elif isinstance(found, Member):
            rc, payload = _regular_bytes(found, container_path, self.layer.results_max_bytes)
        else:
            payload = found
        if rc != 0:
            err = payload if isinstance(payload, str) else ""
            log_buf.append({"step": step_name, "command": cmd_str, "wall_time": wall_time, "output": err,
                            "returncode": rc, "exception_info": ""})
            raise EvalStepError(f"{step_name}_failed", err)
        assert isinstance(payload, bytes)
        # Path.read_text(): UTF-8, strict (an undecodable file raises, as upstream), universal newlines.
        contents = payload.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        log_buf.append({"step": step_name, "command": cmd_str, "wall_time": wall_time, "output": contents,
                        "returncode": 0, "exception_info": ""})
        return contents

    def cleanup_all(self) -> None:
        """Queue the removal of every container this evaluator made (``run`` waits for it)."""
        with self._envs_lock:
            envs = list(self.envs)
        for container in envs:
            container.cleanup()

    def run(self) -> EvaluationResult:
        try:
            return super().run()
        finally:
            self._retire()
            self.reaper.close()
            self._remove_renewed()

    def _remove_renewed(self) -> None:
        """The images containers were renewed from (:meth:`SdkContainerEnvironment.renew`), once the image committed
        on top of them and every container are gone; one still held is left to the sweep, said."""
        with self._envs_lock:
            images = [ref for env in self.envs for ref in env.renewed]
        for ref in images:
            try:
                self.layer.engine.api.remove_image(ref, force=True)
            except NotFound:
                pass
            except Exception as exc:
                if _is_connection_failure(exc):
                    raise _engine_unavailable(exc) from exc
                log.warning("removing image %s failed (the sweep will retry): %s", ref, exc)

