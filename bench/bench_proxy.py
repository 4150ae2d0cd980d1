"""Benchmark of the reference proxy: cost per call and stream throughput, proxied vs direct, in one sandbox.

    python3 bench/bench_proxy.py [--image IMAGE] [--calls 200] [--mib 100] [--repeat 3] [--python-client]

In a real sandbox (default: the test bed's cat-like fixture), as the agent user:

- calls: N runs of the reference on /dev/null, through /workspace/binary and directly (a copy of the reference the
  benchmark exposes to the agent), spawned with posix_spawn + waitpid from one Python process; ms per call and
  the time the proxy adds;
- stream: M MiB through stdin and stdout (``head -c | reference | cat``), best of R; MiB/s and the ratio.

Targets (issue 4): under 5 ms added per call; streams at least half of direct throughput. Prints a table and
writes JSON to bench/results/proxy-<UTC>.json. Needs Docker and the test bed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytest_programbench.engine.docker_engine import EngineRun, Engines, Labels, sweep
from pytest_programbench.sandbox.sandbox import Sandbox

DEFAULT_IMAGE = "programbench/pbfix_1776_catlike.c47c47c:task_cleanroom_v6"
DIRECT = "/opt/direct/executable"
RESULTS = Path(__file__).resolve().parent / "results"

INSIDE = r"""
import json, os, signal, statistics, subprocess, sys, time
calls, mib, repeat = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
null = os.open("/dev/null", os.O_RDWR)
# Both sides are spawned the way a shell starts a command: default signal dispositions, inherited stdio.
SHELL_LIKE = {"setsigdef": (signal.SIGPIPE, signal.SIGXFSZ)}
OPEN = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)]
# stdin closed: the proxy then takes its general (fork) path, as for a terminal or an ignored SIGCHLD.
CLOSED = [(os.POSIX_SPAWN_CLOSE, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)]

def per_call(exe, actions):
    for _ in range(10):  # warm-up: page cache, the daemon's worker pool
        os.waitpid(os.posix_spawn(exe, ["ref", "/dev/null"], dict(os.environ), file_actions=actions, **SHELL_LIKE), 0)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        pid = os.posix_spawn(exe, ["ref", "/dev/null"], dict(os.environ), file_actions=actions, **SHELL_LIKE)
        _, status = os.waitpid(pid, 0)
        samples.append(time.perf_counter() - start)
        assert status == 0, status
    return samples

def stream(exe):
    best = None
    for _ in range(repeat):
        start = time.perf_counter()
        out = subprocess.run(["sh", "-c", f"head -c {mib * 1048576} /dev/zero | {exe} | wc -c"],
                             capture_output=True, check=True).stdout
        elapsed = time.perf_counter() - start
        assert int(out) == mib * 1048576, out
        best = elapsed if best is None else min(best, elapsed)
    return best

def summary(samples):
    return {"call_ms_mean": statistics.fmean(samples) * 1000, "call_ms_median": statistics.median(samples) * 1000,
            "call_ms_p90": sorted(samples)[int(len(samples) * 0.9)] * 1000, "calls": len(samples)}

EXE = {"direct": "/opt/direct/executable", "proxied": "/workspace/binary"}
runs = {"direct": [], "proxied": [], "direct_closed": [], "proxied_general": []}
for _ in range(2):  # interleaved: machine noise hits both sides alike
    for side in ("direct", "proxied"):
        runs[side] += per_call(EXE[side], OPEN)
    runs["direct_closed"] += per_call(EXE["direct"], CLOSED)
    runs["proxied_general"] += per_call(EXE["proxied"], CLOSED)
result = {side: summary(samples) for side, samples in runs.items()}
for side in ("direct", "proxied"):
    seconds = stream(EXE[side])
    result[side]["stream_seconds"] = seconds
    result[side]["stream_mib_s"] = mib / seconds
