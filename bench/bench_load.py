"""Load: many fixture tasks evaluated at once (``-n 8`` on a small machine); wall time, peak memory, containers.

The fixture tasks are copied under new ids (``pbload__<name><k>.<hash>``) whose images are tags of the fixture
images (a task's image name derives from its id), with the same hidden test blobs and the known-good submissions, so
every result must be a pass. While the session runs, the bench samples the resident memory of the controller and of
each xdist worker (``/proc``) and the containers of the run alive on the engine.

    python bench/bench_load.py                       # 8 copies x 3 tasks = 24 items, -n 8, the shared engine
    python bench/bench_load.py --private-engine      # on a dockerd of its own (what tests/test_load.py does)
    python bench/bench_load.py --copies 4 -n 4 --json /tmp/load.json

Exit status 0 when every result is right and nothing leaked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURES = ("pbfix__catlike.c47c47c", "pbfix__rpn.0b5e55e", "pbfix__tuiish.7e1a0b2")
RUN_LABEL = "pytest-programbench"
TAG = "task_cleanroom_v6"


@dataclass
class LoadSet:
    root: Path
    tasks_dir: Path
    blob_dir: Path
    submissions: Path
    ids: list[str]
    tags: list[str]


def _testbed_env() -> dict[str, str]:
    env_sh = REPO / "testbed" / ".state" / "env.sh"
    values = {}
    for raw in env_sh.read_text().splitlines():
        line = raw.strip().removeprefix("export ")
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value.strip("'\"")
    return values


def make_load_set(root: Path, engine: Any, copies: int) -> LoadSet:
    """Copies of the fixture tasks under new ids, their images tagged on ``engine`` (a docker client)."""
    from programbench.constants import image_name_from_instance_id

    bed = _testbed_env()
    tasks_src, blobs_src = Path(bed["PB_TESTBED_TASKS_DIR"]), Path(bed["PB_TESTBED_BLOB_DIR"])
    good = Path(bed["PB_TESTBED_SUBMISSIONS"])
    load = LoadSet(root, root / "tasks", root / "blobs", root / "submissions", [], [])
    for fixture in FIXTURES:
        org_name, _, commit = fixture.rpartition(".")
        name = org_name.split("__", 1)[1]
        image = engine.images.get(f"{image_name_from_instance_id(fixture)}:{TAG}")
        for k in range(copies):
            new_id = f"pbload__{name}{k}.{commit}"
            task_dir = load.tasks_dir / new_id
            task_dir.mkdir(parents=True)
            for meta in ("task.yaml", "tests.json"):
                shutil.copy2(tasks_src / fixture / meta, task_dir / meta)
            shutil.copytree(blobs_src / fixture, load.blob_dir / new_id)
            (load.submissions / new_id).mkdir(parents=True)
            shutil.copy2(good / fixture / "submission.tar.gz", load.submissions / new_id / "submission.tar.gz")
            repository = image_name_from_instance_id(new_id)
            image.tag(repository, TAG)
            load.ids.append(new_id)
            load.tags.append(f"{repository}:{TAG}")
    return load


def untag(engine: Any, load: LoadSet) -> None:
    for tag in load.tags:
        with contextlib.suppress(Exception):
            engine.api.remove_image(tag)  # only the tag: the fixture image keeps its own


# ---------------------------------------------------------------------------------------------- sampling


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(p) for p in task.read_text().split()]
    return found


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Samples:
    controller_peak: int = 0
    worker_peaks: dict[int, int] = field(default_factory=dict)
    workers_sum_peak: int = 0
    tree_peak: int = 0
    containers_peak: int = 0
    containers_series: list[tuple[float, int]] = field(default_factory=list)
    workers_seen: int = 0


class Sampler:
    """Samples memory (every 0.2 s) and the run's containers (every 0.5 s) until stopped."""

    def __init__(self, controller: int, engine_api: Any, run_dir: Path) -> None:
        self.controller = controller
        self.api = engine_api
        self.run_dir = run_dir
        self.samples = Samples()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._threads = [threading.Thread(target=self._memory, daemon=True),
                         threading.Thread(target=self._containers, daemon=True)]

    def __enter__(self) -> Sampler:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _memory(self) -> None:
        s = self.samples
        while not self._stop.is_set():
            controller_rss = _rss(self.controller)
            s.controller_peak = max(s.controller_peak, controller_rss)
            workers = [p for p in _children(self.controller) if "exec(eval(" in _cmdline(p) or "xdist" in _cmdline(p)]
            s.workers_seen = max(s.workers_seen, len(workers))
            total = 0
            for pid in workers:
                rss = _rss(pid)
                total += rss
                s.worker_peaks[pid] = max(s.worker_peaks.get(pid, 0), rss)
            s.workers_sum_peak = max(s.workers_sum_peak, total)
            tree, stack, seen = 0, [self.controller], set()
            while stack:
                pid = stack.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                tree += _rss(pid)
                stack += _children(pid)
            s.tree_peak = max(s.tree_peak, tree)
            self._stop.wait(0.2)

    def _containers(self) -> None:
        run_id = None
        while not self._stop.is_set():
            if run_id is None:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    run_id = json.loads((self.run_dir / "pb-run.json").read_text())["run_id"]
            if run_id is not None:
                with contextlib.suppress(Exception):
                    alive = len(self.api.containers(filters={"label": f"{RUN_LABEL}={run_id}"}))
                    self.samples.containers_series.append((round(time.monotonic() - self._started, 1), alive))
                    self.samples.containers_peak = max(self.samples.containers_peak, alive)
            self._stop.wait(0.5)


