"""Warnings that point at what the user wrote, not at the plugin's source line.

``warnings.warn`` names the line that called it: for a warning about the user's input that is a line of this plugin,
which pytest's warnings summary then shows as the warning's place. Here the place is chosen: the ini file's line that
set a value, the command line, or the file the warning is about.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from _pytest.config import apply_warning_filters

COMMAND_LINE = "<command line>"  # the place of a value typed on the command line, as Python names "<stdin>"


def ini_line(config: pytest.Config, name: str) -> int:
    """The line of the ini file that sets ``name`` (0 when it cannot be told)."""
    if config.inipath is None:
        return 0
    try:
        text = config.inipath.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.split("=", 1)[0].strip() == name:
            return number
    return 0


def option_place(config: pytest.Config, dest: str, ini: str) -> tuple[str, int]:
    """Where an option's value came from: the command line (or ``PYTEST_ADDOPTS``), else the ini file's line."""
    if config.getoption(dest, None) is not None or config.inipath is None:
        return COMMAND_LINE, 0
    return str(config.inipath), ini_line(config, ini)


def warn_at(config: pytest.Config, warning: Warning, place: str | os.PathLike[str], lineno: int = 0) -> None:
    """``config.issue_config_time_warning``, at ``place``: the same filters (``-W``, ``filterwarnings``), the same
    report (pytest's warnings summary, under "config")."""
    if config.pluginmanager.is_blocked("warnings"):
        return
    filename = str(place)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always", type(warning))
        apply_warning_filters(config.getini("filterwarnings"), config.known_args_namespace.pythonwarnings or [])
        warnings.warn_explicit(warning, type(warning), filename, lineno, module=Path(filename).name)
    if records:
        config.hook.pytest_warning_recorded.call_historic(kwargs={
            "warning_message": records[0], "when": "config", "nodeid": "", "location": (filename, lineno, "")})


class ProgramBenchWarning(pytest.PytestWarning):
    """Something about the run the user should see, that does not stop it."""