print(json.dumps(result))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--python-client", action="store_true", help="benchmark the Python fallback client")
    parser.add_argument("--output", type=Path, default=None, help="JSON file (default bench/results/proxy-<UTC>.json)")
    args = parser.parse_args(argv)
    if args.python_client:
        os.environ["PB_PROXY_CLIENT"] = "python"

    labels = Labels(f"pbbench-{uuid.uuid4().hex[:10]}", "bench")
    cpus = float(os.cpu_count() or 1)
    engines = Engines(EngineRun.from_environment())  # this script's client of the environment's engine
    engine = engines.client()
    try:
        with Sandbox(args.image, labels=labels, cpus=cpus, memory=4 << 30, lifetime=3600, engine=engine) as box:
            setup = box.exec(f"mkdir -p -m 711 /opt/direct && cp /var/lib/pb-proxy/executable {DIRECT} && "
                             f"chmod 111 {DIRECT}", user="root", workdir="/", timeout=60)
            if setup.exit_code != 0:
                raise SystemExit(f"cannot expose the reference for the direct runs: {setup.text}")
            box.put_file(INSIDE.encode(), "/tmp/bench_inside.py", owner="root")
            run = box.exec(["python3", "/tmp/bench_inside.py", str(args.calls), str(args.mib), str(args.repeat)],
                           timeout=3600)
            if run.exit_code != 0:
                raise SystemExit(f"benchmark failed in the sandbox:\n{run.text}")
            measured = json.loads(run.text.strip().splitlines()[-1])
            client_label = box.proxy_client.label
            client_kind = box.proxy_client.kind
    finally:
        sweep(labels.run_id, engine=engine)
        engines.reset()

    direct, proxied = measured["direct"], measured["proxied"]
    added = proxied["call_ms_median"] - direct["call_ms_median"]
    general = measured["proxied_general"]["call_ms_median"] - measured["direct_closed"]["call_ms_median"]
    report: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "image": args.image,
        "client": client_kind,
        "client_label": client_label,
        "calls_per_side": args.calls * 2,
        "stream_mib": args.mib,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "direct": direct,
        "proxied": proxied,
        "added_ms_per_call_median": added,
        "added_ms_per_call_mean": proxied["call_ms_mean"] - direct["call_ms_mean"],
        "general_path": {"direct": measured["direct_closed"], "proxied": measured["proxied_general"],
                         "added_ms_per_call_median": general},
        "call_ratio": proxied["call_ms_median"] / direct["call_ms_median"],
        "stream_ratio": proxied["stream_mib_s"] / direct["stream_mib_s"],
        "targets": {"added_ms_per_call_below": 5.0, "stream_ratio_at_least": 0.5},
    }
    report["targets_met"] = added < 5.0 and report["stream_ratio"] >= 0.5

    rows = [
        ("per call, median (ms)", f"{direct['call_ms_median']:.2f}", f"{proxied['call_ms_median']:.2f}",
         f"+{added:.2f}", f"{report['call_ratio']:.2f}x"),
        ("per call, mean (ms)", f"{direct['call_ms_mean']:.2f}", f"{proxied['call_ms_mean']:.2f}",
         f"+{report['added_ms_per_call_mean']:.2f}", ""),
        ("per call, p90 (ms)", f"{direct['call_ms_p90']:.2f}", f"{proxied['call_ms_p90']:.2f}", "", ""),
        ("general path, median (ms)", f"{measured['direct_closed']['call_ms_median']:.2f}",
         f"{measured['proxied_general']['call_ms_median']:.2f}", f"+{general:.2f}", ""),
        (f"stream {args.mib} MiB in+out (MiB/s)", f"{direct['stream_mib_s']:.0f}", f"{proxied['stream_mib_s']:.0f}", "",
         f"{report['stream_ratio']:.2f}x"),
    ]
    print(f"proxy benchmark: {args.image}\nclient: {client_label}\n")
    print(f"{'':34} {'direct':>10} {'proxied':>10} {'added':>8} {'ratio':>8}")
    for row in rows:
        print(f"{row[0]:34} {row[1]:>10} {row[2]:>10} {row[3]:>8} {row[4]:>8}")
    print(f"\ntargets (< 5 ms added per call, >= 0.5x stream): {'met' if report['targets_met'] else 'NOT met'}")
    suffix = "-python" if args.python_client else ""
    output = args.output or RESULTS / f"proxy-{report['time'].replace(':', '')}{suffix}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {output}")
    return 0 if report["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
