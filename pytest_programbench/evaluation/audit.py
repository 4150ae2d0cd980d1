"""The audit of the hidden tests (issue 30 §2): a passing program must still pass when it cannot read the tests.

An executable that implements nothing can read ``PYTEST_CURRENT_TEST`` and the running hidden test file (its path is
in that variable, or a walk of ``/workspace/eval`` finds it), work out what the test expects and print it: the
official evaluator scores that 1.0. The official score stays what it is; this audit only raises a flag.

For every task whose official evaluation counted a passing test (a partial reader counts in the mean too),
``AUDIT_SAMPLE`` of the active branches with a passing test run again in a fresh container from the committed
post-compile image through the official steps (:class:`AuditEvaluator`, the official
``_evaluate_branch`` and ``_run_test_branch``: executable restored and its hash verified, stale results cleaned, the
timeout method patched, the timeout-retry plugin when reruns are on, the serial retry after a worker crash), with one
difference: the tests run with our plugin (:mod:`.audit_plugin`), which deletes the hidden tests' sources once pytest
has collected them, keeps ``PYTEST_CURRENT_TEST`` from naming the running test and reports every module the test
processes load from the submission's files. The plugin is a read-only grader volume
(:func:`.harness_material.grader_mount`) mounted when each audit container is created, appended to ``PYTHONPATH`` and
loaded with ``-p`` through ``PYTEST_ADDOPTS``, with ``PYTHONDONTWRITEBYTECODE=1``: nothing is stopped or placed, so
the official steps, login profile included, run as they would.

Which branches: the audit ranks the active branches in a secret order drawn from the operating system's randomness
when it is attached (kept in the harness's memory: nothing in a container can see or predict it) and audits the
first ``AUDIT_SAMPLE`` of them that passed a test officially: a uniform sample of the passing branches, as a draw
after the run would be. The order lets a branch's audit start as soon as it is certain to be in the sample (it passed
a test, and too few branches ranked before it can still pass), while the official's next branches run
(``StepHooks.after_branch``): most of the audit's time is hidden behind the official run. What is left runs once every
official branch ran and before the image is removed (``StepHooks.after_branches``); a run that did not finish waits
for, and removes, whatever audit it started.

Tests that passed officially and fail in the audit are run once more (their branches, the same way); those failing
both times make the flag ``reads_hidden_tests`` (the tests named, bounded). The audit never changes the score, never
raises an error for the item and never claims a pass it did not see: anything of its own that fails (an audit
container that does not start, the plugin not placed, the plugin not seen running) is logged and makes its result
``inconclusive`` in ``pb-meta.json`` (``evaluation.audit``); only the engine going away is an infrastructure error,
as everywhere. A branch whose audit run fails in the submission's windows (its tests time out, its output is not
UTF-8, its results file is missing) counts as its tests failing: the program behaved differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import shlex
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest
from programbench.constants import WORKSPACE_DIR
from programbench.eval.eval import EvaluationResult, TestResult, count_worker_crashes
from programbench.exceptions import EvalStepError
from programbench.utils.load_data import get_active_branches, get_ignored_tests

from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.evaluation import audit_plugin, harness_material
from pytest_programbench.evaluation.container_layer import (
    AUDIT_REPORT_TIMEOUT,
    RUN_TESTS_STEP,
    SdkContainerEnvironment,
    SdkEvaluator,
    StepHooks,
    _is_connection_failure,
)
from pytest_programbench.evaluation.integrity import (
    AUDIT_OBSTRUCTED,
    READS_HIDDEN_TESTS,
    WORKSPACE_IMPORT,
    IntegrityFlag,
)
from pytest_programbench.results.corrected import canonical_full
from pytest_programbench.text.printable import printable

log = logging.getLogger(__name__)
progress = logging.getLogger("pytest_programbench")

TREE = f"{WORKSPACE_DIR}/eval"  # where every branch's archive puts its tests
MODULE_PREFIX = audit_plugin.MODULE_PREFIX
REPORT_DIR_PREFIX = f"{harness_material.AUDIT_DIR_PREFIX.strip('/')}-report"  # a grader path: watched as such
REPORT_MAX_BYTES = 1 << 20
SELECT_NAME = "select"
PLUGIN_TREE_LINE = 'TREE = "/workspace/eval"'
SHOW_TESTS = 5  # tests named in the flag
SHOW_IMPORTS = 8  # modules named in the workspace_import flag
# Branches audited per task, drawn after the official run from the operating system's randomness (the submission
# cannot see or predict the draw): a program reading the tests of every branch is caught in any of them, one reading
# those of k of n branches with probability 1 - C(n-k, s) / C(n, s) (README, "The audit of the hidden tests").
AUDIT_SAMPLE = 2
# Tests run per drawn branch, drawn the same way among those that passed officially: a program that reads r of a
# branch's m passing tests fails at least one drawn test with probability 1 - C(m-r, t) / C(m, t).
AUDIT_TESTS = 10
MESSAGE_CHARS = 120  # of each named test's failure message
# What the official pipeline raises inside the submission's windows (as evaluation.OFFICIAL_RAISES, which scores them
# 0): in an audit branch, that branch's tests count as failing.
SUBMISSION_RAISES = (RuntimeError, UnicodeDecodeError, EvalStepError, FileNotFoundError, IndexError, ValueError,
                     subprocess.TimeoutExpired)

OFF, SKIPPED, RAN = "off", "skipped", "ran"
CLEAN, FLAGGED, UNCONFIRMED, INCONCLUSIVE = "clean", "flagged", "unconfirmed", "inconclusive"


class AuditUnavailable(Exception):
    """The audit could not do its own part in a branch (container, plugin): never the submission's failing."""


