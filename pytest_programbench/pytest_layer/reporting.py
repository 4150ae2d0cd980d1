"""What an opted-in session says: the report header, JUnit (the agent.log tail per test case, the headline as
suite properties), failure titles, the terminal summary, and the run's end-of-session files (report.html, the gold
ledger, the comparison, the leaderboard package) with the exit-status gates (--pb-min-mean, --pb-max-regression)."""

from __future__ import annotations

import logging
import xml.etree.ElementTree as ET
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _pytest.junitxml import bin_xml_escape, xml_key
from programbench.utils.load_data import get_active_branches, get_ignored_tests

from pytest_programbench.core.task_key import TaskKey
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.pytest_layer import keyword_hint
from pytest_programbench.pytest_layer.invocation import is_worker
from pytest_programbench.pytest_layer.run_record import command
from pytest_programbench.pytest_layer.run_state import RunState, agent_label
from pytest_programbench.results.compare import write
from pytest_programbench.results.gold import build_ledger, ledger_lines, write_ledger
from pytest_programbench.results.package import PackageError, package
from pytest_programbench.results.registry import leaderboard
from pytest_programbench.results.report import TaskScope, write_report
from pytest_programbench.results.run_index import INDEX_FILE, write_index
from pytest_programbench.results.verdict import tail_lines
from pytest_programbench.sandbox.proxy_build import ProxyBuildError, build_client
from pytest_programbench.sandbox.sandbox import storage_limit, storage_quota
from pytest_programbench.tasks.catalogue import CatalogueError
from pytest_programbench.text.printable import PrintableRecords, printable

if TYPE_CHECKING:
    from pytest_programbench.results.summary import RunSummary

log = logging.getLogger(__name__)


def junit_headline(summary: RunSummary) -> dict[str, str]:
    """The headline flattened to JUnit property values (plain strings)."""
    head = summary.headline()
    numbers = summary.intervals()
    out = {name: str(head.get(name)) for name in ("selected", "scored", "mean_over_scored", "mean_over_selection")}
    for name in ("mean_over_scored_ci", "mean_over_selection_ci"):
        ci = numbers.get(name)
        if ci:
            out.update({f"{name}_low": str(ci["low"]), f"{name}_high": str(ci["high"]),
                        f"{name}_method": f"bootstrap {ci['method']}, {ci['resamples']} resamples, seed {ci['seed']}, "
                                          f"over {ci['n']} {ci['over']}"})
    if summary.attempts > 1:
        out["attempts"] = str(summary.attempts)
        out["std_across_attempts"] = str(numbers.get("std_across_attempts"))
        for name in ("pass_at_k", "resolved_at_k", "near_resolved_at_k"):
            for k, value in (numbers.get(name) or {}).items():
                out[f"{name.removesuffix('k')}{k}"] = str(value)  # pass_at_1, resolved_at_4, ...
    return out


def _junit_xml(config: pytest.Config) -> Any:
    """pytest's JUnit writer when ``--junitxml`` is on (its node reporters are how a test case gets content)."""
    return config.stash.get(xml_key, None)


