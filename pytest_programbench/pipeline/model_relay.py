"""The model relay of a task's agent window (``--pb-model-endpoint``) and its bookkeeping: started before the sandbox,
closed after it, its waits shown live, what it recorded (usage, refusals, an unavailable API, a spent budget) joined
to the task's meta, notes and flags; an API that failed the task makes it an error, not a score."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pytest_programbench.relay.contract import REPLAY_FILE, RelayConfigError, configured_key_style
from pytest_programbench.relay.rate import RunRateLimit
from pytest_programbench.relay.slots import SLOTS_DIR, ModelSlots
from pytest_programbench.relay.spend import SPEND_DIR, SpendLedger
from pytest_programbench.results.verdict import InfrastructureError

if TYPE_CHECKING:
    from pytest_programbench.agents.agent import AgentSpec
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.core.task_key import TaskKey
    from pytest_programbench.pipeline.run_context import RunContext
    from pytest_programbench.relay.relay import ModelRelay
    from pytest_programbench.results.artifacts import TaskArtifacts
    from pytest_programbench.results.task_meta import TaskMeta
    from pytest_programbench.tasks.catalogue import Task


def configured_models(settings: Settings, spec: AgentSpec | None) -> tuple[str, ...]:
    """The models the run was configured with, which the relay pins: ``--pb-model``, else the CLI preset's default
    (what the preset passes its CLI); none for another agent without ``--pb-model`` (the relay then pins none)."""
    if settings.model:
        return (settings.model,)
    if spec is not None and spec.cli is not None:
        return (spec.cli.preset.default_model,)
    return ()


def anthropic_client(settings: Settings, spec: AgentSpec | None) -> bool:
    """Whether the agent is configured to speak Anthropic Messages: claude-code, or mini-swe-agent (litellm) with an
    ``anthropic/`` model. Decides the key's header with the endpoint (``configured_key_style``)."""
    if spec is not None and spec.cli is not None:
        return spec.cli.preset.api.startswith("Anthropic")
    return spec is not None and spec.kind == "mini-swe-agent" and str(settings.model).startswith("anthropic/")


class RelayHost(Protocol):
    """What the relay's bookkeeping reads of its task's run (``TaskRun``) and adds to."""

    session: RunContext
    settings: Settings
    task: Task
    key: TaskKey
    record: bool
    artifacts: TaskArtifacts
    meta: TaskMeta
    agent_notes: list[str]
    agent_flags: list[str]


