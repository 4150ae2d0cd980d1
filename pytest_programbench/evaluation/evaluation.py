"""Step 7 of the pipeline: evaluate one submission the official way and say what happened.

:func:`evaluate` drives the official ``programbench.eval.eval.Evaluator`` (1.2.5) on the Docker-SDK container layer
(:mod:`.container_layer`), with the inputs resolved beforehand (image id, blob set), and returns
an :class:`EvaluationOutcome`:

* ``result`` — the unfiltered official ``EvaluationResult`` (what ``<id>.eval.json`` holds; official schema);
* ``score`` — ``result.for_branches(get_active_branches(instance)).without_ignored(get_ignored_tests(instance))
  .score``, through the official functions only; ``n_passed`` / ``n_tests`` of that filtered result;
* what failed (branches with their first failing tests, the error code), integrity flags, reruns on/off and why,
  timings and which clock fired;
* ``infra_error`` — set only for what the submission cannot cause: the engine unreachable, the task image or a
  hidden test archive missing, the compile container not starting, a harness self-check. Everything else that
  goes wrong once the compile container runs is scored as ``programbench eval`` scores it: an exception escaping
  the official pipeline (output that is not UTF-8, an ``IndexError`` on an empty hash, a JUnit file junitparser
  cannot read, a timed-out ``docker commit``, "no space left on device") is a 0 for the instance with the
  exception's type as its error code, and ``notes`` names the cause.
* ``notes`` — what the reader of a score needs to know (a cause of a 0, the network used under ``--pb-strict``);
* ``corrected`` — the same official scoring with test names compared canonically (:mod:`.corrected`), beside it;
* ``audit`` — for a task that would pass, whether it still passes when it cannot read the hidden tests (:mod:`.audit`):
  a ``reads_hidden_tests`` flag when not, never a change of the score.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import logging
import shutil
import subprocess
import tarfile
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from programbench.eval.eval import EvaluationResult, Evaluator
from programbench.exceptions import EvalStepError
from programbench.utils.load_data import get_active_branches, get_ignored_branches, get_ignored_tests

from pytest_programbench.core import environment
from pytest_programbench.core.memo import Memo
from pytest_programbench.core.settings import default
from pytest_programbench.engine import disk
from pytest_programbench.engine.archive_out import DIRECTORY, Member
from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.evaluation import harness_material, integrity, results_check, step_batch
from pytest_programbench.evaluation.audit import AuditReport, HiddenTestAudit
from pytest_programbench.evaluation.container_layer import (
    COMPILE_STEP,
    DEFAULT_OUTPUT_CAP,
    INSTALL_RERUNS_STEP,
    RESULTS_MAX_BYTES,
    Diff,
    HarnessError,
    LayerConfig,
    SdkContainerEnvironment,
    SdkEvaluator,
    StepHooks,
    UndecodableOutput,
    _is_connection_failure,
    prefetch_enabled,
)
from pytest_programbench.evaluation.install_cache import (
    DIFF_PRUNE,
    MAX_RECORD_BYTES,
    InstallCache,
    InstallRecord,
    pip_writes,
    pristine_for_pip,
    record_key,
)
from pytest_programbench.evaluation.integrity import IntegrityFlag
from pytest_programbench.evaluation.rerunfailures import (
    INSTALL_COMMAND,
    RerunWheels,
    ensure_wheels,
    install_cache_dir,
    pip_environment,
)
from pytest_programbench.results.corrected import CorrectedScore, safe_corrected_score
from pytest_programbench.tasks.blobs import BlobSet
from pytest_programbench.tasks.catalogue import CatalogueError, Task
from pytest_programbench.text.printable import printable

if TYPE_CHECKING:
    import docker

    from pytest_programbench.core.settings import Settings

log = logging.getLogger(__name__)
_T = TypeVar("_T")

SOLUTION_BRANCH = "submission"  # what `programbench eval` records for run-directory submissions
NO_SUBMISSION = "no_submission"  # eval_batch's code for a missing archive
INVALID_ARCHIVE = "invalid_submission_archive"
STRICT_FAILED = "strict_neutralise_failed"
BACKSTOP_TIMEOUT = "backstop_timeout"  # the item's pytest-timeout fired inside the submission's windows
FIRST_FAILING = 3
DISK_FULL = "no space left on device"
STRICT_NETWORK_NOTE = ("--pb-strict: compile.sh and the hidden tests ran with no network at all (network_mode none); "
                       "the official runs them on the engine's default network, with DNS blackholed for compile.sh")


def eval_storage_limit() -> int:
    """``PB_EVAL_STORAGE``: what each evaluation container's writable layer may hold (default 30g; 0: no limit),
    applied where the engine's storage driver enforces it (docs/security.md)."""
    return environment.EVAL_STORAGE.size()


@dataclass(frozen=True)
class EvalSettings:
    """The evaluation knobs, plain and frozen (built from the plugin's Settings)."""

    # The knobs an option sets take its default from Settings, where it is written once.
    cpus: int = field(default_factory=lambda: default("cpus"))
    memory: int | None = field(default_factory=lambda: default("memory"))
    branch_workers: int = field(default_factory=lambda: default("branch_workers"))
    branch_retries: int = field(default_factory=lambda: default("branch_retries"))
    compile_timeout: int = field(default_factory=lambda: default("compile_timeout"))
    test_timeout: int = field(default_factory=lambda: default("test_timeout"))
    strict: bool = field(default_factory=lambda: default("strict"))
    image_tag: str = field(default_factory=lambda: default("image_tag"))
    reruns: bool = True  # provide pytest-rerunfailures 16.4 offline (False: the install step fails, reruns off)
    output_cap: int = DEFAULT_OUTPUT_CAP
    cache_dir: str | None = None
    storage: int = field(default_factory=eval_storage_limit)  # per container, where the engine can
    # Recorded install steps (evaluation/install_cache.py); None: the default under the cache root, or none at all
    # under $PYTEST_PROGRAMBENCH_PIP_REPLAY=0.
    install_cache: str | None = None
    # The audit of the hidden tests (evaluation/audit.py) for a task that passed a test. Off for a direct call; a
    # session's --pb-audit-hidden-tests (on by default) sets it.
    audit: bool = False

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> EvalSettings:
        values: dict[str, Any] = {
            "cpus": settings.cpus, "memory": settings.memory, "branch_workers": settings.branch_workers,
            "branch_retries": settings.branch_retries, "compile_timeout": settings.compile_timeout,
            "test_timeout": settings.test_timeout, "strict": settings.strict, "image_tag": settings.image_tag,
            "audit": settings.audit_hidden_tests,
        }
        values.update(overrides)
        return cls(**values)


