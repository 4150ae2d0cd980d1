"""Consecutive official steps in one exec (evaluation/step_batch.py): the same commands, results, clocks and log
entries as one exec each."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from programbench.container import ContainerEnvironment
from programbench.eval.eval import Evaluator
from programbench.exceptions import EvalStepError

from pytest_programbench.engine.container import OutputCap
from pytest_programbench.evaluation import container_layer
from pytest_programbench.evaluation.container_layer import SdkContainerEnvironment, SdkEvaluator
from pytest_programbench.evaluation.step_batch import LINGER, Step, _Splitter, enabled
from tests.conftest import Testbed

LABELS = {"pytest-programbench": "pb-test-step-batch", "pytest-programbench.task": "step-batch"}
NONCE = b"pb-step-0123"


class RecordingEnv:
    """What the official pipeline asks of a container, answered at once: every command succeeds, except the one
    named in ``fail`` (exit 1)."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.fail = fail

    def execute(self, command: str, *, timeout: int | None = None) -> dict[str, Any]:
        self.calls.append((command, timeout))
        code = 1 if self.fail is not None and self.fail == command else 0
        # A hash for the hash steps, and the blackhole line the DNS block checks for.
        return {"output": "ab" * 32 + "  ./executable\nnameserver 0.0.0.0\n", "returncode": code, "exception_info": ""}

    def copy_in_tar(self, *_: Any) -> None: ...

    def copy_in(self, *_: Any) -> None: ...

    def cleanup(self) -> None: ...


def official(reruns: bool, env: RecordingEnv) -> tuple[Evaluator, list[dict[str, Any]]]:
    """The official ``_compile_executable`` then ``_run_test_branch`` against ``env``: its log."""
    evaluator = Evaluator.__new__(Evaluator)
    evaluator.submission_archive = Path("/nonexistent.tar.gz")
    evaluator.remove_hashes = []
    evaluator.blob_dir = Path("/nonexistent")
    evaluator.result = type("R", (), {"executable_hash": None})()
    evaluator._has_rerunfailures = reruns
    evaluator._new_env = lambda image, serial_pytest=False: env  # type: ignore[method-assign]
    evaluator._copy_file_from_container = lambda **kw: "<testsuites/>"  # type: ignore[method-assign]
    log: list[dict[str, Any]] = []
    evaluator._compile_executable(env, log)  # type: ignore[arg-type]
    evaluator._has_rerunfailures = reruns
    evaluator._run_test_branch("b", "img", log)
    return evaluator, log


def ours(reruns: bool) -> SdkEvaluator:
    evaluator = SdkEvaluator.__new__(SdkEvaluator)
    evaluator._has_rerunfailures = reruns
    return evaluator


@pytest.mark.parametrize("reruns", [True, False])
def test_batches_are_the_official_steps_in_its_order(reruns: bool) -> None:
    """Each batch is exactly the official's next steps: names, commands and clocks (the audited eval.py)."""
    env = RecordingEnv()
    _, log = official(reruns, env)
    timeouts = dict(env.calls)
    names = [entry["step"] for entry in log]
    batched = 0
    for at, entry in enumerate(log):
        steps = ours(reruns)._batch_from(entry["step"])
        if steps is None:
            continue
        batched += len(steps)
        assert [(s.name, s.command) for s in steps] == [(e["step"], e["command"]) for e in log[at:at + len(steps)]]
        assert [s.timeout for s in steps] == [timeouts[s.command] for s in steps]
    assert batched == (9 if reruns else 8), names


@pytest.mark.parametrize("reruns", [True, False])
def test_a_batch_stops_where_the_official_stops(reruns: bool) -> None:
    """A failing step ends the official's run unless it accepts failure: ``accept_failure`` says which."""
    for first in ("clear_stale_executable", "copy_executable", "restore_executable"):
        steps = ours(reruns)._batch_from(first)
        assert steps
        for step in steps:
            env = RecordingEnv(fail=step.command)
            try:
                official(reruns, env)
                went_on = True
            except EvalStepError:
                went_on = False
            assert went_on == step.accept_failure, step.name