class TaskRelay:
    """One task's model relay (``relay``, None until started and after it closed) and what it recorded."""

    def __init__(self, run: RelayHost) -> None:
        self.run = run
        self.relay: ModelRelay | None = None
        self.stats: dict[str, Any] | None = None
        self.unavailable: str | None = None  # ModelRelay.unavailable() of the agent's window
        self.waited_s = 0.0  # seconds the relay waited to retry model requests (the live view)
        self.rate_waited_s = 0.0  # seconds it held requests back for --pb-model-rpm / --pb-model-tpm
        self.replay_mismatch: str | None = None  # --pb-agent-replay: the first request the recording did not have
        self.over_budget: str | None = None  # --pb-budget: requests refused once the run had spent it (x1.1)
        self.loop_refused: str | None = None  # the agent's loop offered the model no shell tool
        self.outdated_client: str | None = None  # the provider refused the agent's client as outdated

    def start(self, *, on_host: bool) -> ModelRelay | None:
        """--pb-model-endpoint: the agent's only way out, recorded per task."""
        settings, run_dir, task_dir = self.run.settings, self.run.session.identity.path, self.run.artifacts.dir
        if not settings.model_endpoint:
            return None
        # Where the task's files sit in the run (its spend's name, its recording in an earlier run).
        where = task_dir.relative_to(run_dir) if task_dir.is_relative_to(run_dir) else Path(self.run.task.instance_id)
        concurrency, rpm, tpm = settings.model_concurrency, settings.model_rpm, settings.model_tpm
        slots = ModelSlots(run_dir / SLOTS_DIR, concurrency) if concurrency else None
        rate = RunRateLimit(run_dir / SLOTS_DIR, rpm=rpm, tpm=tpm) if rpm or tpm else None
        spend = None
        if settings.budget is not None and settings.token_price is not None:
            spend = SpendLedger(run_dir / SPEND_DIR, str(where), settings.token_price, settings.budget)
        replay_from = Path(settings.agent_replay) / where / REPLAY_FILE if settings.agent_replay else None
        spec = self.run.session.agent_spec
        try:  # the key's header and the pinned models come from the run's configuration, never from the agent
            key_style = configured_key_style(settings.model_endpoint, anthropic_client=anthropic_client(settings, spec))
        except RelayConfigError as exc:
            raise InfrastructureError(f"model relay: {exc}") from exc
        # The relay itself (httpx, TLS, HTTP/1.1 and SSE machinery) only in a run with a model endpoint: a session
        # without one starts without it.
        from pytest_programbench.relay.relay import ModelRelay, RetryPolicy  # noqa: PLC0415 - lazy: a heavy wing

        relay = ModelRelay(settings.model_endpoint, records_path=task_dir / "model-requests.jsonl",
                           api_key_env=settings.model_key_env, key_style=key_style,
                           models=configured_models(settings, spec), unix=not on_host, tcp=on_host,
                           retry=RetryPolicy(budget_s=settings.model_retry_budget), on_wait=self._model_wait,
                           slots=slots, on_slot_wait=self._slot_wait, replay_from=replay_from, spend=spend,
                           rate=rate, on_rate_wait=self._rate_wait,
                           allow_server_tools=settings.model_allow_server_tools,
                           # A CLI preset works by tool calls: its loop without a shell tool is misconfigured. A
                           # custom command is not judged (mini-swe-agent reads commands from text).
                           require_shell_tool=spec is not None and spec.cli is not None)
        try:
            self.relay = relay.start()
        except (RelayConfigError, OSError) as exc:
            raise InfrastructureError(f"model relay: {exc}") from exc
        return self.relay

    def close(self) -> None:
        """Records are complete once the relay is closed (the sandbox is gone by then: nothing is in flight)."""
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.close()
            self.stats = relay.stats().as_dict()
            self.run.meta["relay"] = self.stats
            self.run.meta["relay_bounds"] = relay.record_bounds()
            self.run.agent_notes += relay.notes()  # records dropped past the cap, requests refused for lack of room
            self.unavailable = relay.unavailable()
            self.replay_mismatch = relay.replay_mismatch()
            self.over_budget = relay.over_budget()
            self.loop_refused = relay.loop_refused()
            self.outdated_client = relay.outdated_client()
            self.run.meta["agent_loop"] = {"shell_tool_refused": self.loop_refused,
                                           "final_answers": relay.loop.final_answers,
                                           "outdated_client": self.outdated_client}
            cleanroom = relay.cleanroom()  # provider-side tools and other APIs the agent asked for: refused, flagged
            self.run.meta["cleanroom"] = cleanroom.as_dict()
            flag = cleanroom.flag()
            if flag is not None and flag not in self.run.agent_flags:
                self.run.agent_flags.append(flag)
            if self.unavailable is not None:
                self.run.meta["model_unavailable"] = self.unavailable

    def _model_wait(self, seconds: float) -> None:
        """The relay waits to retry a model request: the live view says so ("agent (rate-limited 40 s)"), on the
        item's key as the phase is (``<id>[attempt-2]`` under --pb-attempts)."""
        self.waited_s += seconds
        if self.run.session.progress is not None and self.run.record:
            self.run.session.progress.note(self.run.key.name, f"rate-limited {self.waited_s:.0f} s")

    def _rate_wait(self, seconds: float) -> None:
        """--pb-model-rpm / --pb-model-tpm hold a request back: the live view says so, with the task's wait so far."""
        self.rate_waited_s += seconds
        if self.run.session.progress is not None and self.run.record:
            self.run.session.progress.note(self.run.key.name,
                                       f"waiting for the model rate limit {self.rate_waited_s:.0f} s")

    def _slot_wait(self) -> None:
        """Every --pb-model-concurrency slot is taken: the live view says the agent waits for one."""
        if self.run.session.progress is not None and self.run.record:
            self.run.session.progress.note(self.run.key.name, "waiting for a model slot")

    def require_available(self) -> None:
        """A model API that rejected the key or stayed down for a whole retry budget is not the agent's failure:
        the task is an error (resumable), not a score of its half-finished work, unless --pb-model-failures-scored."""
        if self.replay_mismatch is not None:
            raise InfrastructureError(f"--pb-agent-replay: first mismatch: {self.replay_mismatch}", retryable=False)
        if self.loop_refused is not None:  # the agent's configuration: never a failure, whatever it did
            raise InfrastructureError(f"agent configuration: {self.loop_refused}; the relay refused its model calls, "
                                      "so the task is not scored (fix the agent's configuration, then --pb-resume)",
                                      retryable=False)
        if self.outdated_client is not None:  # the run's pin of the CLI, not the agent's work
            raise InfrastructureError(f"{self.outdated_client}; pin a newer version (--pb-agent NAME@VERSION; "
                                      "--pb-preflight asks the provider before a run), then --pb-resume",
                                      retryable=False)
        if self.over_budget is not None:  # never a score, whatever --pb-model-failures-scored says
            raise InfrastructureError(f"{self.over_budget}; the agent's files are kept in {self.run.artifacts.dir} "
                                      "(--pb-resume with a larger --pb-budget runs the task again)", retryable=False)
        reason = self.unavailable
        if reason is None:
            return
        if self.run.settings.model_failures_scored:
            self.run.agent_notes.append(f"{reason} (scored anyway: --pb-model-failures-scored)")
            return
        raise InfrastructureError(f"{reason}; the agent's files are kept in {self.run.artifacts.dir} "
                                  "(--pb-resume runs the task again)", retryable=False)

    def answered_idle(self) -> float | None:
        """Seconds the agent has been silent since its final answer (``None``: it gave none, or is not silent)."""
        return self.relay.answered_idle() if self.relay is not None else None

    def held_seconds(self) -> float:
        """Seconds the relay held this task's model requests back so far: the agent's clock gives them back."""
        return self.relay.held_seconds() if self.relay is not None else 0.0

    def env(self, *, on_host: bool) -> dict[str, str]:
        if self.relay is None:
            return {}
        return self.relay.agent_env() if on_host else self.relay.sandbox_env()
