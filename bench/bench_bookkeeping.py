"""Bookkeeping: a 600-item session (200 tasks x 3 attempts) and what the controller spends on the plugin's records.

The tasks are copies of the fixture tasks (their metadata only) whose pipeline is a stub (``pb_outcome`` overridden
in the session's ``conftest.py``, README "Customising"): each item sleeps ``--item-seconds`` and scores 1, so the
items run in seconds and what is left in the controller is the plugin's own work. A probe plugin (``-p``) times,
in the controller, the CPU time (``time.thread_time``: what it computes, not what it waits for on a busy machine)
of every call of the bookkeeping: ``RunSummary.record`` (a report folded in), ``RunSummary.write``
(summary.json, from the main thread and the progress thread), and the progress view's ``poll`` and ``show`` (the
workers' files read, counts, the view drawn); nested calls are counted once. The main thread's wall time in them is
reported too: what holds up xdist's loop. It also counts summary.json's writes
and bytes, and reads the controller's peak resident memory (``ru_maxrss``) at the end.

    python bench/bench_bookkeeping.py                     # 200 tasks x 3 attempts, -n 2
    python bench/bench_bookkeeping.py --tasks 20 --json /tmp/bk.json

Prints the controller's peak memory, its time in bookkeeping over its wall time, and summary.json's writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURES = ("pbfix__catlike.c47c47c", "pbfix__rpn.0b5e55e", "pbfix__tuiish.7e1a0b2")

STUB = textwrap.dedent("""
    import os, time
    import pytest
    from pytest_programbench.results.verdict import TaskOutcome

    @pytest.fixture
    def pb_outcome(pb_task):
        time.sleep(float(os.environ["PB_BENCH_ITEM_SECONDS"]))
        return TaskOutcome(pb_task.instance_id, 1.0, 1, 1)
""")

PROBE = textwrap.dedent("""
    import functools, json, os, resource, threading, time
    from pathlib import Path

    STATE = {"cpu": 0.0, "main_wall": 0.0, "calls": {}, "writes": 0, "bytes": 0, "started": time.monotonic()}
    LOCAL = threading.local()
    LOCK = threading.Lock()

    def timed(cls, name):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            depth = getattr(LOCAL, "depth", 0)
            LOCAL.depth = depth + 1
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                LOCAL.depth = depth
                wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                with LOCK:
                    key = f"{cls.__name__}.{name}"
                    calls, seconds = STATE["calls"].get(key, (0, 0.0))
                    STATE["calls"][key] = (calls + 1, seconds + cpu)
                    if depth == 0:
                        STATE["cpu"] += cpu
                        if threading.current_thread() is threading.main_thread():
                            STATE["main_wall"] += wall
        setattr(cls, name, wrapper)

    def pytest_configure(config):
        if hasattr(config, "workerinput"):
            return
        from pytest_programbench.results import artifacts, progress, summary

        for cls, name in ((summary.RunSummary, "record"), (summary.RunSummary, "write"),
                          (summary.RunSummary, "_write_now"), (summary.RunSummary, "flush"),
                          (progress.ProgressView, "poll"), (progress.ProgressView, "show")):
            timed(cls, name)
        original = summary.atomic_write_text

        def counting(path, text, *args, **kwargs):
            if Path(path).name == "summary.json":
                with LOCK:
                    STATE["writes"] += 1
                    STATE["bytes"] += len(text)
            return original(path, text, *args, **kwargs)
        summary.atomic_write_text = counting

    def pytest_unconfigure(config):
        if hasattr(config, "workerinput"):
            return
        STATE["wall"] = time.monotonic() - STATE["started"]
        usage = resource.getrusage(resource.RUSAGE_SELF)
        STATE["maxrss_mib"] = usage.ru_maxrss / 1024
        STATE["process_cpu"] = usage.ru_utime + usage.ru_stime
        Path(os.environ["PB_BENCH_PROBE_OUT"]).write_text(json.dumps(STATE))