@dataclass
class EvaluationOutcome:
    """What one evaluation produced. ``result`` is the official, unfiltered result (None on infra errors)."""

    instance_id: str
    result: EvaluationResult | None = None
    score: float = 0.0
    n_passed: int = 0
    n_tests: int = 0
    failing_branches: dict[str, list[str]] = field(default_factory=dict)
    branch_errors: dict[str, list[str]] = field(default_factory=dict)
    error_code: str | None = None
    error_details: str | None = None
    executable_hash: str | None = None
    integrity_flags: list[IntegrityFlag] = field(default_factory=list)
    strict: bool = False
    neutralised: list[str] = field(default_factory=list)
    reruns: bool = False
    reruns_reason: str = ""
    reruns_install: str = ""  # how the install step ran: "pip", "pip, recorded", "replayed" ("" not reached)
    compile_seconds: float | None = None
    test_seconds: float = 0.0
    total_seconds: float = 0.0
    timeouts: list[str] = field(default_factory=list)
    infra_error: str | None = None
    image: str = ""
    blob_sha256: dict[str, str] = field(default_factory=dict)
    submission_sha256: str | None = None
    reference_hash: str | None = None
    notes: list[str] = field(default_factory=list)
    corrected: CorrectedScore | None = None  # the official scoring with canonical names (corrected.py)
    audit: AuditReport | None = None  # the audit of the hidden tests (audit.py)
    phases: list[dict[str, Any]] = field(default_factory=list)  # compile, each branch, the audit: start and seconds

    @property
    def clock_fired(self) -> str | None:
        """``"compile"``, ``"test"`` or None: the first evaluation clock that ran out."""
        if not self.timeouts:
            return None
        return "compile" if "compile" in self.timeouts else "test"

    @property
    def flagged(self) -> bool:
        return bool(self.integrity_flags)

    def meta(self) -> dict[str, Any]:
        """The evaluation's part of ``pb-meta.json`` (JSON-serialisable)."""
        return {
            "instance_id": self.instance_id,
            "image": self.image,
            "blob_sha256": dict(self.blob_sha256),
            "submission_sha256": self.submission_sha256,
            "score": self.score,
            "n_passed": self.n_passed,
            "n_tests": self.n_tests,
            "error_code": self.error_code,
            "executable_hash": self.executable_hash,
            "reference_hash": self.reference_hash,
            "failing_branches": self.failing_branches,
            "branch_errors": self.branch_errors,
            "integrity_flags": [f.as_dict() for f in self.integrity_flags],
            "strict": self.strict,
            "neutralised": list(self.neutralised),
            "reruns": "on" if self.reruns else "off",
            "reruns_reason": self.reruns_reason,
            "reruns_install": self.reruns_install,
            "timings": {"compile_seconds": self.compile_seconds, "test_seconds": self.test_seconds,
                        "total_seconds": self.total_seconds},
            "clock_fired": self.clock_fired,
            "timeouts": list(self.timeouts),
            "infra_error": self.infra_error,
            "notes": list(self.notes),
            "corrected": self.corrected.as_dict() if self.corrected is not None else None,
            "audit": self.audit.as_dict() if self.audit is not None else None,
            "phases": list(self.phases),
        }


# --------------------------------------------------------------------------------------------- archive check


@dataclass
class ArchiveCheck:
    problem: str | None = None
    error_code: str | None = None
    flags: list[IntegrityFlag] = field(default_factory=list)
    sha256: str | None = None


def check_archive(path: Path) -> ArchiveCheck:
    """Host-side: the archive exists and is a readable gzip tar (fully decompressed: CRC checked); its flags.

    Members are classified as they stream by (none kept: a tar of ten million empty entries costs no memory), at
    most ``integrity.MAX_ENTRIES`` of them; config files on pytest's rootdir search path are read up to
    ``integrity.CONFIG_READ_CAP`` bytes each."""
    if not path.exists():
        return ArchiveCheck(f"no submission archive at {path}", NO_SUBMISSION)
    if not path.is_file():
        return ArchiveCheck(f"{path} is not a file", INVALID_ARCHIVE)
    scan: integrity.FlagScan | None = None
    sha256: str | None = None
    try:
        with path.open("rb") as raw:
            if raw.read(2) != b"\x1f\x8b":
                return ArchiveCheck(f"{path} is not gzip-compressed (the evaluator unpacks it with tar -xzf)",
                                    INVALID_ARCHIVE)
        with path.open("rb") as raw:
            sha256 = hashlib.file_digest(raw, "sha256").hexdigest()
        with gzip.open(path, mode="rb") as gz:
            with tarfile.open(fileobj=gz, mode="r|") as tar:
                scan = _scan_archive(tar)
            while gz.read(1 << 20):  # to the end: the gzip CRC and length are verified
                pass
    except (OSError, EOFError, tarfile.TarError, zlib.error) as exc:
        return ArchiveCheck(f"{path} is not a readable gzip tar: {type(exc).__name__}: {exc}", INVALID_ARCHIVE)
    except Exception as exc:  # a header Python's tarfile chokes on: the container's tar decides, as the official's
        log.warning("reading the submission archive %s for its flags failed", path, exc_info=True)
        return ArchiveCheck(flags=[integrity.probe_failed("of the archive", exc)], sha256=sha256)
    return ArchiveCheck(flags=scan.result() if scan is not None else [], sha256=sha256)


