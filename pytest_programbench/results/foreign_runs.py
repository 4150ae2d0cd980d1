"""Runs that are not ours, read for ``--pb-compare`` and ``--pb-report``: a ``programbench eval`` output directory and
a leaderboard entry (a packaged submission, or an entry of the registry ProgramBench/submissions).

Three kinds of directory, told apart by their files (:func:`detect`):

* ours: ``pb-run.json`` (results/compare.py reads it; a packaged run of ours is still ours);
* an entry: ``_stats/score.json``, the per-test map ``{instance_id: {"<branch>/<test>": passed}}`` that
  ``programbench submit package`` writes and the registry's ``compile_leaderboard.py`` recomputes every number from,
  with or without the per-instance ``<id>/<id>.eval.json`` (a packaged submission has them, split the official way
  into a light eval.json and ``<id>.eval.log.json``; a registry entry has none);
* a ``programbench eval`` output directory: ``<id>/<id>.eval.json`` per instance (eval_batch.py writes them to
  ``<run dir>/<id>/``, or ``<output>/<run dir name>/<id>/`` with ``--output``).

Read with the official's own models and scoring: ``EvaluationResult.model_validate_json``, then
``for_branches(active).without_ignored(ignored)`` with the task's active branches and ignored tests from the
catalogue, its ``score``; an entry's per-test map as ``compile_leaderboard`` reads it (``score_from_tests``, the
registry's ``_instance_score``). The corrected score (results/corrected.py) where a result keeps its JUnit log.
What a kind does not hold (times, tokens, trajectories; an entry without eval.json files has no corrected score) is
listed in ``lacks`` and shown as "not in this run", never filled in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml
from programbench.eval.eval import EvaluationResult
from programbench.submission import score_from_tests
from programbench.utils.load_data import get_active_branches, get_ignored_tests

from pytest_programbench.core.run_identity import RUN_MARKER
from pytest_programbench.results import registry
from pytest_programbench.results.corrected import safe_corrected_score
from pytest_programbench.results.report import TaskScope, write_report
from pytest_programbench.results.summary import FAILED, PASSED, RunSummary, TaskRecord
from pytest_programbench.tasks.catalogue import Catalogue, CatalogueError, Task

SCORE_JSON = Path("_stats") / "score.json"
COST_JSON = Path("_stats") / "cost.json"
NOT_IN_RUN = "not in this run"
NOT_PASSED = "not passed"  # an entry's per-test map says passed or not, nothing more


@dataclass(frozen=True)
class Kind:
    name: str
    text: str


OURS = Kind("ours", "a pytest-programbench run directory")
OFFICIAL = Kind("official_run", "a programbench eval output directory (<id>/<id>.eval.json)")
ENTRY = Kind("entry", "a leaderboard entry or packaged submission (_stats/score.json)")
KINDS = (OURS, OFFICIAL, ENTRY)

# What no foreign kind records: the agent's side of a run.
NEVER_RECORDED = ("agent time", "evaluation time", "tokens", "trajectories")


class ForeignRunError(Exception):
    """A directory that is none of the kinds, or an entry that is not what the registry reads (a usage error)."""


def _instance_dirs(path: Path) -> list[Path]:
    return sorted(d for d in path.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))


def _eval_json(instance_dir: Path) -> Path:
    return instance_dir / f"{instance_dir.name}.eval.json"


def detect(path: Path) -> Kind:
    """Which kind ``path`` is; a ForeignRunError naming what it holds when it is none of them."""
    if not path.is_dir():
        raise ForeignRunError(f"{path} is not a finished run directory: it is not a directory")
    if (path / RUN_MARKER).is_file():
        return OURS
    if (path / SCORE_JSON).is_file():
        return ENTRY
    dirs = _instance_dirs(path)
    if any(_eval_json(d).is_file() for d in dirs):
        return OFFICIAL
    pending = sum((d / "submission.tar.gz").is_file() for d in dirs)
    held = (f"; it holds {pending} submission(s) no one evaluated yet (programbench eval {path}, or pytest "
            f"--pb-submissions {path})" if pending else "")
    raise ForeignRunError(f"{path} is not a finished run directory: none of {OURS.text} ({RUN_MARKER}), "
                          f"{OFFICIAL.text}, {ENTRY.text}{held}")


def read_score_map(path: Path) -> dict[str, dict[str, bool]]:
    """``_stats/score.json`` as ``compile_leaderboard`` reads it, refused unless it is a non-empty map of per-test
    maps (``{instance_id: {test: passed}}``): a legacy ``{instance_id: score}`` map has no test to compare."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ForeignRunError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(data, dict) or not data:
        raise ForeignRunError(f"{path} is not a map of maps {{instance_id: {{test: passed}}}}: it is "
                              f"{'an empty map' if data == {} else type(data).__name__}")
    bad = [str(iid) for iid, tests in data.items()
           if not isinstance(tests, dict) or not all(isinstance(v, bool) for v in tests.values())]
    if bad:
        legacy = all(isinstance(v, int | float) and not isinstance(v, bool) for v in data.values())
        why = ("a legacy {instance_id: score} map, which has no per-test results" if legacy else
               f"{len(bad)} task(s) map to something else than {{test: passed}} ({', '.join(bad[:3])})")
        raise ForeignRunError(f"{path} is not a map of maps {{instance_id: {{test: passed}}}}: {why}")
    return {str(iid): {str(t): bool(v) for t, v in tests.items()} for iid, tests in data.items()}


