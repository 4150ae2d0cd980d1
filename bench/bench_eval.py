"""Evaluation wall time: the official ``programbench eval`` against ``pytest --pb-submissions`` on the same submissions.

    python bench/bench_eval.py [--repeat N] [--variant good] [--branches N | --realistic] [--copies N]
                               [--only NAME]... [--skip NAME]...

Runs, on copies of the test bed's run directory ``testbed/.state/submissions/<variant>`` (all four fixture tasks):

* ``official`` — the ``programbench eval`` CLI (1.2.5) as is, ``--docker-cpus 2``, ``PROGRAMBENCH_BLOB_DIR`` set.
  Offline, its ``pip3 install pytest-rerunfailures==16.4`` fails after pip's retries, so it runs with reruns off.
  The only shim: the CLI's task catalogue also holds the test bed's task dirs (``load_all_instances`` default).
* ``official+wheels`` — the same CLI given the rerunfailures wheels as it would get them from PyPI with internet
  (``DOCKER_RUN_ARGS``: a read-only mount and ``PIP_NO_INDEX``/``PIP_FIND_LINKS``): reruns on, like ours.
* ``official -w 2``, ``official+wheels -w 2`` — with two instance workers: the equal-parallelism baselines of
  ``pytest -n 2`` (reruns off, as offline, and on).
* ``pytest -n 1``, ``pytest -n 2`` — the plugin, reruns on (the host's cached wheels).
* ``pytest -n 1, reruns off`` — the plugin without wheels (``PYTEST_PROGRAMBENCH_WHEELS`` pointing nowhere): the
  like-for-like comparison with the offline ``official`` row.
* ``pytest -n 1, audit off``, ``pytest -n 2, audit off`` — the plugin, reruns on, ``--pb-audit-hidden-tests off``.
* ``floor``, ``floor -w 2`` — the official's container work and nothing else (``bench/floor.py``): every step the
  official runs in a container, each phase in one exec, in containers made as ours are, the rerunfailures install
  made before the clock starts. With both cores busy no evaluator that gives the official's scores does less, so
  ``floor -w 2`` bounds the equal-parallelism rows; serially it bounds nothing (ours overlaps its branches).

Every row records the machine's one-minute load average before and after it; with ``--repeat N`` the
configurations run in turn N times (ours and the official's interleaved) and the best of each is kept.

``--realistic`` replaces the tasks by one of the medians of the real tasks: the test bed's rpn (its image and good
submission) with ten branches of 170 generated tests each, every test running the executable once.

``--copies N`` runs every task N times over (the realistic one with ``--realistic``): copies under ids
``pbcopyK__...`` (``pbrealK__...``) with their own blobs and submissions, their images extra tags of the originals'
(removed after). The issue's scale bench is "100 tasks at 4 workers, or the same run over copies of the fixture
tasks": on two cores, ``--copies 5`` (twenty tasks) at ``-n 2`` against ``-w 2``.

``--branches N`` gives each of the test bed's own three tasks N active branches (its own repeated under new ids,
blobs copied), the shape of a real task (about ten branches; the fixtures have two or three), and leaves out the
packaged ``testorg__calculator``.

Prints a table (wall seconds, ratio to ``official`` and to ``official+wheels``, mean score), the ratios at equal
parallelism, and per task the time outside compile and the hidden tests with the steps that took it (from each
run's ``eval.json`` logs and the plugin's ``evaluation`` phase in ``pb-meta.json``); writes JSON to
``bench/results/bench_eval-<UTC>.json``. Needs the test bed: ``bash testbed/setup.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STATE = REPO / "testbed" / ".state"
RESULTS = REPO / "bench" / "results"

# The official CLI, with its task catalogue extended to a directory holding the test bed's tasks too.
OFFICIAL_SHIM = r"""
import sys
from pathlib import Path
from programbench import constants
from programbench.utils import load_data
load_data.load_all_instances.__defaults__ = (Path(sys.argv[1]),)
if sys.argv[2]:
    constants.DOCKER_RUN_ARGS.extend(["-v", sys.argv[2] + ":/tmp/pytest-programbench-wheels:ro",
                                      "-e", "PIP_NO_INDEX=1", "-e", "PIP_FIND_LINKS=/tmp/pytest-programbench-wheels"])
