"""The corrected score: the official scoring run again with test names compared in a canonical form.

programbench 1.2.5's ``_process_branch_xml`` compares the names tests.json lists with the JUnit names literally
(upstream ProgramBench issue #56, a fix proposed in PR #61, both open). 415 of the 1,832 packaged branches list their
tests without the ``eval.`` prefix that pytest writes when the run's rootdir is ``/workspace``; where a branch's JUnit
names carry it, each test counts twice: passed (or failed) under its JUnit name, and ``not_run``
(``missing_from_junit_xml``) under its tests.json name, and an ignored test the JUnit names with the prefix is scored.

:func:`corrected_score` changes nothing but the names and one rule: for each branch it takes the JUnit text the
official result's log kept (the ``results_read`` step's output; of a branch's retried attempts, the one whose official
replay gives the official's own entries), removes an optional leading ``eval.`` from every name (the JUnit's,
tests.json's and the ignored tests'), and runs the official ``_process_branch_xml`` and the official
``for_branches(...).without_ignored(...).score`` on that. Then PR #57's rule (upstream, open): a JUnit record that
tests.json does not list for its branch still counts in 1.2.5, so extra passing items (a stray ``conftest.py``
collecting more) raise a score; such a record is dropped only if it passed, and only where the branch lists tests
(26 non-ignored branches ship ``"tests": []``, whose passing records would all go). pytest's own breakage markers (an
internal error, a collection error's record) never passed, so they stay. Branch errors with their ``not_run``
entries, an instance's error code and everything else stay the official's. It never raises: a result it cannot
replay is scored as the official scored it, and said.
"""

from __future__ import annotations

import logging
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from programbench.eval.eval import EvaluationResult, TestResult, _process_branch_xml
from programbench.exceptions import EmptyTestResultError, XmlParseError
from programbench.utils.load_data import get_active_branches, get_ignored_branches, get_ignored_tests

log = logging.getLogger(__name__)

PREFIX = "eval."
MISSING = "missing_from_junit_xml"  # the official's error code of a tests.json name absent from the JUnit
UPSTREAM = "upstream ProgramBench issue #56, fix proposed in PR #61"
UPSTREAM_UNLISTED = "upstream ProgramBench PR #57"
OFFICIAL, CORRECTED = "official", "corrected"
BASES = (OFFICIAL, CORRECTED)
SHOWN = 3  # tests named in the one-line note


def canonical(name: str) -> str:
    """A test name without an optional leading ``eval.``."""
    return name.removeprefix(PREFIX)


def canonical_full(full_name: str) -> str:
    """``branch/name`` with the name canonical."""
    branch, sep, name = full_name.partition("/")
    return f"{branch}/{canonical(name)}" if sep else canonical(full_name)


def canonical_xml(raw_xml: str) -> str:
    """The JUnit text with every test case's name canonical: ``classname.name`` as the official parser joins them,
    without a leading ``eval.``. Raises ``ET.ParseError`` where the official parser would fail too."""
    root = ET.fromstring(raw_xml)  # noqa: S314 - the text the official parser itself parsed, with the same module
    for case in root.iter("testcase"):
        classname = case.get("classname") or ""
        if classname == "eval":  # "eval.<name>": the prefix is the whole classname
            case.set("classname", "")
        elif classname:
            case.set("classname", canonical(classname))
        else:
            case.set("name", canonical(case.get("name") or ""))
    return ET.tostring(root, encoding="unicode")


