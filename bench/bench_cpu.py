"""What a command costs the machine: wall seconds and CPU seconds, its own and the whole machine's.

The suite's time on a 2-core machine is bound by CPU (three streams, most of it containers), so a test's cost is the
CPU it makes the machine spend, not its wall clock alone. Two measures, read from the kernel's accounting:

- ``own``: what the command itself caused, exact even while other work runs beside it:
  - ``host``: user plus system seconds of the command and every descendant it waited for (``RUSAGE_CHILDREN``:
    pytest, its xdist workers, the sessions its tests start);
  - ``containers``: the cgroup CPU of every container the plugin made for it: a container whose owner label
    (``pytest-programbench.owner``) names a controller process descended from the command, sampled every 0.1 s
    until it is gone (the last sample counts: up to 0.1 s of a container's end is missed). Containers without that
    label (a test's own probes, the official ``programbench eval``'s) are counted apart, not attributed.
- ``machine``: every CPU's busy time over the run (cgroup v1 ``cpuacct.usage``), split into the engine's containers,
  ``dockerd``, ``containerd`` and the rest (the host's processes, runc, shims, the re-executed ``dockerd`` of archive
  copies and commits, the kernel). Meaningful only when nothing else runs: the load average is printed.

    python bench/bench_cpu.py -- pytest tests/test_outcomes.py -p no:cacheprovider -q
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
TICKS = os.sysconf("SC_CLK_TCK")
OWNER_LABEL = "pytest-programbench.owner"  # "<hostname>/<boot id>/<controller pid>/<started>"
SAMPLE_SECONDS = 0.1


@dataclass(frozen=True)
class Snapshot:
    at: float
    total: float
    containers: float
    dockerd: float
    containerd: float


def _usage(path: Path) -> float | None:
    try:
        return int(path.read_text()) / 1e9
    except (OSError, ValueError):
        return None


def _stat_fields(pid: int | str) -> tuple[str, list[str]] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def _process_seconds(name: str) -> float:
    """User plus system seconds of every running process called ``name`` (its own, not its children's)."""
    seconds = 0.0
    for proc in Path("/proc").iterdir():
        fields = _stat_fields(proc.name) if proc.name.isdigit() else None
        if fields is not None and fields[0] == name:
            seconds += (int(fields[1][11]) + int(fields[1][12])) / TICKS  # utime, stime: fields 14 and 15
    return seconds


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        if pid == ancestor:
            return True
        fields = _stat_fields(pid)
        if fields is None or pid <= 1:
            return False
        pid = int(fields[1][1])  # ppid: field 4
    return False


def snapshot() -> Snapshot:
    return Snapshot(at=time.monotonic(), total=_usage(CPUACCT / "cpuacct.usage") or 0.0,
                    containers=_usage(CPUACCT / "docker" / "cpuacct.usage") or 0.0,
                    dockerd=_process_seconds("dockerd"), containerd=_process_seconds("containerd"))


@dataclass
class OwnContainers:
    """The containers made for one command, their CPU sampled until they are gone."""

    root_pid: int
    client: Any
    own: dict[str, float] = field(default_factory=dict)  # container id -> its last sampled CPU seconds
    unattributed: int = 0
    _live: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> list[threading.Thread]:
        self._events = self.client.events(decode=True, filters={"type": "container", "event": "create"})
        threads = [threading.Thread(target=self._watch, daemon=True),
                   threading.Thread(target=self._sample, daemon=True)]
        for thread in threads:
            thread.start()
        return threads

    def stop(self) -> None:
        self._done.set()
        self._events.close()
        self._sample_once()

    def _watch(self) -> None:
        try:
            for event in self._events:
                attributes = (event.get("Actor") or {}).get("Attributes") or {}
                owner = str(attributes.get(OWNER_LABEL, "")).split("/")
                cid = str(event.get("id") or event["Actor"]["ID"])
                if len(owner) == 4 and owner[2].isdigit() and _descends_from(int(owner[2]), self.root_pid):
                    with self._lock:
                        self._live.add(cid)
                        self.own.setdefault(cid, 0.0)
                else:
                    self.unattributed += 1
        except Exception:  # the stream closed under the reader: the end
            return

    def _sample(self) -> None:
        while not self._done.wait(SAMPLE_SECONDS):
            self._sample_once()

    def _sample_once(self) -> None:
        with self._lock:
            for cid in list(self._live):
                seconds = _usage(CPUACCT / "docker" / cid / "cpuacct.usage")
                if seconds is None:
                    if self.own[cid] > 0:  # gone (a container not yet started has no cgroup yet)
                        self._live.discard(cid)
                    continue
                self.own[cid] = max(self.own[cid], seconds)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to measure is required, after --")
    if not (CPUACCT / "cpuacct.usage").is_file():
        parser.error(f"{CPUACCT}/cpuacct.usage is not readable: this bench reads cgroup v1's CPU accounting")
    load_before = os.getloadavg()[0]
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = snapshot()
    proc = subprocess.Popen(command)
    containers = OwnContainers(root_pid=proc.pid, client=docker.from_env())
    containers.start()
    status = proc.wait()
    containers.stop()
    after = snapshot()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    host = (children.ru_utime - children_before.ru_utime) + (children.ru_stime - children_before.ru_stime)
    own_containers = sum(containers.own.values())
    total = after.total - before.total
    parts = {"containers": after.containers - before.containers, "dockerd": after.dockerd - before.dockerd,
             "containerd": after.containerd - before.containerd}
    parts["rest"] = total - sum(parts.values())
    machine = ", ".join(f"{name} {seconds:.1f}" for name, seconds in parts.items())
    print(f"wall {after.at - before.at:.1f} s; own CPU {host + own_containers:.1f} core-s (host {host:.1f}, "
          f"{len(containers.own)} containers {own_containers:.1f}; {containers.unattributed} other containers "
          f"made meanwhile); machine CPU {total:.1f} core-s ({machine}); exit status {status}; "
          f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
