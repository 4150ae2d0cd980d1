"""What one engine operation costs the machine: a container's life, an exec, an archive read, a commit.

    python bench/bench_cpu.py -- python bench/bench_engine_ops.py life 20
    python bench/bench_cpu.py -- python bench/bench_engine_ops.py exec 20

Each run makes ``N`` containers of the test bed's base image the way the evaluation makes its containers (``--init``,
two CPUs, the engine's default network, ``sleep``), does the operation once in each (``life``: nothing more; ``exec``:
one ``true``; ``archive``: one read of ``/etc/hostname``; ``commit``: one commit, the image removed after) and removes
it. Under ``bench/bench_cpu.py`` the machine's CPU divided by ``N``, less ``life``'s, is the operation's price: what
an evaluator pays for each container, step and copy it makes, whoever makes them.
"""

from __future__ import annotations

import sys
import time

import docker
from bench_eval import read_env  # run as a script of bench/: the test bed's base image

LABEL = "pytest-programbench.bench-engine-ops"
OPERATIONS = ("life", "exec", "archive", "commit")


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in OPERATIONS:
        sys.exit(f"usage: bench_engine_ops.py {{{'|'.join(OPERATIONS)}}} N")
    operation, n = sys.argv[1], int(sys.argv[2])
    image = read_env()["PB_TESTBED_BASE"]
    api = docker.from_env().api
    started = time.monotonic()
    for _ in range(n):
        host = api.create_host_config(init=True, network_mode="default", nano_cpus=2_000_000_000)
        cid = api.create_container(image, command=["sleep", "600"], host_config=host, labels={LABEL: "1"})["Id"]
        try:
            api.start(cid)
            if operation == "exec":
                exec_id = api.exec_create(cid, ["true"])["Id"]
                api.exec_start(exec_id)
                api.exec_inspect(exec_id)
            elif operation == "archive":
                stream, _stat = api.get_archive(cid, "/etc/hostname")
                b"".join(stream)
            elif operation == "commit":
                made = api.commit(cid, repository="pb-bench-engine-ops", tag=cid[:12], conf={"Labels": {LABEL: "1"}})
                api.remove_image(made["Id"], force=True)
        finally:
            api.remove_container(cid, force=True)
    print(f"{n} containers, {operation}: {time.monotonic() - started:.2f} s wall")


if __name__ == "__main__":
    main()