class SessionReporting:
    """A plugin object beside the session: its hooks report, ``finish`` writes the end-of-run files."""

    def __init__(self, pb: RunState) -> None:
        self.pb = pb  # the opted-in session whose state this reads
        self.report_path: Path | None = None
        self.min_mean_failed = ""
        self.end_lines: list[tuple[str, list[str]]] = []  # --pb-compare / --pb-package: (section, lines)
        self.end_failed = ""  # --pb-max-regression's message, or a comparison it needed that failed

    def finish(self, session: pytest.Session) -> None:
        """On the controller at session end, once the summary is final: the files and the gates."""
        self._registry_leaderboard()
        if self.pb.summary is not None:
            self._write_report()
        self._check_min_mean(session)
        self._write_gold_ledger()
        self._compare_and_package(session)
        if self.pb.summary is not None:  # last: it lists this run's comparisons too
            self._write_index()

    def _write_index(self) -> None:
        """index.html beside this run: the runs of its directory, one page (results/run_index.py); never fails."""
        root = self.pb.identity.path.parent
        try:
            write_index(root)
        except Exception as exc:
            log.warning("could not write %s: %s", root / INDEX_FILE, exc)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """pytest's handlers that write records out (the live log, --log-file, the captured log of a report and so
        harness.log) show every record printable: the harness's and the official's logs quote container output."""
        logging_plugin = session.config.pluginmanager.get_plugin("logging-plugin")
        for name in ("log_cli_handler", "log_file_handler", "report_handler"):
            handler = getattr(logging_plugin, name, None)
            if isinstance(handler, logging.Handler):
                handler.addFilter(PrintableRecords())

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        per_language = Counter(t.language for t in self.pb.selection.tasks)
        languages = ", ".join(f"{lang} {n}" for lang, n in sorted(per_language.items(), key=lambda kv: -kv[1]))
        lines = [
            f"programbench {version('programbench')}: {len(self.pb.selection.tasks)} tasks selected ({languages})",
            f"programbench run {self.pb.identity.run_id}: " + (
                self.pb.identity.run_dir if not self.pb.collect_only
                # Nothing runs: naming the folder a run would have made sent users looking for it.
                else f"no run directory ({'--pb-preflight checks' if self.pb.settings.preflight else 'a listing of'}"
                     " the selection: nothing runs)"),
        ]

        if self.pb.identity.resumed:
            lines.append("programbench: resuming with the run's recorded settings (options given now replace them)")
        overridden = [t.instance_id for t in self.pb.selection.tasks if t.overridden]
        if overridden:
            lines.append(f"programbench overridden by --pb-tasks-dir: {', '.join(overridden)}")
        if self.pb.agent_spec is not None:
            lines.append(f"programbench agent: {agent_label(self.pb.agent_spec)}"
                         + (" (on the host)" if self.pb.agent_spec.on_host else " (in the sandbox)"))
            if not self.pb.collect_only:
                lines.append(f"programbench binary proxy client: {self._proxy_client_label()}")
                lines.append(f"programbench sandbox storage: {self._storage_label()}")
        if self.pb.engines is not None:
            described = ", ".join(f"{spec.name}" + (f" ({spec.slots} slots)" if spec.slots else "")
                                  for spec in self.pb.engines.specs)
            lines.append(f"programbench engines: {described}")
        elif not self.pb.collect_only:
            problem = self.pb.docker_engines.preflight()
            if problem:
                lines.append(f"programbench: {problem} (every item will error)")
        return lines

    def _storage_label(self) -> str:
        """Whether the engine can limit a sandbox's writable layer: said up front where it cannot."""
        limit = storage_limit()
        if not limit:
            return "no size limit asked (PB_SANDBOX_STORAGE=0)"
        try:
            return storage_quota(self.pb.docker_engines.client().api).describe(limit)
        except EngineUnavailable as exc:
            return f"unknown ({exc})"

    def _proxy_client_label(self) -> str:
        """Built (or found in its cache) once here, so a fallback to the slow Python client is visible up front."""
        try:
            return build_client().label
        except (ProxyBuildError, OSError) as exc:
            return f"unavailable ({exc}); each sandbox will try again"

    @pytest.hookimpl(tryfirst=True, specname="pytest_runtest_logreport")
    def pytest_runtest_logreport_junit(self, report: pytest.TestReport) -> None:
        """JUnit ``<system-out>``: the agent.log tail, added before junitxml closes the test case (on teardown)."""
        key = TaskKey.of_nodeid(report.nodeid)
        if report.when != "teardown" or key is None:
            return
        xml = _junit_xml(self.pb.config)
        if xml is None:
            return
        tail = tail_lines(key.task_dir(self.pb.identity.path) / "agent.log")
        if tail:
            out = ET.Element("system-out")
            out.text = bin_xml_escape("\n".join([f"last {len(tail)} lines of agent.log:", *tail, ""]))
            xml.node_reporter(report).append(out)

    @pytest.hookimpl(trylast=True, specname="pytest_runtest_logreport")
    def pytest_runtest_logreport_title(self, report: pytest.TestReport) -> None:
        """After the progress line is written: the failure header names the task."""
        key = TaskKey.of_nodeid(report.nodeid)
        if key is not None and report.failed and report.location is not None:
            # pytest titles a failure with the location's domain ("test session" when empty).
            report.location = (report.location[0], report.location[1], key.name)

    @pytest.hookimpl(tryfirst=True, specname="pytest_sessionfinish")
    def pytest_sessionfinish_junit(self, session: pytest.Session) -> None:
        """The headline's numbers as JUnit suite properties (``programbench_*``), before junitxml writes the file:
        both means with their intervals, and under --pb-attempts the spread and pass@k."""
        xml = _junit_xml(self.pb.config)
        if xml is None or self.pb.summary is None or is_worker(self.pb.config):
            return
        for name, value in junit_headline(self.pb.summary).items():
            xml.add_global_property(f"programbench_{name}", value)

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.pb.preflight is not None:
            terminalreporter.write_sep("=", "programbench preflight")
            for line in self.pb.preflight.lines():
                terminalreporter.write_line(line, red=bool(self.pb.preflight.missing) and not line.startswith(
                    "checked:"))
        if not is_worker(config):
            for line in keyword_hint.hint_lines(config, list(self.pb.catalogue), self.pb.selection.tasks,
                                                attempts=self.pb.settings.attempts, gold=self.pb.settings.gold):
                terminalreporter.write_line(line, yellow=True)
        if self.pb.summary is None:
            return
        terminalreporter.write_sep("=", "programbench summary")
        # Lines of data shown printable: failure reasons quote sandboxes, and a compared run's summary.json or a
        # gold ledger is read back from disk, written by any version.
        for line in self.pb.summary.terminal_lines():
            terminalreporter.write_line(printable(line))
        terminalreporter.write_line(f"run directory: {self.pb.identity.run_dir}")
        headline = self.pb.summary.headline()
        if exitstatus == pytest.ExitCode.INTERRUPTED or headline.get("errors") or headline.get("not_run"):
            terminalreporter.write_line("to resume (finished tasks are kept): "
                                        + command(config.invocation_params.args, self.pb.identity.path), bold=True)
        if self.report_path is not None:
            terminalreporter.write_line(f"report: {self.report_path}")
        if self.min_mean_failed:
            terminalreporter.write_line(self.min_mean_failed, red=True, bold=True)
        for title, lines in self.end_lines:
            terminalreporter.write_sep("=", title)
            for line in lines:
                terminalreporter.write_line(printable(line))
        if self.end_failed:
            terminalreporter.write_line(self.end_failed, red=True, bold=True)

    def _write_report(self) -> None:
        """report.html next to summary.json; a page that cannot be written is said, never fails the run."""
        assert self.pb.summary is not None
        by_id = {t.instance_id: t for t in self.pb.selection.tasks}

        def scope(instance_id: str) -> TaskScope | None:
            task = by_id.get(instance_id)
            try:
                instance = task.load_instance() if task is not None else None
            except CatalogueError:
                return None
            if instance is None:
                return None
            return TaskScope(tuple(get_active_branches(instance)), frozenset(get_ignored_tests(instance)))

        try:
            self.report_path = write_report(self.pb.identity.path, self.pb.summary.as_dict(), scope)
        except Exception as exc:
            log.warning("could not write %s: %s", self.pb.identity.path / "report.html", exc)

    def _check_min_mean(self, session: pytest.Session) -> None:
        """--pb-min-mean: the run fails when the mean over the selection (errors count 0) is below the bar."""
        if self.pb.summary is None or self.pb.settings.min_mean is None:
            return
        mean = self.pb.summary.headline()["mean_over_selection"] or 0.0
        if mean < self.pb.settings.min_mean:
            self.min_mean_failed = (f"programbench: mean over the selection {mean:.4f} is below --pb-min-mean "
                                    f"{self.pb.settings.min_mean:g}")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _registry_leaderboard(self) -> None:
        """--pb-registry-ignore: the number the leaderboard will show for this run packaged, beside ours, in the
        terminal, summary.json and report.html (``leaderboard``); said, never fails the run."""
        if not self.pb.settings.registry_ignore or self.pb.summary is None:
            return
        summary = self.pb.summary
        try:
            board = leaderboard(self.pb.identity.path, Path(self.pb.settings.registry_ignore))
        except Exception as exc:  # a number beside ours: its failure is said, the run stands
            self.end_lines.append(("programbench leaderboard", [f"not computed: {exc!r}"]))
            return
        summary.header["leaderboard"] = board.as_dict(summary.headline())
        summary.write()
        summary.flush()
        self.end_lines.append(("programbench leaderboard", [board.line(summary.headline())]))

    def _write_gold_ledger(self) -> None:
        """--pb-gold: gold-ledger.json from the gold runs' official results; said, never fails the run."""
        if not self.pb.settings.gold:
            return
        try:
            instances = {t.instance_id: t.load_instance() for t in self.pb.selection.tasks}
            clocks = ("cpus", "memory", "branch_workers", "branch_retries", "compile_timeout", "test_timeout", "strict")
            ledger = build_ledger(self.pb.identity.path, instances, self.pb.settings.gold,
                                  {name: getattr(self.pb.settings, name) for name in clocks})
            path = write_ledger(self.pb.identity.path, ledger)
        except Exception as exc:
            self.end_lines.append(("programbench gold ledger", [f"not written: {exc!r}"]))
            return
        self.end_lines.append(("programbench gold ledger", [*ledger_lines(ledger), f"ledger: {path}"]))

    def _compare_and_package(self, session: pytest.Session) -> None:
        """--pb-compare BASE (compare.json/html; --pb-max-regression gates the exit status), then --pb-package (last:
        it splits each eval.json the official way). Neither changes a score; a failure of either is said."""
        if self.pb.settings.compare:
            try:
                written = write(Path(self.pb.settings.compare[0]), self.pb.identity.path, ledger=self.pb.ledger,
                                max_regression=self.pb.settings.max_regression,
                                tasks_dirs=self.pb.settings.tasks_dirs,
                                registry_ignore=self.pb.settings.registry_ignore)
            except Exception as exc:  # a gate that cannot be computed fails; a plain comparison is only said
                self.end_lines.append(("programbench compare", [f"comparison failed: {exc!r}"]))
                if self.pb.settings.max_regression is not None:
                    self.end_failed = f"programbench: --pb-max-regression: no comparison ({exc})"
            else:
                self.end_lines.append(("programbench compare", written.lines()))
                self.end_failed = written.gate_failure
            if self.end_failed and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.pb.settings.package:
            self._package(session)

    def _package(self, session: pytest.Session) -> None:
        """--pb-package that packaged nothing fails the session: a CI step that asked for a package must not pass."""
        try:
            packaged = package(self.pb.identity.path)
        except PackageError as exc:
            self.end_lines.append(("programbench package", [f"not packaged: {exc}"]))
            reason = f"programbench: --pb-package packaged nothing: {exc}"
        else:
            self.end_lines.append(("programbench package", packaged.lines()))
            if packaged.packaged:
                return
            reason = ("programbench: --pb-package packaged nothing: none of the run's tasks is a ProgramBench "
                      "benchmark task with an eval.json and a submission.tar.gz"
                      + (f" (not benchmark tasks: {', '.join(packaged.skipped)})" if packaged.skipped else ""))
        self.end_failed = "\n".join(filter(None, (self.end_failed, reason)))
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
