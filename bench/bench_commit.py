"""What the ``install_rerunfailures`` step's files cost a compile container: unpacking them and committing them.

    python bench/bench_commit.py [--trials 5] [--image REF]

The official installs ``pytest-rerunfailures==16.4`` in the compile container after ``compile.sh`` and commits the
container: every branch container starts from that image. The plugin replays the install's recorded files
(``evaluation/install_cache.py``); the files themselves must still reach the committed image. On a fresh container
of a fixture task's image (the test bed's, whose pytest is Debian's 7.2, so pip brings pytest 9 and pygments:
about a thousand files, 14 MB), per trial:

* the files unpacked by the container's own ``tar`` (what the replay does) and by the engine (``put_archive``);
* ``docker commit`` of that container, paused (the official's default) and not, against the commit of a container
  without them.

Prints medians and every trial; writes JSON to ``bench/results/bench_commit-<UTC>.json``. Needs the test bed and one
evaluation with reruns on before it (the recorded files).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytest_programbench.engine.docker_engine import EngineRun, Engines, Labels, sweep  # noqa: E402
from pytest_programbench.evaluation.rerunfailures import install_cache_dir  # noqa: E402

RESULTS = REPO / "bench" / "results"
DEFAULT_IMAGE = "programbench/pbfix_1776_catlike.c47c47c:task_cleanroom_v6"


def recorded_files() -> Path:
    root = install_cache_dir()
    found = sorted(root.glob("*/files.tar"), key=lambda p: p.stat().st_size, reverse=True) if root else []
    if not found:
        sys.exit(f"no recorded install under {root}: run one evaluation with reruns on first "
                 "(python bench/bench_eval.py --only 'pytest -n 1')")
    return found[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    args = parser.parse_args()
    archive = recorded_files()
    payload = archive.read_bytes()
    engines = Engines(EngineRun.from_environment())  # this script's client of the environment's engine
    api = engines.client().api
    labels = Labels(f"pb-bench-commit-{os.getpid()}")
    times: dict[str, list[float]] = {}

    def container() -> str:
        host = api.create_host_config(init=True, network_mode="none")
        cid = str(api.create_container(args.image, command=["sleep", "600"], host_config=host,
                                       labels=labels.as_dict())["Id"])
        api.start(cid)
        return cid

    def unpack_with_tar(cid: str) -> None:
        exec_id = api.exec_create(cid, ["tar", "-C", "/", "-xpf", "-"], stdin=True)["Id"]
        sock = api.exec_start(exec_id, socket=True)
        sock._sock.sendall(payload)
        sock._sock.shutdown(1)  # end of the tar's stdin
        while sock.read(65536):
            pass
        code = api.exec_inspect(exec_id)["ExitCode"]
        if code != 0:
            raise RuntimeError(f"tar exited {code}")

    cases: list[tuple[str, Callable[[str], None] | None, bool]] = [
        ("tar", unpack_with_tar, True), ("tar", unpack_with_tar, False),
        ("put_archive", lambda cid: api.put_archive(cid, "/", payload), True),
        ("none", None, True), ("none", None, False),
    ]
    def record(name: str, started: float) -> None:
        times.setdefault(name, []).append(time.monotonic() - started)

    def trial(how: str, unpack: Callable[[str], None] | None, pause: bool) -> None:
        what = "files" if unpack is not None else "no files"
        cid = container()
        try:
            if unpack is not None:
                started = time.monotonic()
                unpack(cid)
                record(f"unpack by {how}", started)
            started = time.monotonic()
            image = api.commit(cid, repository="pb-bench-commit", tag=labels.run_id, pause=pause)
            record(f"commit ({what}, pause={pause})", started)
        finally:
            api.remove_container(cid, force=True)
        started = time.monotonic()
        api.remove_image(image["Id"], force=True)
        record(f"remove image ({what})", started)

    try:
        for _trial in range(args.trials):
            for how, unpack, pause in cases:
                trial(how, unpack, pause)
    finally:
        sweep(labels.run_id, engine=engines.client())
        engines.reset()
    print(f"{archive} ({len(payload) / 1e6:.1f} MB) on {args.image}, {args.trials} trials, median and all (s):")
    for name, values in times.items():
        print(f"  {name:34s} {statistics.median(values):6.3f}   {' '.join(f'{v:.2f}' for v in values)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"bench_commit-{stamp}.json"
    out.write_text(json.dumps({"when": stamp, "image": args.image, "archive_bytes": len(payload),
                               "cores": os.cpu_count(), "seconds": times}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