def _scan_archive(tar: tarfile.TarFile) -> integrity.FlagScan:
    current: list[tarfile.TarInfo] = []

    def read(_rel: str) -> bytes | None:
        member = current[0]
        if not member.isfile() or member.size > integrity.CONFIG_READ_CAP:
            return None
        f = tar.extractfile(member)
        return f.read(integrity.CONFIG_READ_CAP + 1) if f is not None else None

    scan = integrity.FlagScan(read)
    for member in tar:
        tar.members.clear()  # type: ignore[attr-defined]  # streamed: tarfile would otherwise keep every member
        if member.isdir():
            continue
        if scan.entries >= integrity.MAX_ENTRIES:
            scan.bound(f"more than {integrity.MAX_ENTRIES} archive members")
            break
        current[:] = [member]
        scan.add(member.name)
    return scan


# --------------------------------------------------------------------------------------------- harness probes

# The reference's sha256 per image (its bytes never change under one image id).
_reference_hashes: Memo[str, str | None] = Memo()
NO_WHEELS = RerunWheels(None, reason="not mounted")
INSTALL_TIMEOUT = 120  # the official install step's clock
RENEWED_REPOSITORY = "pb-postcompile"  # the compile container's image the install step's container is made from
STOPPED_NOTE = ("compile.sh left {n} process(es) running; they were stopped when it ended, before the integrity "
                "check (the official lets them run until the image is committed)")