def read_result(instance_dir: Path) -> EvaluationResult:
    """An instance's official result: its eval.json, with the heavy part ``programbench submit package`` split into
    ``<id>.eval.log.json`` folded back in memory as ``recombine_eval_json`` folds it (nothing is written)."""
    eval_json = _eval_json(instance_dir)
    heavy_file = instance_dir / f"{instance_dir.name}.eval.log.json"
    if not heavy_file.is_file():
        return EvaluationResult.model_validate_json(eval_json.read_bytes())
    data = json.loads(eval_json.read_text())
    heavy = json.loads(heavy_file.read_text())
    data["log"] = heavy.get("log", [])
    failures = heavy.get("failures", {})
    for test in data.get("test_results", []):
        name = f"{test['branch']}/{test['name']}" if test.get("branch") else test["name"]
        if name in failures:
            test.setdefault("extra", {}).update(failures[name])
    return EvaluationResult.model_validate(data)


@dataclass(frozen=True)
class TaskRead:
    """One task of a foreign run as its files have it."""

    official: float
    n_passed: int
    n_tests: int
    statuses: dict[str, str]  # "<branch>/<test>" -> status, the tests the official score counts
    corrected: float | None = None  # None: not in this run (no JUnit log to replay)
    note: str = ""
    counted_twice: int = 0


def _from_result(result: EvaluationResult, instance: Mapping[str, Any]) -> TaskRead:
    scoped = result.for_branches(get_active_branches(dict(instance))).without_ignored(
        get_ignored_tests(dict(instance)))
    replayable = any(e.get("step") == "results_read" for e in result.log)
    corrected = safe_corrected_score(result, instance) if replayable else None
    return TaskRead(official=scoped.score, n_passed=scoped.n_resolved, n_tests=len(scoped),
                    statuses={t.full_name: t.status for t in scoped.test_results},
                    corrected=None if corrected is None else corrected.score,
                    note="" if corrected is None else corrected.note(),
                    counted_twice=0 if corrected is None else len(corrected.counted_twice))


def _from_map(tests: Mapping[str, bool]) -> TaskRead:
    return TaskRead(official=score_from_tests(dict(tests)), n_passed=sum(tests.values()), n_tests=len(tests),
                    statuses={name: PASSED if passed else NOT_PASSED for name, passed in tests.items()})