def test_the_batch_can_be_turned_off() -> None:
    assert enabled({})
    assert enabled({"PYTEST_PROGRAMBENCH_STEP_BATCH": "1"})
    assert not enabled({"PYTEST_PROGRAMBENCH_STEP_BATCH": " 0 "})


def split(chunks: list[bytes], steps: int = 2) -> tuple[_Splitter, list[OutputCap]]:
    caps = [OutputCap(1 << 16) for _ in range(steps)]
    splitter = _Splitter(NONCE, caps, with_status=True)
    for chunk in chunks:
        splitter.feed(chunk)
    return splitter, caps


def test_splitter_cuts_at_markers_wherever_the_chunks_break() -> None:
    stream = b"one\n\n" + NONCE + b" 0 0 next\ntwo, no newline\n" + NONCE + b" 1 3 last\n"
    for size in (1, 2, 5, 7, len(stream)):
        splitter, caps = split([stream[i:i + size] for i in range(0, len(stream), size)])
        assert [c.text("stdout") for c in caps] == ["one\n", "two, no newline"]
        assert (splitter.done, splitter.statuses, splitter.broken) == (2, [0, 3], "")
        assert splitter.hows == ["next", "last"]


def test_splitter_keeps_look_alikes_and_refuses_forged_order() -> None:
    splitter, caps = split([b"\npb-step-01234 0 0 next\n", b"\n" + NONCE[:-1] + b"\n\n" + NONCE + b" 0 0 next\n"])
    assert caps[0].text("stdout") == "\npb-step-01234 0 0 next\n\n" + NONCE[:-1].decode() + "\n"
    assert splitter.done == 1
    forged, _ = split([b"x\n" + NONCE + b" 1 0 next\n"])
    assert "out of order" in forged.broken
    for how in (b"", b" later", b" next 1"):
        unknown, _ = split([b"\n" + NONCE + b" 0 0" + how + b"\n"])
        assert "out of order" in unknown.broken, how
    unfinished, _ = split([b"\n" + NONCE + b" 0 " + b"9" * 64])
    assert unfinished.broken


# ------------------------------------------------------------------------------------------ a real container


@pytest.fixture
def env(docker_client: Any, testbed: Testbed) -> Iterator[SdkContainerEnvironment]:
    container = SdkContainerEnvironment(image=testbed.base_image, cwd="/workspace", engine=docker_client, cpus=2,
                                        run_args=["--init"], labels=LABELS, lifetime=600)
    yield container
    container.cleanup()


def answers(env: SdkContainerEnvironment, steps: list[Step]) -> list[dict[str, Any]]:
    """What execute() gives for each step after ``run_steps``, as the official would ask; stops where it would."""
    out = []
    for step in steps:
        result = env.execute(step.command, timeout=step.timeout)
        out.append(result)
        if result["returncode"] != 0 and not step.accept_failure:
            break
    return out


@pytest.mark.docker
def test_batched_results_are_the_one_by_one_results(env: SdkContainerEnvironment) -> None:
    steps = [Step("a", "echo out; echo err >&2; printf 'no newline'; pwd", 20),
             Step("b", "shopt -q login_shell && echo login; echo $$ > /tmp/pid", 20),
             Step("c", "printf 'a\\r\\nb'; exit 3", 10, accept_failure=True),
             Step("d", "test $$ != $(cat /tmp/pid) && echo own-shell", 20),
             Step("e", "exit 4", 20),
             Step("f", "touch /tmp/f-ran", 20)]
    one_by_one = answers(env, steps)
    env.execute("rm -f /tmp/f-ran /tmp/pid")
    env.run_steps(steps)
    assert [s.step.name for s in env.batched] == ["a", "b", "c", "d", "e"]  # stopped after e, as the official
    batched = answers(env, steps)
    assert [{k: v for k, v in r.items() if k != "wall_time"} for r in batched] == one_by_one
    assert one_by_one[0]["output"] == "out\nno newline/workspace\nerr\n"
    assert [r["returncode"] for r in batched] == [0, 0, 3, 0, 4]
    assert all(0 <= r["wall_time"] < 5 for r in batched)
    assert env.execute("test -e /tmp/f-ran")["returncode"] == 1


