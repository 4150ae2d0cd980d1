"""Makespan of a heterogeneous run: today's collection order against longest first, each beside its lower bound.

Twelve copies of the ``rpn`` fixture task whose hidden tests take from 1 s to 60 s (``sleep S`` at the top of one
branch's ``run.sh``; the blobs packed as ``testbed/setup.sh`` packs them, the image a tag of the fixture's), evaluated
from the known-good submission (``--pb-submissions``) with ``-n 4``. The sleeps are dealt to the task ids in a seeded
random order (``--seed``), so collection order is an ordinary one, neither the best nor the worst; with
``--ascending`` the longest task comes last in collection order (the worst case).

1. baseline: ``--dist worksteal`` given explicitly: xdist's work stealing in collection order (what ``-n`` alone did
   before the plugin's scheduler);
2. longest first: ``-n 4`` alone with ``--pb-durations`` the baseline's run directory (the plugin's scheduler).

From each run's ``progress.jsonl``: the makespan (first task started to last task finished), the work (the sum of
every task's start-to-finish) and the lower bound max(work / workers, longest task); printed as ratios.

    python bench/bench_makespan.py                  # -n 4, seed 1
    python bench/bench_makespan.py --seed 7 --json /tmp/makespan.json
    python bench/bench_makespan.py --ascending
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURE = "pbfix__rpn.0b5e55e"
TAG = "task_cleanroom_v6"
SLEEPS = (60, 45, 30, 20, 15, 10, 8, 5, 3, 2, 1, 1)  # seconds of hidden tests per task, beyond the fixture's own


def _testbed_env() -> dict[str, str]:
    values = {}
    for raw in (REPO / "testbed" / ".state" / "env.sh").read_text().splitlines():
        key, _, value = raw.strip().removeprefix("export ").partition("=")
        if value:
            values[key] = value.strip("'\"")
    return values


def pack(src: Path, out: Path) -> None:
    """A branch archive exactly as testbed/setup.sh's ``pack`` makes one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tar = subprocess.Popen(["tar", "--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner",
                            "--mode=u+rwX,go=rX", "--exclude=__pycache__", "--exclude=*.pyc",
                            "--exclude=.pytest_cache", "--exclude=.benchmarks", "--exclude=results.xml",
                            "-C", str(src), "-cf", "-", "."], stdout=subprocess.PIPE)
    with out.open("wb") as handle:
        subprocess.run(["gzip", "-n", "-9"], stdin=tar.stdout, stdout=handle, check=True)
    if tar.wait() != 0:
        raise RuntimeError(f"tar of {src} failed")


def make_tasks(root: Path, engine: Any, seed: int | None) -> tuple[dict[str, int], list[str]]:
    """The copies: id -> seconds of sleep; and the image tags made (removed after)."""
    from programbench.constants import image_name_from_instance_id

    bed = _testbed_env()
    source = Path(bed["PB_TESTBED_TASKS_DIR"]) / FIXTURE
    good = Path(bed["PB_TESTBED_SUBMISSIONS"]) / FIXTURE / "submission.tar.gz"
    image = engine.images.get(f"{image_name_from_instance_id(FIXTURE)}:{TAG}")
    sleeps = sorted(SLEEPS)  # no seed: ascending in collection order, the longest last (the worst case)
    if seed is not None:
        random.Random(seed).shuffle(sleeps)
    commit = FIXTURE.rpartition(".")[2]
    tasks, tags = {}, []
    for k, seconds in enumerate(sleeps):
        iid = f"pbspan__rpn{k:02d}.{commit}"
        task_dir = root / "tasks" / iid
        task_dir.mkdir(parents=True)
        for meta in ("task.yaml", "tests.json"):
            shutil.copy2(source / meta, task_dir / meta)
        shutil.copytree(source / "tests", task_dir / "tests")
        branches = sorted(p.name for p in (task_dir / "tests").iterdir())
        run_sh = task_dir / "tests" / branches[0] / "eval" / "run.sh"
        head, _, rest = run_sh.read_text().partition("\n")
        run_sh.write_text(f"{head}\nsleep {seconds}  # bench_makespan: a long hidden test\n{rest}")
        for branch in branches:
            pack(task_dir / "tests" / branch, root / "blobs" / iid / "tests" / f"{branch}.tar.gz")
        (root / "submissions" / iid).mkdir(parents=True)
        shutil.copy2(good, root / "submissions" / iid / "submission.tar.gz")
        repository = image_name_from_instance_id(iid)
        image.tag(repository, TAG)
        tags.append(f"{repository}:{TAG}")
        tasks[iid] = seconds
    return tasks, tags


