"""What running on several engines adds: the relay tunnel's latency per request, and the pool's cost per task.

    python bench/bench_engines.py [--requests N] [--tasks-per-engine K] [--engines 1,2,3]

1. Tunnel: inside a fixture sandbox, a client makes N small request/response exchanges (1 KiB each way, a new
   connection per exchange, as an SDK without keep-alive does) to 127.0.0.1:47801. Behind it, the relay tunnel
   (``relay_bridge --stdio`` over an exec stream, what the plugin uses) to a host-side echo server. Median and p90
   per exchange. (The bind-mounted socket it was once compared with is gone; its numbers stay in the results of
   2026-11-22 and before.)
2. Throughput: the fixture tasks' known-good submissions evaluated K per engine with 1, 2 and 3 engines (the default
   one plus private ``dockerd``s on this machine), ``-n`` = the engines' slots, one slot each: tasks per minute and
   wall time per task. On one machine the engines share its cores, so this measures the pool's overhead, not the
   gain of more machines.

Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytest_programbench.engine.docker_engine import EngineRun, Engines, Labels, sweep  # noqa: E402
from pytest_programbench.relay.contract import BRIDGE_SCRIPT  # noqa: E402
from pytest_programbench.relay.relay_bridge import connect_unix  # noqa: E402
from pytest_programbench.relay.relay_tunnel import RelayTunnel  # noqa: E402
from pytest_programbench.sandbox.layout import RELAY_PORT  # noqa: E402
from pytest_programbench.sandbox.sandbox import Sandbox  # noqa: E402

IMAGE = "programbench/pbfix_1776_rpn.0b5e55e:task_cleanroom_v6"
PORT = RELAY_PORT

CLIENT = r"""
import json, socket, sys, time
n = int(sys.argv[1]); port = int(sys.argv[2])
payload = b"x" * 1024
times = []
for _ in range(n):
    started = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    got = 0
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += len(chunk)
    s.close()
    assert got == len(payload), got
    times.append(time.perf_counter() - started)
print(json.dumps(times))
"""


def _exchanges(box: Sandbox, n: int) -> list[float]:
    result = box.exec(["python3", "/tmp/bench_client.py", str(n), str(PORT)], timeout=600)
    if result.exit_code != 0:
        raise RuntimeError(result.text[-2000:])
    times: list[float] = json.loads(result.text.strip().splitlines()[-1])
    return times


def _stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_ms": round(statistics.median(ordered) * 1000, 3),
            "p90_ms": round(ordered[int(len(ordered) * 0.9) - 1] * 1000, 3)}


def bench_tunnel(engine: Any, requests: int) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="pb-bench-echo-"))
    socket_path = directory / "relay.sock"
    from tests.test_relay_tunnel import EchoServer

    echo = EchoServer(socket_path)
    labels = Labels(f"pbbench-{uuid.uuid4().hex[:10]}", "controller", "bench")
    results: dict[str, Any] = {}
    try:
        # Tunnel: no mount at all.
        with Sandbox(IMAGE, labels=labels, cpus=1, memory=512 << 20, lifetime=1200, engine=engine) as box:
            box.put_file(CLIENT.encode(), "/tmp/bench_client.py", mode=0o644, owner="root")
            tunnel = RelayTunnel(box.engine.api, box.id, lambda: connect_unix(str(socket_path))).open(
                PORT, script=BRIDGE_SCRIPT.read_bytes())
            try:
                _exchanges(box, 10)  # warm-up
                results["tunnel"] = _stats(_exchanges(box, requests))
            finally:
                tunnel.close()
    finally:
        echo.close()
        sweep(labels.run_id, engine=engine)
        shutil.rmtree(directory, ignore_errors=True)
    results["requests"] = requests
    return results


def bench_throughput(shared: Any, engine_counts: list[int], per_engine: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO / "tests"))
    from tests.test_chaos_engine import FIXTURE_IMAGES, private_engine_running

    env_sh = REPO / "testbed" / ".state" / "env.sh"
    bed = dict(line.removeprefix("export ").split("=", 1) for line in env_sh.read_text().splitlines()
               if line.startswith("export "))
    rows = []
    with private_engine_running(shared, FIXTURE_IMAGES) as first, private_engine_running(shared, FIXTURE_IMAGES) \
            as second:
        urls = ["default", first.url, second.url]
        for count in engine_counts:
            workdir = Path(tempfile.mkdtemp(prefix="pb-bench-engines-"))
            subs = workdir / "subs"
            good = Path(bed["PB_TESTBED_SUBMISSIONS"])
            fixture_ids = sorted(p.name for p in good.iterdir() if p.name.startswith("pbfix__"))
            tasks = fixture_ids[: max(1, min(len(fixture_ids), per_engine * count))]
            for iid in tasks:
                shutil.copytree(good / iid, subs / iid)
            hosts = [arg for url in urls[:count] for arg in ("--pb-docker-host", f"{url}=1")]
            (workdir / "pytest.ini").write_text("[pytest]\n")
            argv = [sys.executable, "-m", "pytest", "-c", str(workdir / "pytest.ini"), "--rootdir", str(workdir),
                    "-p", "no:cacheprovider", "-q", "--pb-tasks-dir", bed["PB_TESTBED_TASKS_DIR"],
                    "--pb-blob-dir", bed["PB_TESTBED_BLOB_DIR"], "--pb-pull", "never", "--pb-cpus", "1",
                    "--pb-submissions", str(subs), "--pb-filter", "|".join(tasks), "--pb-output",
                    str(workdir / "run"), "-n", str(count), *hosts]
            started = time.monotonic()
            done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=3600,
                                  env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
            wall = time.monotonic() - started
            if done.returncode != 0:
                raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
            rows.append({"engines": count, "tasks": len(tasks), "wall_s": round(wall, 1),
                         "tasks_per_min": round(len(tasks) / wall * 60, 2),
                         "seconds_per_task": round(wall / len(tasks), 1)})
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tasks-per-engine", type=int, default=1)
    parser.add_argument("--engines", default="1,2,3")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    engines = Engines(EngineRun.from_environment())  # this script's client of the environment's engine
    try:
        engine = engines.client()
        tunnel = bench_tunnel(engine, args.requests)
        print(f"relay path, {tunnel['requests']} exchanges of 1 KiB (new connection each):")
        print(f"  tunnel median {tunnel['tunnel']['median_ms']:.3f} ms   p90 {tunnel['tunnel']['p90_ms']:.3f} ms")
        rows = [] if args.skip_throughput else bench_throughput(engine, [int(n) for n in args.engines.split(",")],
                                                                args.tasks_per_engine)
    finally:
        engines.reset()
    for row in rows:
        print(f"engines {row['engines']}: {row['tasks']} tasks in {row['wall_s']} s = {row['tasks_per_min']} tasks/min "
              f"({row['seconds_per_task']} s per task)")
    out = REPO / "bench" / "results" / f"engines-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tunnel": tunnel, "throughput": rows, "load": os.getloadavg()}, indent=2))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