class _Probe:
    """The harness's own work around official steps: reference hash, compile diff, strict mode, reruns wheels.

    Flag probes never change a score or raise: a probe that fails is a ``scan_bounded`` flag (logged with its
    traceback). Only the engine going away (an infrastructure error) and --pb-strict failing to neutralise (its
    documented 0) leave here."""

    def __init__(self, *, image: str, strict: bool, wheels: RerunWheels, eval_clean_hashes: list[str],
                 install_cache: InstallCache | None = None, instance: str = "") -> None:
        self.image = image
        self.install_cache = install_cache
        self.install = ""  # see EvaluationOutcome.reruns_install
        self.scan_bounded: list[str] = []
        self.strict = strict
        self.wheels = wheels
        self.eval_clean_hashes = eval_clean_hashes
        self.reference_hash: str | None = None
        self.baseline: list[dict[str, Any]] | None = None  # before seed_git, the first step that can run its code
        self.git_seeded = True  # whether seed_git was to make /workspace/.git (none shipped, or removed)
        self.before: list[dict[str, Any]] | None = None  # right before compile.sh
        self.scanned: list[dict[str, Any]] | None = None  # the compile container's changes the scan saw
        self.compile_flags: list[IntegrityFlag] = []
        self.neutralised: list[str] = []
        self.notes: list[str] = []
        self.wheel_dir: str | None = None  # where the install step's pip finds the wheels (a read-only mount)
        self.compiled: list[dict[str, Any]] | None = None  # the compile container's changes when it was committed
        self.instance = instance

    def hooks(self) -> StepHooks:
        return StepHooks(before_step=self.before_step, after_step=self.after_step, step_env=self.step_env,
                         before_commit=self.before_commit)

    def before_step(self, step: str, env: SdkContainerEnvironment) -> None:
        if step == "wipe_workspace":
            self.reference_hash = self._reference_hash(env)
        elif step == "clear_stale_executable":
            # seed_git, next, is the first official step that can run the submission's code (git with its .git):
            # the baseline is taken here, and a .git that is not a plain directory is flagged (removed: --pb-strict).
            self.baseline = self._guarded("before seed_git", lambda: self._diff(env).changes)
            self._guarded("the .git check", lambda: self._check_git(env))
        elif step == COMPILE_STEP:
            self.before = self._guarded("before compile.sh", lambda: self._diff(env).changes)
            if self.baseline is not None and self.before is not None:
                self.compile_flags = integrity.merge(self.compile_flags, integrity.seed_git_flags(
                    self.baseline, self.before, seeded=self.git_seeded))
        elif step == INSTALL_RERUNS_STEP:
            self.install = "pip"
            self._renew(env)
            self._plan_install(env)

    def _renew(self, env: SdkContainerEnvironment) -> None:
        """After compile.sh and the official hash step: the compile container frozen, looked at once more (what a
        process that outlived compile.sh changed since the scan is flagged), committed, and removed with every
        process in it. The install step, the last scan and the commit the branches start from then run in a fresh
        container from that image, the wheels mounted read-only: no process of the submission exists there."""
        if not env.pause():
            self.compile_flags = integrity.merge(self.compile_flags, [integrity.probe_failed(
                "after the hash step", RuntimeError("the compile container could not be frozen before its commit"))])
        self._guarded("after the hash step", lambda: self._scan_survivors(env))
        mounts = self._wheel_mounts(env)
        refused = env.renew(f"{RENEWED_REPOSITORY}/{self.instance or 'instance'}:{uuid.uuid4().hex[:12]}",
                            mounts=mounts)
        if refused is not None:
            log.warning("the rerunfailures wheels could not be mounted: %s", refused)
            self.notes.append(f"the rerunfailures wheels could not be mounted in the install step's container "
                              f"({refused[:300]}): pip ran without them, reruns off")
            self.wheel_dir = None
        self.scanned = []  # the fresh container: nothing changed in it yet

    def _wheel_mounts(self, env: SdkContainerEnvironment) -> list[harness_material.GraderMount]:
        """The wheels as a read-only volume (none without wheels: pip then fails offline, reruns off)."""
        if not self.wheels.available:
            return []
        try:
            mount = harness_material.grader_mount(
                env.engine, self.wheels.files(), target=f"{harness_material.GRADER_MOUNT_ROOT}/wheels",
                labels=env.labels, image=self.image)
        except harness_material.MaterialRefused as exc:
            log.warning("the rerunfailures wheels were not made ready: %s", exc)
            self.notes.append(f"the rerunfailures wheels could not be made ready ({exc}): reruns off")
            return []
        self.wheel_dir = mount.target
        return [mount]

    def _scan_survivors(self, env: SdkContainerEnvironment) -> None:
        """The frozen compile container against the scan after compile.sh: what changed since (besides the
        official's own moves of the executable) was changed by a process that outlived compile.sh."""
        now = self._diff(env)
        self.scan_bounded = [*self.scan_bounded, *now.bounded]
        if self.scanned is None:
            self.compiled = now.changes
            return
        read = functools.partial(_read, env)
        late = integrity.scan_late(integrity.late_changes(self.scanned, now.changes), read)
        late += integrity.grader_path_flags(self.scanned, now.changes)
        # An image's directory listed only for what changed below it (the official's DNS restore) is no change.
        directories = {str(c["Path"]) for c in now.changes if c.get("Kind") == 0 and c.get("Stamp") is None}
        outside = [change for change in integrity.outside_changes(self.scanned, now.changes)
                   if not change[2:].startswith(Evaluator._stashed_executable)
                   and not (change.startswith("C ") and change[2:] in directories)]
        if outside:
            late.append(integrity.IntegrityFlag(
                integrity.CHANGED_AFTER_COMPILE, "/",
                f"changed outside /workspace after compile.sh ended, by a process that outlived it: "
                f"{', '.join(printable(c) for c in outside[:10])}{' ...' if len(outside) > 10 else ''}"))
        self.compile_flags = integrity.merge(self.compile_flags, late)
        self.compiled = now.changes

    def _check_git(self, env: SdkContainerEnvironment) -> None:
        # The engine's archive API says what .git is: no tool of the container runs.
        code, found = env.read_member(f"{integrity.WORKSPACE}/.git", timeout=60, max_bytes=0)
        kind = found.kind if isinstance(found, Member) else ""
        if code != 0 or kind == DIRECTORY:
            self.git_seeded = code != 0  # none shipped: seed_git makes one
            return
        flag = integrity.git_metadata_flag(kind or "special file")
        self.compile_flags = integrity.merge(self.compile_flags, [flag])
        if self.strict:
            # Before seed_git nothing of the submission has run: this rm is the image's.
            status, output = env.harness_run(["rm", "-f", "--", f"{integrity.WORKSPACE}/.git"], timeout=60)
            if status != 0:
                raise EvalStepError(STRICT_FAILED, f"--pb-strict could not remove .git: {output.strip()[:2000]}")
            self.neutralised = list(dict.fromkeys([*self.neutralised, ".git"]))
            self.git_seeded = True

    def step_env(self, step: str, env: SdkContainerEnvironment) -> dict[str, str] | None:
        if step == INSTALL_RERUNS_STEP:
            # Without the mount pip finds no wheels (it fails offline, reruns off): never a directory of ours that a
            # submission could have prepared.
            return pip_environment(self.wheels if self.wheel_dir else NO_WHEELS, self.wheel_dir)
        return None

    def after_step(self, step: str, env: SdkContainerEnvironment, result: dict[str, Any]) -> None:
        if step == COMPILE_STEP:
            # What compile.sh started is stopped before the scan (it dies with the compile container, removed
            # after the hash step, in any case): a stop that fails is a flag.
            stopped = env.stop_processes()
            if stopped is None:
                self.compile_flags = integrity.merge(self.compile_flags, [integrity.probe_failed(
                    "after compile.sh", RuntimeError("the processes compile.sh left could not be stopped"))])
            elif stopped:
                self.notes.append(STOPPED_NOTE.format(n=stopped))
            self._guarded("after compile.sh", lambda: self._scan_compile(env))
            if self.strict:
                self._neutralise(env, self.compile_flags)

    # ------------------------------------------------------------------------------ the install step's record

    def _plan_install(self, env: SdkContainerEnvironment) -> None:
        """Before the install step, in the fresh container: a record replayed when compile.sh left everything pip
        reads as the image shipped it (:func:`pristine_for_pip`), made first when there is none; otherwise pip."""
        if self.install_cache is None or self.compiled is None:
            return
        self._guarded("the install step's record (pip runs)", lambda: self._look_up_install(env), flag=False)

    def _look_up_install(self, env: SdkContainerEnvironment) -> None:
        assert self.install_cache is not None
        assert self.compiled is not None
        why = pristine_for_pip(self.compiled, self.scan_bounded, env.path_variable())
        if why is None and self.wheels.available and self.wheel_dir is None:
            why = "the wheels are not mounted"
        if why is not None:
            log.debug("install step not replayed: %s", why)
            return
        key = record_key(self.image, self.wheels.wheels, INSTALL_COMMAND, pip_environment(self.wheels))
        record = self.install_cache.load(key)
        recorded = record is None
        if record is None:
            record = self._record_install(env, key)
        if record is not None and record.deleted:
            log.debug("install step not replayed: its record removes paths (pip runs)")
        elif record is not None:
            env.exec_override = lambda command, _timeout: self._replay(env, record, command, recorded=recorded)

    def _record_install(self, env: SdkContainerEnvironment, key: str) -> InstallRecord | None:
        """pip run in a container of the task's own image (no submission ran there), with the same settings and
        wheels: its result and what it wrote, recorded for every evaluation of this image. Never from a container a
        submission ran in."""
        assert self.install_cache is not None
        recorder = env.sibling(self.image)
        try:
            recorder.exec_env = pip_environment(self.wheels if self.wheel_dir else NO_WHEELS, self.wheel_dir)
            result = recorder.execute(INSTALL_COMMAND, timeout=INSTALL_TIMEOUT)
            if result.get("exception_info") or not isinstance(result.get("returncode"), int):
                return None  # timed out: nothing worth replaying
            after = recorder.bounded_diff(prune=DIFF_PRUNE)
            if after.bounded:
                return None
            written, deleted = pip_writes([], after.changes)
            staging = self.install_cache.staging()
            try:
                with (staging / "files.tar").open("wb") as f:
                    problem = recorder.export_tree(written, f, max_bytes=MAX_RECORD_BYTES)
                if problem is not None:
                    log.warning("install step not recorded: %s", problem)
                    return None
                self.install_cache.commit(key, staging, returncode=int(result["returncode"]),
                                          output=str(result.get("output", "")), deleted=deleted)
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # nothing left once committed (renamed into place)
        finally:
            recorder.cleanup()
        return self.install_cache.load(key)

    def _replay(self, env: SdkContainerEnvironment, record: InstallRecord, command: str, *,
                recorded: bool) -> dict[str, Any] | None:
        if command != INSTALL_COMMAND:
            return None
        try:
            env.apply_tree(record.archive)
        except (RuntimeError, OSError) as exc:
            log.warning("replaying the recorded install step failed (pip runs): %s", exc)
            self.install = "pip, after a failed replay"
            return None
        self.install = "recorded from the task's image, replayed" if recorded else "replayed"
        return {"output": record.output, "returncode": record.returncode, "exception_info": ""}

    def before_commit(self, env: SdkContainerEnvironment) -> None:
        """The image the hidden tests run in, frozen, scanned again: what changed in /workspace since the scan."""
        for _round in range(3):
            if not env.pause():
                self.notes.append("the compile container could not be paused before its commit: the last scan "
                                  "ran with it running")
            late = self._guarded("before the commit", lambda: self._scan_late(env))
            if not (self.strict and late and integrity.neutralise_command(late)):
                return
            env.unpause()  # --pb-strict: removed like the others, then looked at again
            self._neutralise(env, late)
        raise EvalStepError(STRICT_FAILED, "--pb-strict: /workspace kept changing before the commit")

    def _scan_compile(self, env: SdkContainerEnvironment) -> list[IntegrityFlag]:
        after = self._diff(env)
        self.scanned = after.changes
        self.scan_bounded = list(after.bounded)
        baseline = self.baseline if self.baseline is not None else self.before
        self.compile_flags = [*self.compile_flags, *integrity.scan_compile(
            baseline or [], after.changes, lambda rel: _read(env, rel), bounded=after.bounded)]
        return self.compile_flags

    def _scan_late(self, env: SdkContainerEnvironment) -> list[IntegrityFlag]:
        if self.scanned is None:
            return []
        now = self._diff(env)
        late = integrity.scan_late(integrity.late_changes(self.scanned, now.changes), lambda rel: _read(env, rel))
        late += integrity.grader_path_flags(self.scanned, now.changes)
        self.scanned = now.changes
        self.compile_flags = integrity.merge(self.compile_flags, late)
        return late

    @staticmethod
    def _diff(env: SdkContainerEnvironment) -> Diff:
        # Build caches and scratch space are listed, not descended into: what lies below them is never flagged.
        # The grader's own paths in /tmp are walked whole.
        return env.bounded_diff(prune=integrity.ALLOWED_OUTSIDE, watch=harness_material.GRADER_PATHS)

    def _guarded(self, where: str, probe: Callable[[], _T], *, flag: bool = True) -> _T | None:
        """Runs a probe of ours: the engine going away is an infrastructure error; any other failure is a flag, or
        with ``flag=False`` (the install step's record, which touches neither the score nor the flags) only
        logged."""
        try:
            return probe()
        except EngineUnavailable:
            raise
        except Exception as exc:
            if _is_connection_failure(exc):
                raise
            if not flag:
                log.warning("%s failed: %s", where, exc, exc_info=True)
                return None
            log.warning("integrity check %s failed (flagged, the score stays official)", where, exc_info=True)
            self.compile_flags = [*self.compile_flags, integrity.probe_failed(where, exc)]
            return None

    def _neutralise(self, env: SdkContainerEnvironment, flags: list[IntegrityFlag]) -> None:
        planned = integrity.neutralise_command(flags)
        if planned is None:
            return
        commands, paths = planned
        for command in commands:
            r = env.execute(command, timeout=120)
            if r["returncode"] != 0:
                raise EvalStepError(STRICT_FAILED, f"--pb-strict could not remove {paths[:20]}: "
                                                   f"{r['output'].strip()[:2000]}")
        self.neutralised = list(dict.fromkeys([*self.neutralised, *paths]))

    def _reference_hash(self, env: SdkContainerEnvironment) -> str | None:
        def read() -> str | None:
            rc, payload = env.read_file("/workspace/executable", timeout=120)
            return hashlib.sha256(payload).hexdigest() if rc == 0 and isinstance(payload, bytes) else None

        return _reference_hashes.get(self.image, read)


