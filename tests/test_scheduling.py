"""Scheduling: the longest tasks start first, by an earlier run's durations, pytest's cache or an estimate.

Real sessions over copies of the fixture tasks whose pipeline is a stub (``pb_outcome`` overridden in a
``conftest.py``, README "Customising"): each task sleeps a time of its own and scores 1, so the order tasks start in
is what is tested, seconds per session. The order is read from the run's ``progress.jsonl`` (every task's start,
on which worker), which the plugin writes whatever the pipeline is.
"""

from __future__ import annotations

import json
import secrets
import shutil
import textwrap
from pathlib import Path

import pytest

from tests.conftest import Testbed

pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.timeout(600)]

FIXTURES = ("pbfix__catlike.c47c47c", "pbfix__rpn.0b5e55e", "pbfix__tuiish.7e1a0b2")

# The stub pipeline: sleeps the task's time (PB_TEST_SLEEPS), and kills its own process (an xdist worker) on the
# first PB_TEST_KILLS[task] runs of a task, counted in files (the pattern of test_outcomes.py's crash test).
STUB = textwrap.dedent("""
    import json, os, signal, time
    from pathlib import Path
    import pytest
    from pytest_programbench.results.verdict import TaskOutcome

    @pytest.fixture
    def pb_outcome(pb_task):
        iid = pb_task.instance_id
        kills = json.loads(os.environ.get("PB_TEST_KILLS", "{}")).get(iid, 0)
        if kills:
            counter = Path(os.environ["PB_TEST_COUNTS"]) / iid
            n = int(counter.read_text()) if counter.exists() else 0
            counter.write_text(str(n + 1))
            if n < kills:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(json.loads(os.environ.get("PB_TEST_SLEEPS", "{}")).get(iid, 0))
        return TaskOutcome(iid, 1.0, 1, 1)
""")


@pytest.fixture
def six(pytester: pytest.Pytester, testbed: Testbed) -> list[str]:
    """Six copies of the fixture tasks (their metadata only: the stub needs no image), ids in collection order."""
    org = f"pbsched{secrets.token_hex(3)}"
    ids = []
    for fixture in FIXTURES:
        name, _, commit = fixture.split("__", 1)[1].rpartition(".")
        for k in range(2):
            new_id = f"{org}__{name}{k}.{commit}"
            (pytester.path / "tasks" / new_id).mkdir(parents=True)
            for meta in ("task.yaml", "tests.json"):
                shutil.copy2(testbed.tasks_dir / fixture / meta, pytester.path / "tasks" / new_id / meta)
            ids.append(new_id)
    pytester.makeconftest(STUB)
    return sorted(ids)


def run(pytester: pytest.Pytester, name: str, *args: str) -> tuple[pytest.RunResult, Path]:
    run_dir = pytester.path / name
    result = pytester.runpytest_subprocess(
        "--pb-tasks-dir", str(pytester.path / "tasks"), "--pb-filter", "pbsched", "--pb-agent", "true",
        "--pb-output", str(run_dir), "--pb-progress", "lines", *args, timeout=300)
    return result, run_dir


def starts(run_dir: Path) -> list[tuple[str, str]]:
    """(task, worker) in the order tasks started."""
    events = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines()]
    return [(e["task"], e["worker"]) for e in sorted(events, key=lambda e: e["at"]) if e["phase"] == "starting"]


