"""What a command costs the whole machine: wall seconds and CPU seconds, split by where they were spent.

The suite's time on a 2-core machine is bound by CPU (three streams, most of it containers), so a test's cost is the
machine's CPU over its run, not its wall clock alone. Read from the kernel's accounting before and after:

- ``total``: every CPU's busy time (``/sys/fs/cgroup/cpuacct/cpuacct.usage``, cgroup v1, all processes and the
  kernel);
- ``containers``: the Docker engine's container cgroups (``docker/cpuacct.usage``; a removed container's time stays
  counted in its parent);
- ``dockerd``, ``containerd``: the engines' own processes (``/proc/<pid>/stat``, every one of that name running
  before and after; each is a process we only read, never signal);
- ``rest``: the remainder: the host's Python (pytest and its workers), the engine's short-lived helpers (runc,
  shims, the re-executed ``dockerd`` that archive copies and commits run in) and the kernel's own work.

Only meaningful when nothing else runs on the machine; the load average before and after is printed.

    python bench/bench_cpu.py -- pytest tests/test_outcomes.py -p no:cacheprovider -q
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Snapshot:
    at: float
    total: float
    containers: float
    dockerd: float
    containerd: float


def _usage(path: Path) -> float:
    try:
        return int(path.read_text()) / 1e9
    except (OSError, ValueError):
        return 0.0


def _process_seconds(name: str) -> float:
    """User plus system seconds of every running process called ``name`` (its own, not its children's)."""
    seconds = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if comm == name:
            seconds += (int(rest[11]) + int(rest[12])) / TICKS  # utime, stime: fields 14 and 15
    return seconds


def snapshot() -> Snapshot:
    return Snapshot(at=time.monotonic(), total=_usage(CPUACCT / "cpuacct.usage"),
                    containers=_usage(CPUACCT / "docker" / "cpuacct.usage"),
                    dockerd=_process_seconds("dockerd"), containerd=_process_seconds("containerd"))


def load_average() -> float:
    return os.getloadavg()[0]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to measure is required, after --")
    if not (CPUACCT / "cpuacct.usage").is_file():
        parser.error(f"{CPUACCT}/cpuacct.usage is not readable: this bench reads cgroup v1's CPU accounting")
    load_before = load_average()
    before = snapshot()
    status = subprocess.run(command, check=False).returncode
    after = snapshot()
    total = after.total - before.total
    parts = {"containers": after.containers - before.containers, "dockerd": after.dockerd - before.dockerd,
             "containerd": after.containerd - before.containerd}
    parts["rest"] = total - sum(parts.values())
    shown = ", ".join(f"{name} {seconds:.1f}" for name, seconds in parts.items())
    print(f"wall {after.at - before.at:.1f} s, CPU {total:.1f} core-s ({shown}); exit status {status}; "
          f"load {load_before:.1f} -> {load_average():.1f}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