def _read(env: SdkContainerEnvironment, rel: str) -> bytes | None:
    """A workspace file for the flag probes, at most ``integrity.CONFIG_READ_CAP`` bytes (larger: None)."""
    rc, payload = env.read_file(f"/workspace/{rel}", timeout=60, max_bytes=integrity.CONFIG_READ_CAP)
    return payload if rc == 0 and isinstance(payload, bytes) else None


# --------------------------------------------------------------------------------------------- scoring


def _official_not_run(instance_id: str, branches: list[str], tests_by_branch: dict[str, list[str]], *,
                      error_code: str, error_details: str, log_entries: list[dict[str, Any]] | None = None
                      ) -> EvaluationResult:
    """An official result where every branch is ``not_run`` with ``error_code`` (built by the official code)."""
    shell = Evaluator(tests_branches=branches, tests_by_branch=tests_by_branch, solution_branch=SOLUTION_BRANCH,
                      instance_id=instance_id)
    shell.result.error_code = error_code
    shell.result.error_details = error_details
    if log_entries:
        shell.result.log = list(log_entries)
    for branch in branches:
        shell._inject_not_run(branch, error_code)
    return shell.result


def fill_scores(outcome: EvaluationOutcome, result: EvaluationResult, instance: Mapping[str, Any]) -> None:
    """Score and summaries from the official filtering functions only."""
    inst = dict(instance)
    filtered = result.for_branches(get_active_branches(inst)).without_ignored(get_ignored_tests(inst))
    outcome.result = result
    outcome.score = filtered.score
    outcome.n_passed = filtered.n_resolved
    outcome.n_tests = len(filtered)
    outcome.error_code = result.error_code
    outcome.error_details = result.error_details
    outcome.executable_hash = result.executable_hash
    failing: dict[str, list[str]] = {}
    for test in filtered.test_results:
        if not test.is_resolved:
            names = failing.setdefault(test.branch, [])
            if len(names) < FIRST_FAILING:
                names.append(f"{test.name} ({test.status})")
    outcome.branch_errors = {b: [e.error_code for e in errs] for b, errs in filtered.test_branch_errors.items()}
    for branch in outcome.branch_errors:
        failing.setdefault(branch, [])
    outcome.failing_branches = failing
    outcome.corrected = safe_corrected_score(result, inst)
    for entry in result.log:
        if entry.get("step") == COMPILE_STEP:
            outcome.compile_seconds = float(entry.get("wall_time", 0.0))
        elif entry.get("step") == "run_tests":
            outcome.test_seconds += float(entry.get("wall_time", 0.0))


