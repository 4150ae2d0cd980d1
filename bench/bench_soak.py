"""Soak: one agent that runs long, with bursts of output and long silences, under a real session with one xdist worker.

    python bench/bench_soak.py [--minutes 30] [--silence 600] [--burst-lines 20000]

The agent (in a fixture task's sandbox) prints a numbered burst, stays silent, and repeats until its time is up,
then writes the known-good solution. Sampled every few seconds: the resident memory of the controller and of the
worker. Checked at the end: the item passed, agent.log holds every line of every burst (the silences never ended the
agent's window, nothing was lost), and memory stayed flat (last sample against the first after start-up).

Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RPN = "pbfix__rpn.0b5e55e"


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(p) for p in task.read_text().split()]
        except OSError:
            continue
    return found


def _worker(controller: int) -> int | None:
    """The xdist worker: the controller's child running python."""
    for child in _children(controller):
        try:
            if "python" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                return child
        except OSError:
            continue
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--silence", type=int, default=600, help="seconds of silence between bursts")
    parser.add_argument("--burst-lines", type=int, default=20000)
    args = parser.parse_args()
    env_sh = REPO / "testbed" / ".state" / "env.sh"
    bed = dict(line.removeprefix("export ").split("=", 1) for line in env_sh.read_text().splitlines()
               if line.startswith("export "))
    seconds = int(args.minutes * 60)
    agent = (f"end=$(( $(date +%s) + {seconds} )); b=0; "
             f"while [ $(date +%s) -lt $end ]; do b=$((b+1)); "
             f"seq -f \"burst $b line %g of {args.burst_lines}\" 1 {args.burst_lines}; "
             f"echo \"burst $b done\"; sleep {args.silence}; done; "
             f"echo \"bursts: $b\"; cp -r /pb-testbed/solutions/{RPN}/. .")
    workdir = Path(tempfile.mkdtemp(prefix="pb-soak-"))
    (workdir / "pytest.ini").write_text("[pytest]\n")
    run_dir = workdir / "run"
    argv = [sys.executable, "-m", "pytest", "-c", str(workdir / "pytest.ini"), "--rootdir", str(workdir),
            "-p", "no:cacheprovider", "-q", "-n", "1", "--pb-tasks-dir", bed["PB_TESTBED_TASKS_DIR"],
            "--pb-blob-dir", bed["PB_TESTBED_BLOB_DIR"], "--pb-filter", RPN, "--pb-pull", "never",
            "--pb-agent", agent, "--pb-agent-mount", f"{REPO / 'testbed'}:/pb-testbed",
            "--pb-agent-timeout", str(seconds + args.silence + 600), "--pb-output", str(run_dir)]
    out = (workdir / "out.txt").open("wb")
    proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    while proc.poll() is None:
        worker = _worker(proc.pid)
        samples.append({"t": round(time.monotonic() - started, 1), "controller_mib": _rss_mib(proc.pid),
                        "worker_mib": _rss_mib(worker) if worker else None})
        time.sleep(5)
    out.close()
    log = (run_dir / RPN / "agent.log").read_text(errors="replace")
    bursts = int(next((line.split()[-1] for line in log.splitlines() if line.startswith("bursts: ")), "0"))
    lines_seen = sum(1 for line in log.splitlines() if line.startswith("burst ") and " line " in line)
    summary = json.loads((run_dir / "summary.json").read_text())["tasks"][RPN]
    steady = [s for s in samples if s["t"] > 30 and s["worker_mib"]]
    result = {
        "minutes": args.minutes, "silence_s": args.silence, "exit_code": proc.returncode,
        "outcome": summary["outcome"], "bursts": bursts, "lines_expected": bursts * args.burst_lines,
        "lines_in_agent_log": lines_seen, "wall_s": round(time.monotonic() - started, 1),
        "controller_mib_first": steady[0]["controller_mib"] if steady else None,
        "controller_mib_last": steady[-1]["controller_mib"] if steady else None,
        "worker_mib_first": steady[0]["worker_mib"] if steady else None,
        "worker_mib_last": steady[-1]["worker_mib"] if steady else None,
        "worker_mib_max": max((s["worker_mib"] for s in steady), default=None),
    }
    for key, value in result.items():
        print(f"{key:<22} {value}")
    target = REPO / "bench" / "results" / f"soak-{time.strftime('%Y%m%dT%H%M%S')}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({**result, "samples": samples}, indent=2))
    print(f"written: {target}")
    ok = result["outcome"] == "passed" and result["lines_in_agent_log"] == result["lines_expected"] and bursts > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
