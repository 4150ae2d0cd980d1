"""Step 8 of the pipeline: the verdict. An item passes when its official score reaches ``--pb-min-score`` and no
integrity flag is raised (unless ``--pb-allow-flags``). Its JUnit properties are plain builtins (xdist ships them)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.safe_text import printable, sanitise


class InfrastructureError(Exception):
    """Something outside the agent's and the submission's windows broke: reported as an error, never a score.

    ``retryable=False`` when a retry would run the agent a second time after it already ended."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class VerdictFailure(Exception):
    """The task was scored and did not pass; the message says why."""


@dataclass
class TaskOutcome:
    """What an item reports, whatever produced it (evaluation only, or an agent run first)."""

    instance_id: str
    score: float
    n_passed: int
    n_tests: int
    error_code: str | None = None
    failing_branches: Mapping[str, Sequence[str]] = field(default_factory=dict)
    branch_errors: Mapping[str, Sequence[str]] = field(default_factory=dict)
    flags: Sequence[str] = ()
    clock_fired: str | None = None
    executable_hash: str | None = None
    compile_seconds: float | None = None
    test_seconds: float | None = None
    reruns: bool | None = None
    agent_exit: int | None = None
    agent_seconds: float | None = None
    tests: Mapping[str, str] = field(default_factory=dict)  # "<branch>/<name>" -> status, scored tests only
    tokens: Mapping[str, int | float | None] | None = None  # the model relay's counts (None: no relay)
    notes: Sequence[str] = ()

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["failing_branches"] = {k: list(v) for k, v in self.failing_branches.items()}
        data["branch_errors"] = {k: list(v) for k, v in self.branch_errors.items()}
        data["flags"] = list(self.flags)
        data["notes"] = list(self.notes)
        data["tests"] = dict(self.tests)
        data["tokens"] = dict(self.tokens) if self.tokens is not None else None
        return data


def junit_properties(outcome: TaskOutcome) -> list[tuple[str, Any]]:
    def plain(value: Any) -> Any:
        # JUnit writes str(value): "" says "none" better than "None"; xdist needs plain builtins.
        if value is None:
            return ""
        return value if isinstance(value, bool | int | float | str) else str(value)

    return [
        ("score", outcome.score),
        ("n_passed", outcome.n_passed),
        ("n_tests", outcome.n_tests),
        ("error_code", plain(outcome.error_code)),
        ("executable_hash", plain(outcome.executable_hash)),
        ("failed_branches", ",".join(sorted({*outcome.failing_branches, *outcome.branch_errors}))),
        ("compile_seconds", plain(outcome.compile_seconds)),
        ("test_seconds", plain(outcome.test_seconds)),
        ("integrity_flags", ",".join(outcome.flags)),
        ("clock_fired", plain(outcome.clock_fired)),
        ("reruns", plain(outcome.reruns)),
        ("agent_exit", plain(outcome.agent_exit)),
        ("agent_seconds", plain(outcome.agent_seconds)),
        *((f"model_{name}", plain(value)) for name, value in sorted((outcome.tokens or {}).items())),
    ]


# Shell exit statuses that mean the agent never ran: said first, before any score.
AGENT_NOT_RUN = {127: "command not found", 126: "command found but not executable"}


AGENT_LOG_TAIL = 20


def tail_lines(path: Path, n: int = AGENT_LOG_TAIL, *, max_bytes: int = 64 << 10, width: int = 400) -> list[str]:
    """The last ``n`` lines of a file (read from its end: agent.log may be large), each cut at ``width``."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first line read is likely cut
    return [line if len(line) <= width else line[:width] + " [...]" for line in lines[-n:]]


def failure_message(outcome: TaskOutcome, min_score: float, *, flagged: bool, task_dir: Path | None = None) -> str:
    """The first line is the reason (pytest's short summary shows it); the header above it is the task id."""
    lines = []
    if outcome.agent_exit in AGENT_NOT_RUN:
        lines.append(f"agent exited {outcome.agent_exit}: {AGENT_NOT_RUN[outcome.agent_exit]} (check --pb-agent; "
                     "the shell's own message is in agent.log)")
    lines += [f"score {outcome.score:.4f} ({outcome.n_passed}/{outcome.n_tests} tests passed)"
              + (f", below --pb-min-score {min_score:g}" if outcome.score < min_score else "")]
    if outcome.agent_exit is not None or outcome.agent_seconds is not None:
        status = "no exit status" if outcome.agent_exit is None else f"exit status {outcome.agent_exit}"
        clock = "" if outcome.agent_seconds is None else f" after {outcome.agent_seconds:.1f} s"
        lines.append(f"agent: {status}{clock}")
    if outcome.error_code:
        lines.append(f"error code: {outcome.error_code}")
    if outcome.clock_fired:
        lines.append(f"clock fired: {outcome.clock_fired}")
    for branch, errors in sorted(outcome.branch_errors.items()):
        lines.append(f"branch {branch}: {', '.join(errors)}")
    for branch, tests in sorted(outcome.failing_branches.items()):
        shown = ", ".join(tests[:5]) + (f" (+{len(tests) - 5} more)" if len(tests) > 5 else "")
        lines.append(f"branch {branch} failing: {shown}")
    if flagged:
        lines.append(f"integrity flags: {', '.join(outcome.flags)} (the score is official; pass --pb-allow-flags "
                     "to accept it, or --pb-strict to evaluate with the flagged files neutralised)")
    lines.extend(outcome.notes)
    if task_dir is not None:
        lines.append(f"run directory: {task_dir}")
        tail = tail_lines(task_dir / "agent.log")
        if tail:
            lines.append(f"last {len(tail)} lines of agent.log:")
            lines.extend(f"  {line}" for line in tail)
    return "\n".join(lines)


def assert_verdict(item: pytest.Item, outcome: TaskOutcome, *, min_score: float, allow_flags: bool,
                   junit_tests: bool = False, task_dir: Path | None = None) -> None:
    item.user_properties.extend(junit_properties(outcome))
    if junit_tests:
        item.user_properties.extend((f"test:{name}", status) for name, status in sorted(outcome.tests.items()))
    flagged = bool(outcome.flags) and not allow_flags
    if outcome.score < min_score or flagged:
        raise VerdictFailure(failure_message(outcome, min_score, flagged=flagged, task_dir=task_dir))


def sanitise_report(report: pytest.TestReport) -> None:
    """The last line of defence before a report leaves (xdist, JUnit, the terminal, summary.json): no string in it
    may hold an undecodable file name's surrogates. Flags and messages are built safe; this catches the rest."""
    report.user_properties = sanitise(list(report.user_properties))
    report.sections = sanitise(list(report.sections))
    if isinstance(report.longrepr, str | tuple):
        report.longrepr = sanitise(report.longrepr)
    elif report.longrepr is not None:
        text = report.longreprtext
        if printable(text) != text:  # a traceback or exception text holding one: its text, escaped
            report.longrepr = printable(text)
