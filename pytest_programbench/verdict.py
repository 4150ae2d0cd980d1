"""Step 8 of the pipeline: the verdict. An item passes when its official score reaches ``--pb-min-score`` and no
integrity flag is raised (unless ``--pb-allow-flags``). Its JUnit properties are plain builtins (xdist ships them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest


class InfrastructureError(Exception):
    """Something outside the agent's and the submission's windows broke: reported as an error, never a score."""


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


def failure_message(outcome: TaskOutcome, min_score: float, *, flagged: bool) -> str:
    lines = []
    if outcome.agent_exit in AGENT_NOT_RUN:
        lines.append(f"agent exited {outcome.agent_exit}: {AGENT_NOT_RUN[outcome.agent_exit]} (check --pb-agent; "
                     "the shell's own message is in agent.log)")
    lines += [f"{outcome.instance_id}: score {outcome.score:.4f} ({outcome.n_passed}/{outcome.n_tests} tests passed)"
             + (f", below --pb-min-score {min_score:g}" if outcome.score < min_score else "")]
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
    return "\n".join(lines)


def assert_verdict(item: pytest.Item, outcome: TaskOutcome, *, min_score: float, allow_flags: bool,
                   junit_tests: bool = False) -> None:
    item.user_properties.extend(junit_properties(outcome))
    if junit_tests:
        item.user_properties.extend((f"test:{name}", status) for name, status in sorted(outcome.tests.items()))
    flagged = bool(outcome.flags) and not allow_flags
    if outcome.score < min_score or flagged:
        raise VerdictFailure(failure_message(outcome, min_score, flagged=flagged))