@dataclass(frozen=True)
class CorrectedScore:
    """The corrected score of one result, with what the official counted that it does not."""

    score: float
    n_passed: int
    n_tests: int
    # ``branch/name`` -> status of exactly the tests the corrected score counts, under the official result's names
    tests: dict[str, str]
    official_score: float
    official_passed: int
    official_tests: int
    # Official ``branch/name``s the official counted twice: not_run under the tests.json name, while the JUnit has
    # the test under its prefixed name.
    counted_twice: tuple[str, ...] = ()
    # Official ``branch/name``s the official scored though the task ignores them (the JUnit's prefixed name).
    counted_ignored: tuple[str, ...] = ()
    # Official ``branch/name``s of passing JUnit records tests.json does not list for their branch (PR #57's rule).
    counted_unlisted: tuple[str, ...] = ()
    # Branches whose JUnit text could not be replayed to the official's entries: scored as the official scored them.
    unreplayed: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        return (self.n_passed, self.n_tests) != (self.official_passed, self.official_tests)

    def note(self) -> str:
        """One line when the two scores differ (else ""): both, and why."""
        if not self.differs:
            return ""
        why: list[str] = []
        if self.counted_twice:
            names = [t.partition("/")[2] for t in self.counted_twice[:SHOWN]]
            more = ", ..." if len(self.counted_twice) > SHOWN else ""
            why.append(f"{len(self.counted_twice)} test(s) the JUnit names with 'eval.' were counted a second time, "
                       f"as not_run under tests.json's name ({', '.join(names)}{more})")
        if self.counted_ignored:
            why.append(f"{len(self.counted_ignored)} ignored test(s) were scored under the JUnit's 'eval.' name")
        head = (f"official score {self.official_score:.4f} ({self.official_passed}/{self.official_tests}), corrected "
                f"{self.score:.4f} ({self.n_passed}/{self.n_tests}): ")
        parts = []
        if why or not self.counted_unlisted:
            parts.append("the official scorer compares tests.json names with JUnit names literally, so "
                         + "; ".join(why or ["names differing only in 'eval.' differ"]) + f" ({UPSTREAM})")
        if self.counted_unlisted:
            names = [t.partition("/")[2] for t in self.counted_unlisted[:SHOWN]]
            more = ", ..." if len(self.counted_unlisted) > SHOWN else ""
            parts.append(f"{len(self.counted_unlisted)} passing JUnit record(s) tests.json does not list were "
                         f"counted ({', '.join(names)}{more}; {UPSTREAM_UNLISTED})")
        return head + "; ".join(parts)

    def outcome_fields(self) -> dict[str, Any]:
        """The corrected fields of the item's ``TaskOutcome`` (results/verdict.py); its per-test map only when the
        scores differ (otherwise it is the official one)."""
        return {"score_corrected": self.score, "n_passed_corrected": self.n_passed, "n_tests_corrected": self.n_tests,
                "score_note": self.note(), "counted_twice": list(self.counted_twice),
                "counted_ignored": list(self.counted_ignored), "counted_unlisted": list(self.counted_unlisted),
                "tests_corrected": self.tests if self.differs else {}}

    def as_dict(self) -> dict[str, Any]:
        """pb-meta.json's ``evaluation.corrected`` (the per-test map stays in the outcome, when it differs)."""
        return {"score": self.score, "n_passed": self.n_passed, "n_tests": self.n_tests,
                "counted_twice": list(self.counted_twice), "counted_ignored": list(self.counted_ignored),
                "counted_unlisted": list(self.counted_unlisted), "unreplayed": list(self.unreplayed),
                "note": self.note()}


def _pairs(results: Sequence[TestResult]) -> list[tuple[str, str]]:
    return [(t.name, t.status) for t in results]


def _replay(raw_xml: str, branch: str, tests_by_branch: dict[str, list[str]], *, instance_id: str,
            ignored: set[str], branch_ignored: bool, canonical_names: bool = False) -> list[TestResult] | None:
    """The official ``_process_branch_xml`` on one branch's JUnit text (its names made canonical first when
    asked); None where the official would have raised."""
    try:
        text = canonical_xml(raw_xml) if canonical_names else raw_xml
        results, _warnings = _process_branch_xml(text, branch, tests_by_branch, instance_id,
                                                 ignored_tests=ignored, branch_ignored=branch_ignored)
    except (EmptyTestResultError, XmlParseError, ET.ParseError, ValueError, TypeError):
        return None
    return results


