"""Does a branch's ``eval/results.xml`` say what pytest itself said in the same run?

The submission's executable runs as root while the hidden tests run, so it can rewrite the JUnit file (a FIFO that
pytest's JUnit writer blocks on, then a forged file renamed into place): the official evaluator reads whatever is
there. pytest's own terminal output of the same run (the ``run_tests`` step's output) is a second witness: its
final outcome line (``3 failed, 12 passed, 2 rerun in 4.1s``) and, with ``-r``, its short summary (``FAILED
eval/tests/test_x.py::test_y - ...``). A JUnit file claiming more passing tests than that line counts, or a pass for
a test the short summary lists as failed, is a flag: the item fails, the official score is still the one reported.

The comparison is one-sided on purpose, so an honest run never trips it: only *passes* are counted (the official
score counts nothing else), and every way pytest's counts may legitimately exceed the JUnit file's is allowed
(a crashed xdist worker's test is ``failed`` in the line and an ``<error>`` in the file; a teardown error adds an
``error`` to a passed test; reruns add ``rerun``; deselected tests are not in the file). Ignored tests are in both.

Residual (docs/security.md): a process of the submission that outlives pytest can also write to pytest's own
stdout pipe, and so forge the outcome line as well (with ``-r``, every outcome line after pytest's short summary
header is checked, so pytest's own line still gives away a forger who only appends one). Never raises, never changes
a score.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from programbench.eval.eval import parse_test_results

from pytest_programbench.evaluation.integrity import IntegrityFlag

log = logging.getLogger(__name__)

RESULTS_MISMATCH = "results_mismatch"
RESULTS_PATH = "eval/results.xml"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# `=== 1 failed, 2 passed, 1 warning in 0.12s ===`, `-q`'s bare `3 passed in 1.02s`, `no tests ran in 0.01s`,
# a duration with its clock form `in 65.43s (0:01:05)`.
_OUTCOME_LINE = re.compile(
    r"^(?:=+ )?(?P<stats>\d+ [a-z][a-z ]*(?:, \d+ [a-z][a-z ]*)*|no tests ran) in \d+(?:\.\d+)?s(?: \([0-9:]+\))?"
    r"(?: =+)?$")
_STAT = re.compile(r"(\d+) ([a-z][a-z ]*)")
_SHORT_SUMMARY = re.compile(r"^=+ short test summary info =+$")
_NOT_PASSED_WORDS = ("FAILED", "ERROR")


@dataclass(frozen=True)
class OutcomeLine:
    """One final outcome line of pytest: word -> count (``errors`` folded into ``error``, ``warnings`` dropped)."""

    text: str
    counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def passes(self) -> int:
        """What pytest counted as passing: passed, and xpassed (non-strict: a pass in the JUnit file)."""
        return self.counts.get("passed", 0) + self.counts.get("xpassed", 0)


def outcome_lines(output: str) -> list[OutcomeLine]:
    """Every final outcome line in ``output`` (one per pytest session; colours stripped)."""
    found = []
    for raw in output.splitlines():
        line = _ANSI.sub("", raw).strip()
        match = _OUTCOME_LINE.match(line)
        if match is None:
            continue
        counts: dict[str, int] = {}
        for number, word in _STAT.findall(match.group("stats")):
            key = {"errors": "error", "warnings": "warning"}.get(word, word)
            counts[key] = counts.get(key, 0) + int(number)
        found.append(OutcomeLine(line, counts))
    return found


def _checked_lines(output: str) -> list[OutcomeLine]:
    """The outcome lines that can only be pytest's own: its last one, and with ``-r`` every one after its last short
    test summary header (a test's captured output, which may hold such a line too, is printed before it)."""
    lines = output.splitlines()
    starts = [i for i, raw in enumerate(lines) if _SHORT_SUMMARY.match(_ANSI.sub("", raw).strip())]
    if starts:
        after = outcome_lines("\n".join(lines[starts[-1] + 1:]))
        if after:
            return after
    found = outcome_lines(output)
    return found[-1:]


def mangled(nodeid: str) -> str:
    """A node id as pytest's JUnit writer names the test, and the official joins it (``classname.name``)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names)


def reported_not_passed(output: str) -> list[str]:
    """The ``FAILED``/``ERROR`` entries of pytest's last short test summary (present with ``-r``), as written."""
    lines = [_ANSI.sub("", raw).rstrip() for raw in output.splitlines()]
    starts = [i for i, line in enumerate(lines) if _SHORT_SUMMARY.match(line.strip())]
    if not starts:
        return []
    entries = []
    for line in lines[starts[-1] + 1:]:
        if _OUTCOME_LINE.match(line.strip()):
            break
        word, _, rest = line.partition(" ")
        if word in _NOT_PASSED_WORDS and rest:
            entries.append(rest)
    return entries


def _named_in(entry: str, passed: set[str]) -> str | None:
    """The passing JUnit test that a short-summary entry (``nodeid`` or ``nodeid - reason``) names, if any."""
    candidates = [entry]
    at = entry.find(" - ")
    while at != -1:
        candidates.append(entry[:at])
        at = entry.find(" - ", at + 1)
    for candidate in candidates:
        name = mangled(candidate.strip())
        if name in passed:
            return name
    return None


def check_branch(branch: str, xml: str, run_entry: Mapping[str, Any] | None) -> IntegrityFlag | None:
    """A flag when the JUnit file ``xml`` claims passes that pytest's output in ``run_entry`` (the branch attempt's
    ``run_tests`` log entry) does not back; None when they agree or the file has no pass to question."""
    try:
        parsed = parse_test_results(xml, branch=branch).test_results
    except Exception:  # the official scores a JUnit file it cannot read on its own; nothing to cross-check
        return None
    passing = [t.name for t in parsed if t.status == "passed"]  # testcases, not names: each one is scored
    if not passing:
        return None
    passed = set(passing)
    output = str((run_entry or {}).get("output") or "")
    lines = _checked_lines(output)
    if not lines:
        why = ("its output was discarded when the test clock fired"
               if str((run_entry or {}).get("exception_info", "")).startswith("Command timed out")
               else "pytest printed no final outcome line")
        return _flag(branch, f"{len(passing)} passing test(s) in {RESULTS_PATH} cannot be checked against pytest's "
                             f"own report ({why})")
    for line in lines:
        if len(passing) > line.passes:
            return _flag(branch, f"{RESULTS_PATH} has {len(passing)} passing test(s), pytest's own outcome line in "
                                 f"the same run counts {line.passes} ({line.text!r})")
    for entry in reported_not_passed(output):
        name = _named_in(entry, passed)
        if name is not None:
            return _flag(branch, f"{RESULTS_PATH} says {name} passed; pytest's short test summary in the same run "
                                 f"says {entry.split(' - ', 1)[0]!r} did not")
    return None


def _flag(branch: str, detail: str) -> IntegrityFlag:
    return IntegrityFlag(RESULTS_MISMATCH, f"{RESULTS_PATH}@{branch}",
                         f"branch {branch}: {detail}: the JUnit file was rewritten during the run (the submission's "
                         f"executable runs as root beside pytest)")


def check_attempts(attempts: Iterable[tuple[str, str, Mapping[str, Any] | None]]) -> list[IntegrityFlag]:
    """``check_branch`` over (branch, xml, run entry) of every attempt; never raises."""
    flags = []
    for branch, xml, entry in attempts:
        try:
            flag = check_branch(branch, xml, entry)
        except Exception:  # a probe of ours: never an error, never a score
            log.warning("branch %s: the JUnit cross-check failed", branch, exc_info=True)
            continue
        if flag is not None:
            flags.append(flag)
    return flags