# ---------------------------------------------------------------------------------------------- the run


@dataclass
class LoadReport:
    items: int
    workers: int
    cores: int
    exit_code: int
    wall_seconds: float
    passed: int
    wrong: dict[str, str]
    controller_peak_mib: float
    worker_peak_mib: float
    workers_sum_peak_mib: float
    tree_peak_mib: float
    workers_seen: int
    containers_alive_peak: int
    containers_left: int
    images_left: int
    command: str

    def lines(self) -> list[str]:
        return [
            f"load: {self.items} items, -n {self.workers} on {self.cores} cores: {self.passed} passed, "
            f"{len(self.wrong)} wrong, exit {self.exit_code}",
            f"wall time: {self.wall_seconds:.1f} s",
            f"peak memory (RSS): controller {self.controller_peak_mib:.1f} MiB; worker max "
            f"{self.worker_peak_mib:.1f} MiB; workers together {self.workers_sum_peak_mib:.1f} MiB "
            f"({self.workers_seen} workers); whole pytest tree {self.tree_peak_mib:.1f} MiB",
            f"containers of the run alive: at peak {self.containers_alive_peak}, at the end {self.containers_left}; "
            f"images of the run left: {self.images_left}",
            f"command: {self.command}",
        ]


def run_load(load: LoadSet, workdir: Path, engine_api: Any, *, workers: int, docker_host: str | None,
             extra: list[str] | None = None, timeout: float = 3600) -> LoadReport:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "pytest.ini").write_text("[pytest]\n")
    run_dir = workdir / "run"
    junit = workdir / "junit.xml"
    argv = [sys.executable, "-m", "pytest", "-c", str(workdir / "pytest.ini"), "--rootdir", str(workdir),
            "-p", "no:cacheprovider", "-p", "no:randomly", "-q", "-n", str(workers),
            "--pb-tasks-dir", str(load.tasks_dir), "--pb-blob-dir", str(load.blob_dir),
            "--pb-submissions", str(load.submissions), "--pb-output", str(run_dir), "--pb-cpus", "1",
            "--junitxml", str(junit), *(extra or [])]
    env = dict(os.environ)
    env.pop("PYTEST_XDIST_WORKER", None)
    if docker_host:
        env["DOCKER_HOST"] = docker_host
    started = time.monotonic()
    with (workdir / "out.txt").open("wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        with Sampler(proc.pid, engine_api, run_dir) as sampler:
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(60)
    wall = time.monotonic() - started
    samples = sampler.samples

    passed, wrong = 0, {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = case.get("name", "")
            props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
            bad = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            if not bad and props.get("score") == "1.0":
                passed += 1
            else:
                wrong[name] = f"{bad or 'passed'} score={props.get('score')}"
    run_id = json.loads((run_dir / "pb-run.json").read_text())["run_id"]
    label = f"{RUN_LABEL}={run_id}"
    left = len(engine_api.containers(all=True, filters={"label": label}))
    images_left = len(engine_api.images(all=True, filters={"label": label}))
    mib = 1 << 20
    return LoadReport(
        items=len(load.ids), workers=workers, cores=os.cpu_count() or 1, exit_code=code, wall_seconds=round(wall, 1),
        passed=passed, wrong=wrong, controller_peak_mib=round(samples.controller_peak / mib, 1),
        worker_peak_mib=round(max(samples.worker_peaks.values(), default=0) / mib, 1),
        workers_sum_peak_mib=round(samples.workers_sum_peak / mib, 1), tree_peak_mib=round(samples.tree_peak / mib, 1),
        workers_seen=samples.workers_seen, containers_alive_peak=samples.containers_peak, containers_left=left,
        images_left=images_left,
        command=" ".join(argv[2:]) + (f"  (DOCKER_HOST={docker_host})" if docker_host else ""),
    )


@contextlib.contextmanager
def _engine(private: bool, docker_host: str | None) -> Iterator[tuple[Any, str | None]]:
    import docker

    shared = docker.from_env(timeout=300)
    if not private:
        client = docker.DockerClient(base_url=docker_host, timeout=300) if docker_host else shared
        yield client, docker_host
        return
    sys.path.insert(0, str(REPO))
    from tests.test_chaos_engine import FIXTURE_IMAGES, private_engine_running

    with private_engine_running(shared, FIXTURE_IMAGES) as engine:
        client = engine.client(timeout=300)
        try:
            yield client, engine.url
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=8, help="copies of each of the 3 fixture tasks (default 8)")
    parser.add_argument("-n", "--workers", type=int, default=8)
    parser.add_argument("--private-engine", action="store_true", help="run on a dockerd of its own")
    parser.add_argument("--docker-host", default=None, help="an engine URL (default: DOCKER_HOST or the local one)")
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="pb-load-"))
    try:
        with _engine(args.private_engine, args.docker_host) as (client, host):
            load = make_load_set(root / "set", client, args.copies)
            try:
                report = run_load(load, root / "session", client.api, workers=args.workers, docker_host=host)
            finally:
                untag(client, load)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    for line in report.lines():
        print(line)
    if report.wrong:
        print("wrong results:", json.dumps(report.wrong, indent=2))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    ok = not report.wrong and report.passed == report.items and report.containers_left == 0 \
        and report.images_left == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
