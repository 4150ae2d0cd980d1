"""Load: 9 fixture items with ``-n 3`` on a private engine (serial phase): every result right, nothing leaked.

The full 24-item ``-n 8`` run is a benchmark (``python bench/bench_load.py --private-engine``): the suite keeps the
property (many workers, many items, one engine, nothing left) at the size a 25-minute CI can afford. The figures
(wall time, peak memory of the controller and the workers, containers alive at peak and at the end) go to the JUnit
properties of this test and to its output; ``bench/bench_load.py`` prints the same on its own.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.test_chaos_engine import PrivateEngine, own_engine_module

pytestmark = [pytest.mark.timeout(1800), pytest.mark.usefixtures("clean_env")]

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_load.py"


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_load", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_load"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(private_engine: PrivateEngine, docker_client: Any) -> Iterator[PrivateEngine]:
    with own_engine_module(private_engine, docker_client) as private:
        yield private


COPIES, WORKERS = 3, 3  # 3 fixture tasks x 3 copies: each worker runs several items, all at once on one engine


def test_many_items_with_many_workers(engine: PrivateEngine, tmp_path: Path, record_property: Any) -> None:
    load_bench = bench()
    client = engine.client(timeout=300)
    try:
        load = load_bench.make_load_set(tmp_path / "set", client, copies=COPIES)
        assert len(load.ids) == 3 * COPIES
        report = load_bench.run_load(load, tmp_path / "session", client.api, workers=WORKERS,
                                     docker_host=engine.url)
    finally:
        client.close()
    for line in report.lines():
        print(line)
    for name in ("wall_seconds", "controller_peak_mib", "worker_peak_mib", "workers_sum_peak_mib", "tree_peak_mib",
                 "containers_alive_peak", "containers_left", "images_left", "workers_seen"):
        record_property(name, getattr(report, name))
    output = (tmp_path / "session" / "out.txt").read_text(errors="replace")
    assert report.wrong == {}, output[-4000:]
    assert report.passed == 3 * COPIES
    assert report.exit_code == 0
    assert report.workers_seen == WORKERS
    assert report.containers_alive_peak > 0, "the sampler saw the run's containers"
    assert (report.containers_left, report.images_left) == (0, 0), "nothing of the run may outlive it"
    assert engine.containers() == [], "nothing at all left on the private engine"