from programbench.cli.main import app
sys.argv = ["programbench", *sys.argv[3:]]
app()
"""


def read_env() -> dict[str, str]:
    env_sh = STATE / "env.sh"
    if not env_sh.is_file():
        sys.exit(f"{env_sh} is missing: run `bash testbed/setup.sh` first")
    values = {}
    for raw in env_sh.read_text().splitlines():
        line = raw.strip().removeprefix("export ")
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value.strip("'\"")
    return values


def merged_tasks_dir(work: Path, env: dict[str, str]) -> Path:
    """The packaged tasks plus the test bed's, as symlinks (what the official CLI will see)."""
    from programbench.constants import TASKS_DIR

    merged = work / "tasks"
    merged.mkdir()
    for root in (TASKS_DIR, Path(env["PB_TESTBED_TASKS_DIR"])):
        for task in root.iterdir():
            if (task / "task.yaml").is_file():
                link = merged / task.name
                if link.exists():
                    link.unlink()
                link.symlink_to(task)
    return merged


def widened(work: Path, env: dict[str, str], source: Path, branches: int) -> tuple[dict[str, str], Path]:
    """The test bed's own tasks (not the packaged one) with ``branches`` active branches each, as real tasks have
    (about ten): their branches repeated under new ids, each with its own copy of the blob, in a tasks and a blob
    directory of their own; the images are the tasks' (same ids). Returns the environment pointing at them and the
    run directory holding only those tasks' submissions."""
    bed_tasks, bed_blobs = Path(env["PB_TESTBED_TASKS_DIR"]), Path(env["PB_TESTBED_BLOB_DIR"])
    tasks_root, blobs_root, runs = work / "wide-tasks", work / "wide-blobs", work / "wide-runs" / source.name
    for task in sorted(bed_tasks.iterdir()):
        if not (task / "tests.json").is_file() or not (source / task.name).is_dir():
            continue
        shutil.copytree(task, tasks_root / task.name, ignore=shutil.ignore_patterns("tests"))
        original = json.loads((task / "tests.json").read_text())["branches"]
        wide = {}
        for k in range(branches):
            branch = sorted(original)[k % len(original)]
            new_id = f"{k:04x}{branch[4:]}"
            wide[new_id] = original[branch]
            blob = blobs_root / task.name / "tests" / f"{new_id}.tar.gz"
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(bed_blobs / task.name / "tests" / f"{branch}.tar.gz", blob)
        (tasks_root / task.name / "tests.json").write_text(json.dumps({"branches": wide}, indent=2))
        shutil.copytree(source / task.name, runs / task.name)
    return {**env, "PB_TESTBED_TASKS_DIR": str(tasks_root), "PB_TESTBED_BLOB_DIR": str(blobs_root)}, runs


REALISTIC_TASK = "pbfix__rpn.0b5e55e"  # its good submission prints a sum of integers as the integer


