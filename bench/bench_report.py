"""report.html's size and render time for a run of long agents: the timelines must keep the page bounded.

Writes a synthetic run directory: per task a pb-meta.json with its phases (sandbox, a six-hour agent, pack, an
evaluation with compile and branches), a model-requests.jsonl of ``--requests`` relay records (some retried and held
back) and a binary-calls.jsonl of ``--calls`` proxy records (some killed by a signal), spread over the agent's six
hours; then builds each task's timeline.json as the item does when it ends (timeline.save) and renders report.html from
that directory (results/report.py, as the session's end does); prints the page's bytes, the rows embedded and left
out, and the CPU time of both (process time: the machine's other load does not count).

    python bench/bench_report.py                            # 1, 10 and 200 tasks, 5,000 requests, 20,000 calls each
    python bench/bench_report.py --tasks 200

Writes the results as JSON to ``bench/results/bench_report-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytest_programbench.results import timeline  # noqa: E402
from pytest_programbench.results.report import render  # noqa: E402
from pytest_programbench.results.summary import RunSummary, TaskRecord  # noqa: E402

AGENT_SECONDS = 6 * 3600
START = 1_795_000_000.0


def iso(at: float, *, millis: bool) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at))
    return f"{stamp}.{int(at % 1 * 1000):03d}+00:00" if millis else f"{stamp}Z"


def write_task(task_dir: Path, instance_id: str, requests: int, calls: int) -> TaskRecord:
    task_dir.mkdir(parents=True)
    agent_at = START + 5
    phases = [{"phase": "sandbox", "at": START, "seconds": 5.0},
              {"phase": "agent", "at": agent_at, "seconds": float(AGENT_SECONDS)},
              {"phase": "pack", "at": agent_at + AGENT_SECONDS, "seconds": 1.0},
              {"phase": "evaluation", "at": agent_at + AGENT_SECONDS + 1, "seconds": 300.0}]
    evaluation = [{"phase": "compile", "at": agent_at + AGENT_SECONDS + 3, "seconds": 40.0}]
    evaluation += [{"phase": "branch", "branch": f"b{i:02d}", "serial": False,
                    "at": agent_at + AGENT_SECONDS + 45 + 25 * i, "seconds": 24.0} for i in range(10)]
    meta = {"instance_id": instance_id, "state": "finished", "phases": phases,
            "timings": {p["phase"]: p["seconds"] for p in phases},
            "evaluation": {"phases": evaluation, "timings": {"total_seconds": 300.0}}}
    (task_dir / "pb-meta.json").write_text(json.dumps(meta))
    with (task_dir / "model-requests.jsonl").open("w") as out:
        for i in range(requests):
            at = agent_at + AGENT_SECONDS * i / requests
            retried = [{"attempt": 1, "status": 429, "wait_s": 2.0}] if i % 97 == 0 else []
            out.write(json.dumps({
                "started_at": iso(at, millis=True), "listener": "unix", "method": "POST", "path": "/v1/responses",
                "status": 200, "model": "m", "stream": True, "api": "responses", "first_byte_s": 1.2,
                "total_s": 3.4, "request_bytes": 40_000, "response_bytes": 2_000,
                "usage": {"input_tokens": 12_000, "output_tokens": 300, "total_tokens": 12_300},
                "error": None, "tool_calls": 1, "retries": retried, "retry_wait_s": 2.0 if retried else 0.0,
                "slot_wait_s": 0.0, "rate_wait_s": 0.0, "gave_up": False, "rejected": False,
                "stream_broken": False, "cleanroom_refused": None}, separators=(",", ":")) + "\n")
    with (task_dir / "binary-calls.jsonl").open("w") as out:
        for i in range(calls):
            at = agent_at + AGENT_SECONDS * i / calls
            killed = i % 501 == 0
            out.write(json.dumps({
                "argv": ["/workspace/binary", f"--option-{i % 40}", "input file.txt", "-n", str(i)],
                "call": f"{i}.0", "core": False, "cwd": "/workspace/src", "duration_s": 0.0123,
                "exit": None if killed else i % 3, "signal": 9 if killed else None, "flags": [], "path": "fast",
                "pid": 100 + i, "time": iso(at, millis=False), "tty": False, "uid": 1777},
                sort_keys=True) + "\n")
    return TaskRecord(instance_id, "c", "easy", outcome="failed", score=0.5, meta=meta,
                      properties={"n_passed": 5, "n_tests": 10})


def measure(tasks: int, requests: int, calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pb-bench-report-") as tmp:
        run = Path(tmp)
        records = [write_task(run / f"bench__t{i:03d}.0000000", f"bench__t{i:03d}.0000000", requests, calls)
                   for i in range(tasks)]
        header = {"run_id": "bench", "run_dir": str(run), "plugin_version": "0", "programbench_version": "0"}
        data = RunSummary(run / "summary.json", header, records).as_dict()
        started = time.process_time()
        for record in records:  # what each attempt's item does when it ends (pipeline: timeline.save)
            timeline.save(run / record.instance_id)
        saved = (time.process_time() - started) / tasks
        started = time.process_time()
        page = render(run, data, lambda _iid: None)
        seconds = time.process_time() - started
    rows = page.count("<li class=\"request") + page.count("<li class=\"call")
    left_out = sum(int(n) for n in re.findall(r'<span class="left-out">(\d+)</span>', page))
    return {"tasks": tasks, "requests_per_task": requests, "calls_per_task": calls, "page_bytes": len(page.encode()),
            "bytes_per_task": len(page.encode()) // tasks, "rows_embedded": rows, "rows_left_out": left_out,
            "save_cpu_seconds_per_task": round(saved, 3), "render_cpu_seconds": round(seconds, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, action="append", help="tasks in the run (repeatable; 1, 10, 200)")
    parser.add_argument("--requests", type=int, default=5_000, help="model requests per task")
    parser.add_argument("--calls", type=int, default=20_000, help="calls of the reference per task")
    args = parser.parse_args()
    results = [measure(n, args.requests, args.calls) for n in args.tasks or (1, 10, 200)]
    for r in results:
        print(f"{r['tasks']:>4} task(s) x ({r['requests_per_task']:,} requests + {r['calls_per_task']:,} calls): "
              f"report.html {r['page_bytes']:,} bytes ({r['bytes_per_task']:,} per task), {r['rows_embedded']:,} "
              f"rows embedded, {r['rows_left_out']:,} left out; each task's timeline.json built in "
              f"{r['save_cpu_seconds_per_task']} s CPU when it ended, the page rendered in {r['render_cpu_seconds']} s "
              "CPU")
    out = REPO / "bench" / "results" / f"bench_report-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
