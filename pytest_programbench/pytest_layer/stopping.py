"""Early stops: when the first tasks show that every task would fail the same way (the agent command does not
exist, the model API rejects the key) or the run's budget is spent, no new task starts and the session says why.

``--pb-keep-going`` turns the first two off. Under xdist the controller's loop reads its own ``shouldstop``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_programbench.agents.command_check import AGENT_COMMAND_MISSING
from pytest_programbench.core.task_key import TaskKey
from pytest_programbench.relay.contract import MODEL_REJECTED
from pytest_programbench.results.verdict import AGENT_NOT_RUN

if TYPE_CHECKING:
    from pytest_programbench.pytest_layer.run_state import RunState

# Tasks whose agent all exited 127/126 (never ran) before the session stops; --pb-keep-going turns it off.
STOP_AFTER_AGENT_NOT_RUN = 3
# Tasks whose model API rejected the key (401/403) before any task was scored, before the session stops.
STOP_AFTER_MODEL_REJECTED = 2


class EarlyStops:
    """Watches finished reports (a plugin object, registered with the session) and stops the run early."""

    def __init__(self, pb: RunState) -> None:
        self.pb = pb  # the opted-in session whose state this reads
        self.settings = pb.settings
        # The agent's exit statuses of the first tasks, while none of them ran (127/126): see _watch_agent_exit.
        self.agent_not_run: list[tuple[str, int]] = []
        self.agent_ran = False
        self.model_rejected: list[str] = []  # the first tasks whose key was rejected, while none was scored
        self.scored_any = False
        self.stop_reason = ""

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """After the progress line is written: a missing agent, a rejected key or a spent budget stops the run."""
        key = TaskKey.of_nodeid(report.nodeid)
        if key is None:
            return
        instance_id = key.name
        if report.when == "call":
            self.scored_any = True
            self._watch_agent_exit(instance_id, dict(report.user_properties).get("agent_exit"))
        elif report.when == "setup" and report.failed:
            self._watch_agent_command(report.user_properties)
            self._watch_model_rejected(instance_id, report.user_properties)
        if report.when == "teardown":
            self._watch_budget()


    def _watch_budget(self) -> None:
        """--pb-budget: once spent plus the running tasks' projected cost passes it, no new task starts (the rest
        is not run, resumable with a larger budget)."""
        summary = self.pb.summary
        if summary is None or summary.budget is None or self.stop_reason:
            return
        # At a task's end the live view may not have seen the others start (or is off): every other worker is
        # assumed busy then.
        workers = getattr(self.pb.config.option, "numprocesses", None)
        state = summary.budget_state(len(summary.in_flight) or max(0, (workers if isinstance(workers, int) else 1) - 1))
        if state is None or not state.passes:
            return
        summary.budget.stopped = True
        self._stop(f"programbench: stopping: budget: ${state.spent:.4f} spent + ${state.projected - state.spent:.4f} "
                   f"projected for {state.running} running task(s) passes --pb-budget ${state.limit:g}; the tasks "
                   "not started are not run (--pb-resume with a larger --pb-budget runs them)")

    def _watch_agent_command(self, properties: list[tuple[str, object]]) -> None:
        """The first sandbox did not find the agent command: every task would do the same, so nothing more runs."""
        missing = next((str(value) for name, value in properties if name == AGENT_COMMAND_MISSING), None)
        if missing is not None and not self.stop_reason:
            self._stop(f"programbench: stopping: {missing.splitlines()[0]}")

    def _watch_model_rejected(self, instance_id: str, properties: list[tuple[str, object]]) -> None:
        """Stop the session when the model API rejected the key on the first tasks: every task would do the same."""
        if self.settings.keep_going or self.stop_reason or self.scored_any:
            return
        reasons = [str(value) for name, value in properties
                   if str(name).startswith("infra_attempt_") and str(value).startswith(MODEL_REJECTED)]
        if not reasons:
            return
        self.model_rejected.append(instance_id)
        if len(self.model_rejected) < STOP_AFTER_MODEL_REJECTED:
            return
        self._stop(f"programbench: stopping: {reasons[0].split(';')[0]} on each of the first "
                   f"{len(self.model_rejected)} tasks; check --pb-model-key-env {self.settings.model_key_env!r} "
                   f"and --pb-model-endpoint {self.settings.model_endpoint!r} (--pb-resume runs the tasks once the "
                   "key works); --pb-keep-going runs every task anyway")

    def _watch_agent_exit(self, instance_id: str, agent_exit: Any) -> None:
        """Stop the session when the first tasks' agents all exited 127/126: every other task would do the same."""
        if self.settings.keep_going or self.pb.agent_spec is None or agent_exit in (None, "") or self.stop_reason:
            return
        if agent_exit not in AGENT_NOT_RUN:
            self.agent_ran = True
        if self.agent_ran:
            return
        self.agent_not_run.append((instance_id, int(agent_exit)))
        if len(self.agent_not_run) < STOP_AFTER_AGENT_NOT_RUN:
            return
        codes = sorted({code for _, code in self.agent_not_run})
        what = "; ".join(f"{code}: {AGENT_NOT_RUN[code]}" for code in codes)
        first = self.agent_not_run[0][0]
        self.stop_reason = (
            f"programbench: stopping: the agent of each of the first {len(self.agent_not_run)} tasks exited "
            f"{'/'.join(map(str, codes))} ({what}); check --pb-agent {self.settings.agent!r} (the shell's message "
            f"is in {self.pb.identity.path / first / 'agent.log'}); --pb-keep-going runs every task anyway")
        self._stop(self.stop_reason)

    def _stop(self, reason: str) -> None:
        """No new task starts; the session ends with ``reason`` (under xdist too)."""
        self.stop_reason = reason
        dsession = self.pb.config.pluginmanager.get_plugin("dsession")
        if dsession is not None:
            dsession.shouldstop = self.stop_reason  # xdist's controller loop reads its own flag
        if self.pb.pytest_session is not None:
            self.pb.pytest_session.shouldstop = self.stop_reason
