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

Such a directory is untrusted input: its files are read by results/foreign_files.py only (inside it, capped before
reading, YAML without aliases), an id counts only when it is a task of the catalogue (the others are listed, never
scored or counted in a denominator), and a file refused is a usage error naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from programbench.eval.eval import EvaluationResult
from programbench.submission import score_from_tests
from programbench.utils.load_data import get_active_branches, get_ignored_tests

from pytest_programbench.core.run_identity import RUN_MARKER
from pytest_programbench.results import foreign_files, registry
from pytest_programbench.results.corrected import safe_corrected_score
from pytest_programbench.results.foreign_files import ForeignFileError
from pytest_programbench.results.report import TaskScope, write_report
from pytest_programbench.results.summary import FAILED, PASSED, RunSummary, TaskRecord
from pytest_programbench.tasks.catalogue import Catalogue, CatalogueError, Task
from pytest_programbench.text.printable import printable

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
    """A directory that is none of the kinds, or an entry that is not what the registry reads (a usage error); its
    message printable (it quotes the directory's names)."""

    def __init__(self, message: str) -> None:
        super().__init__(printable(message))


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


def read_score_map(entry: Path) -> dict[str, dict[str, bool]]:
    """``entry``'s ``_stats/score.json`` as ``compile_leaderboard`` reads it, refused unless it is a non-empty map of
    per-test maps (``{instance_id: {test: passed}}``): a legacy ``{instance_id: score}`` map has no test to compare."""
    path = entry / SCORE_JSON
    try:
        data = foreign_files.read_json(path, root=entry)
    except ForeignFileError as exc:
        raise ForeignRunError(str(exc)) from None
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


def read_result(root: Path, instance_dir: Path) -> EvaluationResult:
    """An instance's official result: its eval.json, with the heavy part ``programbench submit package`` split into
    ``<id>.eval.log.json`` folded back in memory as ``recombine_eval_json`` folds it (nothing is written). Read inside
    ``root`` with the caps of results/foreign_files.py (a ForeignFileError past them)."""
    eval_json = _eval_json(instance_dir)
    heavy_file = instance_dir / f"{instance_dir.name}.eval.log.json"
    if not heavy_file.is_file():
        return EvaluationResult.model_validate_json(
            foreign_files.read_bytes(eval_json, root=root, limit=foreign_files.EVAL_JSON_MAX))
    data = foreign_files.read_json(eval_json, root=root, limit=foreign_files.EVAL_JSON_MAX)
    heavy = foreign_files.read_json(heavy_file, root=root, limit=foreign_files.EVAL_JSON_MAX)
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
    unknown: tuple[str, ...] = ()  # ids no task of the catalogue has: listed, never scored nor counted

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


UNKNOWN = "not a task of the catalogue (programbench's, and --pb-tasks-dir's): never scored nor counted"
UNKNOWN_SHOWN = 20  # unknown ids listed by name; the rest counted


def known(iid: str, tasks: Mapping[str, Task]) -> bool:
    """An id names a task only when it has a task id's shape (never a path, a scheme or a control byte) and the
    catalogue has it: a foreign run's other ids are listed, never scored, and count in no denominator."""
    return foreign_files.is_task_id(iid) and iid in tasks


def unknown_note(unknown: Sequence[str]) -> str:
    shown = ", ".join(unknown[:UNKNOWN_SHOWN]) + (f" and {len(unknown) - UNKNOWN_SHOWN} more"
                                                   if len(unknown) > UNKNOWN_SHOWN else "")
    return f"{len(unknown)} id(s) {UNKNOWN}: {shown}"


BAD_RESULT = (OSError, ValueError, KeyError, TypeError, AttributeError)  # a result the official model does not read


def _read_official(path: Path, tasks: Mapping[str, Task]) -> tuple[dict[str, TaskRead], dict[str, str], list[str]]:
    read: dict[str, TaskRead] = {}
    unscored: dict[str, str] = {}
    unknown: list[str] = []
    for d in _instance_dirs(path):
        iid = d.name
        if not _eval_json(d).is_file():
            if (d / "submission.tar.gz").is_file() and known(iid, tasks):
                unscored[iid] = "a submission without an eval.json (not evaluated, or its evaluation raised)"
            elif (d / "submission.tar.gz").is_file():
                unknown.append(iid)
            continue
        instance = _instance(tasks, iid) if known(iid, tasks) else None
        if instance is None:
            unknown.append(iid)
            continue
        try:
            read[iid] = _from_result(read_result(path, d), instance)
        except BAD_RESULT as exc:
            unscored[iid] = f"its eval.json cannot be read as the official result ({type(exc).__name__})"
    return read, unscored, unknown


def _read_entry(path: Path, tasks: Mapping[str, Task]) -> tuple[dict[str, TaskRead], list[str], list[str]]:
    """The per-test map decides (it is what the leaderboard reads); an eval.json beside it adds the corrected score,
    and a map that disagrees with it is said (``programbench submit verify``'s tier 0 would fail)."""
    maps = read_score_map(path)
    read: dict[str, TaskRead] = {}
    disagree: list[str] = []
    unknown = sorted(iid for iid in maps if not known(iid, tasks))
    for iid, tests in sorted(maps.items()):
        if not known(iid, tasks):
            continue
        entry = _from_map(tests)
        instance = _instance(tasks, iid)
        if _eval_json(path / iid).is_file() and instance is not None:
            try:
                full = _from_result(read_result(path, path / iid), instance)
            except BAD_RESULT:
                full = None
            if full is not None:
                if {t: s == PASSED for t, s in full.statuses.items()} != tests:
                    disagree.append(iid)
                entry = TaskRead(entry.official, entry.n_passed, entry.n_tests, entry.statuses, full.corrected,
                                 full.note, full.counted_twice)
        read[iid] = entry
    notes = [f"{SCORE_JSON} and the eval.json files disagree on {', '.join(disagree)} (programbench submit verify's "
             "tier 0 fails there): the per-test map, which the leaderboard reads, is used"] if disagree else []
    return read, unknown, notes