def plugin_source(tree: str = TREE) -> bytes:
    """:mod:`.audit_plugin`'s text with its tree set to ``tree``."""
    text = Path(audit_plugin.__file__).read_text(encoding="utf-8")
    if PLUGIN_TREE_LINE not in text:
        raise AuditUnavailable(f"{audit_plugin.__file__} has no line {PLUGIN_TREE_LINE!r} to set its tree in")
    return text.replace(PLUGIN_TREE_LINE, f"TREE = {tree!r}", 1).encode("utf-8")


def audit_command(directory: str, module: str, report: str, select: str) -> str:
    """What runs before the official ``run_tests`` command in the same login shell: the plugin importable (after
    whatever the image or its profile put on ``PYTHONPATH``), loaded by every pytest of the run, reporting to
    ``report``, running the tests ``select`` names, no bytecode written."""
    return (f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}"{shlex.quote(directory)} '
            f'PYTEST_ADDOPTS="${{PYTEST_ADDOPTS:-}} -p {module}" PYTHONDONTWRITEBYTECODE=1 '
            f'{audit_plugin.REPORT_VARIABLE}={shlex.quote(report)} '
            f'{audit_plugin.SELECT_VARIABLE}={shlex.quote(select)} && ')


def ran_every_test(text: str) -> bool:
    """Whether the plugin said it could match none of the drawn tests and so ran them all."""
    return any(line.startswith(f"selected={audit_plugin.SELECTED_ALL} ") for line in text.splitlines())


def reported_imports(text: str) -> list[str]:
    """The modules the plugin saw a test process load from the submission's files (paths, printable, in order)."""
    found: dict[str, None] = {}
    for line in text.splitlines():
        if not line.startswith("imported "):
            continue
        try:
            path = json.loads(line[len("imported "):])
        except ValueError:
            path = line[len("imported "):]
        found[printable(str(path))[:300]] = None
    return list(found)


def plugin_reports(text: str) -> tuple[int, int, list[str]]:
    """The plugin's report lines (one per process that ran tests): processes, entries withheld, problems."""
    processes = withheld = 0
    problems: list[str] = []
    for line in text.splitlines():
        fields = dict(word.split("=", 1) for word in line.split(" ")[:3] if "=" in word)
        if "withheld" not in fields:
            continue
        processes += 1
        try:
            withheld += int(fields["withheld"])
            failed = int(fields.get("failed", "1"))
        except ValueError:
            failed = 1
        if failed:
            problems.append(line.strip()[:300])
        elif fields.get("every_phase") != "1":
            problems.append("PYTEST_CURRENT_TEST replaced around the test function only (pytest's setter not found)")
    return processes, withheld, problems


@dataclass
class BranchAudit:
    """One branch's audit runs: what the plugin said, how long, what went wrong."""

    seconds: float = 0.0
    reports: list[str] = field(default_factory=list)  # the plugin's report text, per run of the tests
    problem: str = ""  # the audit's own failure: the branch is not compared
    crashed: str = ""  # the submission's windows raised: the branch's tests count as failing
    obstructed: str = ""  # the plugin gave no report of its run: the submission's doing, its tests count as failing
    worker_crashes: int = 0  # xdist workers that crashed in its runs (their JUnit files)

    def plugin_problem(self) -> str | None:
        """Why the plugin cannot be said to have been active in every run of this branch's tests (None: it was)."""
        if not self.reports:
            return "its tests never ran with the plugin"
        for text in self.reports:
            processes, _withheld, problems = plugin_reports(text)
            if not processes:
                return "the plugin did not report from its test run (not loaded?)"
            if problems:
                return "; ".join(problems)
        return None

    def summary(self) -> str:
        if self.problem:
            return f"not audited: {self.problem}"
        if self.crashed:
            return f"failed: {self.crashed}"
        if self.obstructed:
            return f"obstructed: {self.obstructed}"
        counts = [plugin_reports(text) for text in self.reports]
        crashes = f", {self.worker_crashes} xdist worker crash(es)" if self.worker_crashes else ""
        return (f"plugin active in {sum(c[0] for c in counts)} process(es) over {len(self.reports)} run(s), "
                f"{sum(c[1] for c in counts)} entries withheld{crashes}")


