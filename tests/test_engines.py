"""More than one engine (``--pb-docker-host``): tasks spread over the default engine and two private ones, an
engine lost mid-run absorbed by another, its leftovers reaped when it comes back, the relay reaching an agent on a
non-default engine through the tunnel. (The shared engine reached over ssh://: tests/test_engine_over_ssh.py, which
needs no engine of its own and runs with the parallel suite.)

Serial phase (own engines): run with the chaos and load tests, never under the parallel suite.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TESTBED, Testbed
from tests.scripted_llm import ScriptedLLM, Turn
from tests.test_chaos_engine import FIXTURE_IMAGES, PrivateEngine, own_engine_module, private_engine_running
from tests.test_first_hour import RELAY_AGENT

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("clean_env")]

RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"
TUIISH = "pbfix__tuiish.7e1a0b2"
RUN_LABEL = "pytest-programbench"


@pytest.fixture(scope="module")
def engines(private_engine: PrivateEngine, docker_client: Any) -> Iterator[tuple[PrivateEngine, PrivateEngine]]:
    """The process's private engine and a second one of this module's own."""
    with own_engine_module(private_engine, docker_client) as first, \
            private_engine_running(docker_client, FIXTURE_IMAGES) as second:
        yield first, second


@pytest.fixture(scope="module")
def mixed_submissions(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A known-good, a partly wrong and a known-good submission: three different scores to keep apart."""
    root = tmp_path_factory.mktemp("mixed")
    runs = testbed.submissions.parent
    for variant, iid in (("good", RPN), ("wrong", CATLIKE), ("good", TUIISH)):
        shutil.copytree(runs / variant / iid, root / iid)
    return root