def _read_costs(path: Path, tasks: Mapping[str, Task]) -> dict[str, float]:
    """``_stats/cost.json`` (``{instance_id: USD}``, summed by the leaderboard) when there is one: its tasks'."""
    if not (path / COST_JSON).is_file():
        return {}
    data = foreign_files.read_json(path / COST_JSON, root=path)
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items()
            if known(str(k), tasks) and isinstance(v, int | float) and not isinstance(v, bool)}


def _read_manifest(path: Path) -> dict[str, Any]:
    if not (path / "submission.yaml").is_file():
        return {}
    data = foreign_files.read_yaml(path / "submission.yaml", root=path)
    return data if isinstance(data, dict) else {}


def read(path: Path, kind: Kind, *, tasks_dirs: Sequence[str] = ()) -> ForeignRun:
    """A foreign run of ``kind`` (from :func:`detect`), with the catalogue of programbench's tasks and
    ``tasks_dirs``."""
    path = path.expanduser().resolve()
    tasks = catalogue(tasks_dirs)
    try:
        return _read(path, kind, tasks)
    except ForeignFileError as exc:
        raise ForeignRunError(str(exc)) from None


def _read(path: Path, kind: Kind, tasks: Mapping[str, Task]) -> ForeignRun:
    notes: list[str] = []
    unscored: dict[str, str] = {}
    if kind == ENTRY:
        read_tasks, unknown, notes = _read_entry(path, tasks)
    elif kind == OFFICIAL:
        read_tasks, unscored, unknown = _read_official(path, tasks)
    else:
        raise ForeignRunError(f"{path} is {kind.text}, not a foreign run")
    if unknown and not read_tasks and not unscored:
        listed = unknown_note(unknown).partition(": ")[2]
        raise ForeignRunError(f"{path}: none of its {len(unknown)} instance(s) is a task the catalogue knows "
                              f"(programbench's own; give --pb-tasks-dir DIR for others): {listed}")
    if unknown:
        notes.append(unknown_note(unknown))
    if unscored:
        notes.append(f"not scored here: {', '.join(f'{iid} ({why})' for iid, why in unscored.items())}")
    scoped = {iid: tasks[iid] for iid in [*read_tasks, *unscored]}
    return ForeignRun(path, kind, read_tasks, unscored, scoped, manifest=_read_manifest(path),
                      costs=_read_costs(path, tasks) if kind == ENTRY else {},
                      notes=tuple(printable(n) for n in notes), unknown=tuple(unknown))


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


RECORDS_READ = 50  # our run directories whose recorded tasks directories --pb-report reads, newest first


def recorded_tasks_dirs(roots: Iterable[Path]) -> list[str]:
    """The tasks directories our runs in ``roots`` were made with (their pb-run.json, read bounded), newest first:
    what ``--pb-compare`` takes from its side of ours, for ``--pb-report``, which has none."""
    runs: list[Path] = []
    for root in dict.fromkeys(r.expanduser().resolve() for r in roots):
        try:
            runs += [d for d in root.iterdir() if (d / RUN_MARKER).is_file()]
        except OSError:
            continue
    runs.sort(key=lambda d: (d / RUN_MARKER).stat().st_mtime, reverse=True)
    found: list[str] = []
    for run in runs[:RECORDS_READ]:
        try:
            record = foreign_files.read_json(run / RUN_MARKER, root=run, limit=foreign_files.RECORD_MAX)
        except ForeignFileError:
            continue
        settings = record.get("settings") if isinstance(record, dict) else None
        dirs = settings.get("tasks_dirs") if isinstance(settings, dict) else None
        found += [d for d in dirs or () if isinstance(d, str) and Path(d).is_dir()]
    return list(dict.fromkeys(found))


def report(path: Path, *, tasks_dirs: Sequence[str] = (), ignore_file: str | None = None,
           runs_beside: Iterable[Path] = ()) -> tuple[ForeignRun, Path]:
    """``--pb-report DIR``: our report.html for a foreign run, written into DIR; nothing is run. Without
    ``tasks_dirs``, the tasks directories our runs in ``runs_beside`` (and beside DIR) used, as --pb-compare does."""
    kind = detect(path.expanduser().resolve())
    if kind == OURS:
        raise ForeignRunError(f"{path} is {OURS.text}: its report.html is written by the run itself "
                              f"({path / 'report.html'})")
    if not tasks_dirs:
        tasks_dirs = recorded_tasks_dirs([path.expanduser().resolve().parent, *runs_beside])
    run = read(path, kind, tasks_dirs=tasks_dirs)
    try:
        data = report_data(run, ignore_file=ignore_file)
    except ForeignFileError as exc:  # the registry's ignore map
        raise ForeignRunError(str(exc)) from None
    return run, write_report(run.path, data, run.scope, foreign=True)


def report_lines(run: ForeignRun, path: Path) -> list[str]:
    """What ``--pb-report`` prints: the kind, the mean, what the run lacks, its notes (unknown ids among them), the
    page; printable (the notes quote the run's names)."""
    scores = run.scores()
    mean = f"{sum(scores.values()) / len(scores):.3f}" if scores else "-"
    return [printable(line) for line in (
        f"{run.path} is {run.kind_of.text}: {len(scores)} task(s) scored, mean official score {mean}",
        f"{', '.join(run.lacks)}: {NOT_IN_RUN}", *run.notes, f"report: {path}")]