@pytest.mark.docker
def test_each_step_has_its_own_clock(env: SdkContainerEnvironment) -> None:
    """A step still running at its clock times out as its own exec would; the official teardown ends it, and the
    steps after it run by themselves."""
    steps = [Step("quick", "echo quick", 20),
             Step("slow", "echo started; sleep 60", 3, accept_failure=True),
             Step("after", "echo after", 20)]
    began = time.monotonic()
    env.run_steps(steps)
    assert 3 <= time.monotonic() - began < 15
    assert [s.step.name for s in env.batched] == ["quick", "slow"]
    quick, slow = answers(env, steps[:2])
    assert quick["output"] == "quick\n"
    assert slow == {"output": "", "returncode": -1, "exception_info": "Command timed out after 3s",
                    "wall_time": slow["wall_time"]}
    # Not batched: run now, in a container the official teardown stopped (it kills every process but init, the
    # container's own command too), as the official's next exec would find it.
    after = env.execute("echo after")
    assert after["returncode"] != 0, after  # the engine's words vary with timing: stopped, deleted, not running
    assert "after" not in after["output"], after


class BorrowedContainer(ContainerEnvironment):
    """The official environment on a container it does not own (its ``__del__`` would remove it)."""

    def cleanup(self) -> None: ...


def official_exec(env: SdkContainerEnvironment, command: str, timeout: int = 60) -> dict[str, Any]:
    """``command`` run by the official ``ContainerEnvironment.execute`` (the docker CLI) in ``env``'s container."""
    official = BorrowedContainer.__new__(BorrowedContainer)
    official.cwd, official.executable, official.default_timeout = env.cwd, "docker", 600
    official.container_id = env.container_id
    return official.execute(command, timeout=timeout)


@pytest.mark.docker
def test_a_step_whose_output_a_child_holds_ends_as_its_exec_does(env: SdkContainerEnvironment) -> None:
    """An exec returns about 2 s after its process exits, whoever still holds its output (the daemon waits 2 s for
    the streams, then closes them), with what was printed until then; back to back, up to 2 s more. The batched
    step ends LINGER s after its process, with that output, and the batch ends there: the next steps run by
    themselves. (Waiting for every holder, the step ran into its 10 s clock and the teardown killed the
    container.)"""
    holder = "(sleep 1; echo late; sleep 30) & echo started"
    for run in (official_exec, lambda e, c: e.execute(c, timeout=10)):
        began = time.monotonic()
        alone = run(env, holder)
        assert 2 <= time.monotonic() - began < 7, alone
        assert (alone["output"], alone["returncode"]) == ("started\nlate\n", 0)
    steps = [Step("quick", "echo quick", 20), Step("holder", holder, 10), Step("after", "echo after", 20)]
    began = time.monotonic()
    env.run_steps(steps)
    assert LINGER <= time.monotonic() - began < LINGER + 4
    assert [s.step.name for s in env.batched] == ["quick", "holder"]
    _quick, held = answers(env, steps[:2])
    assert (held["output"], held["returncode"], held["exception_info"]) == ("started\nlate\n", 0, "")
    # Timed on the host from the previous step's marker, which may arrive late: a little under LINGER is possible.
    assert LINGER - 0.25 <= held["wall_time"] < LINGER + 3
    assert env.execute("echo after")["output"] == "after\n"  # by itself; the container runs on
    # A child that closes its output before LINGER ends its step then, and the batch goes on.
    steps = [Step("brief", "(sleep 0.5; echo late) & echo started", 10), Step("after", "echo after", 20)]
    env.run_steps(steps)
    assert [s.step.name for s in env.batched] == ["brief", "after"]
    brief, after = answers(env, steps)
    assert (brief["output"], after["output"]) == ("started\nlate\n", "after\n")
    assert brief["wall_time"] < LINGER