""")


def _testbed_tasks() -> Path:
    env_sh = REPO / "testbed" / ".state" / "env.sh"
    for raw in env_sh.read_text().splitlines():
        key, _, value = raw.strip().removeprefix("export ").partition("=")
        if key == "PB_TESTBED_TASKS_DIR":
            return Path(value.strip("'\""))
    raise SystemExit(f"{env_sh}: no PB_TESTBED_TASKS_DIR (run testbed/setup.sh)")


def make_tasks(root: Path, count: int) -> None:
    source = _testbed_tasks()
    for k in range(count):
        fixture = FIXTURES[k % len(FIXTURES)]
        name, _, commit = fixture.split("__", 1)[1].rpartition(".")
        task_dir = root / f"pbbook__{name}{k}.{commit}"
        task_dir.mkdir(parents=True)
        for meta in ("task.yaml", "tests.json"):
            shutil.copy2(source / fixture / meta, task_dir / meta)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pb-bench-bookkeeping-") as tmp:
        root = Path(tmp)
        make_tasks(root / "tasks", args.tasks)
        (root / "conftest.py").write_text(STUB)
        (root / "pb_bench_probe.py").write_text(PROBE)
        (root / "pytest.ini").write_text("[pytest]\n")
        probe_out = root / "probe.json"
        env = {**os.environ, "PB_BENCH_ITEM_SECONDS": str(args.item_seconds), "PB_BENCH_PROBE_OUT": str(probe_out),
               "PYTHONPATH": os.pathsep.join([str(root), str(REPO), os.environ.get("PYTHONPATH", "")])}
        argv = [sys.executable, "-m", "pytest", "-c", str(root / "pytest.ini"), "--rootdir", str(root),
                "-p", "no:cacheprovider", "-p", "pb_bench_probe", "-q", "--pb-tasks-dir", str(root / "tasks"),
                "--pb-filter", "pbbook__", "--pb-agent", "true", "--pb-attempts", str(args.attempts),
                "--pb-output", str(root / "run"), "--pb-progress", "lines:1", "-n", str(args.workers)]
        started = time.monotonic()
        proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
        wall = time.monotonic() - started
        tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
        if proc.returncode != 0 or not probe_out.exists():
            raise SystemExit(f"the session failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        probe = json.loads(probe_out.read_text())
        summary = json.loads((root / "run" / "summary.json").read_text())
    items = args.tasks * args.attempts
    return {
        "items": items, "workers": args.workers, "item_seconds": args.item_seconds, "session_wall_s": round(wall, 1),
        "controller_wall_s": round(probe["wall"], 1), "controller_cpu_s": round(probe["process_cpu"], 1),
        "bookkeeping_cpu_s": round(probe["cpu"], 2), "bookkeeping_share": round(probe["cpu"] / probe["wall"], 4),
        "bookkeeping_main_wall_s": round(probe["main_wall"], 2),
        "main_thread_share": round(probe["main_wall"] / probe["wall"], 4),
        "controller_maxrss_mib": round(probe["maxrss_mib"], 1),
        "summary_writes": probe["writes"], "summary_mib_written": round(probe["bytes"] / 2**20, 1),
        "calls": {k: {"calls": c, "seconds": round(s, 3)} for k, (c, s) in sorted(probe["calls"].items())},
        "passed": summary["headline"].get("passed"), "pytest": tail[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("-n", "--workers", type=int, default=2)
    parser.add_argument("--item-seconds", type=float, default=0.05)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result["calls"], indent=1))
    print(f"{result['items']} items ({args.tasks} tasks x {args.attempts} attempts), -n {args.workers}, "
          f"{args.item_seconds} s each: {result['pytest']}")
    print(f"controller peak memory: {result['controller_maxrss_mib']} MiB (goal < 300)")
    print(f"controller time in bookkeeping: {result['bookkeeping_cpu_s']} s CPU (all threads) in "
          f"{result['controller_wall_s']} s = {100 * result['bookkeeping_share']:.1f}% (goal < 5%); its main thread "
          f"(xdist's loop) {result['bookkeeping_main_wall_s']} s = {100 * result['main_thread_share']:.1f}%; the "
          f"controller's whole CPU {result['controller_cpu_s']} s")
    print(f"summary.json: {result['summary_writes']} writes, {result['summary_mib_written']} MiB written")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