def test_longest_first_from_a_run_dir_under_xdist_and_from_the_cache_without(
        pytester: pytest.Pytester, six: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Durations rising in collection order: the longest tasks come last in collection order.
    sleeps = {iid: 0.4 * (k + 1) for k, iid in enumerate(six)}
    monkeypatch.setenv("PB_TEST_SLEEPS", json.dumps(sleeps))
    first, first_dir = run(pytester, "first")
    first.assert_outcomes(passed=6)
    first.stdout.fnmatch_lines(["programbench schedule: longest first, by the hidden tests and branches of each*"])
    measured = {iid: row["duration"] for iid, row in json.loads((first_dir / "summary.json").read_text())
                ["tasks"].items()}
    longest = sorted(six, key=lambda iid: -measured[iid])
    assert longest == six[::-1], measured  # the stub's sleeps dominate what a task takes

    # -n 2 with the first run's durations: the two longest start at once, each worker's tasks longest first.
    second, second_dir = run(pytester, "second", "-p", "no:cacheprovider", "--pb-durations", str(first_dir),
                             "-n", "2")
    second.assert_outcomes(passed=6)
    # One line says what -n alone does (it said "using --dist worksteal" beside "longest first" before).
    second.stdout.fnmatch_lines([f"programbench schedule: longest first to idle workers (-n without --dist; pass "
                                 f"--dist to use xdist's own), by durations of 6 of 6 tasks from {first_dir}"])
    assert "worksteal" not in second.stdout.str()
    order = starts(second_dir)
    assert sorted(t for t, _ in order) == sorted(six)
    assert {t for t, _ in order[:2]} == set(longest[:2]), order
    assert len({w for _, w in order[:2]}) == 2, order
    for worker in {w for _, w in order}:
        mine = [t for t, w in order if w == worker]
        assert mine == sorted(mine, key=longest.index), (worker, order)

    # Without xdist and without --pb-durations: pytest's cache of the last run that used it (the first), serially
    # in exactly that order.
    third, third_dir = run(pytester, "third")
    third.assert_outcomes(passed=6)
    third.stdout.fnmatch_lines(["programbench schedule: longest first, by durations of 6 of 6 tasks from pytest's "
                                "cache of the last run"])
    assert [t for t, _ in starts(third_dir)] == longest


def test_an_explicit_dist_is_kept(pytester: pytest.Pytester, six: list[str]) -> None:
    result, _run_dir = run(pytester, "run", "-p", "no:cacheprovider", "-n", "2", "--dist", "load")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["programbench schedule: as --dist load orders it (collection order)"])
    assert "using --dist worksteal" not in result.stdout.str()


def test_a_crashed_workers_task_is_rescheduled_by_the_longest_first_scheduler(
        pytester: pytest.Pytester, six: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    once, always = six[0], six[1]
    counts = pytester.mkdir("counts")
    monkeypatch.setenv("PB_TEST_COUNTS", str(counts))
    monkeypatch.setenv("PB_TEST_KILLS", json.dumps({once: 1, always: 99}))
    result, run_dir = run(pytester, "run", "-p", "no:cacheprovider", "-n", "2")
    result.stdout.fnmatch_lines(["programbench schedule: longest first*"])
    # once: killed, rescheduled, then scored; always: killed twice (--pb-infra-retries 1), an error.
    said = result.stdout.str()[-4000:]
    assert (counts / once).read_text() == "2", said
    assert (counts / always).read_text() == "2", said
    tasks = json.loads((run_dir / "summary.json").read_text())["tasks"]
    assert tasks[once]["outcome"] == "passed", said
    assert any("crashed" in r for r in tasks[once]["reasons"])
    assert tasks[always]["outcome"] == "error"
    assert "crashed 2 time(s)" in tasks[always]["reasons"][-1]
    result.assert_outcomes(passed=5, errors=1)


def test_durations_of_a_directory_that_is_no_run_is_a_usage_error(pytester: pytest.Pytester, six: list[str]) -> None:
    result, _run_dir = run(pytester, "run", "-p", "no:cacheprovider", "--pb-durations", str(pytester.path / "tasks"))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--pb-durations: * is not a run directory with a readable summary.json*"])


def test_an_estimate_is_made_only_for_a_task_asked_about(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole benchmark's estimates cost a read of every task's tests.json; a run orders only what it runs."""
    from pytest_programbench.scheduling.estimates import Estimates
    from pytest_programbench.tasks.catalogue import Catalogue, Task

    tasks = Catalogue.load().tasks
    read: list[str] = []
    load_instance = Task.load_instance

    def counted(task: Task) -> dict[str, object]:
        read.append(task.instance_id)
        return load_instance(task)

    monkeypatch.setattr(Task, "load_instance", counted)
    estimates = Estimates.build(tasks, durations_dir=None, cache=None, agent_seconds=0)
    assert read == []
    assert "no earlier run's durations" in estimates.describe()
    first = f"programbench::{tasks[0].instance_id}"
    seconds = estimates.of(first)
    assert seconds > 0
    assert estimates.of(first) == seconds
    assert read == [tasks[0].instance_id]
    assert estimates.of("programbench::no-such-task") == 0.0
