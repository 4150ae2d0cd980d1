"""Step 8 of the pipeline: the verdict. An item passes when its score reaches ``--pb-min-score`` and no integrity
flag is raised (unless ``--pb-allow-flags``); the score is the official one, or under ``--pb-score corrected`` the
corrected one (results/corrected.py), and both are always reported. Its JUnit properties are plain builtins (xdist
ships them)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.text.printable import printable, sanitise

OFFICIAL, CORRECTED = "official", "corrected"  # --pb-score: which score decides


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
    # The corrected score (results/corrected.py): the official scoring with test names compared canonically. None:
    # not computed (no official result, a run of an older version): the official stands for it.
    score_corrected: float | None = None
    n_passed_corrected: int | None = None
    n_tests_corrected: int | None = None
    score_note: str = ""  # one line when the two differ: both scores, and why
    counted_twice: Sequence[str] = ()  # "<branch>/<name>"s the official counted twice (not_run beside the JUnit's)
    counted_ignored: Sequence[str] = ()  # ignored "<branch>/<name>"s the official scored under the JUnit's name
    counted_unlisted: Sequence[str] = ()  # passing records tests.json does not list, which the official counted
    tests_corrected: Mapping[str, str] = field(default_factory=dict)  # the corrected score's tests, when they differ

    def scored(self, basis: str = OFFICIAL) -> tuple[float, int, int]:
        """(score, passed, tests) of ``basis`` (``--pb-score``); the official where no corrected one was computed."""
        if basis == CORRECTED and self.score_corrected is not None:
            return self.score_corrected, self.n_passed_corrected or 0, self.n_tests_corrected or 0
        return self.score, self.n_passed, self.n_tests

    def for_basis(self, basis: str) -> TaskOutcome:
        """This outcome with the per-test statuses ``basis`` counts (what its message lists as failing)."""
        if basis == CORRECTED and self.tests_corrected:
            return replace(self, tests=self.tests_corrected)
        return self

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["failing_branches"] = {k: list(v) for k, v in self.failing_branches.items()}
        data["branch_errors"] = {k: list(v) for k, v in self.branch_errors.items()}
        data["flags"] = list(self.flags)
        data["notes"] = list(self.notes)
        data["tests"] = dict(self.tests)
        data["tokens"] = dict(self.tokens) if self.tokens is not None else None
        data["counted_twice"] = list(self.counted_twice)
        data["counted_ignored"] = list(self.counted_ignored)
        data["counted_unlisted"] = list(self.counted_unlisted)
        data["tests_corrected"] = dict(self.tests_corrected)
        return data


def junit_properties(outcome: TaskOutcome, basis: str = OFFICIAL) -> list[tuple[str, Any]]:
    """``score``, ``n_passed``, ``n_tests`` are ``basis``'s (``--pb-score``); both scores are there by name."""

    def plain(value: Any) -> Any:
        # JUnit writes str(value): "" says "none" better than "None"; xdist needs plain builtins.
        if value is None:
            return ""
        return value if isinstance(value, bool | int | float | str) else str(value)

    score, n_passed, n_tests = outcome.scored(basis)
    return [
        ("score", score),
        ("n_passed", n_passed),
        ("n_tests", n_tests),
        ("score_basis", basis),
        ("score_official", outcome.score),
        ("n_passed_official", outcome.n_passed),
        ("n_tests_official", outcome.n_tests),
        ("score_corrected", plain(outcome.score_corrected)),
        ("n_passed_corrected", plain(outcome.n_passed_corrected)),
        ("n_tests_corrected", plain(outcome.n_tests_corrected)),
        ("counted_twice", len(outcome.counted_twice)),
        ("counted_unlisted", len(outcome.counted_unlisted)),
        ("score_note", outcome.score_note),
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


# ---------------------------------------------------------------------------------------------- failing tests

FAILING_SHOWN = 3  # per branch in the item's message; report.html lists every one
FAILING_BRANCHES_SHOWN = 8  # branches whose failing tests the message lists; the others by name and count
MESSAGE_WIDTH = 200  # a test's one-line message in the item's message
DETAIL_MAX = 2000  # a test's whole message in report.html
EVAL_JSON_MAX = 64 << 20  # eval.json read for the messages; a larger one gives names only


@dataclass(frozen=True)
class FailingTest:
    """A scored hidden test that did not pass, with what its assertion said (from the official eval.json)."""

    branch: str
    name: str
    status: str
    detail: str = ""  # the assertion's message (or the official error code and details), bounded

    @property
    def message(self) -> str:
        """The first line of the detail, cut: what the item's message shows."""
        return one_line(self.detail, MESSAGE_WIDTH)


def one_line(text: str, width: int) -> str:
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first if len(first) <= width else first[:width - 3] + "..."


def _printable(text: str, limit: int, *, multiline: bool = True) -> str:
    """A hidden test's text (which quotes the submission's output, and the official's error details the container's):
    :func:`printable`, cut at ``limit`` characters (before escaping: never mid-escape)."""
    out = printable(text[:limit], multiline=multiline)
    return out + (f" [... {len(text) - limit:,} more characters in eval.json]" if len(text) > limit else "")


def _detail(extra: Any) -> str:
    if not isinstance(extra, dict):
        return ""
    for key in ("message", "error_details", "error_code"):
        value = extra.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return ""


def read_failing(eval_json: Path, counted: Callable[[str, str], bool]) -> dict[str, list[FailingTest]]:
    """Every test of the official result that did not pass and that the score counts (``counted(branch, name)``),
    by branch in eval.json's order, with its message. {} when eval.json is missing, unreadable or too large."""
    try:
        if eval_json.stat().st_size > EVAL_JSON_MAX:
            return {}
        data = json.loads(eval_json.read_bytes())
    except (OSError, ValueError):
        return {}
    return failing_tests(data, counted)


def failing_tests(data: Any, counted: Callable[[str, str], bool]) -> dict[str, list[FailingTest]]:
    """:func:`read_failing` of an eval.json already parsed (a foreign run's, read by results/foreign_files.py)."""
    out: dict[str, list[FailingTest]] = {}
    for test in (data.get("test_results") if isinstance(data, dict) else None) or []:
        if not isinstance(test, dict):
            continue
        branch, name, status = str(test.get("branch", "")), str(test.get("name", "")), str(test.get("status", ""))
        if status == "passed" or not counted(branch, name):
            continue
        detail = _printable(_detail(test.get("extra")), DETAIL_MAX)
        out.setdefault(branch, []).append(FailingTest(_printable(branch, 200, multiline=False),
                                                      _printable(name, 500, multiline=False),
                                                      _printable(status, 50, multiline=False), detail))
    return dict(sorted(out.items()))


# Where the rest is, said after the first few failing tests (report.html leaves it out of its own panel).
PANEL_POINTER = "every failing test with its message: report.html's task panel, and eval.json"


def _failing_lines(outcome: TaskOutcome, eval_json: Path | None) -> list[str]:
    """Per branch: how many of its scored tests failed, the first few with their one-line message, "+N more"."""
    by_branch: dict[str, list[str]] = {}
    totals: dict[str, int] = {}
    for full_name, status in outcome.tests.items():
        branch, _, name = full_name.partition("/")
        totals[branch] = totals.get(branch, 0) + 1
        if status != "passed":
            by_branch.setdefault(branch, []).append(name)
    if not outcome.tests:  # no per-test statuses (no official result): the evaluation's own short list
        return [f"branch {branch} failing: {', '.join(map(printable, tests))}"
                for branch, tests in sorted(outcome.failing_branches.items()) if tests]
    scored = set(outcome.tests)
    messages = read_failing(eval_json, lambda b, n: f"{b}/{n}" in scored) if eval_json is not None else {}
    lines: list[str] = []
    branches = sorted(by_branch)
    for branch in branches[:FAILING_BRANCHES_SHOWN]:
        names = by_branch[branch]
        known = {t.name: t for t in messages.get(branch, [])}
        lines.append(f"branch {branch}: {len(names)} of {totals[branch]} tests failing")
        for name in names[:FAILING_SHOWN]:
            shown = printable(name)  # a test name (the submission sways the JUnit XML it comes from): one line
            test = known.get(shown)
            said = f": {test.message}" if test is not None and test.message else ""
            lines.append(f"  {shown} ({outcome.tests[f'{branch}/{name}']}){said}")
        if len(names) > FAILING_SHOWN:
            lines.append(f"  +{len(names) - FAILING_SHOWN} more")
    rest = branches[FAILING_BRANCHES_SHOWN:]
    if rest:
        lines.append(f"+{len(rest)} more branches failing: "
                     + ", ".join(f"{b} ({len(by_branch[b])})" for b in rest))
    if lines:
        lines.append(PANEL_POINTER)
    return lines


# Shell exit statuses that mean the agent never ran: said first, before any score.
AGENT_NOT_RUN = {127: "command not found", 126: "command found but not executable"}


AGENT_LOG_TAIL = 20


def tail_lines(path: Path, n: int = AGENT_LOG_TAIL, *, max_bytes: int = 64 << 10, width: int = 400) -> list[str]:
    """The last ``n`` lines of a file (read from its end: agent.log may be large), each cut at ``width`` and made
    :func:`printable` (the agent's escape sequences shown, never run: every caller shows them)."""
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
    return [printable(line if len(line) <= width else line[:width] + " [...]", multiline=True) for line in lines[-n:]]


def failure_message(outcome: TaskOutcome, min_score: float, *, flagged: bool, task_dir: Path | None = None,
                    basis: str = OFFICIAL) -> str:
    """The first line is the reason (pytest's short summary shows it); the header above it is the task id. The score is
    ``basis``'s; where the official and the corrected differ, the next line says both and why."""
    lines = []
    if outcome.agent_exit in AGENT_NOT_RUN:
        lines.append(f"agent exited {outcome.agent_exit}: {AGENT_NOT_RUN[outcome.agent_exit]} (check --pb-agent; "
                     "the shell's own message is in agent.log)")
    score, n_passed, n_tests = outcome.scored(basis)
    lines += [f"score {score:.4f} ({n_passed}/{n_tests} tests passed)"
              + (f", below --pb-min-score {min_score:g}" if score < min_score else "")]
    if outcome.score_note:
        lines.append(f"{outcome.score_note}; the {basis} score decides (--pb-score)")
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
    if flagged:
        lines.append(f"integrity flags: {', '.join(outcome.flags)} (the score is official; pass --pb-allow-flags "
                     "to accept it, or --pb-strict to evaluate with the flagged files neutralised)")
    lines.extend(outcome.notes)  # causes (the compiler's error, a failed set-up, no submission): before per-test lines
    eval_json = task_dir / f"{outcome.instance_id}.eval.json" if task_dir is not None else None
    lines.extend(_failing_lines(outcome.for_basis(basis), eval_json))
    if task_dir is not None:
        lines.append(f"run directory: {task_dir}")
        tail = tail_lines(task_dir / "agent.log")
        if tail:
            lines.append(f"last {len(tail)} lines of agent.log:")
            lines.extend(f"  {line}" for line in tail)
    return "\n".join(lines)


def assert_verdict(item: pytest.Item, outcome: TaskOutcome, *, min_score: float, allow_flags: bool,
                   junit_tests: bool = False, task_dir: Path | None = None, basis: str = OFFICIAL) -> None:
    """``basis`` (``--pb-score``) picks the score that decides; ``test:`` properties are the official per-test map."""
    item.user_properties.extend(junit_properties(outcome, basis))
    if junit_tests:
        item.user_properties.extend((f"test:{name}", status) for name, status in sorted(outcome.tests.items()))
    flagged = bool(outcome.flags) and not allow_flags
    if outcome.scored(basis)[0] < min_score or flagged:
        raise VerdictFailure(failure_message(outcome, min_score, flagged=flagged, task_dir=task_dir, basis=basis))


def sanitise_report(report: pytest.TestReport) -> None:
    """The boundary of a report (before it leaves for xdist, JUnit, the terminal, summary.json): every string in it
    :func:`printable`, so a file name, the agent.log tail or a test name never brings a control byte or an undecodable
    byte to a reader. A property is one line (a test name's newline shown as ``\\n``); a message keeps its lines."""
    report.user_properties = sanitise(list(report.user_properties), multiline=False)
    report.sections = sanitise(list(report.sections))
    if isinstance(report.longrepr, str | tuple):
        report.longrepr = sanitise(report.longrepr)
    elif report.longrepr is not None:
        text = report.longreprtext
        if printable(text, multiline=True) != text:  # a traceback or exception text holding one: its text, escaped
            report.longrepr = printable(text, multiline=True)
