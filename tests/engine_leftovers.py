"""What the suite leaves on the shared engine, checked once it ended (scripts/test-suite.sh)::

    python -m tests.engine_leftovers snapshot .ci/out/leftovers.json   # before the suite
    python -m tests.engine_leftovers check .ci/out/leftovers.json      # after it: exit 1 on anything new

Each test checks its own runs; this is the whole suite's account, so a leak of a path no test looks at still fails:

- containers and volumes labelled with a run (``RUN_LABEL``), and grader volumes' stand-ins (``pb-grader-*``);
- containerd tasks with no container: an orphaned ``containerd-shim``, left when the engine removes or kills a frozen
  gVisor container its own way (``Container.thaw_under_gvisor``).

What was there before the suite (another session's, a crashed run's on the same machine) is not counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import docker

from pytest_programbench import GRADER_VOLUME_PREFIX, RUN_LABEL

# Where the local engine's containerd keeps each container's task (its shim's state) while the task exists.
CONTAINERD_TASKS = Path("/var/run/docker/containerd/daemon/io.containerd.runtime.v2.task/moby")


def leftovers() -> dict[str, list[str]]:
    """The engine's objects that no finished suite may leave, by kind (sorted ids or names)."""
    api = docker.from_env().api
    labelled = api.containers(all=True, filters={"label": RUN_LABEL})
    every = {c["Id"] for c in api.containers(all=True)}
    volumes = (api.volumes() or {}).get("Volumes") or []
    tasks = sorted(p.name for p in CONTAINERD_TASKS.iterdir()) if CONTAINERD_TASKS.is_dir() else []
    return {
        "containers": sorted(f"{c['Id'][:12]} {(c.get('Names') or ['?'])[0]}" for c in labelled),
        "volumes": sorted(v["Name"] for v in volumes
                          if RUN_LABEL in (v.get("Labels") or {}) or v["Name"].startswith(GRADER_VOLUME_PREFIX)),
        "containerd tasks without a container": [t for t in tasks if t not in every],
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("snapshot", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    command, path = argv[0], Path(argv[1])
    now = leftovers()
    if command == "snapshot":
        path.write_text(json.dumps(now, indent=2))
        return 0
    before = json.loads(path.read_text())
    new = {kind: [item for item in items if item not in before.get(kind, [])] for kind, items in now.items()}
    new = {kind: items for kind, items in new.items() if items}
    if not new:
        print("engine leftovers: none")
        return 0
    for kind, items in new.items():
        print(f"engine leftovers: {len(items)} {kind} left by the suite: {', '.join(items[:20])}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
