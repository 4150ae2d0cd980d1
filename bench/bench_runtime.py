"""The price of gVisor: ``--pb-runtime runsc`` against the engine's runc, in the same run.

    python3 bench/bench_runtime.py [--task pbfix__rpn.0b5e55e] [--repeat 3] [--calls 200] [--image IMAGE]
                                   [--runtimes runc,runsc]

Per repeat, each runtime in turn (the order alternates, so machine noise hits both alike), on the test bed:

- sandbox start: a sandbox of ``--image`` (the test bed's cat-like task) made ready (create, start, the reference
  moved behind the proxy, the agent user), as every agent run starts, until it answers;
- proxy call: in that sandbox, as the agent user, ``calls`` runs of the reference on /dev/null through
  ``/workspace/binary`` and directly (a readable copy of the reference the bench exposes: gVisor runs no file it
  cannot read), spawned with posix_spawn + waitpid from one Python process; the median per call and what the proxy
  adds;
- evaluation: the test bed's good submission of ``--task`` evaluated as a session does (reruns on, audit off), each
  container under the runtime: compile.sh's seconds, the hidden tests' (every branch, summed), and the whole.

Prints the medians over repeats per runtime and runsc/runc, with the one-minute load average before and after; writes
JSON to bench/results/bench_runtime-<UTC>.json. Needs Docker with runsc registered and the test bed
(``bash testbed/setup.sh`` does both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_eval import RESULTS, read_env
from programbench.utils.load_data import get_active_branches

from pytest_programbench.engine.backpressure import Backpressure
from pytest_programbench.engine.docker_engine import EngineRun, Engines, Labels, sweep
from pytest_programbench.engine.images import ensure_image
from pytest_programbench.evaluation import harness_material
from pytest_programbench.evaluation.evaluation import EvalSettings, evaluate
from pytest_programbench.sandbox.sandbox import Sandbox
from pytest_programbench.tasks.blobs import resolve_blobs
from pytest_programbench.tasks.catalogue import Task, load_tasks_dir

DIRECT = "/opt/direct/executable"
SANDBOX_IMAGE = "programbench/pbfix_1776_catlike.c47c47c:task_cleanroom_v6"  # a cat-like reference: run on /dev/null

INSIDE = r"""
import json, os, signal, statistics, sys, time
calls = int(sys.argv[1])
null = os.open("/dev/null", os.O_RDWR)
SHELL_LIKE = {"setsigdef": (signal.SIGPIPE, signal.SIGXFSZ)}
OPEN = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)]

def per_call(exe, n):
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        _, status = os.waitpid(os.posix_spawn(exe, ["ref", "/dev/null"], dict(os.environ), file_actions=OPEN,
                                              **SHELL_LIKE), 0)
        samples.append(time.perf_counter() - start)
        assert status == 0, status
    return samples

runs = {"direct": [], "proxied": []}
EXE = {"direct": sys.argv[2], "proxied": "/workspace/binary"}
for side in EXE:
    per_call(EXE[side], 10)  # warm-up: page cache, the daemon's worker pool