def realistic(work: Path, env: dict[str, str], source: Path, branches: int = 10, tests: int = 170,
              copies: int = 1) -> tuple[dict[str, str], Path, list[str]]:
    """The realistic task: the test bed's rpn (its image and submission) with ``branches`` active branches of
    ``tests`` tests each, the medians of the real tasks. Every test runs the executable once, as a real hidden test
    does (``rpn A B +`` printing the sum); each branch keeps rpn's own ``run.sh`` and ``pytest.ini``. ``copies`` > 1:
    that many tasks, the first under rpn's id, the others under ids ``pbrealN__rpn.0b5e55e`` whose images are extra
    tags of rpn's (returned, for removal). Returns the environment pointing at its tasks and blob directories, the run
    directory holding their submissions, and the image tags made."""
    import io
    import tarfile

    bed_tasks, bed_blobs = Path(env["PB_TESTBED_TASKS_DIR"]), Path(env["PB_TESTBED_BLOB_DIR"])
    tasks_root, blobs_root, runs = work / "real-tasks", work / "real-blobs", work / "real-runs" / source.name
    task = bed_tasks / REALISTIC_TASK
    shutil.copytree(task, tasks_root / task.name, ignore=shutil.ignore_patterns("tests"))
    original = sorted(json.loads((task / "tests.json").read_text())["branches"])
    with tarfile.open(bed_blobs / task.name / "tests" / f"{original[0]}.tar.gz") as tar:
        kept = {m.name: (m, tar.extractfile(m).read() if m.isfile() else b"")  # type: ignore[union-attr]
                for m in tar.getmembers() if m.name in ("./eval/run.sh", "./eval/pytest.ini")}
    listed = {}
    for k in range(branches):
        branch = f"{k:04x}5e55e0{k:02x}"
        module = f"test_wide_{k:02d}"
        lines = ['"""Generated: one run of the executable per test."""', "", "import subprocess", "", ""]
        names = []
        for i in range(tests):
            a, b = 7 * i + k, 3 * i + 1
            lines += [f"def test_sum_{i:04d}():",
                      f"    r = subprocess.run(['./executable', '{a}', '{b}', '+'], stdin=subprocess.DEVNULL,",
                      "                       capture_output=True, text=True, timeout=10)",
                      f"    assert (r.returncode, r.stdout) == (0, '{a + b}\\n')", "", ""]
            names.append(f"tests.{module}.test_sum_{i:04d}")
        listed[branch] = {"ignore_reason": "", "ignored": False, "ignored_tests": [], "tests": names}
        blob = blobs_root / task.name / "tests" / f"{branch}.tar.gz"
        blob.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(blob, "w:gz") as out:
            for name in ("./", "./eval/", "./eval/tests/"):
                info = tarfile.TarInfo(name)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                out.addfile(info)
            for member, data in kept.values():
                out.addfile(member, io.BytesIO(data))
            data = "\n".join(lines).encode()
            info = tarfile.TarInfo(f"./eval/tests/{module}.py")
            info.size, info.mode = len(data), 0o644
            out.addfile(info, io.BytesIO(data))
    (tasks_root / task.name / "tests.json").write_text(json.dumps({"branches": listed}, indent=2))
    shutil.copytree(source / task.name, runs / task.name)
    tags = [_realistic_copy(tasks_root, blobs_root, runs, task.name, k) for k in range(1, copies)]
    return {**env, "PB_TESTBED_TASKS_DIR": str(tasks_root), "PB_TESTBED_BLOB_DIR": str(blobs_root)}, runs, tags


def _task_copy(tasks_root: Path, blobs_root: Path, runs: Path, name: str, prefix: str) -> str:
    """A copy of task ``name`` under the id ``<prefix>__<the rest of name>``: its directory, blobs and submission, its
    image an extra tag of the original's (returned, for removal)."""
    import docker

    org, _, rest = name.partition("__")
    copy = f"{prefix}__{rest}"
    shutil.copytree(tasks_root / name, tasks_root / copy)  # the id is the directory's name
    shutil.copytree(blobs_root / name, blobs_root / copy)
    shutil.copytree(runs / name, runs / copy)
    image = docker.from_env().images.get(f"programbench/{org}_1776_{rest}:task_cleanroom_v6")
    repository = f"programbench/{prefix}_1776_{rest}"
    image.tag(repository, "task_cleanroom_v6")
    return f"{repository}:task_cleanroom_v6"


def _realistic_copy(tasks_root: Path, blobs_root: Path, runs: Path, name: str, k: int) -> str:
    """Copy ``k`` of the realistic task ``name`` (ids ``pbrealK__...``)."""
    return _task_copy(tasks_root, blobs_root, runs, name, f"pbreal{k}")


def copied(work: Path, env: dict[str, str], source: Path, tasks_dir: Path,
           copies: int) -> tuple[dict[str, str], Path, list[str]]:
    """The run directory's tasks ``copies`` times (issue 39's "the same run over copies of the fixture tasks"): the
    originals, and copies ``pbcopyK__...`` (K = 1 .. copies - 1) of each, in a tasks, blob and run directory of their
    own; each copy's image is an extra tag of its original's. Returns the environment pointing at them, the run
    directory, and the image tags made."""
    tasks_root, blobs_root, runs = work / "copy-tasks", work / "copy-blobs", work / "copy-runs" / source.name
    bed_blobs = Path(env["PB_TESTBED_BLOB_DIR"])
    tags: list[str] = []
    names = sorted(task.name for task in source.iterdir() if task.is_dir())
    for name in names:
        shutil.copytree(tasks_dir / name, tasks_root / name)  # tasks_dir: the packaged ones and the test bed's
        shutil.copytree(bed_blobs / name, blobs_root / name)
        shutil.copytree(source / name, runs / name)
    try:
        for k in range(1, copies):
            tags += [_task_copy(tasks_root, blobs_root, runs, name, f"pbcopy{k}") for name in names]
    except BaseException:
        _untag(tags)
        raise
    return {**env, "PB_TESTBED_TASKS_DIR": str(tasks_root), "PB_TESTBED_BLOB_DIR": str(blobs_root)}, runs, tags