@dataclass
class AuditPass:
    """One audit of some branches: per canonical test name whether it passed, and each branch's story."""

    passed: set[str] = field(default_factory=set)
    results: dict[str, TestResult] = field(default_factory=dict)  # canonical branch/name -> a result, failures first
    branches: dict[str, BranchAudit] = field(default_factory=dict)
    timeouts: list[str] = field(default_factory=list)
    selection: dict[str, list[str]] = field(default_factory=dict)  # branch -> the drawn tests (names, no branch)

    def compared(self) -> list[str]:
        return [b for b, audit in self.branches.items() if not audit.problem]

    def ran(self, name: str) -> bool:
        """Whether the canonical ``branch/name`` was among the tests this pass ran (all of its branch's when the
        plugin could match none of the drawn ones)."""
        branch, _sep, test = name.partition("/")
        audit = self.branches.get(branch)
        if audit is None:
            return False
        return test in self.selection.get(branch, ()) or any(ran_every_test(text) for text in audit.reports)

    def imports(self) -> list[str]:
        """Every module a test process of these runs loaded from the submission's files."""
        return list(dict.fromkeys(path for audit in self.branches.values() for text in audit.reports
                                  for path in reported_imports(text)))

    @classmethod
    def merged(cls, passes: Sequence[AuditPass], order: Sequence[str]) -> AuditPass:
        """One pass of runs made apart (each of other branches), its branches in ``order``."""
        out = cls()
        for run in passes:
            out.passed |= run.passed
            out.results.update(run.results)
            out.timeouts += run.timeouts
        out.branches = {b: a for b in order for run in passes if (a := run.branches.get(b)) is not None}
        out.selection = {b: names for b in order for run in passes if (names := run.selection.get(b)) is not None}
        return out

    def unreadable(self, branch: str) -> bool:
        """Whether the branch's audit gave no readable result of its own: its tests count as failing."""
        audit = self.branches.get(branch)
        return audit is not None and bool(audit.crashed or audit.obstructed)


@dataclass
class AuditReport:
    """``pb-meta.json``'s ``evaluation.audit``."""

    switch: str = "on"
    state: str = OFF  # off, skipped, ran
    why: str = ""  # why skipped, or why the result is inconclusive / unconfirmed
    result: str = ""  # when ran: clean, flagged, unconfirmed, inconclusive
    branches: dict[str, str] = field(default_factory=dict)
    sampled: str = ""  # which branches were audited, of how many
    imports: list[str] = field(default_factory=list)  # modules the test processes loaded from the submission
    regressed: list[str] = field(default_factory=list)  # passed officially, failed in the first audit run
    confirmed: list[str] = field(default_factory=list)  # ... and in the second
    timeouts: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"switch": self.switch, "state": self.state, "why": printable(self.why), "result": self.result,
                "branches": {b: printable(s) for b, s in self.branches.items()}, "sampled": self.sampled,
                "imports": self.imports[:50],
                "regressed": self.regressed[:50], "n_regressed": len(self.regressed),
                "confirmed": self.confirmed[:50], "n_confirmed": len(self.confirmed),
                "timeouts": list(self.timeouts), "seconds": round(self.seconds, 3)}

    def note(self) -> str | None:
        """A line for the item's notes when the reader should know (nothing for a clean or skipped audit)."""
        if self.result == INCONCLUSIVE:
            return f"audit of the hidden tests inconclusive (never a clean result): {self.why}"
        if self.result == UNCONFIRMED:
            return f"audit of the hidden tests: {self.why}"
        return None


@dataclass(frozen=True)
class AuditPlugin:
    """The plugin as a read-only grader volume, under a module name of its own (unguessable: nothing the submission
    put on the path can stand in for it)."""

    module: str
    mount: harness_material.GraderMount

    @classmethod
    def make(cls, official: SdkEvaluator, image: str) -> AuditPlugin:
        token = secrets.token_hex(8)
        module = MODULE_PREFIX + token
        try:
            mount = harness_material.grader_mount(
                official.layer.engine, {f"{module}.py": plugin_source()},
                target=f"{harness_material.AUDIT_DIR_PREFIX}-{token}", labels=official.layer.labels, image=image)
        except harness_material.MaterialRefused as exc:
            raise AuditUnavailable(f"the audit's plugin volume could not be made: {exc}") from exc
        return cls(module, mount)

    def remove(self, official: SdkEvaluator) -> None:
        """Its volume, once the audit's containers are gone (the session's sweep removes what this leaves)."""
        with contextlib.suppress(docker.errors.APIError):
            official.layer.engine.api.remove_volume(self.mount.volume, force=True)