@dataclass(frozen=True)
class ForeignRun:
    """A ``programbench eval`` output directory or an entry, read: what compare.py's ``ComparedRun`` asks of a run."""

    path: Path
    kind_of: Kind
    results: dict[str, TaskRead]
    unscored: dict[str, str]  # instance id -> why it has no score here (listed, never dropped)
    tasks_known: dict[str, Task]
    manifest: dict[str, Any] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return self.kind_of.name

    @property
    def basis(self) -> str:
        return "official"  # the leaderboard's; a foreign run has no --pb-score

    @property
    def attempts(self) -> int:
        return 1

    @property
    def lacks(self) -> tuple[str, ...]:
        lacking = [*NEVER_RECORDED]
        if not self.costs:
            lacking.append("cost")
        if self.results and all(r.corrected is None for r in self.results.values()):
            lacking.append("corrected score (no eval.json with its JUnit log)")
        return tuple(lacking)

    @property
    def tasks(self) -> dict[str, dict[str, Any]]:
        """summary.json's rows, as far as the files go: every absent field None."""
        rows: dict[str, dict[str, Any]] = {}
        for iid, read in self.results.items():
            rows[iid] = {"outcome": PASSED if read.official >= registry.RESOLVED else FAILED,
                         "score": read.official, "score_official": read.official, "score_corrected": read.corrected,
                         "score_note": read.note, "n_passed": read.n_passed, "n_tests": read.n_tests,
                         "tokens": None, "cost_usd": self.costs.get(iid), "timings": {}}
        for iid, why in self.unscored.items():
            rows[iid] = {"outcome": "not_scored", "score": None, "reasons": [why], "tokens": None,
                         "cost_usd": self.costs.get(iid), "timings": {}}
        return dict(sorted(rows.items()))

    def scores(self, basis: str | None = None) -> dict[str, float]:
        if basis == "corrected":
            return {iid: r.corrected for iid, r in self.results.items() if r.corrected is not None}
        return {iid: r.official for iid, r in self.results.items()}

    def test_runs(self, instance_id: str) -> list[dict[str, str]]:
        read = self.results.get(instance_id)
        return [] if read is None else [dict(read.statuses)]

    def test_map(self, instance_id: str) -> dict[str, bool] | None:
        read = self.results.get(instance_id)
        return None if read is None else {t: s == PASSED for t, s in read.statuses.items()}

    def scoped(self, instance_id: str) -> bool:
        return instance_id in self.results  # scored with the official scope, or an entry's already scoped map

    def describe(self) -> dict[str, Any]:
        system = self.manifest.get("system") if isinstance(self.manifest.get("system"), dict) else {}
        scores = list(self.scores().values())
        mean = round(sum(scores) / len(scores), 6) if scores else None
        return {
            "run_dir": str(self.path), "run_id": self.path.name,
            "agent": system.get("agent") if system else None, "model": system.get("model") if system else None,
            "submissions": None, "plugin_version": None,
            "programbench_version": self.manifest.get("programbench_version"),
            "headline": {"selected": len(self.results) + len(self.unscored), "scored": len(scores),
                         "mean_over_scored": mean, "resolved": sum(s >= registry.RESOLVED for s in scores),
                         "near_resolved": sum(s >= registry.NEAR_RESOLVED for s in scores)},
            "tokens": {"cost_usd": round(sum(self.costs.values()), 6)} if self.costs else {},
            "agent_seconds": None, "evaluation_seconds": None,
        }

    def scope(self, instance_id: str) -> TaskScope | None:
        task = self.tasks_known.get(instance_id)
        if task is None:
            return None
        instance = task.load_instance()
        return TaskScope(tuple(get_active_branches(instance)), frozenset(get_ignored_tests(instance)))


def catalogue(tasks_dirs: Iterable[str]) -> dict[str, Task]:
    """The tasks a foreign run may name: programbench's packaged ones (its fixture too: ``programbench eval`` reads
    it) and those of the given tasks directories."""
    dirs = [d for d in dict.fromkeys(tasks_dirs) if Path(d).is_dir()]
    try:
        return {t.instance_id: t for t in Catalogue.load(dirs, include_fixtures=True)}
    except CatalogueError as exc:
        raise ForeignRunError(f"the tasks to read it with cannot be loaded: {exc}") from None


def _instance(tasks: Mapping[str, Task], iid: str) -> dict[str, Any] | None:
    task = tasks.get(iid)
    if task is None:
        return None
    try:
        return task.load_instance()
    except CatalogueError:
        return None


UNKNOWN = "not a task of the catalogue (programbench's, and --pb-tasks-dir's): its scope is unknown, so no score"


def _read_official(path: Path, tasks: Mapping[str, Task]) -> tuple[dict[str, TaskRead], dict[str, str]]:
    read: dict[str, TaskRead] = {}
    unscored: dict[str, str] = {}
    for d in _instance_dirs(path):
        iid = d.name
        if not _eval_json(d).is_file():
            if (d / "submission.tar.gz").is_file():
                unscored[iid] = "a submission without an eval.json (not evaluated, or its evaluation raised)"
            continue
        instance = _instance(tasks, iid)
        if instance is None:
            unscored[iid] = UNKNOWN
            continue
        try:
            read[iid] = _from_result(read_result(d), instance)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            unscored[iid] = f"its eval.json cannot be read as the official result ({type(exc).__name__})"
    return read, unscored


def _read_entry(path: Path, tasks: Mapping[str, Task]) -> tuple[dict[str, TaskRead], dict[str, str], list[str]]:
    """The per-test map decides (it is what the leaderboard reads); an eval.json beside it adds the corrected score,
    and a map that disagrees with it is said (``programbench submit verify``'s tier 0 would fail)."""
    maps = read_score_map(path / SCORE_JSON)
    read: dict[str, TaskRead] = {}
    disagree: list[str] = []
    for iid, tests in sorted(maps.items()):
        entry = _from_map(tests)
        instance = _instance(tasks, iid)
        if _eval_json(path / iid).is_file() and instance is not None:
            try:
                full = _from_result(read_result(path / iid), instance)
            except (OSError, ValueError, KeyError, TypeError):
                full = None
            if full is not None:
                if {t: s == PASSED for t, s in full.statuses.items()} != tests:
                    disagree.append(iid)
                entry = TaskRead(entry.official, entry.n_passed, entry.n_tests, entry.statuses, full.corrected,
                                 full.note, full.counted_twice)
        read[iid] = entry
    notes = [f"{SCORE_JSON} and the eval.json files disagree on {', '.join(disagree)} (programbench submit verify's "
             "tier 0 fails there): the per-test map, which the leaderboard reads, is used"] if disagree else []
    return read, {}, notes