def _untag(tags: list[str]) -> None:
    """Remove the copies' image tags (the tags only: the images are the originals')."""
    import docker

    api = docker.from_env().api
    for tag in tags:
        api.remove_image(tag, noprune=True)


def scores_from_eval_json(run_dir: Path, tasks_dir: Path) -> dict[str, float]:
    """Per-task scores of a run directory, the official way (``programbench info``'s computation)."""
    from programbench.eval.eval import EvaluationResult
    from programbench.utils.load_data import get_active_branches, get_ignored_tests, load_all_instances

    instances = {i["instance_id"]: i for i in load_all_instances(tasks_dir)}
    out = {}
    for path in sorted(run_dir.glob("*/*.eval.json")):
        inst = instances[path.parent.name]
        result = EvaluationResult.model_validate_json(path.read_text())
        out[path.parent.name] = result.for_branches(get_active_branches(inst)).without_ignored(
            get_ignored_tests(inst)).score
    return out


# The two steps whose time is the submission's (its compile.sh, its hidden tests); everything else is overhead.
SUBMISSION_STEPS = ("compile", "run_tests")


def step_breakdown(run_dir: Path) -> dict[str, Any]:
    """Per task, where the evaluation's time went: each official step's ``wall_time`` from the task's
    ``eval.json`` log (summed over branches), the plugin's ``evaluation`` phase (``pb-meta.json``) when there is
    one, and the rest of that phase (container create/start, copies, commit, removal, the harness's checks) as
    ``unlogged``. ``outside`` is the phase less compile and the hidden tests: the per-task overhead."""
    tasks: dict[str, Any] = {}
    for path in sorted(run_dir.glob("*/*.eval.json")):
        data = json.loads(path.read_text())
        steps: dict[str, float] = {}
        for entry in data.get("log") or []:
            if isinstance(entry, dict) and isinstance(entry.get("wall_time"), int | float):
                name = str(entry.get("step"))
                steps[name] = round(steps.get(name, 0.0) + float(entry["wall_time"]), 3)
        row: dict[str, Any] = {"steps": steps, "logged": round(sum(steps.values()), 3)}
        meta = path.parent / "pb-meta.json"
        if meta.is_file():
            phase = (json.loads(meta.read_text()).get("timings") or {}).get("evaluation")
            if isinstance(phase, int | float):
                row["evaluation"] = phase
                row["unlogged"] = round(phase - row["logged"], 3)
                row["outside"] = round(phase - sum(steps.get(n, 0.0) for n in SUBMISSION_STEPS), 3)
        tasks[path.parent.name] = row
    return tasks


def print_breakdown(name: str, tasks: dict[str, Any]) -> None:
    """One line per task: time outside compile and hidden tests, then the steps that took it, largest first."""
    for task, row in tasks.items():
        others = sorted(((v, k) for k, v in row["steps"].items() if k not in SUBMISSION_STEPS), reverse=True)
        listed = ", ".join(f"{k} {v:.2f}" for v, k in others[:8])
        outside = f"{row['outside']:.2f} s outside compile+tests" if "outside" in row else "no phase timing"
        unlogged = f", unlogged {row['unlogged']:.2f}" if "unlogged" in row else ""
        print(f"  {name:24s} {task:34s} {outside} (steps: {listed}{unlogged})")