def _reruns_reason(evaluator: SdkEvaluator, wheels: RerunWheels) -> str:
    entries = [e for e in evaluator.result.log if e.get("step") == INSTALL_RERUNS_STEP]
    if not entries:
        return "not reached (the compile phase ended before the install step)"
    if not wheels.available:
        return f"no pytest-rerunfailures wheels on this host: {wheels.reason}"
    if entries[-1].get("returncode") != 0:
        tail = str(entries[-1].get("output", "")).strip().splitlines()[-1:] or [""]
        if entries[-1].get("returncode") == 127:  # the shell found no pip3: so would the official's
            return f"no pip3 in this image (the official's install fails the same way): {tail[0][:200]}"
        # Ours reads only the host's wheels; the official's pip reaches PyPI (and can upgrade a pytest too old).
        return (f"pip3 could not install pytest-rerunfailures==16.4 from this host's wheels (offline, --no-index): "
                f"{tail[0][:200]}; `programbench eval` installs it from PyPI, where it can succeed (reruns on)")
    return ""


# --------------------------------------------------------------------------------------------- crashes

# What the official pipeline itself raises from inside the submission's containers (others are logged with their
# traceback, in case one is ours): all of them score 0, as `programbench eval` scores them.
OFFICIAL_RAISES = (RuntimeError, UnicodeDecodeError, EvalStepError, FileNotFoundError, IndexError, ValueError,
                   subprocess.TimeoutExpired)


def official_error_code(exc: BaseException) -> str:
    """The error code `programbench eval` records for ``exc``: its type's name (ours map to the official type)."""
    if isinstance(exc, UndecodableOutput):
        return "UnicodeDecodeError"
    return type(exc).__name__


def _crash_note(exc: BaseException, code: str) -> str:
    if isinstance(exc, UndecodableOutput):
        why = f"a command printed bytes that are not UTF-8 ({exc}); the output is in the log, escaped"
    elif isinstance(exc, UnicodeDecodeError):
        why = f"a file the evaluator reads is not UTF-8 ({exc})"
    elif DISK_FULL in str(exc).lower():
        why = f"no space left on device during the evaluation (the disk check before the task had passed): {exc}"
    elif isinstance(exc, subprocess.TimeoutExpired):
        why = f"a Docker step ran out of its time ({exc})"
    else:
        why = f"{type(exc).__name__}: {str(exc)[:300]}"
    return (f"scored 0 as `programbench eval` scores it (error {code}): the official pipeline raised inside the "
            f"submission's containers: {why}")


# --------------------------------------------------------------------------------------------- disk


def _require_disk(workdir: Path, engine: docker.DockerClient, *, branches: int) -> None:
    """Before the compile container: the engine's data root has ``PB_DISK_RUN_NEED`` free and the task's directory
    room for eval.json (every attempt's results text). Hours may have passed since the check before the agent, and
    another task's submission may have filled the disk since: then this is an error, never this task's 0."""
    root = disk.docker_root(engine.api)
    if root is not None:
        disk.require(root, disk.run_need(), "evaluate a submission", label="the Docker data root")
    disk.require(workdir, (64 << 20) + 2 * branches * RESULTS_MAX_BYTES, "evaluate a submission",
                 label="the run directory")


def _disk_still_short(result: EvaluationResult, notes: list[str], workdir: Path, engine: docker.DockerClient, *,
                      branches: int) -> str | None:
    """After an evaluation that ran out of space (the exception that ended it, or a failed step's output), with its
    containers and image gone: still short means the host or another task filled the disk (an error); enough means
    the submission did (its score stands). The hidden tests' own output is not read: a test may well expect a
    program's "No space left on device" (writing to /dev/full)."""
    failed = (str(e.get("output", "")) for e in result.log
              if e.get("step") != "run_tests" and e.get("returncode") not in (0, None))
    if not any(DISK_FULL in text.lower() for text in (*notes, str(result.error_details or ""), *failed)):
        return None
    try:
        _require_disk(workdir, engine, branches=branches)
    except EngineUnavailable as exc:
        return f"the disk filled during the evaluation and is still short once its containers are gone: {exc}"
    notes.append("no space left on device during the evaluation; the disk had room again once this evaluation's "
                 "containers were removed, so the submission used it: scored")
    return None


