"""Markers every ProgramBench item carries, so ``-m "lang_go and difficulty_easy"`` works under --strict-markers."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest

from pytest_programbench.tasks.catalogue import CORE_LANGUAGES, DIFFICULTIES

SUITE = "programbench"


def language_marker(language: str) -> str:
    return "lang_" + re.sub(r"\W", "_", language)


def difficulty_marker(difficulty: str) -> str:
    return "difficulty_" + difficulty


def register_static(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SUITE}: a ProgramBench task (pytest-programbench)")
    register_languages(config, CORE_LANGUAGES)
    for level in DIFFICULTIES:
        config.addinivalue_line("markers", f"{difficulty_marker(level)}: ProgramBench tasks of difficulty {level}")


def register_languages(config: pytest.Config, languages: Iterable[str]) -> None:
    known = set(config.getini("markers"))
    for language in languages:
        line = f"{language_marker(language)}: ProgramBench tasks in {language}"
        if line not in known:
            config.addinivalue_line("markers", line)
