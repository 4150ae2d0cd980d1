"""The opted-in session: selection, run identity, collection of task items, report header, final sweep.

Registered as a plugin object only when the session opts in, so a project that merely has the package installed
runs none of these hooks.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Generator
from typing import Any

import pytest

from pytest_programbench import options
from pytest_programbench.catalogue import Catalogue, CatalogueError
from pytest_programbench.markers import register_languages
from pytest_programbench.run_identity import RunIdentity
from pytest_programbench.selection import Selection, select

log = logging.getLogger(__name__)

WORKERINPUT_KEY = "pytest_programbench_run"
NOTHING_TO_RUN = (
    "the ProgramBench suite is selected but there is nothing to run: pass --pb-agent CMD to run an agent, or "
    "--pb-submissions DIR to evaluate existing submissions (add --co to only list the tasks)"
)


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class ProgramBenchSession:
    """Session-wide state and the hooks that need it."""

    def __init__(self, config: pytest.Config, settings: options.Settings, catalogue: Catalogue,
                 selection: Selection, identity: RunIdentity) -> None:
        self.config = config
        self.settings = settings
        self.catalogue = catalogue
        self.selection = selection
        self.identity = identity
        self.collect_only = bool(config.option.collectonly)
        self.explicit_paths = config.args_source == pytest.Config.ArgsSource.ARGS
        self.worker_id: str = getattr(config, "workerinput", {}).get("workerid", "controller")

    @classmethod
    def from_config(cls, config: pytest.Config) -> ProgramBenchSession:
        settings = options.parse(config)
        try:
            catalogue = Catalogue.load(settings.tasks_dirs, include_fixtures=settings.include_fixtures)
        except CatalogueError as exc:
            raise pytest.UsageError(f"malformed task: {exc}") from None
        selection = select(
            catalogue,
            languages=settings.languages,
            difficulties=settings.difficulties,
            filter_spec=settings.filter,
            slice_spec=settings.slice,
            shuffle_seed=settings.shuffle,
        )
        if not selection.tasks:
            raise pytest.UsageError(f"no ProgramBench task matched: {selection.why_empty}")
        if not config.option.collectonly and not settings.agent and not settings.submissions:
            raise pytest.UsageError(NOTHING_TO_RUN)
        register_languages(config, {t.language for t in catalogue})
        if is_worker(config):
            identity = RunIdentity.from_dict(config.workerinput[WORKERINPUT_KEY])  # type: ignore[attr-defined]
        else:
            identity = RunIdentity.create(config.rootpath, output=settings.output, resume=settings.resume)
        return cls(config, settings, catalogue, selection, identity)

    # -- collection -------------------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        report = yield
        if isinstance(collector, pytest.Session) and report.passed:
            from pytest_programbench.items import ProgramBenchSuite

            suite = ProgramBenchSuite.from_parent(collector, name="programbench", nodeid="programbench",
                                                  tasks=self.selection.tasks)
            # With no explicit path the session is the benchmark alone; with paths, the benchmark joins them.
            report.result = [*report.result, suite] if self.explicit_paths else [suite]
        return report

    # -- xdist ------------------------------------------------------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[WORKERINPUT_KEY] = self.identity.as_dict()

    # -- reporting --------------------------------------------------------------------------------------------

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        from importlib.metadata import version

        import programbench  # noqa: F401 - the version comes from its metadata

        per_language = Counter(t.language for t in self.selection.tasks)
        languages = ", ".join(f"{lang} {n}" for lang, n in sorted(per_language.items(), key=lambda kv: -kv[1]))
        lines = [
            f"programbench {version('programbench')}: {len(self.selection.tasks)} tasks selected ({languages})",
            f"programbench run {self.identity.run_id}: {self.identity.run_dir}",
        ]
        overridden = [t.instance_id for t in self.selection.tasks if t.overridden]
        if overridden:
            lines.append(f"programbench overridden by --pb-tasks-dir: {', '.join(overridden)}")
        return lines

    # -- run lifecycle ----------------------------------------------------------------------------------------

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.collect_only or is_worker(self.config):
            return
        from importlib.metadata import version

        self.identity.materialise({
            "plugin_version": version("pytest-programbench"),
            "programbench_version": version("programbench"),
            "selected": [t.instance_id for t in self.selection.tasks],
        })

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.collect_only or is_worker(self.config):
            return
        from pytest_programbench import docker_engine

        try:
            report = docker_engine.sweep(self.identity.run_id)
        except docker_engine.EngineUnavailable as exc:
            log.warning("could not sweep run %s: %s", self.identity.run_id, exc)
            return
        if report.errors:
            log.warning("sweep of run %s left: %s", self.identity.run_id, "; ".join(report.errors))