def _session(pytester: pytest.Pytester, testbed: Testbed, run_dir: Path, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-pull", "never", "--pb-cpus", "1", "--pb-output", str(run_dir), *args, timeout=900)


def _tasks(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return data


def _leftovers(client: Any, run_dir: Path | None = None) -> list[str]:
    """Containers of the run whose directory is ``run_dir`` (of any run without one: private engines only; the shared
    engine runs the parallel suite's sessions meanwhile)."""
    label = RUN_LABEL
    if run_dir is not None:
        label += "=" + json.loads((run_dir / "pb-run.json").read_text())["run_id"]
    return [c.id for c in client.containers.list(all=True, filters={"label": label})]


def test_tasks_spread_over_three_engines_score_as_on_one(pytester: pytest.Pytester, testbed: Testbed,
                                                         mixed_submissions: Path, docker_client: Any,
                                                         engines: tuple[PrivateEngine, PrivateEngine]) -> None:
    first, second = engines
    common = ["--pb-filter", "pbfix__", "--pb-submissions", str(mixed_submissions)]
    single = _session(pytester, testbed, pytester.path / "single", *common, "-n", "3")  # one engine, same workers
    single.assert_outcomes(passed=2, failed=1)
    spread_dir = pytester.path / "spread"
    spread = _session(pytester, testbed, spread_dir, *common, "-n", "3", "--pb-docker-host", "default=1",
                      "--pb-docker-host", f"{first.url}=1", "--pb-docker-host", f"{second.url}=1")
    spread.assert_outcomes(passed=2, failed=1)
    spread.stdout.fnmatch_lines(["*programbench engines: *"])
    one, many = _tasks(pytester.path / "single")["tasks"], _tasks(spread_dir)
    for iid in (RPN, CATLIKE, TUIISH):
        assert many["tasks"][iid]["score"] == one[iid]["score"], iid
        assert many["tasks"][iid]["outcome"] == one[iid]["outcome"], iid
    used = {many["tasks"][iid]["engine"] for iid in (RPN, CATLIKE, TUIISH)}
    assert len(used) == 3, f"three tasks at once on three one-slot engines, got {used}"
    assert set(many["by_engine"]) == used
    for client, run in ((docker_client, spread_dir), (docker_client, pytester.path / "single"),
                        (first.client(), None), (second.client(), None)):
        assert _leftovers(client, run) == [], "nothing of the run may outlive it on any engine"


# Sleeps (a process the test can see) until the flag file exists: the first attempt is caught asleep, the retry on the
# other engine (after the flag is set) copies the solution at once.
SLOW_AGENT = f"test -e /pb-flag/go || sleep 31; cp -r /pb-testbed/solutions/{CATLIKE}/. ."


def _runs_process(engine: PrivateEngine, command: str) -> bool:
    """A container of a run on ``engine`` runs a process whose command line is ``command`` (the agent's shell, whose
    command line merely contains it, does not count)."""
    client = engine.client(timeout=10)
    try:
        for container in client.api.containers(filters={"label": RUN_LABEL}):
            with contextlib.suppress(Exception):  # gone meanwhile
                processes = client.api.top(container["Id"]).get("Processes") or []
                if any(proc and proc[-1] == command for proc in processes):
                    return True
        return False
    finally:
        client.close()


def test_an_engine_lost_mid_run_is_absorbed_by_another(pytester: pytest.Pytester, testbed: Testbed,
                                                       engines: tuple[PrivateEngine, PrivateEngine],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = engines
    monkeypatch.setenv("PB_DOCKER_RETRY_SECONDS", "3")  # the lost engine is given up quickly
    run_dir = pytester.path / "run"
    flag = pytester.mkdir("flag")
    by_url = {first.url: first, second.url: second}
    lost: list[PrivateEngine] = []

    def kill_the_engine_running_the_agent() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not lost:
            for engine in by_url.values():
                with contextlib.suppress(Exception):
                    if _runs_process(engine, "sleep 31"):
                        # The agent sleeps in its sandbox: take its engine away; the retry elsewhere need not sleep.
                        (flag / "go").touch()
                        engine.stop(timeout=10)
                        lost.append(engine)
                        return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_engine_running_the_agent, daemon=True)
    killer.start()
    try:
        result = _session(pytester, testbed, run_dir, "--pb-filter", CATLIKE, "--pb-agent", SLOW_AGENT,
                          "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-agent-mount", f"{flag}:/pb-flag",
                          "--pb-infra-retries", "1",
                          "--pb-docker-host", f"{first.url}=1", "--pb-docker-host", f"{second.url}=1")
    finally:
        killer.join(60)
    assert lost, "the test never saw the sandbox to take its engine away"
    result.assert_outcomes(passed=1)
    task = _tasks(run_dir)["tasks"][CATLIKE]
    survivor = next(url for url in by_url if by_url[url] is not lost[0])
    assert task["engine"] == survivor, task
    assert task["engines_tried"] == [lost[0].url, survivor]
    assert task["score"] == 1.0
    with contextlib.suppress(Exception):
        assert _leftovers(by_url[survivor].client()) == []

    # It comes back: the next session on it reaps what the lost run left there.
    lost[0].start()
    again = _session(pytester, testbed, pytester.path / "again", "--pb-filter", RPN, "--pb-submissions",
                     str(testbed.submissions), "--pb-docker-host", lost[0].url)
    again.assert_outcomes(passed=1)
    assert _leftovers(lost[0].client()) == [], "the lost run's sandbox was not reaped"


def test_relay_reaches_an_agent_on_another_engine(pytester: pytest.Pytester, testbed: Testbed,
                                                  engines: tuple[PrivateEngine, PrivateEngine]) -> None:
    first, _second = engines
    if not first.ping():
        first.start()
    agent_dir = pytester.mkdir("agent")
    (agent_dir / "relay_agent.py").write_text(RELAY_AGENT)
    agent_dir.chmod(0o755)  # the agent user reads it through the mount
    (agent_dir / "relay_agent.py").chmod(0o644)
    run_dir = pytester.path / "run"
    agent = f"python3 /pb-agent/relay_agent.py && cp -r /pb-testbed/solutions/{RPN}/. ."
    with ScriptedLLM([Turn("copying the solution", "true", 10, 5)]) as llm:
        result = _session(pytester, testbed, run_dir, "--pb-filter", RPN, "--pb-agent", agent,
                          "--pb-model-endpoint", llm.base_url, "--pb-agent-mount", f"{TESTBED}:/pb-testbed",
                          "--pb-agent-mount", f"{agent_dir}:/pb-agent", "--pb-docker-host", first.url)
        served = len(llm.requests)
    result.assert_outcomes(passed=1)
    assert served == 1
    assert _tasks(run_dir)["tasks"][RPN]["engine"] == first.url