def _official_xml(result: EvaluationResult, branch: str, official: Sequence[TestResult], *,
                  tests_by_branch: dict[str, list[str]], ignored: set[str], branch_ignored: bool) -> str | None:
    """The JUnit text the official scored for ``branch``: of the branch's read attempts (a crash retry reads
    several), the last whose official replay gives exactly the official's entries."""
    texts = [str(e.get("output", "")) for e in result.log
             if e.get("step") == "results_read" and e.get("returncode", -1) == 0 and e.get("branch") == branch]
    want = _pairs(official)
    for text in reversed(texts):
        replayed = _replay(text, branch, tests_by_branch, instance_id="", ignored=ignored,
                           branch_ignored=branch_ignored)
        if replayed is not None and _pairs(replayed) == want:
            return text
    return None


def _renamed(results: Sequence[TestResult]) -> list[TestResult]:
    return [t.model_copy(update={"name": canonical(t.name)}) for t in results]


@dataclass(frozen=True)
class _Names:
    """What an instance says a result is scored over: its tests per branch and its ignored tests, under tests.json's
    names and canonical."""

    instance_id: str
    active: list[str]
    ignored: set[str]
    ignored_branches: set[str]
    tests_by_branch: dict[str, list[str]]
    canon_tests: dict[str, list[str]]
    canon_ignored: set[str]

    @classmethod
    def of(cls, result: EvaluationResult, instance: Mapping[str, Any]) -> _Names:
        inst = dict(instance)
        ignored = set(get_ignored_tests(inst))
        branches_data = inst.get("branches", {}) or {}
        tests_by_branch = {b: list(branches_data[b].get("tests", []) or []) for b in result.test_branches
                           if b in branches_data}
        return cls(
            instance_id=str(inst.get("instance_id", "")), active=get_active_branches(inst), ignored=ignored,
            ignored_branches=set(get_ignored_branches(inst)), tests_by_branch=tests_by_branch,
            canon_tests={b: [canonical(n) for n in names] for b, names in tests_by_branch.items()},
            canon_ignored={canonical_full(t) for t in ignored})


def corrected_score(result: EvaluationResult, instance: Mapping[str, Any]) -> CorrectedScore:
    """The official scoring of ``result`` (the official, unfiltered result) with names compared canonically."""
    names = _Names.of(result, instance)
    rebuilt, unreplayed = _rebuild(result, names)
    listed, unlisted = _without_unlisted_passes(rebuilt, names, result)
    corrected = result.model_copy(update={"test_results": listed})
    scoped = corrected.for_branches(names.active).without_ignored(names.canon_ignored)
    official_scoped = result.for_branches(names.active).without_ignored(names.ignored)
    twice = _counted_twice(result, official_scoped, scoped, unreplayed)
    counted_ignored = [t.full_name for t in official_scoped.test_results
                       if canonical_full(t.full_name) in names.canon_ignored and t.branch not in unreplayed]
    counted_unlisted = [t.full_name for t in official_scoped.test_results if canonical_full(t.full_name) in unlisted]
    tests = _per_test(official_scoped, scoped, dropped={*twice, *counted_ignored, *counted_unlisted})
    notes = [f"the corrected score keeps the official's entries for branch(es) {', '.join(unreplayed)}: no JUnit "
             "text in the result's log replays to them"] if unreplayed else []
    return CorrectedScore(
        score=scoped.score, n_passed=scoped.n_resolved, n_tests=len(scoped),
        tests=tests,
        official_score=official_scoped.score, official_passed=official_scoped.n_resolved,
        official_tests=len(official_scoped), counted_twice=tuple(twice), counted_ignored=tuple(counted_ignored),
        counted_unlisted=tuple(counted_unlisted), unreplayed=tuple(unreplayed), notes=notes)


def _without_unlisted_passes(rebuilt: Sequence[TestResult], names: _Names, result: EvaluationResult
                             ) -> tuple[list[TestResult], set[str]]:
    """PR #57's rule on the canonical entries: a passing record whose name its branch's tests.json list does not hold
    is dropped, where that list is not empty and the branch was compared (no branch error); everything else stays,
    pytest's breakage markers included (they never pass). The dropped ``branch/name``s, canonical."""
    kept: list[TestResult] = []
    dropped: set[str] = set()
    for test in rebuilt:
        expected = names.canon_tests.get(test.branch)
        if (test.status == "passed" and expected and test.branch not in result.test_branch_errors
                and canonical(test.name) not in expected):
            dropped.add(f"{test.branch}/{canonical(test.name)}")
            continue
        kept.append(test)
    return kept, dropped


