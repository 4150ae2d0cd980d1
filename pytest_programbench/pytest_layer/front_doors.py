"""The front doors that run no session: ``--pb-compare BASE,NEW`` compares two finished runs and ``--pb-report DIR``
writes report.html for a foreign run, both from files, before pytest configures a session (nothing is collected; no
agent or engine). They read the options here; ``results/`` does the work from plain values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _pytest.config import create_terminal_writer

from pytest_programbench.pytest_layer import options
from pytest_programbench.results import compare, foreign_runs
from pytest_programbench.results.gold import Ledger, LedgerError

# Options a comparison of two finished runs reads; any other --pb-* option asks for a run, which it does not do.
# --pb-tasks-dir: the tasks a foreign side names (beside programbench's own and those our side's run used).
FINISHED_OPTIONS = frozenset({"--pb-compare", "--pb-max-regression", "--pb-gold-ledger", "--pb-registry-ignore",
                              "--pb-tasks-dir"})


def compare_finished_runs(config: pytest.Config) -> int:
    """``pytest --pb-compare BASE,NEW [--pb-max-regression X]``: print and write the comparison, exit 1 when the gate
    fails. Runs before pytest configures a session: no collection, agent or engine."""
    values = _only_options(config, FINISHED_OPTIONS, "--pb-compare BASE,NEW compares two finished runs and runs "
                           "nothing: {extra} cannot go with it (give one directory to compare a run)")
    base_dir, new_dir = (Path(d) for d in values["compare"])
    try:
        ledger = None
        if values.get("gold_ledger"):  # flips of tests the reference itself passes only sometimes are marked
            try:
                ledger = Ledger.load(Path(values["gold_ledger"]))
            except LedgerError as exc:
                raise compare.CompareError(f"--pb-gold-ledger: {exc}") from None
        written = compare.write(base_dir, new_dir, ledger=ledger, max_regression=values.get("max_regression"),
                                tasks_dirs=values.get("tasks_dirs") or (),
                                registry_ignore=values.get("registry_ignore"))
    except compare.CompareError as exc:
        raise pytest.UsageError(f"--pb-compare: {exc}") from None
    writer = create_terminal_writer(config)
    writer.sep("=", "programbench compare")
    for line in written.lines():
        writer.line(line)
    if written.gate_failure:
        writer.line(written.gate_failure, red=True, bold=True)
        return int(pytest.ExitCode.TESTS_FAILED)
    return int(pytest.ExitCode.OK)


DEFAULT_RUNS = "pb-runs"  # where runs go without --pb-output: --pb-report reads their recorded tasks directories
# Options --pb-report reads; any other --pb-* option asks for a run, which it does not do.
REPORT_OPTIONS = frozenset({"--pb-report", "--pb-tasks-dir", "--pb-registry-ignore"})


def report_foreign_run(config: pytest.Config) -> int:
    """``pytest --pb-report DIR``: report.html for a foreign run, before pytest configures a session (nothing is
    collected; no agent or engine)."""
    values = _only_options(config, REPORT_OPTIONS, "--pb-report DIR writes the report of a finished run and runs "
                           "nothing: {extra} cannot go with it")
    try:
        run, path = foreign_runs.report(Path(values["report"]), tasks_dirs=values.get("tasks_dirs") or (),
                                        ignore_file=values.get("registry_ignore"),
                                        runs_beside=[config.invocation_params.dir / DEFAULT_RUNS])
    except foreign_runs.ForeignRunError as exc:
        raise pytest.UsageError(f"--pb-report: {exc}") from None
    writer = create_terminal_writer(config)
    writer.sep("=", "programbench report")
    for line in foreign_runs.report_lines(run, path):
        writer.line(line)
    return int(pytest.ExitCode.OK)


def _only_options(config: pytest.Config, allowed: frozenset[str], refusal: str) -> dict[str, Any]:
    """The Settings fields of the ``allowed`` options given; any other ``--pb-*`` option asks for a run, which a
    front door does not do: a usage error, ``refusal`` naming them (``{extra}``)."""
    extra = [flag for flag in options.given_on_command_line(config) if flag not in allowed]
    if extra:
        raise pytest.UsageError(refusal.format(extra=", ".join(extra)))
    values: dict[str, Any] = {}
    for opt in options.OPTIONS:
        raw = options.raw_value(config, opt) if opt.flag in allowed else None
        if raw is not None:
            values.update(opt.parse(raw))
    return values
