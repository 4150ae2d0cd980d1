"""A task's run, step by step: task → blobs → image → (relay →) sandbox → agent → submission → evaluation → outcome.

``TaskRun`` holds one task's state and does each step's work; the fixtures of ``pytest_layer/fixtures.py`` are thin
wrappers that call one step each, so that pytest sees (``--setup-show``), orders, finalises and lets users override
every step.
The run outlives one attempt (it is the item's, not a fixture's value): what an attempt finished and must never be
done twice (the agent's run, the packed submission) is kept on it, and a retry's fixtures find it there.

Everything before the submission's own windows that fails is infrastructure (``InfrastructureError``, reported as a
pytest error); everything inside them is scored the official way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from docker.errors import NotFound
from programbench.utils.load_data import get_active_branches, get_ignored_tests

from pytest_programbench.agents.agent import AgentResult, AgentRunner, AgentSpec
from pytest_programbench.core.atomic import atomic_copy
from pytest_programbench.core.cache import cache_root
from pytest_programbench.core.task_key import ATTEMPT, GOLD, TaskKey
from pytest_programbench.engine import disk, runtimes
from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.engine.images import ImageError, ensure_image
from pytest_programbench.evaluation import evaluation
from pytest_programbench.pipeline.model_relay import TaskRelay
from pytest_programbench.pipeline.room import run_dir_need
from pytest_programbench.relay.contract import BRIDGE_SCRIPT, SANDBOX_BRIDGE_PORT
from pytest_programbench.relay.relay_bridge import connect_unix
from pytest_programbench.relay.relay_tunnel import RelayTunnel
from pytest_programbench.results import coverage, task_meta, timeline
from pytest_programbench.results.artifacts import TaskArtifacts
from pytest_programbench.results.atif import AtifBuilder
from pytest_programbench.results.corrected import recomputed_fields
from pytest_programbench.results.gold import GoldError, reference_bytes, require_reference_built, write_submission
from pytest_programbench.results.task_meta import TaskMeta
from pytest_programbench.results.transcript import write_transcript
from pytest_programbench.results.verdict import InfrastructureError, TaskOutcome
from pytest_programbench.sandbox.sandbox import (
    Sandbox,
    SandboxError,
    SubmissionTooLarge,
    SubmissionUnpackable,
    sandbox_storage_need,
)
from pytest_programbench.tasks.blobs import BlobError, resolve_blobs
from pytest_programbench.tasks.catalogue import CatalogueError, Task

if TYPE_CHECKING:
    from pytest_programbench.engine.engines import EngineLease
    from pytest_programbench.engine.images import ResolvedImage
    from pytest_programbench.engine.protocol import DockerEngine
    from pytest_programbench.evaluation.evaluation import EvaluationOutcome
    from pytest_programbench.pipeline.run_context import RunContext
    from pytest_programbench.relay.relay import ModelRelay
    from pytest_programbench.tasks.blobs import BlobSet

log = logging.getLogger("pytest_programbench")



class TaskLog(logging.LoggerAdapter[logging.Logger]):
    """Every progress line names its task, so ``--log-cli-level=INFO`` reads well under xdist too."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['task'] if self.extra else '?'}] {msg}", kwargs