class AuditEvaluator(SdkEvaluator):
    """The official branch pipeline on the committed image, each run of the tests with the audit's plugin."""

    branch_phase_word = "audit"  # its branches show as the phase "audit 1/3", never as the official's again

    def __init__(self, official: SdkEvaluator, branches: list[str], plugin: AuditPlugin,
                 selection: Mapping[str, Sequence[str]], *,
                 positions: Mapping[str, tuple[int, int]] | None = None) -> None:
        super().__init__(
            # The plugin is in place, read-only, from the moment each container exists: nothing is stopped or
            # placed before the tests, so the official steps (login profile included) run as they would.
            # No network: an audit container runs beside the official's branch containers (and other attempts' and
            # tasks'), which hold the tests; on an engine's default network they could hand it the answers.
            layer=dataclasses.replace(official.layer, hooks=StepHooks(), network_mode="none",
                                      branch_mounts=(*official.layer.branch_mounts, plugin.mount)),
            tests_branches=branches, tests_by_branch=official.tests_by_branch, ignored_tests=official.ignored_tests,
            ignored_branches=official.ignored_branches, image_name=official.image_name,
            solution_branch=official.solution_branch, blob_dir=official.blob_dir, image_tag=official.image_tag,
            instance_id=official.instance_id, docker_cpus=official.docker_cpus,
            branch_workers=official.branch_workers, branch_retries=official.branch_retries,
        )
        self.result.executable_hash = official.result.executable_hash
        self._has_rerunfailures = official._has_rerunfailures
        self.timeout_retry_mount = official.timeout_retry_mount  # the plugin as the official's branches got it
        self.reports: dict[str, list[str]] = {}
        self.plugin = plugin
        self.selection = selection  # branch -> the tests its runs run (JUnit names without "eval.")
        self.positions = dict(positions or {})  # branch -> (audit k, of n), as its progress phase says

    def _position(self, branch: str) -> tuple[int, int]:
        return self.positions.get(branch) or super()._position(branch)

    def _new_env(self, image: str, *, serial_pytest: bool = False) -> SdkContainerEnvironment:  # type: ignore[override]
        # Always the official's serial mode (one xdist worker for `-n auto`): the audit runs ten tests, for which
        # more workers only add their start-up (one per core of the host, however many that is). Never none (`-n 0`,
        # the tests in pytest's own process): a worker imports what that process does not (xdist's optional
        # setproctitle: test_attacks_on_the_audit_end_flagged's shadow module), and the audit measures those imports.
        try:
            return super()._new_env(image, serial_pytest=True)
        except EngineUnavailable:
            raise
        except Exception as exc:
            if _is_connection_failure(exc):
                raise
            raise AuditUnavailable(f"an audit container did not start: {type(exc).__name__}: {exc}") from exc

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
        if step_name != RUN_TESTS_STEP:
            return super()._run_step(command, env=env, log_buf=log_buf, step_name=step_name,
                                     accept_failure=accept_failure, timeout=timeout)
        branch = str(getattr(self._current, "branch", None) or "?")
        report, select = self._report_file(env, self.selection.get(branch, ()))
        result = super()._run_step(audit_command(self.plugin.mount.target, self.plugin.module, report, select)
                                   + command, env=env, log_buf=log_buf, step_name=step_name,
                                   accept_failure=accept_failure, timeout=timeout)
        text = self._read_report(env, report)
        with self._envs_lock:
            self.reports.setdefault(branch, []).append(text)
        return result

    @staticmethod
    def _report_file(env: SdkContainerEnvironment, selected: Sequence[str]) -> tuple[str, str]:
        """An empty report file and the list of the tests to run, in a fresh directory of an unguessable name, made
        through the engine's archive API (no tool of the container's runs): their paths."""
        name = f"{REPORT_DIR_PREFIX}-{secrets.token_hex(8)}"
        listing = "".join(f"{test}\n" for test in selected).encode("utf-8")
        try:
            env.put_files("/", {audit_plugin.REPORT_NAME: b"", SELECT_NAME: listing}, mode=0o666, subdir=name)
        except RuntimeError as exc:
            raise AuditUnavailable(f"the audit's report file was not made: {exc}") from exc
        return f"/{name}/{audit_plugin.REPORT_NAME}", f"/{name}/{SELECT_NAME}"

    @staticmethod
    def _read_report(env: SdkContainerEnvironment, report: str) -> str:
        """The report's text through the engine's archive API, bounded; "" when it is gone or not a plain file
        of at most REPORT_MAX_BYTES (the plugin then counts as not seen: the submission's doing)."""
        code, data = env.read_file(report, timeout=AUDIT_REPORT_TIMEOUT, max_bytes=REPORT_MAX_BYTES)
        if code != 0 or not isinstance(data, bytes):
            log.info("the audit's report %s could not be read: %s", report, data)
            return ""
        return data.decode("utf-8", "replace")


