"""The floor: the official's container work and nothing else, for ``bench_eval.py``'s ``floor`` rows.

An evaluator that gives the official's score has to run every step ``programbench eval`` runs in a container, each
branch in a container of its own. This runs exactly those steps and nothing more, with as few engine operations as
they allow, so that its time is a lower bound for any such evaluator on this machine:

* per task, once and *before* the clock starts: an image of the task's with pytest-rerunfailures 16.4 installed and the
  official's timeout-retry plugin in place (the install costs the floor nothing);
* on the clock, per task: a container of that image, the workspace wiped (one exec), the submission put in by the
  engine, then one exec for the rest of the official's compile phase (files matching ``eval_clean_hashes`` removed,
  a stale ``./executable`` removed, the synthetic git repository, the DNS block, ``compile.sh``, the DNS restored, the
  executable moved aside and hashed), the container committed and removed; per active branch, in turn: a container
  of the committed image, the branch's tests put in by the engine, one exec for the official's branch steps (the
  executable restored and its hash verified, stale results removed, the timeout method patched, the timeout-retry
  plugin's directory, then the official's test command: the plugin and ``--reruns=2 --reruns-delay=1``,
  ``PYTEST_XDIST_AUTO_NUM_WORKERS`` and ``--max-worker-restart=4`` as the official sets them), ``eval/results.xml``
  read by the engine, the container removed; then the committed image.

Left out: the install (made before the clock), retries, what the official does on the host (its docker CLI
processes), and every check of ours. Containers are made as ours are (``--init``, two CPUs, the engine's default
network, the quick-ACK sysctl where the kernel takes it), so the tests run under the same conditions as in ``pytest
-n 2``. The results are scored the official way (``_process_branch_xml``) and written as ``<id>/<id>.eval.json``, so
the bench checks that the floor's scores equal the official's.
"""

from __future__ import annotations

import io
import json
import shlex
import tarfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, NotFound
from programbench.constants import WORKSPACE_DIR
from programbench.eval.eval import EvaluationResult, Evaluator, _process_branch_xml
from programbench.eval.pytest_timeout_retry import (
    PYTEST_TIMEOUT_RETRY_PLUGIN_DIR,
    PYTEST_TIMEOUT_RETRY_PLUGIN_MODULE,
    PYTEST_TIMEOUT_RETRY_PLUGIN_PATH,
    PYTEST_TIMEOUT_RETRY_PLUGIN_SOURCE,
)
from programbench.utils.load_data import (
    get_active_branches,
    get_ignored_branches,
    get_ignored_tests,
    load_all_instances,
)

# The official's step commands as the evaluation layer pins them (tests/test_step_batch.py).
from pytest_programbench.evaluation.container_layer import HASH_COMMAND, SEED_GIT_COMMAND, VERIFY_HASH_COMMAND

LABEL = "pytest-programbench.bench-floor"  # every container and image made here (removed at the end)
CPUS = 2
QUICK_ACKS = {"net.ipv4.tcp_pingpong_thresh": "255"}  # as ours (container_layer.QUICK_ACK_SYSCTL)
WHEELS_MOUNT = "/tmp/pb-floor-wheels"
STASHED = Evaluator._stashed_executable
# The official's steps (eval.py 1.2.5), each phase's in one exec: the compile phase after the submission is in (the
# eval_clean_hashes removal is put in front per task), and a branch's after its tests are in.
COMPILE_COMMAND = (
    f"rm -f ./executable && {{ {SEED_GIT_COMMAND}; }} && "
    "cp -f /etc/resolv.conf /etc/resolv.conf.programbench-build-bak && "
    "printf '%s\\n' 'nameserver 0.0.0.0' > /etc/resolv.conf && cat /etc/resolv.conf >/dev/null && "
    "{ chmod +x ./compile.sh && ./compile.sh; built=$?; "
    "cat /etc/resolv.conf.programbench-build-bak > /etc/resolv.conf && rm -f /etc/resolv.conf.programbench-build-bak; "
    "[ $built = 0 ]; } && "
    f"mv ./executable {STASHED} && {HASH_COMMAND}"
)
BRANCH_STEPS = (
    f"rm -f ./executable && mv {STASHED} ./executable && chmod +x ./executable && {VERIFY_HASH_COMMAND} && "
    "rm -f eval/results.xml results.xml && "
    "{ test -f eval/run.sh && sed -i 's/--timeout-method=thread/--timeout-method=signal/g' eval/run.sh || true; } && "
    f"mkdir -p {shlex.quote(PYTEST_TIMEOUT_RETRY_PLUGIN_DIR)} && "
)
# The official's test command with reruns on (eval.py, _run_test_branch).
TEST_COMMAND = (
    'export PROGRAMBENCH_PYTEST_ORIGINAL_PYTHONPATH="${PYTHONPATH-}" && '
    'export PROGRAMBENCH_PYTEST_ORIGINAL_ADDOPTS="${PYTEST_ADDOPTS-}" && '
    f'export PYTHONPATH="{PYTEST_TIMEOUT_RETRY_PLUGIN_DIR}${{PYTHONPATH:+:$PYTHONPATH}}" && '
    f'export PYTEST_ADDOPTS="${{PYTEST_ADDOPTS:-}} -p {PYTEST_TIMEOUT_RETRY_PLUGIN_MODULE} '
    '--reruns=2 --reruns-delay=1" && chmod +x ./eval/run.sh && ./eval/run.sh'
)