class TaskRun:
    """One task's run: its state across attempts and the work of each step (the fixtures call these)."""

    def __init__(self, session: RunContext, task: Task, *, key: TaskKey | None = None,
                 artifacts_root: Path | None = None, record: bool = True) -> None:
        self.session = session
        self.settings = session.settings
        self.task = task
        # Which attempt (--pb-attempts) or gold run (--pb-gold): its own files, labels and live line.
        self.key = key or TaskKey(task.instance_id)
        # record=False: a user's own test over this task (its files apart, no pb-meta.json, no live phases).
        self.record = record
        self.artifacts = TaskArtifacts(artifacts_root or self.key.run_root(session.identity.path), task.instance_id)
        self.labels = Labels(session.identity.run_id, session.worker_id, self.key.name)
        self.log = TaskLog(log, {"task": self.key.name})
        self.timings: dict[str, float] = {}
        self.phases: list[dict[str, Any]] = []  # when each phase started and how long it took (report.html's timeline)
        # Kept across infrastructure retries: the agent runs once.
        self.agent_result: AgentResult | None = None
        self.submission: Path | None = None
        self.gold_reference: str | None = None  # --pb-gold: the reference's sha256, what the build must produce
        self.lease: EngineLease | None = None  # this attempt's engine (--pb-docker-host)
        self.engine: DockerEngine | None = None  # this attempt's engine client (set by lease_engine)
        self.engines_tried: list[str] = []
        self.retried_after: list[str] = []  # the infrastructure errors of earlier attempts (the item's retries)
        self.pack_error = ""
        self.pack_error_code = "submission_too_large"
        self.agent_notes: list[str] = []  # from the agent's window (call log, packing): joined to the outcome
        self.agent_flags: list[str] = []
        self.reused = False
        self.sandbox: Sandbox | None = None
        self.tunnel: RelayTunnel | None = None
        self._instance: dict[str, Any] | None = None
        self.meta: TaskMeta = task_meta.new(
            task.instance_id, session.identity.run_id, session.worker_id,
            attempt=None if self.key.single or self.key.kind != ATTEMPT else self.key.n,
            gold_run=self.key.n if self.key.kind == GOLD else None)
        # The model relay of the agent's window and what it recorded (--pb-model-endpoint).
        self.model = TaskRelay(self)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.log.info("%s ...", name)
        if self.session.progress is not None and self.record:  # the live view (--pb-progress)
            self.session.progress.phase(self.key.name, name)
        started, at = time.monotonic(), time.time()
        try:
            yield
        finally:
            self.timings[name] = round(time.monotonic() - started, 3)
            self.phases.append({"phase": name, "at": round(at, 3), "seconds": self.timings[name]})
            self.log.info("%s done in %.1f s", name, self.timings[name])

    # -- one attempt ------------------------------------------------------------------------------------------

    def attempt(self, steps: Callable[[], TaskOutcome]) -> TaskOutcome:
        """One attempt of the steps (the item's fixtures); its state and pb-meta.json are written either way."""
        try:
            outcome = steps()
        except EngineUnavailable as exc:
            self.meta.update({"state": "error", "infra_error": str(exc)})
            if self.lease is not None and self.session.engines is not None:
                # Its other tasks will fail the same way: every worker avoids it until it answers a probe again.
                self.session.engines.mark_down(self.lease.spec, str(exc))
            raise InfrastructureError(str(exc)) from exc
        except InfrastructureError as exc:
            self.meta.update({"state": "error", "infra_error": str(exc)})
            raise
        except BaseException as exc:
            self.meta.update({"state": "interrupted", "error": f"{type(exc).__name__}: {exc}"})
            raise
        else:
            if self.retried_after:
                outcome.notes = [*outcome.notes, *(f"infrastructure retry after {r}" for r in self.retried_after)]
            self.meta.update({"state": "finished", "outcome": outcome.as_dict()})
            return outcome
        finally:
            self.write_meta()
            if self.record and self.artifacts.dir.exists() and not self.reused:
                timeline.save(self.artifacts.dir)  # once, here: the report's end reads it, not every call

    def write_meta(self) -> None:
        self.meta["timings"] = self.timings
        self.meta["phases"] = self.phases
        if self.record and self.artifacts.dir.exists() and not self.reused:
            self.artifacts.write_meta(self.meta)

    # -- engine -----------------------------------------------------------------------------------------------

    def lease_engine(self) -> Any:
        """This attempt's engine client: --pb-docker-host's least busy one that is up (one the task failed on
        before only when no other is), else the environment's; the run directory's and engine's room checked."""
        pool = self.session.engines
        self.lease, self.engine = None, None
        if pool is not None:
            with self.phase("engine"):
                lease = pool.lease(avoid=self.engines_tried, task=self.task.instance_id)
            self.engines_tried.append(lease.spec.name)
            self.meta["engine"] = lease.spec.name
            self.meta.setdefault("engines_tried", []).append(lease.spec.name)
            try:
                self.engine = self.session.docker_engines.client(lease.url)
            except BaseException:
                lease.release()
                raise
            self.lease = lease
        try:
            # A DiskSpaceError is an EngineUnavailable: an error. An agent run also needs its sandbox's storage.
            engine = self.engine = self.engine or self.session.docker_engines.client()
            # Every container of the task runs under it (docker_engine.EngineRun sets it on each create).
            self.meta["runtime"] = self.settings.runtime or runtimes.default(engine.api)
            runs_agent = self.session.submissions is None and not self.settings.gold
            sandbox_need = sandbox_storage_need(engine.api) if runs_agent else 0
            disk.require_for_run(self.artifacts.dir.parent, engine_api=engine.api, run_dir_need=run_dir_need(),
                                 sandbox_need=sandbox_need)
        except EngineUnavailable as exc:
            if self.lease is not None and self.session.engines is not None:
                self.session.engines.mark_down(self.lease.spec, str(exc))
            self.release_engine()
            raise
        self.artifacts.dir.mkdir(parents=True, exist_ok=True)
        return engine

    def engine_client(self) -> Any:
        """This attempt's engine client; the run's default engine when no lease was taken (a conftest.py that
        overrides the engine fixture): never a client outside the session's, which would miss the run's labels."""
        return self.engine or self.session.docker_engines.client()

    def release_engine(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    # -- task, blobs, image -----------------------------------------------------------------------------------

    def instance(self) -> dict[str, Any]:
        """tests.json and task.yaml, read once."""
        if self._instance is None:
            with self.phase("task"):
                try:
                    self._instance = self.task.load_instance()
                except CatalogueError as exc:
                    raise InfrastructureError(f"malformed task: {exc}") from exc
        return self._instance

    def resolve_blobs(self) -> BlobSet:
        """Resolved before any agent or evaluation time is spent: a failure here is fast and an error."""
        instance = self.instance()
        with self.phase("blobs"):
            try:
                blobs = resolve_blobs(self.task, get_active_branches(instance), blob_dir=self.settings.blob_dir)
            except BlobError as exc:
                raise InfrastructureError(str(exc)) from exc
            self.meta["blobs"] = {"source": blobs.source, "sha256": dict(blobs.sha256)}
        return blobs

    def ensure_image(self) -> ResolvedImage:
        with self.phase("image"):
            try:
                image = ensure_image(self.task, tag=self.settings.image_tag, pull=self.settings.pull,
                                     labels=self.labels.as_dict(), engine=self.engine_client(),
                                     lock_dir=self._image_lock_dir())
            except ImageError as exc:
                raise InfrastructureError(str(exc)) from exc
            self.meta["image"] = dataclasses.asdict(image)
        return image

    def _image_lock_dir(self) -> Path | None:
        """One build or pull of an image per engine: the lock is the engine's (default: the shared one)."""
        if self.engine is None or self.session.engines is None:
            return None

        return cache_root() / "image-locks" / hashlib.sha256(str(self.meta.get("engine")).encode()).hexdigest()[:16]

    def reuse_finished(self, image: ResolvedImage, blobs: BlobSet) -> TaskOutcome | None:
        """--pb-resume: a task that finished before keeps its result (no agent re-run) if nothing it used changed."""
        if not self.session.identity.resumed or not self.record:
            return None
        previous = self.artifacts.read_meta()
        recorded = previous.get("outcome") if previous else None
        if not previous or previous.get("state") != "finished" or not isinstance(recorded, dict):
            return None
        changed = []
        if (previous.get("image") or {}).get("id") != image.id:
            changed.append(f"image {image.ref}: {(previous.get('image') or {}).get('id')} -> {image.id}")
        before = previous["blobs"]["sha256"] if "blobs" in previous else {}
        if dict(before) != dict(blobs.sha256):
            changed.append(f"hidden test archives: {before} -> {dict(blobs.sha256)}")
        if changed:
            raise InfrastructureError("--pb-resume refused for this task, it changed since it ran: "
                                      + "; ".join(changed))
        self.reused = True
        self.log.info("reusing the finished result of the resumed run")
        data = dict(recorded)
        data["notes"] = [*data.get("notes", []), f"result reused from the resumed run {previous.get('run_id')}"]
        if data.get("score_corrected") is None and data.get("tests"):  # recorded before the corrected score was
            data.update(recomputed_fields(self.artifacts.eval_json, self.instance()))
        return TaskOutcome(**data)

    # -- the agent's window: relay, sandbox, agent, pack ------------------------------------------------------

    def open_sandbox(self, image: ResolvedImage, *, tunnel_to: ModelRelay | None = None) -> Sandbox:
        """Only the sandbox itself failing is infrastructure."""
        with self.phase("sandbox"):
            sandbox = Sandbox.for_task(self.task, self.settings, self.labels, image_id=image.id,
                                       engine=self.engine_client(), remote=self._engine_is_remote())
            self.sandbox = sandbox
            try:
                sandbox.start()
                if tunnel_to is not None:
                    self.tunnel = self._open_tunnel(sandbox, tunnel_to)
            except (SandboxError, RuntimeError) as exc:
                self.close_sandbox()
                raise InfrastructureError(f"sandbox: {exc}") from exc
            self.meta["sandbox"] = {"container": sandbox.id, "proxy_client": sandbox.proxy_client.label,
                                    "reference_kind": sandbox.layout.reference_kind}
        return sandbox

    def close_sandbox(self) -> None:
        tunnel, self.tunnel = self.tunnel, None
        sandbox, self.sandbox = self.sandbox, None
        try:
            if tunnel is not None:
                tunnel.close()
        finally:
            if sandbox is not None:
                sandbox.close()

    def end_agent_window(self) -> None:
        """The agent's window is over once its work is packed: its sandbox and relay go before the evaluation;
        then a model API that was unavailable makes the task an error (``TaskRelay.require_available``)."""
        try:
            self.close_sandbox()
        finally:
            self.model.close()
            self.write_atif()
        self.model.require_available()

    def write_atif(self) -> None:
        """The attempt's trajectory in Harbor's ATIF beside ours (results/atif.py), once the relay's records are
        complete. A file that cannot be written is a note, never a verdict."""
        if self.agent_result is None:
            return
        spec = self.session.agent_spec
        label = spec.label if spec is not None else "agent"
        name, _, agent_version = label.partition("@") if spec is not None and spec.cli is not None else (label, "", "")
        builder = AtifBuilder(self.artifacts.dir, session_id=f"{self.session.identity.run_id}/{self.key.name}",
                              agent=name, agent_version=agent_version or "unknown", model=self.settings.model)
        try:
            self.meta["atif"] = builder.write().name
        except (OSError, ValueError) as exc:
            self.agent_notes.append(f"trajectory.atif.json not written: {exc}")
            return
        try:  # the same steps as a page a person reads (results/transcript.py)
            write_transcript(self.artifacts.dir)
        except OSError as exc:
            self.agent_notes.append(f"transcript.html not written: {exc}")

    def write_prompt(self, sandbox: Sandbox, *, on_host: bool) -> str:
        """The prompt (task docs + rules, the prompt hook applied), written to the sandbox's prompt file."""
        spec = self.session.agent_spec or AgentSpec("command", on_host=on_host)
        runner = AgentRunner(dataclasses.replace(spec, on_host=on_host), self.task, self.settings,
                             log_path=self.artifacts.agent_log, config=self.session.config)
        return runner.write_prompt(sandbox)

    def run_agent(self, agent: Any, sandbox: Sandbox, prompt: str) -> AgentResult:
        """``agent.run(sandbox, prompt)``, then the window's end (``Sandbox.end_agent_window``: the sandbox frozen
        and stopped); once that found the sandbox alive, or brought down by the agent itself (its memory limit's
        OOM killer), the run counts and is never repeated."""
        # The configured agent's --pb-agent label, else (a conftest.py's own agent) its class.
        self.meta["agent"] = {"spec": getattr(agent, "label", None) or type(agent).__name__}
        try:
            with self.phase("agent"):
                started = time.monotonic()
                try:
                    returned = agent.run(sandbox, prompt)
                except SandboxError as exc:
                    # The sandbox went away under the agent: whose doing was it? (Infrastructure raises below.)
                    if not sandbox.end_agent_window().agent_caused:
                        raise
                    returned = AgentResult(None, False, time.monotonic() - started, self.artifacts.agent_log,
                                           [f"the agent's run ended with its sandbox: {exc}"])
                if not isinstance(returned, AgentResult):  # a Python agent: its result, or nothing
                    returned = AgentResult(getattr(returned, "exit_code", 0), bool(getattr(returned, "timed_out",
                                                                                            False)),
                                           time.monotonic() - started, self.artifacts.agent_log,
                                           list(getattr(returned, "notes", None) or []))
                ended = sandbox.end_agent_window()  # (done already by AgentRunner: the same answer)
            self.meta["agent"].update(returned.meta())
            # A sandbox that died under the agent for another reason (its engine went away) ended the agent: it may
            # run again. One that outlived it, or that the agent itself brought down, makes the run count: from
            # here on the agent is never run a second time.
            if ended.died and not ended.agent_caused:
                raise InfrastructureError(ended.died)
            self.meta["sandbox_end"] = dataclasses.asdict(ended)
            self.agent_result = returned
            self.agent_notes += returned.notes  # a failed --pb-agent-setup, processes left running, ...
            self.agent_notes += [note for note in ended.notes() if note not in returned.notes]
            # Before packing, so that it is kept whatever packing does. Unreadable: a note and a flag, scored.
            calls = sandbox.save_call_log(self.artifacts.binary_calls)
        except SandboxError as exc:
            raise InfrastructureError(f"sandbox: {exc}") from exc
        self.meta["binary_calls"] = calls.count
        self.meta["binary_calls_unrecorded"] = calls.unrecorded
        self.agent_notes += calls.notes()
        if calls.problem:
            self.agent_flags.append("call-log-unreadable")
        if calls.unrecorded:  # the audit is incomplete, as with an unreadable log
            self.agent_flags.append("call-log-incomplete")
        return returned

    def require_agent_not_run(self) -> None:
        """The agent runs once per task: after it ended, a failing later step is retried on its own, and an agent
        whose work was lost with its sandbox is not run again (its cost is paid; ``--pb-resume`` can)."""
        if self.agent_result is not None:
            raise InfrastructureError(
                "the agent finished but its sandbox was lost before its work was packed; the agent is not run a "
                "second time (re-run the task with --pb-resume)", retryable=False)

    def pack(self, sandbox: Sandbox) -> Path | None:
        """``/workspace/src`` as submission.tar.gz; too large or unpackable: the agent's doing, scored 0 (None)."""
        with self.phase("pack"):
            try:
                size = self._pack(sandbox)
            except (SubmissionTooLarge, SubmissionUnpackable) as exc:  # the agent's files: scored 0
                self.meta.setdefault("agent", {})["pack_error"] = str(exc)
                self.pack_error = str(exc)
                if isinstance(exc, SubmissionUnpackable):
                    self.pack_error_code = "submission_unpackable"
                return None
            except SandboxError as exc:
                raise InfrastructureError(f"sandbox: {exc}") from exc
            self.meta["submission_bytes"] = size
        self.submission = self.artifacts.submission
        return self.submission

    def _pack(self, sandbox: Sandbox) -> int:
        """Pack ``/workspace/src``; an engine failure is retried in place (``--pb-infra-retries``), never the agent."""
        failures: list[str] = []
        while True:
            try:
                size = sandbox.pack_src(self.artifacts.submission)
            except SandboxError as exc:
                failures.append(str(exc))
                self.log.warning("packing failed (%s): %s", len(failures), exc)
                if len(failures) > self.settings.infra_retries:
                    raise InfrastructureError(
                        "packing the agent's work failed after the agent finished (the agent is not run a second "
                        "time): " + "; ".join(failures), retryable=False) from exc
                self.require_present(sandbox)
                continue
            if failures:
                self.meta.setdefault("notes", []).append(f"packing retried after: {'; '.join(failures)}")
            return size

    def given_submission(self) -> Path | None:
        """Evaluate-only (--pb-submissions): the given archive, copied into the run directory first."""
        submissions = self.session.submissions
        assert submissions is not None
        if not submissions.has(self.task.instance_id):
            return None
        self.artifacts.dir.mkdir(parents=True, exist_ok=True)
        atomic_copy(submissions.archive(self.task.instance_id), self.artifacts.submission)
        self.meta["submission_source"] = str(submissions.archive(self.task.instance_id))
        self.submission = self.artifacts.submission
        return self.submission

    def gold_submission(self, image: ResolvedImage) -> Path:
        """--pb-gold: the reference's own bytes as the submission (results/gold.py), read from the task image."""
        engine = self.engine_client()
        with self.phase("gold"):
            try:
                data = reference_bytes(engine.api, image.id, self.labels.as_dict())
            except GoldError as exc:
                raise InfrastructureError(f"--pb-gold: {exc}") from exc
            try:
                self.gold_reference = write_submission(self.artifacts.submission, data, run=self.key.n,
                                                       clean_hashes=self.task.eval_clean_hashes)
            except GoldError as exc:  # the same bytes again next time: not retried
                raise InfrastructureError(f"--pb-gold: {exc}", retryable=False) from exc
        self.meta["submission_source"] = f"--pb-gold: the reference of {image.ref}, gold run {self.key.n}"
        self.meta["submission_bytes"] = self.artifacts.submission.stat().st_size
        self.submission = self.artifacts.submission
        return self.submission

    def _engine_is_remote(self) -> bool:
        """Not on this machine: nothing of the host's filesystem may be bind-mounted into its containers."""
        pool = self.session.engines
        name = self.meta.get("engine")
        return pool is not None and any(spec.remote for spec in pool.specs if spec.name == name)

    @staticmethod
    def _open_tunnel(sandbox: Sandbox, relay: ModelRelay) -> RelayTunnel:
        """The relay reaches an in-sandbox agent through an exec stream: no bind mount, any engine."""
        socket_path = str(relay.socket_path)
        return RelayTunnel(sandbox.engine.api, sandbox.id, lambda: connect_unix(socket_path)).open(
            SANDBOX_BRIDGE_PORT, script=BRIDGE_SCRIPT.read_bytes())

    def require_present(self, sandbox: Sandbox) -> None:
        """After the window the sandbox is stopped, its files still there: one that disappeared lost them."""
        try:
            sandbox.engine.api.inspect_container(sandbox.id)
        except NotFound:
            raise InfrastructureError(f"sandbox container {sandbox.id[:12]} disappeared before its files were "
                                      "packed", retryable=False) from None

    # -- evaluation and outcome -------------------------------------------------------------------------------

    def evaluate(self, submission: Path, image: ResolvedImage, blobs: BlobSet) -> EvaluationOutcome:
        """The official evaluation; the official result goes to <id>.eval.json."""
        with self.phase("evaluation"):
            result = evaluation.evaluate(
                self.task, submission, blobs=blobs, image=image.id, labels=self.labels,
                # --pb-gold evaluates the reference itself: nothing to audit for reading the tests.
                settings=evaluation.EvalSettings.from_settings(
                    self.settings, **({"audit": False} if self.key.kind == GOLD else {})),
                workdir=self.artifacts.dir,
                engine=self.engine_client(),
            )
        source = self.meta.get("submission_source")
        if source and result.error_details:  # the file the user passed, not our copy of it in the run directory
            result.error_details = result.error_details.replace(str(submission), str(source))
        self.meta["evaluation"] = result.meta()
        if result.infra_error is None and self.key.kind != GOLD:
            # After the evaluation, on the host: the hidden tests' options against the agent's calls (coverage.py).
            self.meta["coverage"] = coverage.measure_task([blobs.archive(b) for b in blobs.branches],
                                                          self.artifacts.binary_calls)
        if self.settings.prune_images and image.source in ("built", "pulled"):
            engine = self.engine_client()
            self.meta["pruned"] = dataclasses.asdict(disk.prune_images([image.id], engine=engine))
        if result.infra_error:
            raise InfrastructureError(result.infra_error)
        if result.result is not None and self.record:
            self.artifacts.write_eval_json(result.result)
        if self.key.kind == GOLD:
            self._require_reference_built(result)
        return result

    def _require_reference_built(self, result: EvaluationOutcome) -> None:
        """--pb-gold: a run whose build is not the reference measured nothing (its eval.json stays, to say why)."""
        try:
            require_reference_built(result.error_code, result.executable_hash, self.gold_reference,
                                    details=result.error_details or "")
        except GoldError as exc:
            # Not retried: the same reference and compile.sh fail the same way again.
            raise InfrastructureError(f"--pb-gold: {exc}", retryable=False) from exc

    def outcome(self, result: EvaluationOutcome) -> TaskOutcome:
        outcome = self._with_agent(task_outcome(result, self.instance()))
        self.log.info("verdict: score %.4f (%d/%d)", outcome.score, outcome.n_passed, outcome.n_tests)
        return outcome

    def no_submission(self) -> TaskOutcome:
        instance = self.instance()
        ignored = get_ignored_tests(instance)
        n_tests = sum(
            1 for branch in get_active_branches(instance) for name in instance["branches"][branch].get("tests", [])
            if f"{branch}/{name}" not in ignored
        )
        if self.pack_error:
            code, note = self.pack_error_code, self.pack_error
        else:
            code, note = "no_submission", f"no submission.tar.gz in {self.settings.submissions} (--pb-require-all)"
        self.meta["outcome"] = code
        return self._with_agent(TaskOutcome(self.task.instance_id, score=0.0, n_passed=0, n_tests=n_tests,
                                            error_code=code, notes=[note], score_corrected=0.0,
                                            n_passed_corrected=0, n_tests_corrected=n_tests))

    def _with_agent(self, outcome: TaskOutcome) -> TaskOutcome:
        """The agent's clock and exit status join the outcome (the verdict stays the score alone)."""
        if self.agent_result is not None:
            outcome.agent_exit = self.agent_result.exit_code
            outcome.agent_seconds = round(self.agent_result.seconds, 3)
            if self.agent_result.clock_fired:
                outcome.clock_fired = self.agent_result.clock_fired
        if self.model.stats is not None:
            outcome.tokens = {k: v for k, v in self.model.stats.items() if isinstance(v, int | float | None)}
        if self.agent_notes:
            outcome.notes = [*outcome.notes, *self.agent_notes]
        if self.agent_flags:
            outcome.flags = [*outcome.flags, *(f for f in self.agent_flags if f not in outcome.flags)]
        return outcome


def scored_tests(result: EvaluationOutcome, instance: dict[str, Any]) -> dict[str, str]:
    """Per-test statuses of exactly the tests the official score counts (active branches, ignored tests out)."""
    if result.result is None:
        return {}
    scoped = result.result.for_branches(get_active_branches(instance)).without_ignored(get_ignored_tests(instance))
    return {t.full_name: t.status for t in scoped.test_results}


def task_outcome(result: EvaluationOutcome, instance: dict[str, Any]) -> TaskOutcome:
    notes = []
    if result.strict and result.neutralised:
        notes.append(f"--pb-strict neutralised before the hidden tests: {', '.join(result.neutralised)}")
    notes.append(f"reruns: {'on' if result.reruns else 'off'}" + (f" ({result.reruns_reason})"
                                                                 if result.reruns_reason else ""))
    if result.error_details and result.error_code:
        notes.append(f"{result.error_code}: {result.error_details.strip().splitlines()[-1][:300]}")
    notes.extend(result.notes)  # a cause of a 0, the network used under --pb-strict
    corrected = result.corrected.outcome_fields() if result.corrected is not None else {}
    if result.corrected is not None:
        notes.extend(result.corrected.notes)
    return TaskOutcome(
        result.instance_id, score=result.score, n_passed=result.n_passed, n_tests=result.n_tests,
        error_code=result.error_code, failing_branches=result.failing_branches, branch_errors=result.branch_errors,
        flags=[str(flag) for flag in result.integrity_flags], clock_fired=result.clock_fired,
        executable_hash=result.executable_hash, compile_seconds=result.compile_seconds,
        test_seconds=result.test_seconds, reruns=result.reruns, notes=notes, tests=scored_tests(result, instance),
        **corrected,
    )
