"""Leaderboard stats of a packaged pytest-programbench run, recomputable from the run's own files.

Shipped into the submission as ``_scripts/pb_stats.py`` (the official README asks that every extra stat come from
a script reading the run, not be entered by hand). Standard library only:

    python _scripts/pb_stats.py RUN_DIR

For each task in ``_stats/score.json`` (the tasks the official ``package`` scored):

- ``_stats/calls.json``: model calls the relay answered (``pb-meta.json``'s ``relay.turns``), tasks run with a
  ``--pb-model-endpoint`` relay only;
- ``_stats/cost.json``: USD as ``summary.json`` has it (the agent's own account from a mini-swe-agent trajectory,
  else the relay's input and output tokens at ``--pb-token-price``), tasks with a known cost only;
- ``_stats/tokens.json``: output tokens the relay metered (``pb-meta.json``'s ``relay.output_tokens``), the registry's
  tokens column, tasks whose model calls reported usage only: a task without a relay, or whose answers carried no
  usage, is not metered and is left out (``unmetered`` names them).

A stat no task has is not written (an evaluate-only run has neither).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def calls(run_dir: Path, iid: str) -> int | None:
    meta = _read(run_dir / iid / "pb-meta.json")
    relay = meta.get("relay") if isinstance(meta, dict) else None
    turns = relay.get("turns") if isinstance(relay, dict) else None
    return turns if isinstance(turns, int) else None


def output_tokens(run_dir: Path, iid: str) -> int | None:
    """The output tokens the relay metered for the task; ``None`` when none were (no relay, no usage reported)."""
    meta = _read(run_dir / iid / "pb-meta.json")
    relay = meta.get("relay") if isinstance(meta, dict) else None
    if not isinstance(relay, dict) or not relay.get("requests_with_usage"):
        return None
    tokens = relay.get("output_tokens")
    return tokens if isinstance(tokens, int) else None


def unmetered(run_dir: Path) -> list[str]:
    """The packaged tasks whose output tokens were not metered (not in ``_stats/tokens.json``)."""
    scored = _read(run_dir / "_stats" / "score.json")
    return [iid for iid in sorted(scored) if output_tokens(run_dir, iid) is None] if isinstance(scored, dict) else []


def cost(summary: Any, iid: str) -> float | None:
    row = (summary.get("tasks") or {}).get(iid) if isinstance(summary, dict) else None
    value = row.get("cost_usd") if isinstance(row, dict) else None
    return float(value) if isinstance(value, int | float) else None


def write_stats(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Write ``_stats/calls.json``, ``_stats/cost.json`` and ``_stats/tokens.json`` for the packaged tasks; returns
    what was written."""
    scored = _read(run_dir / "_stats" / "score.json")
    if not isinstance(scored, dict):
        raise SystemExit(f"{run_dir / '_stats' / 'score.json'} is missing: run `programbench submit package` first")
    summary = _read(run_dir / "summary.json")
    stats: dict[str, dict[str, Any]] = {
        "calls": {iid: n for iid in sorted(scored) if (n := calls(run_dir, iid)) is not None},
        "cost": {iid: usd for iid in sorted(scored) if (usd := cost(summary, iid)) is not None},
        "tokens": {iid: n for iid in sorted(scored) if (n := output_tokens(run_dir, iid)) is not None},
    }
    written = {}
    for name, values in stats.items():
        path = run_dir / "_stats" / f"{name}.json"
        if values:
            path.write_text(json.dumps(values, indent=2, sort_keys=True))
            written[name] = values
        else:
            path.unlink(missing_ok=True)  # a stat no task has: absent, never a map of nothing
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python pb_stats.py RUN_DIR")
    run = Path(sys.argv[1])
    for stat, by_task in write_stats(run).items():
        print(f"_stats/{stat}.json: {len(by_task)} tasks")
    missing = unmetered(run)
    if missing:
        print(f"output tokens not metered (not in _stats/tokens.json): {', '.join(missing)}")
