"""The scheduling hooks of an opted-in session: the order tasks start in, said in the header, remembered at the end.

Without xdist the collected items are reordered (one process: nothing else sees the order). Under xdist every
worker must collect the same items in the same order, so the order is applied by the controller's scheduler
instead (``scheduling/longest_first.py``), and only when the plugin chose the mode (``-n`` alone); a ``--dist`` the
user gave is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_programbench.pytest_layer.items import ProgramBenchItem
from pytest_programbench.pytest_layer.stash import WORKSTEAL_DEFAULTED
from pytest_programbench.scheduling.estimates import (
    Estimates,
    instance_of,
    read_run_durations,
    remember_durations,
    reorder,
)
from pytest_programbench.scheduling.longest_first import LongestFirstScheduling

if TYPE_CHECKING:
    from pytest_programbench.pytest_layer.run_state import RunState


class SchedulingPlugin:
    def __init__(self, session: RunState) -> None:
        self.session = session
        self.config = session.config
        self._estimates: Estimates | None = None
        durations = session.settings.durations
        if durations is not None and not session.collect_only:
            try:  # before anything runs: a directory that is no run is the user's mistake, said as such
                read_run_durations(Path(durations))
            except (OSError, ValueError) as exc:
                raise pytest.UsageError(f"--pb-durations: {durations} is not a run directory with a readable "
                                        f"summary.json ({exc})") from None

    @property
    def estimates(self) -> Estimates:
        if self._estimates is None:
            settings = self.session.settings
            agent = settings.agent_timeout if self.session.agent_spec is not None else 0
            self._estimates = Estimates.build(self.session.selection.tasks, durations_dir=settings.durations,
                                              cache=getattr(self.config, "cache", None), agent_seconds=agent)
        return self._estimates

    def _under_xdist(self) -> bool:
        return self.config.pluginmanager.get_plugin("dsession") is not None or hasattr(self.config, "workerinput")

    def _ours_to_order(self) -> bool:
        return not self._under_xdist() or self.config.stash.get(WORKSTEAL_DEFAULTED, False)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if self._under_xdist():
            return  # every worker keeps collection order; the scheduler decides what starts when
        if self.session.collect_only:
            return  # a listing shows the selection in its own order (--pb-shuffle's, as the official); nothing starts
        reorder(items, lambda item: isinstance(item, ProgramBenchItem), self.estimates)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if not config.stash.get(WORKSTEAL_DEFAULTED, False):
            return None  # the user's --dist
        return LongestFirstScheduling(config, log, self.estimates.longest_first)

    def pytest_report_header(self) -> list[str]:
        if self.session.collect_only:
            return []
        if not self._ours_to_order():
            return [f"programbench schedule: as --dist {self.config.option.dist} orders it (collection order)"]
        # One line for what -n alone does: the plugin's scheduler replaces xdist's (its worksteal is only the base).
        workers = (" to idle workers (-n without --dist; pass --dist to use xdist's own)" if self._under_xdist()
                   else "")
        return [f"programbench schedule: longest first{workers}, by {self.estimates.describe()}"]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self) -> None:
        """The durations of what ran, for the next run's order (pytest's cache; absent under -p no:cacheprovider)."""
        summary = self.session.summary
        if summary is None or hasattr(self.config, "workerinput"):
            return
        runs: dict[str, list[float]] = {}
        for key, record in list(summary.records.items()):
            if record.outcome and record.duration > 0:
                runs.setdefault(instance_of(key), []).append(record.duration)
        remember_durations(getattr(self.config, "cache", None),
                           {iid: sum(seconds) / len(seconds) for iid, seconds in runs.items()})
