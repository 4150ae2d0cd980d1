"""The ground floor's rules, each in one place: the memo, the declared environment variables, the settings' defaults
and the CLI presets' names (no Docker, no pytest session)."""

from __future__ import annotations

import threading
import time
from dataclasses import fields

import pytest

from pytest_programbench.core import environment
from pytest_programbench.core.memo import Memo
from pytest_programbench.core.presets import DEFAULT_VERSIONS, parse_preset
from pytest_programbench.core.settings import Settings, default
from pytest_programbench.evaluation.evaluation import EvalSettings


def test_a_memo_makes_each_value_once_even_when_threads_ask_together() -> None:
    memo: Memo[str, int] = Memo()
    made: list[str] = []

    def make() -> int:
        made.append("x")
        time.sleep(0.05)  # long enough for every thread to be waiting on the same key
        return 42

    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(memo.get("k", make))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [42] * 8
    assert made == ["x"]
    assert memo.get("other", lambda: 7) == 7  # another key is made on its own


def test_a_memo_remembers_nothing_that_raised() -> None:
    memo: Memo[str, int] = Memo()

    def fail() -> int:
        raise OSError("unreadable")

    with pytest.raises(OSError, match="unreadable"):
        memo.get("k", fail)
    assert memo.get("k", lambda: 1) == 1


def test_a_variable_that_does_not_parse_falls_back_to_its_default(caplog: pytest.LogCaptureFixture) -> None:
    assert environment.DOCKER_API_TIMEOUT.number({"PB_DOCKER_API_TIMEOUT": "soon"}) == 300.0
    assert environment.AGENT_LOG_MAX.size({"PB_AGENT_LOG_MAX": "lots"}) == 64 << 20
    assert environment.DOCKER_CONCURRENCY.integer({"PB_DOCKER_CONCURRENCY": "x"}) == 4
    assert "PB_DOCKER_API_TIMEOUT='soon' is not a number" in caplog.text
    # A computed default stands in where the variable has none, set or not.
    assert environment.DISK_RUN_DIR_NEED.size({}, otherwise=123) == 123
    assert environment.DISK_RUN_DIR_NEED.size({"PB_DISK_RUN_DIR_NEED": "?"}, otherwise=123) == 123
    assert environment.DISK_RUN_DIR_NEED.size({"PB_DISK_RUN_DIR_NEED": "2k"}, otherwise=123) == 2048


def test_the_official_switches_are_on_unless_zero() -> None:
    for switch in (environment.STEP_BATCH, environment.PREFETCH, environment.PIP_REPLAY, environment.AUDIT_EARLY,
                   environment.QUICK_ACKS):
        assert [switch.enabled(env) for env in ({}, {switch.name: "1"}, {switch.name: "yes"})] == [True] * 3
        assert not switch.enabled({switch.name: " 0 "})


def test_every_variable_is_declared_once() -> None:
    names = [v.name for v in environment.VARIABLES]
    assert len(names) == len(set(names))


def test_the_evaluation_takes_its_defaults_from_the_settings() -> None:
    evaluation = EvalSettings()
    shared = {f.name for f in fields(EvalSettings)} & {f.name for f in fields(Settings)}
    assert shared >= {"cpus", "memory", "branch_workers", "branch_retries", "compile_timeout", "test_timeout",
                      "strict", "image_tag"}
    assert {name: getattr(evaluation, name) for name in shared} == {name: default(name) for name in shared}


def test_a_preset_names_its_version_or_the_default() -> None:
    assert parse_preset("codex") == ("codex", DEFAULT_VERSIONS["codex"])
    assert parse_preset(" opencode@1.2.3 ") == ("opencode", "1.2.3")
    assert parse_preset("codex exec --full-auto") is None  # a command, not a preset
    with pytest.raises(ValueError, match="expected claude-code@VERSION"):
        parse_preset("claude-code@../../etc")