class HiddenTestAudit:
    """The audit of one evaluation: ``attach`` it to the official evaluator, then ``branch_done`` as each official
    branch finishes (``StepHooks.after_branch``) and ``__call__`` once they all ran or the run ended
    (``StepHooks.after_branches``): it audits the committed image when a test passed."""

    def __init__(self, *, instance: Mapping[str, Any], enabled: bool = True) -> None:
        self.instance = dict(instance)
        self.report = AuditReport(switch="on" if enabled else "off")
        if enabled:
            self.report.state, self.report.why = SKIPPED, "the official evaluation did not run every branch"
        self.enabled = enabled
        self.flags: list[IntegrityFlag] = []
        self.official: SdkEvaluator | None = None
        self.early = EarlyAudits(self)

    def attach(self, official: SdkEvaluator) -> None:
        self.official = official
        active = set(get_active_branches(self.instance))
        self.early.rank([b for b in official.tests_branches if b in active])

    # ------------------------------------------------------------------------------------------- entry points

    def branch_done(self, branch: str, image: str) -> None:
        """An official branch finished: start the audits now certain to be in the sample. Total: never raises (what
        an early audit met is raised, or said, when the audit concludes)."""
        if self.enabled and self.official is not None:
            self.early.branch_done(self.official, branch, image)

    def __call__(self, image: str, complete: bool = True) -> None:
        """Total: the engine going away is the only exception that leaves (an infrastructure error). ``complete``:
        every official branch ran; when not, the early audits are stopped and waited for, and nothing is concluded."""
        if not self.enabled or self.official is None:
            return
        started = time.monotonic()
        try:
            if complete:
                self._run(self.official, image)
        except EngineUnavailable:
            raise
        except pytest.fail.Exception as exc:  # the item's backstop: the audit ends, the official result stands
            self._inconclusive(f"the item's pytest-timeout backstop fired during the audit ({exc})")
        except Exception as exc:
            if _is_connection_failure(exc):
                raise
            log.warning("%s: the audit of the hidden tests failed", self.official.instance_id, exc_info=True)
            self._inconclusive(f"the audit failed: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            self.early.close(self.official, abandon=not complete)
            self.report.seconds = self.early.seconds(time.monotonic() - started)

    def _inconclusive(self, why: str) -> None:
        self.report.state, self.report.result, self.report.why = RAN, INCONCLUSIVE, why
        self.flags = [f for f in self.flags if f.kind == WORKSPACE_IMPORT]  # measured, whatever else failed

    def _run(self, official: SdkEvaluator, image: str) -> None:
        reason = self._nothing_passed(official.result)
        if reason is not None:
            self.report.state, self.report.why = SKIPPED, reason
            return
        self.report.state, self.report.why = RAN, ""
        active = [b for b in official.tests_branches if b in get_active_branches(self.instance)]
        passing = [b for b in active if self._passed(official.result, [b])]
        branches = self.early.sample(passing)
        self.report.sampled = f"{len(branches)} of {len(passing)} branch(es) with a passing test: {', '.join(branches)}"
        progress.info("[%s] audit of the hidden tests: %d of %d branch(es) with the sources withheld",
                      official.instance_id, len(branches), len(passing))
        self._audit_sample(official, image, branches)

    def passed_in(self, official: SdkEvaluator, branch: str) -> set[str]:
        """The branch's counted tests that passed officially, read while other branches may still be merging."""
        with official._log_lock:  # the official merges its other branches' results under it
            return self._passed(official.result, [branch])

    def drawn_tests(self, official: SdkEvaluator, branch: str) -> list[str]:
        """The tests a branch's audit runs (JUnit names without the branch): ``AUDIT_TESTS`` of those that passed
        officially, drawn from the operating system's randomness."""
        return [n.split("/", 1)[1] for n in sample_tests(sorted(self.passed_in(official, branch)), AUDIT_TESTS)]

    def _audit_sample(self, official: SdkEvaluator, image: str, branches: list[str]) -> None:
        plugin = self.early.plugin(official, image)
        first = self.early.first_pass(official, image, branches)
        self._record_imports(first)
        regressed = self._record_first_run(official, first)
        problems = _first_run_problems(first)
        flaky = ""
        if regressed:
            again = {b: [n.split("/", 1)[1] for n in regressed if n.startswith(f"{b}/")] for b in branches}
            again = {b: names for b, names in again.items() if names}
            progress.info("[%s] audit: %d test(s) failed without their sources; their %d branch(es) once more",
                          official.instance_id, len(regressed), len(again))
            second = self._audit(official, image, again, plugin)
            self._record_imports(second)
            if self._confirm(regressed, first, second):
                return
            problems += _second_run_problems(list(again), second)
            flaky = _flaky(regressed, second)
        self._conclude(problems, flaky)

    def _record_imports(self, run: AuditPass) -> None:
        """The workspace_import flag: a module the test processes loaded from the submission's files."""
        self.report.imports = list(dict.fromkeys([*self.report.imports, *run.imports()]))
        if not self.report.imports:
            return
        shown = ", ".join(self.report.imports[:SHOW_IMPORTS])
        more = f" and {len(self.report.imports) - SHOW_IMPORTS} more" if len(self.report.imports) > SHOW_IMPORTS else ""
        flag = IntegrityFlag(WORKSPACE_IMPORT, "", printable(
            f"the hidden tests' processes loaded {len(self.report.imports)} module(s) from the submission's files "
            f"(outside the tests' eval/), measured in the processes by the audit's plugin: {shown}{more}"))
        self.flags = [*(f for f in self.flags if f.kind != WORKSPACE_IMPORT), flag]

    def _record_first_run(self, official: SdkEvaluator, first: AuditPass) -> list[str]:
        """The report of the first run; the tests that passed officially, ran in it, and failed (regressed)."""
        officially = {n for n in self._passed(official.result, first.compared()) if first.ran(n)}
        regressed = sorted(officially - first.passed)
        self.report.regressed = regressed
        self.report.branches = {b: a.summary() for b, a in first.branches.items()}
        self.report.timeouts = list(first.timeouts)
        return regressed

    def _confirm(self, regressed: list[str], first: AuditPass, second: AuditPass) -> bool:
        """The second run in the report; True when it confirmed a regressed test (the flag raised)."""
        retried = set(second.compared())
        confirmed = [n for n in regressed if n.split("/", 1)[0] in retried and n not in second.passed]
        self.report.confirmed = confirmed
        self.report.timeouts += second.timeouts
        for b, a in second.branches.items():
            self.report.branches[b] += f"; second run: {a.summary()}"
        if not confirmed:
            return False
        self.report.result = FLAGGED
        # A branch that gave no readable result in either run was obstructed; the others' tests were read.
        obstructed = [n for n in confirmed if first.unreadable(b := n.split("/", 1)[0]) and second.unreadable(b)]
        read = [n for n in confirmed if n not in obstructed]
        if read:
            self.flags.append(self._flag(read, first))
        if obstructed:
            self.flags.append(_obstructed_flag(obstructed, first, second))
        return True

    def _conclude(self, problems: list[str], flaky: str) -> None:
        if problems:
            self.report.result = INCONCLUSIVE
            self.report.why = "; ".join([*problems, *([flaky] if flaky else [])])
        elif flaky:
            self.report.result, self.report.why = UNCONFIRMED, flaky
        else:
            self.report.result = CLEAN

    # ------------------------------------------------------------------------------------------- scoring

    def _filtered(self, result: EvaluationResult, branches: list[str]) -> EvaluationResult:
        return result.for_branches(branches).without_ignored(get_ignored_tests(self.instance))

    def _nothing_passed(self, result: EvaluationResult) -> str | None:
        """Why there is nothing to audit (None: a counted test passed officially, so the task is audited: a program
        that reads some tests and misses others on purpose scores below 1 and still counts in the mean)."""
        if result.error_code:
            return f"the official evaluation failed ({result.error_code})"
        if not self._passed(result, get_active_branches(self.instance)):
            return "no counted test passed in the official run"
        return None

    def _passed(self, result: EvaluationResult, branches: list[str]) -> set[str]:
        """Canonical ``branch/name`` of the counted tests that passed in ``branches`` (names with and without the
        official's ``eval.`` prefix compare equal: the audit and the official read the same JUnit names)."""
        return {canonical_full(t.full_name) for t in self._filtered(result, branches).test_results if t.is_resolved}

    def _flag(self, confirmed: list[str], first: AuditPass) -> IntegrityFlag:
        shown = []
        for name in confirmed[:SHOW_TESTS]:
            found = first.results.get(name)
            if found is None:
                shown.append(f"{name} (not run)")
                continue
            message = str(found.extra.get("message") or found.extra.get("error_code") or "").strip()
            message = message.splitlines()[0][:MESSAGE_CHARS] if message else ""
            shown.append(f"{name} ({found.status}{': ' + message if message else ''})")
        more = f" and {len(confirmed) - SHOW_TESTS} more" if len(confirmed) > SHOW_TESTS else ""
        crashed = [b for b, a in first.branches.items() if a.worker_crashes
                   and any(name.startswith(f"{b}/") for name in confirmed)]
        # A replacement worker cannot collect the withheld tests: what a crashed worker still had to run is lost
        # there, where the official run's replacement ran it. Said, so a reader can tell such a case apart.
        crash_note = (f" (xdist workers crashed in the audit of branch(es) {', '.join(crashed)}: a replacement worker "
                      f"cannot collect the withheld tests, so the tests a crashed worker had left are lost there)"
                      if crashed else "")
        detail = (f"{len(confirmed)} test(s) that passed in the official run failed when the program could not read "
                  f"the hidden tests (their sources withheld after collection, PYTEST_CURRENT_TEST naming no test), "
                  f"in two audit runs; the score stays the official one: {'; '.join(shown)}{more}{crash_note}")
        return IntegrityFlag(READS_HIDDEN_TESTS, "", printable(detail))

    # ------------------------------------------------------------------------------------------- running

    def _audit(self, official: SdkEvaluator, image: str, selection: Mapping[str, Sequence[str]],
               plugin: AuditPlugin) -> AuditPass:
        branches = list(selection)
        evaluator = AuditEvaluator(official, branches, plugin, selection, positions=self.early.positions)
        with self.early.lock:
            self.early.live.add(evaluator)
        outcome = AuditPass(branches={b: BranchAudit() for b in branches},
                            selection={b: list(names) for b, names in selection.items()})
        lock = threading.Lock()

        def one(branch: str) -> None:
            started = time.monotonic()
            audit = outcome.branches[branch]
            try:
                evaluator._evaluate_branch(branch, image)
            except EngineUnavailable:
                raise
            except AuditUnavailable as exc:
                with lock:
                    audit.problem = str(exc)
            except SUBMISSION_RAISES as exc:
                if _is_connection_failure(exc):
                    raise
                with lock:
                    audit.crashed = f"{type(exc).__name__}: {str(exc)[:300]}"
            except Exception as exc:
                log.warning("%s: the audit of branch %s failed", official.instance_id, branch, exc_info=True)
                with lock:
                    audit.problem = f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                audit.seconds = time.monotonic() - started

        pool: ThreadPoolExecutor | None = None
        try:
            if evaluator.branch_workers > 1 and len(branches) > 1:
                pool = ThreadPoolExecutor(max_workers=evaluator.branch_workers, thread_name_prefix="pb-audit")
                futures: list[Future[None]] = [pool.submit(one, b) for b in branches]
                for future in futures:
                    future.result()
            else:
                for branch in branches:
                    one(branch)
        finally:
            evaluator.cleanup_all()  # first: a branch still running then ends with its container
            if pool is not None:
                pool.shutdown(wait=True)
            evaluator._retire()
            evaluator.reaper.close()
            with self.early.lock:
                self.early.live.discard(evaluator)
        for branch, audit in outcome.branches.items():
            audit.reports = list(evaluator.reports.get(branch, []))
            audit.worker_crashes = sum(count_worker_crashes(xml) for b, xml, _run in evaluator.attempts
                                       if b == branch)
            if not audit.problem and not audit.crashed:
                # The plugin is mounted read-only and loaded by every pytest of the run: a run it did not report
                # from is one the submission obstructed (its report removed, its processes killed, ...).
                audit.obstructed = audit.plugin_problem() or ""
        outcome.timeouts = list(evaluator.timed_out)
        ran = [b for b, a in outcome.branches.items() if not (a.problem or a.crashed or a.obstructed)]
        for test in self._filtered(evaluator.result, ran).test_results:
            name = canonical_full(test.full_name)
            if test.is_resolved:
                outcome.passed.add(name)
                outcome.results.setdefault(name, test)
            else:
                outcome.results[name] = test
        return outcome


class EarlyAudits:
    """The audit's branches started while the official run goes on, in a thread pool of the evaluation's branch
    width: the secret rank, the branches known to pass or not, the started runs, the plugin's one volume."""

    def __init__(self, hook: HiddenTestAudit) -> None:
        self.hook = hook
        self.order: list[str] = []  # the active branches in the secret rank
        self.passing: dict[str, bool] = {}  # branch -> passed a counted test officially (absent: not run yet)
        self.futures: dict[str, Future[AuditPass]] = {}
        self.positions: dict[str, tuple[int, int]] = {}  # branch -> (audit k, of n): its progress phase
        self.live: set[AuditEvaluator] = set()  # evaluators whose containers an abandoned run removes
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.closed = False
        self.started_at: float | None = None
        self._plugin: AuditPlugin | AuditUnavailable | None = None

    def rank(self, active: list[str]) -> None:
        self.order = secrets.SystemRandom().sample(active, len(active))

    def sample(self, passing: list[str]) -> list[str]:
        """The first ``AUDIT_SAMPLE`` passing branches in the secret rank (a uniform sample of them), in the
        official order."""
        drawn = set([b for b in self.order if b in passing][:AUDIT_SAMPLE])
        return [b for b in passing if b in drawn]

    def branch_done(self, official: SdkEvaluator, branch: str, image: str) -> None:
        try:
            passed = bool(self.hook.passed_in(official, branch))
            with self.lock:
                if self.closed or branch not in self.order:
                    return
                self.passing[branch] = passed
                for certain in self._certain():
                    self._start(official, image, certain)
        except Exception:  # never the official run's failure: a branch not started runs at the end
            log.warning("%s: the audit of branch %s was not started early", official.instance_id, branch,
                        exc_info=True)

    def _certain(self) -> list[str]:
        """Branches passed and not started that are in the sample whatever the branches still to run do: fewer than
        ``AUDIT_SAMPLE`` branches ranked before them passed or may still pass."""
        found, ahead = [], 0
        for b in self.order:
            if ahead >= AUDIT_SAMPLE:
                break
            passed = self.passing.get(b)
            if passed is False:
                continue
            ahead += 1
            if passed and b not in self.futures:
                found.append(b)
        return found

    def _start(self, official: SdkEvaluator, image: str, branch: str) -> None:
        tests = self.hook.drawn_tests(official, branch)
        self.positions[branch] = (len(self.positions) + 1, min(AUDIT_SAMPLE, len(self.order)))
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=max(1, official.branch_workers),
                                           thread_name_prefix="pb-audit-early")
            self.started_at = time.monotonic()
        progress.info("[%s] audit of branch %s started beside the official run", official.instance_id, branch)
        self.futures[branch] = self.pool.submit(self._one, official, image, branch, tests)

    def _one(self, official: SdkEvaluator, image: str, branch: str, tests: list[str]) -> AuditPass:
        return self.hook._audit(official, image, {branch: tests}, self.plugin(official, image))

    def plugin(self, official: SdkEvaluator, image: str) -> AuditPlugin:
        """The plugin's volume, made once for every run of this audit (a failure to make it, raised again)."""
        with self.lock:
            if self._plugin is None:
                try:
                    self._plugin = AuditPlugin.make(official, image)
                except AuditUnavailable as exc:
                    self._plugin = exc
            if isinstance(self._plugin, AuditUnavailable):
                raise self._plugin
            return self._plugin

    def first_pass(self, official: SdkEvaluator, image: str, branches: list[str]) -> AuditPass:
        """The sample's first run: the started branches' results, the others run now (together)."""
        with self.lock:
            started = {b: f for b, f in self.futures.items() if b in branches}
            rest = [b for b in branches if b not in started]
            for b in rest:
                self.positions[b] = (len(self.positions) + 1, len(branches))  # started ones are in the sample
        passes = {b: future.result() for b, future in started.items()}
        if rest:
            selection = {b: self.hook.drawn_tests(official, b) for b in rest}
            done = self.hook._audit(official, image, selection, self.plugin(official, image))
            passes.update({b: done for b in rest})
        unique: list[AuditPass] = []
        for b in branches:
            if all(run is not passes[b] for run in unique):
                unique.append(passes[b])
        return AuditPass.merged(unique, branches)

    def close(self, official: SdkEvaluator, *, abandon: bool) -> None:
        """Every started audit ended (an abandoned run's stopped first: their containers removed), the pool shut,
        the plugin's volume removed. What a run nobody waited for raised is only logged."""
        with self.lock:
            self.closed = True
            live = list(self.live) if abandon else []
            futures = list(self.futures.values())
        for evaluator in live:
            evaluator.cleanup_all()
        for future in futures:
            with contextlib.suppress(Exception):
                future.result()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if isinstance(self._plugin, AuditPlugin):
            self._plugin.remove(official)

    def seconds(self, tail: float) -> float:
        """The audit's wall time: from its first early start when there was one, else its part at the end."""
        return time.monotonic() - self.started_at if self.started_at is not None else tail