for _ in range(2):  # interleaved
    for side in EXE:
        runs[side] += per_call(EXE[side], calls // 2)
print(json.dumps({side: statistics.median(samples) * 1000 for side, samples in runs.items()}))
"""


def load() -> float:
    return os.getloadavg()[0]


def sandbox_and_calls(engine: Any, image: str, labels: Labels, calls: int) -> dict[str, float]:
    """Seconds to a ready sandbox, and the median ms per call, direct and proxied."""
    started = time.monotonic()
    with Sandbox(image, labels=labels, cpus=2.0, memory=4 << 30, lifetime=3600, engine=engine) as box:
        ready = time.monotonic() - started
        setup = box.exec(f"mkdir -p -m 711 /opt/direct && cp /var/lib/pb-proxy/executable {DIRECT} && "
                         f"chmod 555 {DIRECT}", user="root", workdir="/", timeout=60)
        if setup.exit_code != 0:
            raise SystemExit(f"cannot expose the reference for the direct runs: {setup.text}")
        box.put_file(INSIDE.encode(), "/opt/direct/bench_inside.py", owner="root")
        run = box.exec(["python3", "/opt/direct/bench_inside.py", str(calls), DIRECT], timeout=1800)
        if run.exit_code != 0:
            raise SystemExit(f"the per-call runs failed in the sandbox:\n{run.text}")
        per_call = json.loads(run.text.strip().splitlines()[-1])
    return {"sandbox_start_s": ready, "call_direct_ms": per_call["direct"], "call_proxied_ms": per_call["proxied"],
            "call_added_ms": per_call["proxied"] - per_call["direct"]}


def evaluation(engine: Any, task: Task, submission: Path, blob_dir: Path, run_id: str, work: Path) -> dict[str, float]:
    """The good submission evaluated as a session does (reruns on, audit off): compile, hidden tests, the whole."""
    blobs = resolve_blobs(task, get_active_branches(task.load_instance()), blob_dir=blob_dir, cache_dir=work / "cache")
    image = ensure_image(task, pull="never", engine=engine).id
    outcome = evaluate(task, submission, blobs=blobs, image=image, labels=Labels(run_id), engine=engine,
                       settings=EvalSettings(cpus=2), workdir=work)
    if outcome.result is None or outcome.score < 1.0:
        raise SystemExit(f"{task.instance_id}: the good submission scored {outcome.score} ({outcome.infra_error})")
    compile_s = sum(p["seconds"] for p in outcome.phases if p.get("phase") == "compile")
    tests_s = sum(p["seconds"] for p in outcome.phases if p.get("phase") == "branch")
    return {"compile_s": compile_s, "hidden_tests_s": tests_s, "evaluation_s": outcome.total_seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="pbfix__rpn.0b5e55e")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--image", default=SANDBOX_IMAGE, help="the sandbox's image (its reference reads a file)")
    parser.add_argument("--runtimes", default="runc,runsc")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON file (default bench/results/bench_runtime-<UTC>.json)")
    args = parser.parse_args(argv)
    env = read_env()
    runtimes = args.runtimes.split(",")
    task = next(t for t in load_tasks_dir(Path(env["PB_TESTBED_TASKS_DIR"])) if t.instance_id == args.task)
    submission = Path(env["PB_TESTBED_SUBMISSIONS"]) / args.task / "submission.tar.gz"
    image = args.image
    samples: dict[str, list[dict[str, float]]] = {rt: [] for rt in runtimes}
    loads = [load()]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for k in range(args.repeat):
        for runtime in runtimes if k % 2 == 0 else runtimes[::-1]:
            engines = Engines(EngineRun(None, Backpressure(0), runtime=runtime))
            engine = engines.client()
            if runtime not in (engine.api.info().get("Runtimes") or {}):
                raise SystemExit(f"the engine has no runtime {runtime}: run `bash testbed/setup.sh`")
            run_id = f"pbbench-{uuid.uuid4().hex[:10]}"
            try:
                with tempfile.TemporaryDirectory(prefix="pb-bench-runtime-") as work:
                    row = sandbox_and_calls(engine, image, Labels(run_id, "bench"), args.calls)
                    row.update(evaluation(engine, task, submission, Path(env["PB_TESTBED_BLOB_DIR"]), run_id,
                                          Path(work)))
            finally:
                harness_material.remove_grader_volumes(engine, run_id)
                sweep(run_id, engine=engine)
                engines.reset()
            row["load_after"] = load()
            loads.append(row["load_after"])
            samples[runtime].append(row)
            print(f"repeat {k + 1}/{args.repeat} {runtime}: " + ", ".join(f"{key} {value:.2f}"
                                                                        for key, value in row.items()), flush=True)
    keys = ("sandbox_start_s", "call_direct_ms", "call_proxied_ms", "call_added_ms", "compile_s", "hidden_tests_s",
            "evaluation_s")
    medians = {rt: {key: statistics.median(s[key] for s in samples[rt]) for key in keys} for rt in runtimes}
    report: dict[str, Any] = {
        "time": started, "task": args.task, "repeat": args.repeat, "calls": args.calls,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "load_1min": {"before": loads[0], "during_max": max(loads), "after": loads[-1]},
        "medians": medians, "samples": samples,
        "command": "python3 bench/bench_runtime.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    labels = {"sandbox_start_s": "sandbox start (s)", "call_direct_ms": "reference call, direct (ms)",
              "call_proxied_ms": "reference call, proxied (ms)", "call_added_ms": "proxy adds per call (ms)",
              "compile_s": "compile.sh (s)", "hidden_tests_s": "hidden tests, all branches (s)",
              "evaluation_s": "evaluation, whole (s)"}
    print(f"\nruntime benchmark: {args.task}, median of {args.repeat}, load average (1 min) {loads[0]:.2f} before, "
          f"{max(loads):.2f} at most, {loads[-1]:.2f} after\n")
    print(f"{'':34}" + "".join(f"{rt:>10}" for rt in runtimes) + (f"{'ratio':>10}" if len(runtimes) == 2 else ""))
    for key in keys:
        values = [medians[rt][key] for rt in runtimes]
        ratio = f"{values[1] / values[0]:.2f}x" if len(values) == 2 and values[0] > 0 else ""
        print(f"{labels[key]:34}" + "".join(f"{v:>10.2f}" for v in values) + f"{ratio:>10}")
    output = args.output or RESULTS / f"bench_runtime-{started.replace(':', '').replace('-', '')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