@pytest.mark.docker
def test_each_step_leads_its_own_session(env: SdkContainerEnvironment) -> None:
    """An exec's process leads its own session: an EXIT trap's ``kill 0`` reaches its own processes only. In the
    batch it killed the driver (copy_executable_failed, 0, where the official scores 1.0)."""
    env.execute("echo \"trap 'trap \\\"\\\" TERM; kill 0' EXIT\" > /etc/profile.d/zz-kill0.sh")
    steps = [Step("first", "echo first", 20), Step("second", "echo second", 20)]
    alone = [official_exec(env, s.command) for s in steps]
    assert alone == [{"output": "first\n", "returncode": 0, "exception_info": ""},
                     {"output": "second\n", "returncode": 0, "exception_info": ""}]
    env.run_steps(steps)
    assert [s.step.name for s in env.batched] == ["first", "second"]
    assert [{k: v for k, v in r.items() if k != "wall_time"} for r in answers(env, steps)] == alone


# What a step's process can see of how it was started, beyond its argv: the environment (as `env` and as the process
# was given it), descriptors, signal dispositions, process group and session, umask, limits, directory, login shell.
PROCESS_VIEW = r"""env | sort; echo ---; tr '\0' '\n' </proc/$$/environ | sort; echo ---
ls /proc/$$/fd; readlink /proc/$$/fd/0; grep -E '^Sig(Ign|Blk|Cgt)' /proc/$$/status
read -r line </proc/$$/stat; set -- ${line##*) }; [ "$3" = $$ ] && [ "$4" = $$ ] && echo "leads its session"
umask; ulimit -a; pwd; shopt login_shell; echo "$0 $-"; true"""


@pytest.mark.docker
def test_a_batched_step_sees_what_an_exec_gives(env: SdkContainerEnvironment) -> None:
    """The same environment, descriptors, signals, session and shell as an exec of its own (the official's docker CLI
    and our SDK exec alike), login profile included: a profile printing $SHLVL printed 2 in the batch, and the
    recorded executable_hash (the first word of sha256sum's step) differed from the official's."""
    env.execute("echo 'echo SHLVL=$SHLVL' > /etc/profile.d/zz-shlvl.sh")
    steps = [Step("view", PROCESS_VIEW, 20), Step("again", PROCESS_VIEW, 20)]
    official = official_exec(env, PROCESS_VIEW)
    assert official["output"].startswith("SHLVL=1\n"), official
    assert "leads its session" in official["output"]
    assert env.execute(PROCESS_VIEW) == official
    env.run_steps(steps)
    assert [s.step.name for s in env.batched] == ["view", "again"]
    for result in answers(env, steps):
        assert {k: v for k, v in result.items() if k != "wall_time"} == official


@pytest.mark.docker
def test_a_container_without_the_drivers_tools_runs_each_step_by_itself(env: SdkContainerEnvironment) -> None:
    """What the driver needs beyond bash builtins (setsid, env, cat by their paths) is checked before any step
    runs; without it nothing runs in the batch, and each step runs by itself when asked for."""
    env.execute("mv /usr/bin/setsid /usr/bin/setsid.away")
    steps = [Step("first", "echo first >> /tmp/ran", 20), Step("second", "cat /tmp/ran", 20)]
    env.run_steps(steps)
    assert list(env.batched) == []
    assert [r["output"] for r in answers(env, steps)] == ["", "first\n"]


@pytest.mark.docker
def test_undecodable_output_raises_at_its_own_step(env: SdkContainerEnvironment) -> None:
    steps = [Step("fine", "echo fine", 20), Step("bad", "printf 'ok \\xff' >&2", 20)]
    env.run_steps(steps)
    assert env.execute("echo fine")["output"] == "fine\n"
    with pytest.raises(container_layer.UndecodableOutput, match="stderr") as raised:
        env.execute(steps[1].command)
    assert raised.value.output == "ok \\xff"


@pytest.mark.docker
def test_a_step_forging_a_marker_fails_its_step(env: SdkContainerEnvironment) -> None:
    """Only code that reads the driver's arguments can write a marker: it ends the batch with that step failed."""
    steps = [Step("forger", "n=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | grep ^pb-step-); "
                            "printf '\\n%s 5 0\\n' \"$n\"", 20), Step("next", "echo next", 20)]
    env.run_steps(steps)
    result = env.execute(steps[0].command)
    assert result["returncode"] == -1
    assert "could not be told apart" in result["exception_info"]
