"""Each attempt's transcript, ``<attempt dir>/transcript.html``: the agent's conversation as the relay recorded it,
read from the attempt's ATIF trajectory (results/atif.py: the task's prompt, each model call's text and tool calls
with the results the next call sent back, and the reference's calls at their times), one step after another with
its tokens and the time until the next step.

Everything in it is the agent's (its messages, its tool calls' arguments and output): the trajectory is read as a
foreign file (inside the attempt's directory, capped), each text clipped again for the page, and every value
escaped by the template (control bytes made printable, then markup escaped).
"""

from __future__ import annotations

import json
from datetime import datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.results import foreign_files
from pytest_programbench.results.atif import ATIF_FILE
from pytest_programbench.text.printable import html_text

TRANSCRIPT_FILE = "transcript.html"
TRAJECTORY_MAX = 64 << 20  # bytes of trajectory.atif.json read (atif.py writes at most ~5000 steps of 64 KiB texts)
STEPS_SHOWN = 2000  # steps on the page; the rest counted
TEXT_SHOWN = 8000  # characters of one message, argument list or tool output on the page


def _clip(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, indent=1, ensure_ascii=False, default=str)
    if len(text) <= TEXT_SHOWN:
        return text
    return f"{text[:TEXT_SHOWN]} [... {len(text) - TEXT_SHOWN:,} more characters in {ATIF_FILE}]"


def _when(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _step(raw: dict[str, Any], start: datetime | None, following: datetime | None) -> dict[str, Any]:
    when = _when(raw.get("timestamp"))
    observation = raw.get("observation")
    listed = observation.get("results") if isinstance(observation, dict) else None
    results = {r.get("source_call_id"): r.get("content") for r in listed or [] if isinstance(r, dict)}
    tool_calls = raw.get("tool_calls")
    calls = [{"name": _clip(c.get("function_name") or "?"), "arguments": _clip(c.get("arguments") or {}),
              "output": None if c.get("tool_call_id") not in results else _clip(results[c.get("tool_call_id")])}
             for c in (tool_calls if isinstance(tool_calls, list) else []) if isinstance(c, dict)]
    metrics = raw.get("metrics")
    metrics = metrics if isinstance(metrics, dict) else {}
    return {
        "n": _int(raw.get("step_id")), "source": str(raw.get("source") or "?"),
        "offset": None if when is None or start is None else (when - start).total_seconds(),
        "took": None if when is None or following is None else max(0.0, (following - when).total_seconds()),
        "message": _clip(raw.get("message") or ""), "calls": calls,
        "prompt_tokens": _int(metrics.get("prompt_tokens")),
        "completion_tokens": _int(metrics.get("completion_tokens")),
    }


def transcript_data(attempt_dir: Path) -> dict[str, Any] | None:
    """The page's data from the attempt's trajectory; None when it has none (or one that cannot be read)."""
    try:
        trajectory = foreign_files.read_json(attempt_dir / ATIF_FILE, root=attempt_dir, limit=TRAJECTORY_MAX)
    except foreign_files.ForeignFileError:
        return None
    if not isinstance(trajectory, dict) or not isinstance(trajectory.get("steps"), list):
        return None
    raw = [s for s in trajectory["steps"] if isinstance(s, dict)]
    times = [_when(s.get("timestamp")) for s in raw]
    start = next((t for t in times if t is not None), None)
    steps = []
    for i, step in enumerate(raw[:STEPS_SHOWN]):
        following = next((t for t in times[i + 1:] if t is not None), None)
        steps.append(_step(step, start, following))
    agent = trajectory.get("agent")
    agent = agent if isinstance(agent, dict) else {}
    return {"title": attempt_dir.name, "agent": str(agent.get("name") or "agent"),
            "model": str(agent.get("model_name") or "-"), "steps": steps, "more": max(0, len(raw) - STEPS_SHOWN),
            "prompt_tokens": sum(s["prompt_tokens"] or 0 for s in steps),
            "completion_tokens": sum(s["completion_tokens"] or 0 for s in steps),
            "tool_calls": sum(len(s["calls"]) for s in steps),
            "binary_calls": sum(s["source"] == "system" for s in steps)}


def render(data: dict[str, Any]) -> str:
    template = files("pytest_programbench.results").joinpath("templates", "transcript.html.j2").read_text()
    # finalize: every printed value made printable (control bytes escaped) before autoescape (markup escaped)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             finalize=html_text)
    return env.from_string(template).render(data=data)


def write_transcript(attempt_dir: Path) -> Path | None:
    """``transcript.html`` beside the attempt's trajectory; None when there is no trajectory to show."""
    data = transcript_data(attempt_dir)
    if data is None:
        return None
    path = attempt_dir / TRANSCRIPT_FILE
    atomic_write_text(path, render(data))
    return path
