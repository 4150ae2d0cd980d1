"""The live progress view's hooks: every process that runs items publishes its task and phase, the controller shows
the view for the run loop (``results/progress.py`` does the publishing, reading and drawing, pytest-free)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from pytest_programbench.results.progress import (
    Counts,
    LogTap,
    ProgressView,
    Publisher,
    progress_dir,
)

if TYPE_CHECKING:
    from pytest_programbench.core.run_identity import RunIdentity
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.results.summary import RunSummary


class ProgressHost(Protocol):
    """What the progress view reads and sets: the publisher it installs, the summary it counts from."""

    settings: Settings
    identity: RunIdentity
    worker_id: str
    progress: Publisher | None
    summary: RunSummary | None


class ProgressPlugin:
    """Registered on the controller: the view runs for the run loop, Ctrl-C included."""

    def __init__(self, view: ProgressView) -> None:
        self.view = view

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, Any]:
        self.view.start()
        try:
            return (yield)
        finally:  # before the terminal summary
            self.view.stop()


class WorkerProgress:
    """Registered in every process that runs items: the task starts, its verdict, its end."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        if nodeid.startswith("programbench::"):
            self.publisher.task_started(nodeid.removeprefix("programbench::"))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        if item.nodeid.startswith("programbench::"):
            self.publisher.phase(item.nodeid.removeprefix("programbench::"), "verdict")

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if nodeid.startswith("programbench::"):
            self.publisher.task_finished(nodeid.removeprefix("programbench::"))


def attach(pb_session: ProgressHost, session: pytest.Session) -> Callable[[], None]:
    """Start publishing (a process that runs items) and viewing (the controller); returns the closer."""
    config = session.config
    settings = pb_session.settings
    run_dir = pb_session.identity.path
    closers: list[Callable[[], None]] = []
    runs_items = hasattr(config, "workerinput") or config.pluginmanager.get_plugin("dsession") is None
    if runs_items:
        publisher = Publisher(run_dir, pb_session.worker_id)
        pb_session.progress = publisher
        tap = LogTap(publisher)
        tap.install()
        worker_plugin = WorkerProgress(publisher)
        config.pluginmanager.register(worker_plugin, "programbench-progress-worker")

        def close_publisher() -> None:
            config.pluginmanager.unregister(worker_plugin)
            tap.uninstall()
            pb_session.progress = None
            publisher.close()

        closers.append(close_publisher)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if not hasattr(config, "workerinput") and terminal is not None:
        def counts() -> Counts | None:
            summary = pb_session.summary
            if summary is None:
                return None
            tally = summary.tally  # kept as tasks settle: nothing summed over every record each second
            budget = summary.budget_state()
            return Counts(tally.selected, tally.outcomes["passed"], tally.outcomes["failed"],
                          tally.outcomes["error"], tuple(tally.durations.values()),
                          "" if budget is None else budget.text())

        def on_in_flight(in_flight: dict[str, dict[str, Any]]) -> None:
            if pb_session.summary is not None:
                pb_session.summary.set_in_flight(in_flight)

        mode = settings.progress
        if mode == "auto" and (config.getoption("log_cli_level", None) or config.getini("log_cli")):
            mode = "lines"  # live log lines would land inside a block drawn in place
        view = ProgressView(run_dir, mode=mode, interval=settings.progress_interval,
                            quiet=config.get_verbosity() < 0, terminal=terminal, counts=counts,
                            on_in_flight=on_in_flight)
        view_plugin = ProgressPlugin(view)
        config.pluginmanager.register(view_plugin, "programbench-progress-view")

        def close_view() -> None:
            view.stop()
            config.pluginmanager.unregister(view_plugin)
            with contextlib.suppress(OSError):  # the workers' current-state files; progress.jsonl stays
                for leftover in progress_dir(run_dir).glob("*.json"):
                    leftover.unlink()
                progress_dir(run_dir).rmdir()

        closers.insert(0, close_view)

    def close() -> None:
        for closer in closers:
            closer()

    return close