def sample_tests(names: list[str], size: int) -> list[str]:
    """``size`` of ``names`` (all when there are no more), drawn from the operating system's randomness."""
    return sorted(names) if len(names) <= size else sorted(secrets.SystemRandom().sample(names, size))


def _obstructed_flag(confirmed: list[str], first: AuditPass, second: AuditPass) -> IntegrityFlag:
    branches = list(dict.fromkeys(n.split("/", 1)[0] for n in confirmed))
    why = "; ".join(f"branch {b}: {first.branches[b].crashed or first.branches[b].obstructed}; second run: "
                    f"{second.branches[b].crashed or second.branches[b].obstructed}" for b in branches[:SHOW_TESTS])
    return IntegrityFlag(AUDIT_OBSTRUCTED, "", printable(
        f"{len(confirmed)} test(s) that passed in the official run, whose results were readable there, gave the "
        f"audit no readable result in two runs (counted as the submission's doing; the score stays the official "
        f"one): {why}"[:2000]))


def _first_run_problems(first: AuditPass) -> list[str]:
    """The audit's own failures in its first run: a branch not audited (its container did not start, its plugin
    could not be mounted). A run the plugin did not report from is the submission's doing, not a problem."""
    return [f"branch {b}: {a.problem}" for b, a in first.branches.items() if a.problem]


def _second_run_problems(again: list[str], second: AuditPass) -> list[str]:
    """The audit's own failures in its second run (of the branches ``again``)."""
    retried = set(second.compared())
    return [f"branch {b}: its second run: {second.branches[b].problem}" for b in again if b not in retried]


def _flaky(regressed: list[str], second: AuditPass) -> str:
    """The tests that failed in the first run and passed in the second ("": none)."""
    retried = set(second.compared())
    passed_again = [n for n in regressed if n.split("/", 1)[0] in retried]
    if not passed_again:
        return ""
    return (f"{len(passed_again)} test(s) failed in the audit's first run and passed in its second "
            f"(flaky, not flagged): {', '.join(passed_again[:SHOW_TESTS])}")