def timed(cmd: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> tuple[float, int]:
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    return time.monotonic() - started, proc.returncode


def load_average() -> float:
    """The machine's one-minute load average (the machine is shared: every row says what it ran beside)."""
    return round(os.getloadavg()[0], 2)


def run_official(name: str, source: Path, work: Path, tasks_dir: Path, env: dict[str, str],
                 wheels: str, workers: int = 1) -> dict[str, Any]:
    slug = name.replace("+", "-").replace(" ", "")
    run_dir = work / slug / source.name
    shutil.copytree(source, run_dir)
    penv = {**os.environ, "PROGRAMBENCH_BLOB_DIR": env["PB_TESTBED_BLOB_DIR"]}
    cmd = [sys.executable, "-c", OFFICIAL_SHIM, str(tasks_dir), wheels, "eval", str(run_dir), "--docker-cpus", "2"]
    if workers > 1:
        cmd += ["-w", str(workers)]
    load = load_average()
    seconds, rc = timed(cmd, env=penv, cwd=work, log=work / f"{slug}.log")
    return {"name": name, "seconds": seconds, "returncode": rc, "scores": scores_from_eval_json(run_dir, tasks_dir),
            "breakdown": step_breakdown(run_dir), "load": [load, load_average()]}


def run_plugin(name: str, source: Path, work: Path, tasks_dir: Path, env: dict[str, str], workers: int,
               reruns: bool, audit: bool = True, audit_early: bool = True) -> dict[str, Any]:
    slug = name.replace(" ", "").replace(",", "-").replace("=", "")
    run_copy = work / f"{slug}-input" / source.name
    shutil.copytree(source, run_copy)
    output = work / f"{slug}-output"
    penv = dict(os.environ)
    if not reruns:
        penv["PYTEST_PROGRAMBENCH_WHEELS"] = str(work / "no-wheels")
    if not audit_early:
        penv["PYTEST_PROGRAMBENCH_AUDIT_EARLY"] = "0"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pb-submissions", str(run_copy),
           "--pb-tasks-dir", env["PB_TESTBED_TASKS_DIR"], "--pb-include-fixtures", "--pb-blob-dir",
           env["PB_TESTBED_BLOB_DIR"], "--pb-cpus", "2", "--pb-output", str(output)]
    if workers > 1:
        cmd += ["-n", str(workers)]
    if not audit:
        cmd += ["--pb-audit-hidden-tests", "off"]
    cwd = work / f"{slug}-cwd"
    cwd.mkdir()
    load = load_average()
    seconds, rc = timed(cmd, env=penv, cwd=cwd, log=work / f"{slug}.log")
    return {"name": name, "seconds": seconds, "returncode": rc, "scores": scores_from_eval_json(output, tasks_dir),
            "breakdown": step_breakdown(output), "load": [load, load_average()]}


def run_floor_row(name: str, source: Path, work: Path, tasks_dir: Path, env: dict[str, str], wheels: str,
                  workers: int) -> dict[str, Any]:
    from floor import run_floor

    output = work / "floor-output"
    load = load_average()
    seconds = run_floor(source, output, tasks_dir, Path(env["PB_TESTBED_BLOB_DIR"]), Path(wheels), workers)
    return {"name": name, "seconds": seconds, "returncode": 0, "scores": scores_from_eval_json(output, tasks_dir),
            "breakdown": {}, "load": [load, load_average()]}


