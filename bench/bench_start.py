"""A session's fixed start (issue 39: under 1 s): what a run pays before its first task does anything.

Two measures, each the median of ``--repeat`` runs, bytecode cached as on a user's machine (a first run warms it and
is not counted; ``PYTHONDONTWRITEBYTECODE`` is left out of the runs' environment, so that pytest's rewrites of its
plugins' asserts are cached too):

- ``collect``: ``pytest --co -q`` over the test bed's fixture tasks (204 items): the interpreter, pytest and its
  plugins, ours configured, the catalogue read, the items made and deselected. Wall and CPU seconds.
- ``first task``: a real evaluate-only session of one fixture task (``--pb-submissions``), from the process's start to
  its first task's first phase (``timeline.json``): the above plus the engine reached, the run directory made, the
  task's item set up. The official ``programbench eval``'s own start is not measured (it logs no timestamps).

Beside them, ``bare``: ``pytest --co -q`` with the plugin disabled (``-p no:programbench``) in an empty directory, the
floor no plugin can go under. The load average before and after is printed: the machine is shared.

    python bench/bench_start.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_eval import RESULTS, read_env


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system of the child) and the exit status."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def first_phase(run_dir: Path) -> float | None:
    """The epoch second the session's first task began its first phase."""
    starts = [phase["at"] for path in run_dir.glob("*/timeline.json")
              for phase in json.loads(path.read_text()).get("phases", []) if isinstance(phase.get("at"), float)]
    return min(starts) if starts else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    tb = read_env()
    # Bytecode cached, as on a user's machine: the first run writes the caches, pytest's rewrites of its plugins'
    # asserts among them, which PYTHONDONTWRITEBYTECODE (set on this project's CI machine) would keep it from writing.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"HF_HUB_OFFLINE": "1"}
    work = Path(tempfile.mkdtemp(prefix="pb-bench-start-"))
    rows: dict[str, list[tuple[float, float]]] = {"bare": [], "collect": [], "first task": []}
    load = [round(os.getloadavg()[0], 2)]
    try:
        empty = work / "empty"
        empty.mkdir()
        submissions = work / "in"
        task = "pbfix__catlike.c47c47c"
        shutil.copytree(Path(tb["PB_TESTBED_SUBMISSIONS"]) / task, submissions / task)
        bare = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:programbench", "-q", "--co"]
        collect = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--co", "--pb-tasks-dir",
                   tb["PB_TESTBED_TASKS_DIR"], "--pb-include-fixtures"]
        for attempt in range(args.repeat + 1):  # the first run warms the bytecode and the caches
            b = timed(bare, empty, env)
            c = timed(collect, empty, env)
            run_dir = work / f"run{attempt}"
            started = time.time()
            s = timed([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pb-submissions",
                       str(submissions), "--pb-tasks-dir", tb["PB_TESTBED_TASKS_DIR"], "--pb-include-fixtures",
                       "--pb-blob-dir", tb["PB_TESTBED_BLOB_DIR"], "--pb-audit-hidden-tests", "off",
                       "--pb-output", str(run_dir)], empty, env)
            at = first_phase(run_dir)
            if s[2] not in (0, 1) or at is None:
                sys.exit(f"the evaluate-only session failed (exit {s[2]}): see {run_dir}")
            if attempt:
                rows["bare"].append(b[:2])
                rows["collect"].append(c[:2])
                rows["first task"].append((at - started, float("nan")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load.append(round(os.getloadavg()[0], 2))
    result: dict[str, Any] = {"repeat": args.repeat, "load": load}
    print(f"{'measure':12s} {'wall s (median)':>16s} {'cpu s (median)':>15s}   runs (wall)")
    for name, values in rows.items():
        wall = statistics.median(v[0] for v in values)
        cpus = [v[1] for v in values if v[1] == v[1]]
        cpu = statistics.median(cpus) if cpus else float("nan")
        result[name] = {"wall": round(wall, 3), "cpu": round(cpu, 3), "runs": [round(v[0], 3) for v in values]}
        shown = "-" if cpu != cpu else f"{cpu:.2f}"
        print(f"{name:12s} {wall:16.2f} {shown:>15s}   {', '.join(f'{v[0]:.2f}' for v in values)}")
    print(f"load average {load[0]} -> {load[1]}")
    out = RESULTS / f"bench_start-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
