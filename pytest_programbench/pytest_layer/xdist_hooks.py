"""The xdist hooks of an opted-in session, registered only when pytest-xdist is present (as pytest-randomly does):
the run's identity handed to workers, the first worker's collection starting the summary, crashed workers' tasks
rescheduled within the infrastructure budget."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pytest

from pytest_programbench.core.run_identity import public_settings
from pytest_programbench.core.task_key import TaskKey
from pytest_programbench.pytest_layer.run_record import WORKERINPUT_IDENTITY, WORKERINPUT_RESUMED_SETTINGS

if TYPE_CHECKING:
    from pytest_programbench.pytest_layer.run_state import RunState

log = logging.getLogger(__name__)

class XdistHooks:
    def __init__(self, pb: RunState) -> None:
        self.pb = pb  # the opted-in session whose state this reads
        self.crashes: dict[str, list[str]] = {}

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[WORKERINPUT_IDENTITY] = self.pb.identity.as_dict()
        if self.pb.identity.resumed:
            node.workerinput[WORKERINPUT_RESUMED_SETTINGS] = public_settings(self.pb.settings)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        """A worker died running a task: remove its containers, reschedule it within the infra budget, else error."""
        key = TaskKey.of_nodeid(crashitem)
        if key is None:
            return
        instance_id = key.name
        self.pb.forget_task_containers(instance_id)
        crashes = self.crashes.setdefault(crashitem, [])
        crashes.append(str(report.longrepr))
        if len(crashes) <= self.pb.settings.infra_retries:
            try:
                sched.mark_test_pending(crashitem)
            except NotImplementedError:
                pass  # this --dist mode cannot reschedule (use --dist load or worksteal)
            else:
                report.outcome = "rerun"  # type: ignore[assignment]
                log.warning("%s: rescheduled after a worker crash (%d of %d)", instance_id, len(crashes),
                            self.pb.settings.infra_retries)
                return
        # An infrastructure error, in the error column: the item's own windows did not end it.
        report.when = "setup"
        report.longrepr = (f"infrastructure error: the xdist worker crashed {len(crashes)} time(s) while running "
                           f"it (run directory: {key.task_dir(self.pb.identity.path)})\n" + "\n".join(crashes))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if self.pb.summary is None:  # the first worker's list: the controller collects nothing, so say it here, once
            reporter = self.pb.config.pluginmanager.get_plugin("terminalreporter")
            for line in self.pb.deselected_lines():
                if reporter is not None:
                    if reporter.isatty:  # xdist's status line ends in a carriage return, not a newline
                        reporter.write("\n")
                    reporter.write_line(line)
        self.pb.start_summary(ids)
