"""``--pb-package``: the run directory as a leaderboard submission, in place, the official way and then some.

First the official ``programbench.package.package_run`` (what ``programbench submit package RUN_DIR`` runs:
``_stats/score.json``, ``submission.yaml``, README.md, each eval.json split into a light one and
``<id>.eval.log.json``); it packages the benchmark's own tasks only and skips any other (a ``--pb-tasks-dir`` task).
Then what it leaves as TODO, from the run's own records:

- ``submission.yaml``: ``system.agent`` and ``system.model`` (and ``system.provider`` from a ``provider/model``
  name) from the run's recorded settings, where the official file still says TODO (an author's values are kept),
  and a ``harness`` block: pytest-programbench's and programbench's versions, the agent with its version, the
  model, whether the model relay let provider-side tools through (``model_server_tools``: ``allowed`` under
  ``--pb-model-allow-server-tools``, else ``refused``), the run's start and end, the command line
  (``--pb-agent-env`` values masked) and each task's trajectory;
- ``_stats/cost.json`` (USD, as summary.json has it: the agent's own account, else the relay's tokens at
  ``--pb-token-price``) and ``_stats/calls.json`` (model calls the relay answered), ``{instance_id: value}`` for
  the packaged tasks that have one, and ``_stats/tokens.json`` (output tokens the relay metered: the registry's
  tokens column; the tasks not metered are named in the package's summary), computed by ``_scripts/pb_stats.py``
  (shipped, so the numbers can be recomputed from the run, as the official README asks).

The submitter's name and contact stay TODO: no run knows them. ``programbench submit package`` run again keeps the
system fields and drops the ``harness`` block; ``--pb-package`` (``pytest --pb-resume RUN_DIR --pb-package``) writes
it again.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml
from programbench.package import package_run

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.core.presets import parse_preset
from pytest_programbench.core.run_identity import RUN_MARKER
from pytest_programbench.results import pb_stats, registry
from pytest_programbench.results.task_meta import META_FILE

TODO = "TODO"
STATS_SCRIPT = "_scripts/pb_stats.py"
# A task's trajectory, the first present: mini-swe-agent's, a CLI preset's transcript, the agent's log.
TRAJECTORIES = ("{iid}.traj.json", "trajectory.jsonl", "agent.log")


class PackageError(Exception):
    """The run cannot be packaged (said in the session's summary; the run itself is unaffected)."""


@dataclass
class Packaged:
    run_dir: Path
    packaged: list[str]
    skipped: list[str]
    mean_score: float
    resolved_pct: float
    filled: dict[str, Any]
    left_todo: list[str] = field(default_factory=list)
    unmetered: list[str] = field(default_factory=list)  # packaged tasks without metered output tokens

    def lines(self) -> list[str]:
        out = [f"packaged {len(self.packaged)} task(s) in {self.run_dir} with programbench's package_run "
               f"(mean {self.mean_score:.4f} over the benchmark, resolved {self.resolved_pct}%)"]
        if self.skipped:
            out.append(f"not packaged (not ProgramBench benchmark tasks): {', '.join(self.skipped)}")
        out.append("filled: " + ", ".join(f"{k}={v!r}" for k, v in self.filled.items()))
        if self.left_todo:
            out.append("left TODO in submission.yaml (fill in by hand): " + ", ".join(self.left_todo))
        if self.unmetered:
            out.append("output tokens not metered (no model relay, or no usage in its answers), so not in "
                       f"_stats/tokens.json: {', '.join(self.unmetered)}")
        out.append(f"check it: programbench submit verify {self.run_dir}")
        return out


def masked_command(args: Sequence[str]) -> list[str]:
    """The command line as recorded: an ``--pb-agent-env NAME=VALUE``'s value masked (it may be a secret)."""
    out: list[str] = []
    words = list(args)
    for i, word in enumerate(words):
        flag, eq, spec = word.partition("=")
        if flag == "--pb-agent-env" and eq and "=" in spec:
            out.append(f"{flag}={spec.partition('=')[0]}=...")
        elif i > 0 and words[i - 1] == "--pb-agent-env" and "=" in word:
            out.append(flag + "=...")
        else:
            out.append(word)
    return ["pytest", *out]


def agent_with_version(agent: str | None) -> str | None:
    """The agent as the leaderboard should name it: a preset with its version, a command as typed."""
    if not agent:
        return None
    if agent == "mini-swe-agent":
        try:
            return f"mini-swe-agent@{version('mini-swe-agent')}"
        except PackageNotFoundError:
            return agent
    try:
        parsed = parse_preset(agent)
    except ValueError:  # checked when the run started: a record that says otherwise is kept as it is
        return agent
    return f"{parsed[0]}@{parsed[1]}" if parsed is not None else agent


def _iso(timestamp: Any) -> str | None:
    if not isinstance(timestamp, int | float):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


def _trajectories(run_dir: Path, packaged: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for iid in packaged:
        for pattern in TRAJECTORIES:
            name = pattern.format(iid=iid)
            if (run_dir / iid / name).is_file():
                out[iid] = f"{iid}/{name}"
                break
    return out


def _system_of_run(run_dir: Path, settings: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """The agent (with its version), model and provider-side tools rule that made the submissions: this run's, or
    for an evaluate-only run the ones recorded by the run its ``--pb-submissions`` directory is (when it is a
    pytest-programbench run)."""
    if not settings.get("agent") and settings.get("submissions"):
        try:
            source = json.loads((Path(settings["submissions"]) / RUN_MARKER).read_text()).get("settings") or {}
        except (OSError, ValueError, AttributeError):
            source = {}
        if isinstance(source, dict) and source.get("agent"):
            settings = source
    return agent_with_version(settings.get("agent")), settings.get("model"), _server_tools(settings)


def _server_tools(settings: dict[str, Any]) -> str | None:
    """``allowed`` or ``refused``: whether the model relay forwarded provider-side tools (web search, code execution,
    MCP, files...); ``None`` when no recorded agent made the submissions."""
    if not settings.get("agent"):
        return None
    if not settings.get("model_endpoint"):
        return "refused"  # no relay: the agent reached nothing
    # A run recorded before the cleanroom relay has no such setting: its relay forwarded everything.
    return "refused" if settings.get("model_allow_server_tools") is False else "allowed"


OURS_MARK = "\n# Written by pytest-programbench (--pb-package)"


def _without_ours(text: str) -> str:
    """submission.yaml without the block an earlier --pb-package appended (its comment, headline and harness)."""
    for mark in (OURS_MARK, "\nheadline:", "\nharness:"):
        if mark in text:
            return text[:text.index(mark)] + "\n"
    return text


def run_dates(run_dir: Path, record: Mapping[str, Any], summary: Mapping[str, Any],
              packaged: Sequence[str]) -> dict[str, Any]:
    """The run's own command line and dates, whichever session packages it: its first session's start and command,
    its last task result's time (each task's pb-meta.json is written with its result; a reused one is not), and the
    packaging time apart, with every session of the run."""
    history = [h for h in record.get("history") or [] if isinstance(h, dict)]
    first = history[0] if history else {}
    # A run recorded before each session's command was has the latest session's only: its first is not known.
    known = "command" in first or len(history) <= 1
    command = (first.get("command") or record.get("command")) if known else None
    times = [(run_dir / iid / META_FILE).stat().st_mtime for iid in packaged if (run_dir / iid / META_FILE).is_file()]
    return {
        "started": _iso(first.get("started", record.get("started"))),
        "finished": _iso(max(times) if times else summary.get("updated")),
        "packaged": _iso(time.time()),
        "command": command,
        "sessions": [{"started": _iso(h.get("started")), "command": h.get("command")} for h in history],
    }


def fill_manifest(run_dir: Path, packaged: Sequence[str], headline: Mapping[str, Any] | None = None
                  ) -> tuple[dict[str, Any], list[str]]:
    """submission.yaml's TODO system fields from the run's record (edited in place, so the official file's comments
    and an author's values stay), plus a ``harness`` block; returns what was filled and what is left TODO."""
    record = json.loads((run_dir / RUN_MARKER).read_text())
    settings = record.get("settings") or {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    agent, model, server_tools = _system_of_run(run_dir, settings)
    provider = registry.infer_provider(registry.submitting_settings(settings))
    manifest_path = run_dir / "submission.yaml"
    text = _without_ours(manifest_path.read_text())  # ours, from an earlier packaging
    filled: dict[str, Any] = {}
    for key, value in (("agent", agent), ("model", model),
                       ("provider", provider.name)):
        todo = f"\n  {key}: {json.dumps(TODO)}"
        if value and todo in text:
            text = text.replace(todo, f"\n  {key}: {json.dumps(value)}", 1)
            filled[f"system.{key}"] = value
    if "system.provider" in filled:  # said, so an author can check it
        filled["system.provider"] = f"{provider.name} (inferred from {provider.source})"
    harness = {
        "name": "pytest-programbench",
        "version": record.get("plugin_version"),
        "programbench_version": record.get("programbench_version"),
        "agent": agent,
        "model": model,
        "model_endpoint": settings.get("model_endpoint"),
        "model_server_tools": server_tools,  # provider-side tools through the relay: allowed or refused
        "submissions": settings.get("submissions"),  # evaluate-only: where the submissions came from
        "run_id": record.get("run_id"),
        **run_dates(run_dir, record, summary, packaged),
        "provider_source": provider.source or None,  # what system.provider was inferred from
        "trajectories": _trajectories(run_dir, packaged),
        "stats_script": STATS_SCRIPT,
    }
    text += ("# Written by pytest-programbench (--pb-package) from the run's pb-run.json and summary.json; "
             "`programbench submit package`\n# run again drops this block, `pytest --pb-resume RUN_DIR --pb-package` "
             "writes it again.\n")
    # The registry no longer requires a headline (dropped 2026-06-18); writing it stays harmless.
    text += yaml.safe_dump({"headline": dict(headline or {}), "harness": harness}, sort_keys=False, allow_unicode=True)
    atomic_write_text(manifest_path, text)
    filled["harness"] = f"{len(harness['trajectories'])} trajectories"
    manifest = yaml.safe_load(text)
    left = [f"{section}.{key}" for section in ("submitter", "system")
            for key, value in (manifest.get(section) or {}).items() if value == TODO]
    return filled, left


def package(run_dir: Path) -> Packaged:
    """Package ``run_dir`` in place: the official ``package_run``, then the manifest, trajectories and stats."""
    run_dir = run_dir.resolve()
    try:
        official = package_run(run_dir)
    except ValueError as exc:
        raise PackageError(f"programbench's package_run: {exc} (it packages ProgramBench's own benchmark tasks "
                           "only, with an eval.json and a submission.tar.gz)") from None
    filled, left = fill_manifest(run_dir, official.packaged, official.headline.as_dict())
    script = run_dir / STATS_SCRIPT
    script.parent.mkdir(exist_ok=True)
    shutil.copyfile(Path(pb_stats.__file__), script)
    written = pb_stats.write_stats(run_dir)
    filled.update({f"_stats/{name}.json": f"{len(values)} tasks" for name, values in written.items()})
    head = official.headline
    return Packaged(run_dir, official.packaged, official.skipped, head.mean_score, head.resolved_pct, filled,
                    left, pb_stats.unmetered(run_dir))