def measure(run_dir: Path, workers: int) -> dict[str, Any]:
    starts: dict[str, float] = {}
    spans: dict[str, float] = {}
    first, last = float("inf"), 0.0
    for line in (run_dir / "progress.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["phase"] == "starting":
            starts[event["task"]] = event["at"]
            first = min(first, event["at"])
        elif event["phase"] == "finished" and event["task"] in starts:
            spans[event["task"]] = event["at"] - starts[event["task"]]
            last = max(last, event["at"])
    work = sum(spans.values())
    bound = max(work / workers, *spans.values())
    makespan = last - first
    return {"tasks": len(spans), "makespan_s": round(makespan, 1), "work_s": round(work, 1),
            "longest_s": round(max(spans.values()), 1), "lower_bound_s": round(bound, 1),
            "ratio": round(makespan / bound, 3),
            "start_order": [t for t, _ in sorted(starts.items(), key=lambda kv: kv[1])]}


def session(root: Path, name: str, workers: int, *extra: str) -> tuple[Path, dict[str, Any]]:
    run_dir = root / name
    argv = [sys.executable, "-m", "pytest", "-c", str(root / "pytest.ini"), "--rootdir", str(root),
            "-p", "no:cacheprovider", "-q", "-n", str(workers), "--pb-tasks-dir", str(root / "tasks"),
            "--pb-blob-dir", str(root / "blobs"), "--pb-filter", "pbspan__", "--pb-submissions",
            str(root / "submissions"), "--pb-output", str(run_dir), "--pb-cpus", "1",
            "--pb-progress", "lines:600", *extra]  # progress.jsonl: every task's start and finish
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: pytest exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    header = [line for line in proc.stdout.splitlines() if line.startswith("programbench schedule")]
    return run_dir, {**measure(run_dir, workers), "schedule": header[0] if header else "",
                     "command": " ".join(["pytest", *argv[3:]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ascending", action="store_true", help="the sleeps ascending in collection order (the "
                        "longest task last: the case a collection order can make worst) instead of a seeded order")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import docker

    engine = docker.from_env(timeout=300)
    with tempfile.TemporaryDirectory(prefix="pb-bench-makespan-") as tmp:
        root = Path(tmp)
        (root / "pytest.ini").write_text("[pytest]\n")
        tasks, tags = make_tasks(root, engine, None if args.ascending else args.seed)
        try:
            started = time.monotonic()
            base_dir, baseline = session(root, "baseline", args.workers, "--dist", "worksteal")
            _, longest = session(root, "longest-first", args.workers, "--pb-durations", str(base_dir))
            wall = time.monotonic() - started
        finally:
            for tag in tags:
                with contextlib.suppress(Exception):
                    engine.api.remove_image(tag)  # the tag only: the fixture's image keeps its own
    result = {"workers": args.workers, "seed": None if args.ascending else args.seed, "sleeps": tasks,
              "baseline": baseline,
              "longest_first": longest, "bench_wall_s": round(wall, 1)}
    for name in ("baseline", "longest_first"):
        r = result[name]
        order = ", ".join(str(tasks[t]) for t in r["start_order"])
        print(f"{name:>13}: makespan {r['makespan_s']} s, lower bound {r['lower_bound_s']} s (work {r['work_s']} s"
              f" / {args.workers}, longest {r['longest_s']} s): ratio {r['ratio']}  [sleeps in start order: {order}]")
    print(f"longest first / baseline makespan: {longest['makespan_s'] / baseline['makespan_s']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