def _read_costs(path: Path) -> dict[str, float]:
    """``_stats/cost.json`` (``{instance_id: USD}``, summed by the leaderboard) when there is one."""
    try:
        data = json.loads((path / COST_JSON).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load((path / "submission.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def read(path: Path, kind: Kind, *, tasks_dirs: Sequence[str] = ()) -> ForeignRun:
    """A foreign run of ``kind`` (from :func:`detect`), with the catalogue of programbench's tasks and
    ``tasks_dirs``."""
    path = path.expanduser().resolve()
    tasks = catalogue(tasks_dirs)
    notes: list[str] = []
    if kind == ENTRY:
        read_tasks, unscored, notes = _read_entry(path, tasks)
    elif kind == OFFICIAL:
        read_tasks, unscored = _read_official(path, tasks)
    else:
        raise ForeignRunError(f"{path} is {kind.text}, not a foreign run")
    if unscored and not read_tasks and all(why == UNKNOWN for why in unscored.values()):
        raise ForeignRunError(f"{path}: none of its {len(unscored)} instance(s) is a task the catalogue knows "
                              f"(programbench's own; give --pb-tasks-dir DIR for others): {', '.join(unscored)}")
    if unscored:
        notes.append(f"not scored here: {', '.join(f'{iid} ({why})' for iid, why in unscored.items())}")
    known = {iid: tasks[iid] for iid in [*read_tasks, *unscored] if iid in tasks}
    return ForeignRun(path, kind, read_tasks, unscored, known, _read_manifest(path),
                      _read_costs(path) if kind == ENTRY else {}, tuple(notes))


# ----------------------------------------------------------------------------------------------- --pb-report


def report_data(run: ForeignRun, *, ignore_file: str | None = None) -> dict[str, Any]:
    """summary.json's dictionary for a foreign run (so report.html's numbers are summary.py's), with what the run does
    not hold left empty: no times or tokens, and no corrected score where there is none."""
    records = []
    for iid, row in run.tasks.items():
        task = run.tasks_known.get(iid)
        language, difficulty = (task.language, task.difficulty) if task is not None else ("unknown", "unset")
        read_task = run.results.get(iid)
        if read_task is None:
            records.append(TaskRecord(iid, language, difficulty, reasons=list(row.get("reasons") or [])))
            continue
        properties: dict[str, Any] = {
            "score": read_task.official, "score_basis": "official", "score_official": read_task.official,
            "score_note": read_task.note, "counted_twice": read_task.counted_twice,
            "n_passed": read_task.n_passed, "n_tests": read_task.n_tests}
        if read_task.corrected is not None:
            properties["score_corrected"] = read_task.corrected
        records.append(TaskRecord(iid, language, difficulty, outcome=row["outcome"], score=read_task.official,
                                  properties=properties, cost_usd=run.costs.get(iid)))
    system = run.manifest.get("system") if isinstance(run.manifest.get("system"), dict) else {}
    header: dict[str, Any] = {
        "run_id": run.path.name, "run_dir": str(run.path), "plugin_version": version("pytest-programbench"),
        "programbench_version": version("programbench"), "agent": (system or {}).get("agent"), "kind": run.kind,
        "kind_text": f"{run.kind_of.text}, read by pytest --pb-report: {', '.join(run.lacks)} {NOT_IN_RUN}",
        "notes": list(run.notes), "started": None, "settings": {}}
    data = RunSummary(run.path / "summary.json", header, records).as_dict()
    for iid, row in data["tasks"].items():  # summary.py fills a missing corrected score with the official one
        if iid in run.results and run.results[iid].corrected is None:
            row["score_corrected"] = None
    if ignore_file is not None:
        maps = {iid: m for iid in run.results if (m := run.test_map(iid)) is not None}
        board = registry.compute(maps, registry.read_ignore_map(Path(ignore_file)), ignore_file=ignore_file)
        data["leaderboard"] = board.as_dict(data["headline"])
    return data


def report(path: Path, *, tasks_dirs: Sequence[str] = (), ignore_file: str | None = None) -> tuple[ForeignRun, Path]:
    """``--pb-report DIR``: our report.html for a foreign run, written into DIR; nothing is run."""
    kind = detect(path.expanduser().resolve())
    if kind == OURS:
        raise ForeignRunError(f"{path} is {OURS.text}: its report.html is written by the run itself "
                              f"({path / 'report.html'})")
    run = read(path, kind, tasks_dirs=tasks_dirs)
    return run, write_report(run.path, report_data(run, ignore_file=ignore_file), run.scope)