class Floor:
    """One floor run over a run directory's submissions."""

    def __init__(self, source: Path, output: Path, tasks_dir: Path, blob_dir: Path, wheels: Path) -> None:
        self.source = source
        self.output = output
        self.blob_dir = blob_dir
        self.wheels = wheels
        self.api = docker.from_env().api
        self.run = uuid.uuid4().hex[:12]
        known = {i["instance_id"]: i for i in load_all_instances(tasks_dir)}
        self.instances = [known[task.name] for task in sorted(source.iterdir()) if task.is_dir()]
        self.prepared: dict[str, str] = {}
        self.quick_acks: dict[str, str] | None = QUICK_ACKS

    # ------------------------------------------------------------------------------------------- containers

    def _container(self, image: str, *, binds: list[str] | None = None) -> str:
        env = {"PYTEST_XDIST_AUTO_NUM_WORKERS": str(CPUS), "PYTEST_ADDOPTS": "--max-worker-restart=4"}
        while True:
            host = self.api.create_host_config(init=True, nano_cpus=CPUS * 1_000_000_000, network_mode="default",
                                               sysctls=self.quick_acks, binds=binds)
            cid = str(self.api.create_container(image, command=["sleep", "3600"], working_dir=WORKSPACE_DIR,
                                                environment=env, labels={LABEL: self.run},
                                                host_config=host)["Id"])
            try:
                self.api.start(cid)
                return cid
            except APIError:
                self.api.remove_container(cid, force=True)
                if self.quick_acks is None:
                    raise
                self.quick_acks = None  # the kernel refused the sysctl: as ours, without it

    @contextmanager
    def container(self, image: str, *, binds: list[str] | None = None) -> Iterator[str]:
        cid = self._container(image, binds=binds)
        try:
            yield cid
        finally:
            self.api.remove_container(cid, force=True)

    def _exec(self, cid: str, command: str) -> int:
        exec_id = self.api.exec_create(cid, ["bash", "-lc", command], workdir=WORKSPACE_DIR)["Id"]
        self.api.exec_start(exec_id)  # waits for the end; the output is read and dropped
        return int(self.api.exec_inspect(exec_id)["ExitCode"] or 0)

    def _commit(self, cid: str, repository: str) -> str:
        tag = uuid.uuid4().hex[:12]  # one image per commit: tasks run side by side
        self.api.commit(cid, repository=repository, tag=tag, conf={"Labels": {LABEL: self.run}})
        return f"{repository}:{tag}"

    # ------------------------------------------------------------------------------------------- the steps

    def prepare(self) -> None:
        """Off the clock: each task's image with the rerunfailures install and the timeout-retry plugin."""
        plugin = io.BytesIO()
        with tarfile.open(fileobj=plugin, mode="w") as tar:
            data = PYTEST_TIMEOUT_RETRY_PLUGIN_SOURCE.encode()
            info = tarfile.TarInfo(PYTEST_TIMEOUT_RETRY_PLUGIN_PATH.rsplit("/", 1)[1])
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for instance in self.instances:
            image = f"{instance['image_name']}:task_cleanroom_v6"
            with self.container(image, binds=[f"{self.wheels}:{WHEELS_MOUNT}:ro"]) as cid:
                self._exec(cid, f"pip3 install -q --disable-pip-version-check --no-index --find-links {WHEELS_MOUNT} "
                                f"pytest-rerunfailures==16.4; mkdir -p {shlex.quote(PYTEST_TIMEOUT_RETRY_PLUGIN_DIR)}")
                self.api.put_archive(cid, PYTEST_TIMEOUT_RETRY_PLUGIN_DIR, plugin.getvalue())
                self.prepared[instance["instance_id"]] = self._commit(cid, "pb-floor-prepared")

    def evaluate(self, instance: dict[str, Any]) -> None:
        """On the clock: compile, commit, every active branch in turn; the result written as the official's."""
        instance_id = str(instance["instance_id"])
        active = get_active_branches(instance)
        tests_by_branch = {b: list(instance["branches"][b].get("tests", [])) for b in active}
        result = EvaluationResult(solution_branch="submission", test_branches=active)
        with self.container(self.prepared[instance_id]) as cid:
            archive = self.source / instance_id / "submission.tar.gz"
            self._exec(cid, f"rm -rf {WORKSPACE_DIR}/* {WORKSPACE_DIR}/.[!.]*")
            self.api.put_archive(cid, WORKSPACE_DIR, archive.read_bytes())
            hashes = "|".join(instance.get("eval_clean_hashes") or [])
            remove = (f"find {WORKSPACE_DIR} -type f -exec sha256sum {{}} + 2>/dev/null | grep -E \"^({hashes})  \" "
                      "| cut -c67- | xargs -I% rm -fv %; ") if hashes else ""
            self._exec(cid, remove + COMPILE_COMMAND)
            committed = self._commit(cid, "pb-floor-compiled")
        try:
            for branch in active:
                with self.container(committed) as cid:
                    self.api.put_archive(cid, WORKSPACE_DIR, (self.blob_dir / instance_id / "tests" /
                                                              f"{branch}.tar.gz").read_bytes())
                    self._exec(cid, BRANCH_STEPS + TEST_COMMAND)
                    xml = self._results(cid)
                results, _warnings = _process_branch_xml(
                    xml, branch, tests_by_branch, instance_id, ignored_tests=get_ignored_tests(instance),
                    branch_ignored=branch in get_ignored_branches(instance))
                result.test_results.extend(results)
        finally:
            self.api.remove_image(committed, force=True)
        place = self.output / instance_id
        place.mkdir(parents=True, exist_ok=True)
        (place / f"{instance_id}.eval.json").write_text(result.model_dump_json())

    def _results(self, cid: str) -> str:
        stream, _stat = self.api.get_archive(cid, f"{WORKSPACE_DIR}/eval/results.xml")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            handle = tar.extractfile(member) if member is not None else None
            return handle.read().decode() if handle is not None else ""

    def remove_all(self) -> None:
        for found in self.api.containers(all=True, filters={"label": f"{LABEL}={self.run}"}):
            self.api.remove_container(found["Id"], force=True)
        for found in self.api.images(filters={"label": f"{LABEL}={self.run}"}):
            with suppress(NotFound):
                self.api.remove_image(found["Id"], force=True)


def run_floor(source: Path, output: Path, tasks_dir: Path, blob_dir: Path, wheels: Path, workers: int) -> float:
    """The floor over ``source``'s submissions with ``workers`` tasks at a time: its wall seconds (the preparation
    not counted). Results in ``output``; everything it made removed."""
    floor = Floor(source, output, tasks_dir, blob_dir, wheels)
    try:
        floor.prepare()
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(floor.evaluate, floor.instances))
        return time.monotonic() - started
    finally:
        floor.remove_all()


def main() -> None:  # for a look by hand: python bench/floor.py RUN_DIR OUT TASKS_DIR BLOB_DIR WHEELS [WORKERS]
    import sys

    source, output, tasks_dir, blob_dir, wheels = (Path(a) for a in sys.argv[1:6])
    workers = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    print(json.dumps({"seconds": round(run_floor(source, output, tasks_dir, blob_dir, wheels, workers), 2)}))


if __name__ == "__main__":
    main()