# --------------------------------------------------------------------------------------------- entry point


def evaluate(
    task: Task,
    submission: Path,
    *,
    blobs: BlobSet,
    image: str,
    labels: Labels,
    settings: EvalSettings,
    workdir: Path,
    engine: docker.DockerClient,
) -> EvaluationOutcome:
    """Evaluate ``submission`` (a ``submission.tar.gz``) for ``task`` on ``image`` (an id, resolved beforehand)."""
    started = time.monotonic()
    outcome = EvaluationOutcome(task.instance_id, image=image, blob_sha256=dict(blobs.sha256),
                                strict=settings.strict)
    try:
        return _evaluate(task, submission, blobs=blobs, image=image, labels=labels, settings=settings,
                         workdir=workdir, engine=engine, outcome=outcome)
    finally:
        outcome.total_seconds = time.monotonic() - started


def _evaluate(task: Task, submission: Path, *, blobs: BlobSet, image: str, labels: Labels, settings: EvalSettings,
              workdir: Path, engine: docker.DockerClient, outcome: EvaluationOutcome) -> EvaluationOutcome:
    return _Evaluation(task, submission, blobs=blobs, image=image, labels=labels, settings=settings,
                       workdir=workdir, engine=engine, outcome=outcome).run()


class _Evaluation:
    """One evaluation's steps, in order: the instance, the archive, the probes, the official pipeline, the outcome.

    A step that ends the evaluation early has set ``outcome.infra_error`` (or scored the submission) and returns
    None or False."""

    def __init__(self, task: Task, submission: Path, *, blobs: BlobSet, image: str, labels: Labels,
                 settings: EvalSettings, workdir: Path, engine: docker.DockerClient,
                 outcome: EvaluationOutcome) -> None:
        self.task = task
        self.submission = submission
        self.blobs = blobs
        self.image = image
        self.labels = labels
        self.settings = settings
        self.workdir = workdir
        self.engine = engine
        self.outcome = outcome
        self.instance: dict[str, Any] = {}
        self.active: list[str] = []
        self.tests_by_branch: dict[str, list[str]] = {}

    def run(self) -> EvaluationOutcome:
        if not self._load_instance():
            return self.outcome
        audit = HiddenTestAudit(instance=self.instance, enabled=self.settings.audit)
        self.outcome.audit = audit.report
        archive = check_archive(self.submission)
        self.outcome.submission_sha256 = archive.sha256
        if archive.problem is not None:
            self._score_unreadable_archive(archive)
            return self.outcome
        probe = self._probe()
        if not self._disk_ready():
            return self.outcome
        evaluator = self._evaluator(probe, audit)
        audit.attach(evaluator)
        result = self._run_official(evaluator)
        if result is None:
            return self.outcome
        short = _disk_still_short(result, self.outcome.notes, self.workdir, self.engine, branches=len(self.active))
        if short is not None:
            self.outcome.infra_error = short
            return self.outcome
        self._fill_outcome(result, evaluator, probe, archive, audit)
        return self.outcome

    def _load_instance(self) -> bool:
        """The task's instance, its active branches (each with its hidden tests resolved) and their tests."""
        try:
            self.instance = self.task.load_instance()
        except CatalogueError as exc:
            self.outcome.infra_error = f"task metadata: {exc}"
            return False
        self.active = get_active_branches(self.instance)
        if not self.active:
            self.outcome.infra_error = f"{self.task.instance_id} has no active test branches: nothing can be scored"
            return False
        missing = [b for b in self.active if b not in self.blobs.sha256]
        if missing:
            self.outcome.infra_error = f"hidden tests not resolved for branch(es) {', '.join(missing)}"
            return False
        branches_data = self.instance.get("branches", {})
        self.tests_by_branch = {b: list(branches_data[b].get("tests", [])) for b in self.active if b in branches_data}
        return True

    def _score_unreadable_archive(self, archive: ArchiveCheck) -> None:
        assert archive.error_code is not None
        assert archive.problem is not None
        result = _official_not_run(self.task.instance_id, self.active, self.tests_by_branch,
                                   error_code=archive.error_code, error_details=archive.problem)
        fill_scores(self.outcome, result, self.instance)
        self.outcome.reruns_reason = "not reached (no readable submission archive)"

    def _probe(self) -> _Probe:
        """The harness's probes around the official steps, with the reruns wheels and the install cache."""
        settings = self.settings
        wheels = (ensure_wheels(Path(settings.cache_dir) / "wheels" if settings.cache_dir else None)
                  if settings.reruns else RerunWheels(None, reason="disabled for this evaluation"))
        remove_hashes = list(self.instance.get("eval_clean_hashes", []) or [])
        cache_dir = Path(settings.install_cache) if settings.install_cache else install_cache_dir()
        return _Probe(image=self.image, strict=settings.strict, wheels=wheels, eval_clean_hashes=remove_hashes,
                      install_cache=InstallCache(cache_dir) if cache_dir is not None else None,
                      instance=self.task.instance_id)

    def _disk_ready(self) -> bool:
        try:
            _require_disk(self.workdir, self.engine, branches=len(self.active))
        except EngineUnavailable as exc:  # a DiskSpaceError: the host, not the submission
            self.outcome.infra_error = str(exc)
            return False
        return True

    def _evaluator(self, probe: _Probe, audit: HiddenTestAudit) -> SdkEvaluator:
        task, settings, instance = self.task, self.settings, self.instance
        task_labels = self.labels if self.labels.task else self.labels.for_task(task.instance_id)
        hooks = probe.hooks()
        if environment.AUDIT_EARLY.enabled():  # the audit of a branch sure to be sampled starts beside the official's
            hooks.after_branch = audit.branch_done
        hooks.after_branches = audit  # before the committed image goes
        return SdkEvaluator(
            layer=LayerConfig(
                engine=self.engine, image=self.image, labels=task_labels.as_dict(), memory=settings.memory,
                compile_timeout=settings.compile_timeout, test_timeout=settings.test_timeout,
                output_cap=settings.output_cap, hooks=hooks,
                network_mode="none" if settings.strict else "default", storage=settings.storage,
                batch_steps=step_batch.enabled(), prefetch=prefetch_enabled(),
                quick_acks=environment.QUICK_ACKS.enabled(),
            ),
            image_name=task.image_name,
            solution_branch=SOLUTION_BRANCH,
            submission_archive=self.submission,
            blob_dir=self.blobs.directory,
            tests_branches=self.active,
            remove_hashes=probe.eval_clean_hashes,
            image_tag=settings.image_tag,
            tests_by_branch=self.tests_by_branch,
            ignored_tests=get_ignored_tests(instance),
            ignored_branches=get_ignored_branches(instance),
            instance_id=task.instance_id,
            docker_cpus=settings.cpus,
            branch_workers=settings.branch_workers,
            branch_retries=settings.branch_retries,
        )

    def _run_official(self, evaluator: SdkEvaluator) -> EvaluationResult | None:
        """The official pipeline's result; a crash inside the submission's windows is its 0 (None: an error)."""
        try:
            return evaluator.run()
        except (EngineUnavailable, HarnessError) as exc:
            self.outcome.infra_error = str(exc)
            return None
        except Exception as exc:
            return self._crashed(evaluator, exc)
        except pytest.fail.Exception as exc:
            # The item's pytest-timeout backstop (method signal) fired inside the submission's windows. It is
            # computed above every clock of the evaluation, so only a submission that stretches what no clock bounds
            # gets here: the instance's 0, never an error. Before the compile container ran it is not the
            # submission's doing.
            if not str(exc).startswith("Timeout") or not evaluator.compile_env_started:
                raise
            self.outcome.notes.append(
                f"scored 0 (error {BACKSTOP_TIMEOUT}): the item's pytest-timeout backstop ({exc}) fired inside the "
                f"submission's evaluation, before the evaluation's own clocks ended it")
            return self._not_run(evaluator, BACKSTOP_TIMEOUT, str(exc))
        finally:
            evaluator.cleanup_all()
            self.outcome.phases = sorted(evaluator.clock, key=lambda entry: entry["at"])

    def _crashed(self, evaluator: SdkEvaluator, exc: Exception) -> EvaluationResult | None:
        infra = self._infra_cause(evaluator, exc)
        if infra is not None:
            self.outcome.infra_error = infra
            return None
        # Inside the submission's windows: `programbench eval` (eval_batch._evaluate_instance) scores an instance
        # whose pipeline raised as 0, with the exception's type as its error code. So do we, whatever the type.
        code = official_error_code(exc)
        log.warning("%s: the official pipeline raised inside the submission's containers: %s", self.task.instance_id,
                    f"{type(exc).__name__}: {exc}", exc_info=not isinstance(exc, OFFICIAL_RAISES))
        result = self._not_run(evaluator, code, str(exc))
        self.outcome.notes.append(_crash_note(exc, code))
        return result

    def _infra_cause(self, evaluator: SdkEvaluator, exc: Exception) -> str | None:
        """What the submission cannot cause behind a crash: the compile container not starting, the engine's
        connection, a hidden test archive gone (None: the submission's)."""
        text = f"{type(exc).__name__}: {exc}"
        if not evaluator.compile_env_started:
            return f"could not start the compile container from {self.image}: {text}"
        if _is_connection_failure(exc):
            return f"Docker engine connection failed during evaluation: {text}"
        lost = getattr(exc, "filename", None)
        if isinstance(exc, FileNotFoundError) and lost and Path(str(lost)).is_relative_to(self.blobs.directory):
            return f"a hidden test archive disappeared during the evaluation: {text}"
        return None

    def _not_run(self, evaluator: SdkEvaluator, code: str, details: str) -> EvaluationResult:
        result = _official_not_run(self.task.instance_id, self.active, self.tests_by_branch, error_code=code,
                                   error_details=details, log_entries=[*evaluator.result.log, *evaluator.crash_log])
        result.executable_hash = evaluator.result.executable_hash
        return result

    def _fill_outcome(self, result: EvaluationResult, evaluator: SdkEvaluator, probe: _Probe, archive: ArchiveCheck,
                      audit: HiddenTestAudit) -> None:
        outcome = self.outcome
        fill_scores(outcome, result, self.instance)
        if self.settings.strict:
            outcome.notes.append(STRICT_NETWORK_NOTE)
        outcome.timeouts = list(evaluator.timed_out)
        outcome.reruns = bool(evaluator._has_rerunfailures)
        outcome.reruns_reason = _reruns_reason(evaluator, probe.wheels)
        outcome.reruns_install = probe.install
        outcome.reference_hash = probe.reference_hash
        outcome.neutralised = list(probe.neutralised)
        outcome.notes.extend(probe.notes)
        outcome.notes.extend(evaluator.results_notes)
        audit_note = audit.report.note()
        if audit_note is not None:
            outcome.notes.append(audit_note)
        outcome.integrity_flags = integrity.merge(
            archive.flags,
            probe.compile_flags,
            integrity.executable_flags(result.executable_hash, probe.eval_clean_hashes, probe.reference_hash),
            results_check.check_attempts(evaluator.attempts),
            audit.flags,
        )