def _rebuild(result: EvaluationResult, names: _Names) -> tuple[list[TestResult], list[str]]:
    """Every branch's entries with the names canonical: replayed from the JUnit text the official scored where a
    comparison was made, else the official's renamed; the branches that could not be replayed."""
    by_branch: dict[str, list[TestResult]] = {}
    for test in result.test_results:
        by_branch.setdefault(test.branch, []).append(test)
    rebuilt: list[TestResult] = []
    unreplayed: list[str] = []
    for branch in dict.fromkeys([*result.test_branches, *by_branch]):
        official = by_branch.get(branch, [])
        if result.error_code or branch in result.test_branch_errors or branch not in result.test_branches:
            rebuilt += _renamed(official)  # not_run injections (or out of scope): nothing was compared
            continue
        replayed = _replay_canonical(result, branch, official, names)
        if replayed is None:
            unreplayed.append(branch)
            rebuilt += _renamed(official)
            continue
        rebuilt += replayed
    return rebuilt, unreplayed


def _replay_canonical(result: EvaluationResult, branch: str, official: Sequence[TestResult],
                      names: _Names) -> list[TestResult] | None:
    """The official's JUnit text of ``branch`` replayed with every name canonical; None without one that replays."""
    skipped = branch in names.ignored_branches
    text = _official_xml(result, branch, official, tests_by_branch=names.tests_by_branch, ignored=names.ignored,
                         branch_ignored=skipped)
    return None if text is None else _replay(text, branch, names.canon_tests, instance_id=names.instance_id,
                                             ignored=names.canon_ignored, branch_ignored=skipped,
                                             canonical_names=True)


def _counted_twice(result: EvaluationResult, official_scoped: EvaluationResult, scoped: EvaluationResult,
                   unreplayed: Sequence[str]) -> list[str]:
    """Official ``branch/name``s the official counted as not_run under tests.json's name while the JUnit has the
    test under its prefixed name, and the corrected score counts it."""
    counted = {t.full_name for t in scoped.test_results}
    junit_names = {(t.branch, canonical(t.name)) for t in result.test_results
                   if not (t.status == "not_run" and t.extra.get("error_code") == MISSING)}
    return [t.full_name for t in official_scoped.test_results
            if t.status == "not_run" and t.extra.get("error_code") == MISSING and t.branch not in unreplayed
            and (t.branch, canonical(t.name)) in junit_names and canonical_full(t.full_name) in counted]


def _per_test(official_scoped: EvaluationResult, scoped: EvaluationResult, *, dropped: set[str]) -> dict[str, str]:
    """Per test under the official's own names (so messages in eval.json are found): the official's entries less the
    ones it should not have counted, when that is exactly what the corrected score counts; else the corrected's."""
    tests: dict[str, str] = {t.full_name: t.status for t in official_scoped.test_results
                             if t.full_name not in dropped}
    if sorted(map(canonical_full, tests)) != sorted(t.full_name for t in scoped.test_results) \
            or sum(status == "passed" for status in tests.values()) != scoped.n_resolved:
        tests = {t.full_name: t.status for t in scoped.test_results}
    return tests


def safe_corrected_score(result: EvaluationResult, instance: Mapping[str, Any]) -> CorrectedScore | None:
    """:func:`corrected_score`, or None (logged) if it fails: a second opinion never breaks the official one."""
    try:
        return corrected_score(result, instance)
    except Exception:  # bounded and total: the official score stands alone
        log.warning("the corrected score could not be computed", exc_info=True)
        return None


def recomputed_fields(eval_json: Path, instance: Mapping[str, Any]) -> dict[str, Any]:
    """A finished task's corrected fields from its recorded official result (a run from before they were recorded,
    resumed): computed from ``<id>.eval.json``, nothing run again; {} without a readable one."""
    try:
        result = EvaluationResult.model_validate_json(eval_json.read_bytes())
    except (OSError, ValueError):
        return {}
    corrected = safe_corrected_score(result, instance)
    return corrected.outcome_fields() if corrected is not None else {}
