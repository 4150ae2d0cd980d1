"""The leaderboard registry (ProgramBench/submissions) as a run sees it: the provider an entry names, and the number the
leaderboard will compute from the run's packaged per-test map.

The registry accepts an entry (``scripts/validate_entries.py``) whose ``submission.yaml`` sets ``system.model`` and
``system.provider`` (neither empty nor ``TODO``; a ``headline`` is no longer required since 2026-06-18), beside a
``pointer.yaml`` and a non-empty ``_stats/score.json``; an optional ``_stats/tokens.json`` fills its tokens column.
Its ``scripts/compile_leaderboard.py`` recomputes every entry's numbers from that per-test ``score.json`` with the
registry's ``ignored_tests.json`` (``{instance_id: [test]}``) struck, over a fixed 200 tasks, resolved at 1.0 and
near-resolved at 0.95, as percentages to one decimal: :func:`leaderboard` does the same on a run.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from programbench.submission import benchmark_instances, test_results_map

from pytest_programbench.core.run_identity import RUN_MARKER
from pytest_programbench.results import foreign_files

# compile_leaderboard.py's constants: the benchmark's size is the denominator whatever an entry attempted.
LEADERBOARD_TOTAL = 200
RESOLVED, NEAR_RESOLVED = 1.0, 0.95
# What counts as a submitted solution for programbench's package_run (any form resolve_submission_tar reads).
SOLUTION_FILES = ("submission.tar.gz", "submission.tar.gz.url", "submission.ref.yaml")

# The model APIs the relay meters, and the other common ones, by host.
PROVIDER_HOSTS = {
    "api.openai.com": "openai",
    "api.anthropic.com": "anthropic",
    "openrouter.ai": "openrouter",
    "generativelanguage.googleapis.com": "google",
    "api.mistral.ai": "mistral",
    "api.deepseek.com": "deepseek",
    "api.x.ai": "xai",
    "api.groq.com": "groq",
    "api.together.xyz": "together",
    "api.fireworks.ai": "fireworks",
}
# Agent presets that speak to one provider's API by default.
PRESET_PROVIDERS = {"codex": "openai", "claude-code": "anthropic"}
# The names compile_leaderboard.py shows a provider's logo for (its PROVIDER_LOGOS keys, case and all), by what we infer
# (a lower-case host name or litellm-style model prefix): written as the registry spells them.
REGISTRY_PROVIDER_NAMES = {"openai": "OpenAI", "anthropic": "Anthropic", "google": "Google", "gemini": "Google",
                           "vertex_ai": "Google"}


@dataclass(frozen=True)
class Provider:
    """``system.provider`` as inferred, and from what (None: nothing to infer it from)."""

    name: str | None
    source: str = ""


def submitting_settings(settings: Mapping[str, Any]) -> Mapping[str, Any]:
    """The recorded settings of the run that made the submissions: this run's, or for an evaluate-only run those of
    the run its ``--pb-submissions`` directory is (when it is a pytest-programbench run with an agent)."""
    if settings.get("agent") or not settings.get("submissions"):
        return settings
    try:
        source = json.loads((Path(str(settings["submissions"])) / RUN_MARKER).read_text()).get("settings")
    except (OSError, ValueError, AttributeError):
        return settings
    return source if isinstance(source, dict) and source.get("agent") else settings


def _host_provider(endpoint: str) -> tuple[str | None, str]:
    host = (urlparse(endpoint).hostname or "").lower().rstrip(".")
    if not host or host == "localhost" or host.endswith(".localhost"):
        return None, host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return None, host  # an address names no provider (a local server, a proxy)
    if host in PROVIDER_HOSTS:
        return PROVIDER_HOSTS[host], host
    labels = host.split(".")
    return (labels[-2] if len(labels) >= 2 else None), host  # llm.example.com -> example


def infer_provider(settings: Mapping[str, Any]) -> Provider:
    """From the model's ``provider/model`` prefix, else the model endpoint's host, else the agent preset."""
    prefix, slash, _name = str(settings.get("model") or "").partition("/")
    if slash and prefix:
        return _named(prefix, f"the model's prefix {prefix!r}")
    endpoint = str(settings.get("model_endpoint") or "")
    if endpoint:
        name, host = _host_provider(endpoint)
        if name:
            return _named(name, f"the model endpoint's host {host}")
    agent = str(settings.get("agent") or "")
    preset = agent.partition("@")[0].strip()
    if preset in PRESET_PROVIDERS:
        return _named(PRESET_PROVIDERS[preset], f"the agent preset {preset}")
    return Provider(None)


def _named(inferred: str, source: str) -> Provider:
    """The provider as the registry spells it where it has a logo for it ("OpenAI"), else as inferred."""
    return Provider(REGISTRY_PROVIDER_NAMES.get(inferred.lower(), inferred), source)


# ---------------------------------------------------------------------------------------------- the leaderboard


def read_ignore_map(path: Path) -> dict[str, list[str]]:
    """The registry's ``ignored_tests.json`` (checked as ``--pb-registry-ignore`` parses it), read as a foreign file
    (capped; a ForeignFileError naming it)."""
    data = foreign_files.read_json(path, root=path.resolve().parent)  # named by the user: capped, not confined
    if not isinstance(data, dict) or not all(isinstance(tests, list) for tests in data.values()):
        raise foreign_files.ForeignFileError(path, "is not the registry's ignore map {instance_id: [test]}")
    return {str(iid): [str(t) for t in tests] for iid, tests in data.items()}


def instance_score(tests: Mapping[str, bool], ignore: set[str]) -> float:
    """compile_leaderboard.py's ``_instance_score``: passed over the tests not struck (0.0 if none remain)."""
    kept = [passed for name, passed in tests.items() if name not in ignore]
    return sum(kept) / len(kept) if kept else 0.0


