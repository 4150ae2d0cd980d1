"""``index.html`` in a directory of runs (``pb-runs/``, or wherever ``--pb-output`` puts them): one row per run of
ours with its headline numbers and links to its report, its comparisons and, for any two runs a reader picks, the
command that compares them (and the page, when that pair was compared already).

Written at each session's end into the run directory's parent. Every run directory in it may be anyone's: each is
read as a foreign file (its pb-run.json and summary.json, capped), at most :data:`RUNS_LISTED` of them, newest first,
and every value is escaped by the template; links are relative paths to regular files inside the directory.
"""

from __future__ import annotations

import shlex
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.core.run_identity import RUN_MARKER
from pytest_programbench.results import foreign_files
from pytest_programbench.text.printable import html_text

INDEX_FILE = "index.html"
RUNS_LISTED = 200
COMPARISONS_LISTED = 20  # per run


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _started(value: Any) -> str:
    """A run's start as UTC date and time (summary.json keeps seconds since the epoch)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        except (OverflowError, OSError, ValueError):
            return "-"
    return str(value or "-")[:40]


def _run_row(root: Path, run: Path) -> dict[str, Any] | None:
    try:
        record = foreign_files.read_json(run / RUN_MARKER, root=run, limit=foreign_files.RECORD_MAX)
        summary = foreign_files.read_json(run / "summary.json", root=run)
    except foreign_files.ForeignFileError:
        return None
    if not isinstance(record, dict) or not isinstance(summary, dict):
        return None
    head = summary.get("headline")
    head = head if isinstance(head, dict) else {}
    settings = summary.get("settings")
    settings = settings if isinstance(settings, dict) else {}
    comparisons = sorted(p.name for p in run.glob("compare-*.html") if p.is_file())[:COMPARISONS_LISTED]
    return {
        "name": run.name, "started": _started(summary.get("started") or record.get("started")),
        "agent": str(summary.get("agent") or "") or ("submissions" if settings.get("submissions") else "-"),
        "selected": _number(head.get("selected")), "scored": _number(head.get("scored")),
        "mean_over_scored": _number(head.get("mean_over_scored")),
        "mean_over_selection": _number(head.get("mean_over_selection")) if head.get("scored") else None,
        "resolved": _number(head.get("resolved")), "errors": _number(head.get("errors")),
        "report": foreign_files.link(root, f"{run.name}/report.html"),
        "comparisons": [(name, foreign_files.link(root, f"{run.name}/{name}")) for name in comparisons],
        "path": shlex.quote(str(run)),
    }


def index_data(root: Path) -> dict[str, Any]:
    try:
        runs = [d for d in root.iterdir() if d.is_dir() and (d / RUN_MARKER).is_file()]
    except OSError:
        runs = []
    runs.sort(key=lambda d: (d / RUN_MARKER).stat().st_mtime, reverse=True)
    rows = [row for run in runs[:RUNS_LISTED] if (row := _run_row(root, run)) is not None]
    return {"root": str(root), "rows": rows, "more": max(0, len(runs) - RUNS_LISTED)}


def write_index(root: Path) -> Path:
    template = files("pytest_programbench.results").joinpath("templates", "index.html.j2").read_text()
    # finalize: every printed value made printable (control bytes escaped) before autoescape (markup escaped)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             finalize=html_text)
    path = root / INDEX_FILE
    atomic_write_text(path, env.from_string(template).render(data=index_data(root)))
    return path