def select_skipped(names: list[str], skip: list[str], only: list[str]) -> set[str]:
    """The configurations to leave out. Names hold commas ("pytest -n 1, reruns off"), so a value is taken whole
    when it names a configuration and split on commas otherwise (the old ``--skip a,b`` form)."""
    def parse(values: list[str]) -> set[str]:
        out: set[str] = set()
        for value in values:
            parts = [value] if value in names else [p.strip() for p in value.split(",") if p.strip()]
            unknown = [p for p in parts if p not in names]
            if unknown:
                sys.exit(f"unknown configuration(s) {unknown}; known: {names}")
            out |= set(parts)
        return out

    skipped = parse(skip)
    if only:
        skipped |= set(names) - parse(only)
    return skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs of every configuration (the best is kept)")
    parser.add_argument("--variant", default="good", help="test bed run directory (good, wrong, hang, ...)")
    parser.add_argument("--skip", action="append", default=[],
                        help="a configuration to leave out (repeatable; a value naming none is split on commas)")
    parser.add_argument("--only", action="append", default=[], help="run only this configuration (repeatable)")
    parser.add_argument("--branches", type=int, default=0,
                        help="give each of the test bed's own tasks this many branches (its own repeated)")
    parser.add_argument("--realistic", action="store_true",
                        help="only the realistic task: rpn with 10 branches of 170 generated tests each")
    parser.add_argument("--copies", type=int, default=1,
                        help="this many copies of the tasks (of the realistic task with --realistic)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    env = read_env()
    source = Path(env["PB_TESTBED_RUNS"]) / args.variant
    if not source.is_dir():
        sys.exit(f"no run directory {source}")
    work_root = Path(tempfile.mkdtemp(prefix="pb-bench-"))
    tags: list[str] = []
    if args.realistic:
        env, source, tags = realistic(work_root, env, source, copies=args.copies)
    elif args.branches > 0:
        env, source = widened(work_root, env, source, args.branches)
    if args.copies > 1 and not args.realistic:
        (work_root / "originals").mkdir()
        env, source, tags = copied(work_root, env, source, merged_tasks_dir(work_root / "originals", env),
                                   args.copies)
    from pytest_programbench.evaluation.rerunfailures import ensure_wheels

    wheels = ensure_wheels()
    if not wheels.available:
        print(f"WARNING: no rerunfailures wheels ({wheels.reason}): official+wheels and the reruns-on rows "
              f"are skipped", file=sys.stderr)
    configs: list[tuple[str, Any]] = [
        ("official", lambda w, t: run_official("official", source, w, t, env, "")),
        ("official+wheels", lambda w, t: run_official("official+wheels", source, w, t, env, str(wheels.directory))),
        ("official -w 2", lambda w, t: run_official("official -w 2", source, w, t, env, "", 2)),
        ("official+wheels -w 2", lambda w, t: run_official("official+wheels -w 2", source, w, t, env,
                                                           str(wheels.directory), 2)),
        ("pytest -n 1", lambda w, t: run_plugin("pytest -n 1", source, w, t, env, 1, True)),
        ("pytest -n 2", lambda w, t: run_plugin("pytest -n 2", source, w, t, env, 2, True)),
        ("pytest -n 1, reruns off", lambda w, t: run_plugin("pytest -n 1, reruns off", source, w, t, env, 1, False)),
        ("pytest -n 2, reruns off", lambda w, t: run_plugin("pytest -n 2, reruns off", source, w, t, env, 2, False)),
        ("pytest -n 1, audit off", lambda w, t: run_plugin("pytest -n 1, audit off", source, w, t, env, 1, True,
                                                           audit=False)),
        ("pytest -n 2, audit off", lambda w, t: run_plugin("pytest -n 2, audit off", source, w, t, env, 2, True,
                                                           audit=False)),
        ("floor", lambda w, t: run_floor_row("floor", source, w, t, env, str(wheels.directory), 1)),
        ("floor -w 2", lambda w, t: run_floor_row("floor -w 2", source, w, t, env, str(wheels.directory), 2)),
        # The audit's branches all after the official's (PYTEST_PROGRAMBENCH_AUDIT_EARLY=0): what the early start saves.
        ("pytest -n 1, audit late", lambda w, t: run_plugin("pytest -n 1, audit late", source, w, t, env, 1, True,
                                                            audit_early=False)),
        ("pytest -n 2, audit late", lambda w, t: run_plugin("pytest -n 2, audit late", source, w, t, env, 2, True,
                                                            audit_early=False)),
    ]
    names = [name for name, _run in configs]
    skip = select_skipped(names, args.skip, args.only)
    if not wheels.available:
        skip |= {"official+wheels", "official+wheels -w 2", "floor", "floor -w 2", "pytest -n 1", "pytest -n 2",
                 "pytest -n 1, audit off", "pytest -n 2, audit off", "pytest -n 1, audit late",
                 "pytest -n 2, audit late"}
    rows: dict[str, dict[str, Any]] = {}
    try:
        tasks_dir = merged_tasks_dir(work_root, env)
        for attempt in range(args.repeat):
            for name, run in configs:
                if name in skip:
                    continue
                work = work_root / f"{attempt}-{name.replace(' ', '').replace(',', '-').replace('+', '-')}"
                work.mkdir()
                row = run(work, tasks_dir)
                print(f"[{attempt + 1}/{args.repeat}] {name}: {row['seconds']:.1f} s (exit {row['returncode']}, "
                      f"load {row['load'][0]} -> {row['load'][1]})", file=sys.stderr)
                best = rows.get(name)
                row["all_seconds"] = [*(best or {}).get("all_seconds", []), round(row["seconds"], 2)]
                if best is None or row["seconds"] < best["seconds"]:
                    rows[name] = row
                else:
                    best["all_seconds"] = row["all_seconds"]
    finally:
        _untag(tags)
        if not args.keep:
            shutil.rmtree(work_root, ignore_errors=True)

    base = rows.get("official", {}).get("seconds")
    base_wheels = rows.get("official+wheels", {}).get("seconds")
    tasks = sorted(next(iter(rows.values()))["scores"]) if rows else []
    print()
    print(f"{len(tasks)} submissions from {source} ({', '.join(tasks)}); best of {args.repeat}")
    print(f"{'configuration':26s} {'wall s':>8s} {'÷ official':>11s} {'÷ off.+wheels':>14s} {'mean score':>11s} "
          f"{'load':>11s}")
    for name, row in rows.items():
        ratio = f"{row['seconds'] / base:.2f}x" if base else "-"
        ratio_w = f"{row['seconds'] / base_wheels:.2f}x" if base_wheels else "-"
        mean = sum(row["scores"].values()) / len(row["scores"]) if row["scores"] else float("nan")
        row["ratio_official"] = round(row["seconds"] / base, 3) if base else None
        row["ratio_official_wheels"] = round(row["seconds"] / base_wheels, 3) if base_wheels else None
        row["mean_score"] = mean
        load = f"{row['load'][0]}-{row['load'][1]}"
        print(f"{name:26s} {row['seconds']:8.1f} {ratio:>11s} {ratio_w:>14s} {mean:11.3f} {load:>11s}")
    for name, theirs in (("pytest -n 2", "official -w 2"), ("pytest -n 2, reruns off", "official -w 2"),
                         ("pytest -n 2", "official+wheels -w 2"), ("pytest -n 2, audit off", "official+wheels -w 2"),
                         ("pytest -n 2, audit late", "official+wheels -w 2"), ("floor -w 2", "official+wheels -w 2"),
                         ("floor", "official+wheels"), ("pytest -n 1", "official+wheels"),
                         ("pytest -n 1, audit off", "official+wheels"), ("pytest -n 1, audit late", "official+wheels")):
        parallel = rows.get(theirs, {}).get("seconds")
        if parallel and name in rows:
            rows[name][f"ratio_{theirs}"] = round(rows[name]["seconds"] / parallel, 3)
            print(f"at equal parallelism: {name} ÷ {theirs} = {rows[name]['seconds'] / parallel:.2f}x")
    print()
    print("serial runs outside compile.sh and the hidden tests (wall time less their steps' wall_time; the same "
          "work in both; with two workers the steps overlap and the difference means nothing):")
    for name, row in rows.items():
        if "-n 2" in name or "-w 2" in name:
            continue
        per_task = (row.get("breakdown") or {}).values()
        work = sum(t["steps"].get(step, 0.0) for t in per_task for step in SUBMISSION_STEPS)
        row["outside_submission"] = round(row["seconds"] - work, 3)
        print(f"  {name:26s} {row['seconds']:7.1f} s = {work:6.1f} s compile+tests + "
              f"{row['outside_submission']:6.1f} s outside them")
    for mine, theirs in (("pytest -n 1", "official+wheels"), ("pytest -n 1, reruns off", "official")):
        if mine in rows and theirs in rows and rows[theirs]["outside_submission"] > 0:
            share = rows[mine]["outside_submission"] / rows[theirs]["outside_submission"]
            rows[mine][f"outside_ratio_{theirs}"] = round(share, 3)
            print(f"  outside them: {mine} ÷ {theirs} = {share:.2f}x")
    print()
    print("per task, where the time outside compile and the hidden tests goes (seconds):")
    for name, row in rows.items():
        print_breakdown(name, row.get("breakdown") or {})
    def reference(name: str) -> dict[str, Any] | None:
        """The official row a row's scores must equal: reruns off against ``official``, on against ``+wheels``."""
        off = "reruns off" in name or (name.startswith("official") and "wheels" not in name)
        return rows.get("official") if off else rows.get("official+wheels") or rows.get("official+wheels -w 2")

    mismatched = {name: row["scores"] for name, row in rows.items()
                  if (ref := reference(name)) is not None and row["scores"] != ref["scores"]}
    if mismatched:
        print(f"scores differing from the official run: {json.dumps(mismatched)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"bench_eval-{stamp}.json"
    out.write_text(json.dumps({"when": stamp, "variant": args.variant, "branches": args.branches,
                               "realistic": args.realistic, "repeat": args.repeat,
                               "cores": os.cpu_count(), "tasks": tasks, "rows": rows}, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