def packaged_maps(run_dir: Path, instances: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, bool]]:
    """What ``_stats/score.json`` holds for the run: programbench's per-test map of every benchmark task the official
    ``package_run`` packages (an ``<id>.eval.json`` and a submission), by the official ``test_results_map``."""
    maps: dict[str, dict[str, bool]] = {}
    for iid in sorted(instances):
        task_dir = run_dir / iid
        eval_json = task_dir / f"{iid}.eval.json"
        if eval_json.is_file() and any((task_dir / name).exists() for name in SOLUTION_FILES):
            maps[iid] = test_results_map(eval_json, dict(instances[iid]))
    return maps


@dataclass(frozen=True)
class Leaderboard:
    """The leaderboard's numbers for a run: percentages over :data:`LEADERBOARD_TOTAL` tasks, one decimal."""

    mean_score: float
    resolved: float
    near_resolved: float
    tasks: int  # packaged tasks (the rest of the 200 count 0)
    struck: int  # tests of those tasks the ignore map strikes
    total: int
    ignore_file: str
    scores: dict[str, float]  # per task, the ignore map applied (the website's details/<id>/score.json)

    def line(self, ours: Mapping[str, Any]) -> str:
        """The leaderboard's number beside ours (the headline's, by its ``--pb-score``)."""
        basis = (ours.get("scores") or {}).get("basis", "official")
        mean = ours.get("mean_over_selection")
        mine = "-" if mean is None else f"{100 * mean:.1f}%"
        return (f"leaderboard number (the registry's recomputation: {self.tasks} packaged task(s) over {self.total}, "
                f"{self.struck} test(s) struck by {Path(self.ignore_file).name}): mean {self.mean_score}%, resolved "
                f"{self.resolved}%, near-resolved {self.near_resolved}%; ours ({basis} score, over the "
                f"{ours.get('selected')} selected): mean {mine}, resolved {ours.get('resolved')}, near-resolved "
                f"{ours.get('near_resolved')}")

    def as_dict(self, ours: Mapping[str, Any]) -> dict[str, Any]:
        return {**asdict(self), "line": self.line(ours)}


def compute(maps: Mapping[str, Mapping[str, bool]], ignore: Mapping[str, list[str]], *, ignore_file: str = "",
            total: int = LEADERBOARD_TOTAL) -> Leaderboard:
    """compile_leaderboard.py's row for per-test maps ``maps`` with ``ignore`` struck."""
    scores = {iid: instance_score(tests, set(ignore.get(iid, []))) for iid, tests in maps.items()}
    struck = sum(1 for iid, tests in maps.items() for name in tests if name in set(ignore.get(iid, [])))
    return Leaderboard(
        mean_score=round(100 * sum(scores.values()) / total, 1),
        resolved=round(100 * sum(s >= RESOLVED for s in scores.values()) / total, 1),
        near_resolved=round(100 * sum(s >= NEAR_RESOLVED for s in scores.values()) / total, 1),
        tasks=len(scores), struck=struck, total=total, ignore_file=ignore_file, scores=scores)


def leaderboard(run_dir: Path, ignore_file: Path) -> Leaderboard:
    """The number the leaderboard will show for ``run_dir`` packaged, with ``ignore_file`` struck."""
    return compute(packaged_maps(run_dir, benchmark_instances()), read_ignore_map(ignore_file),
                   ignore_file=str(ignore_file))
