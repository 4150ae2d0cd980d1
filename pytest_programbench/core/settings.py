"""Every option's parsed value and its default, as plain data (``Settings``): safe to ship to xdist workers and to read
from any floor. The options that fill it, with their parsers, are the pytest layer's (``pytest_layer/options.py``).
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

# --pb-score: which score decides the verdict.
SCORE_BASES = ("official", "corrected")
# --pb-progress: the live view's modes.
PROGRESS_MODES = ("auto", "live", "lines", "off")


def cores() -> int:
    return os.cpu_count() or 1


def total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


@dataclass(frozen=True)
class Settings:
    """Parsed, validated values of every option, and their defaults. Plain data: safe to ship to xdist workers."""

    languages: tuple[str, ...] = ()
    difficulties: tuple[str, ...] = ()
    filter: str = ""
    slice: str = ""
    shuffle: int | None = None
    tasks_dirs: tuple[str, ...] = ()
    include_fixtures: bool = False
    agent: str | None = None
    agent_env: tuple[str, ...] = ()
    agent_mounts: tuple[str, ...] = ()
    agent_setup: str | None = None
    agent_on_host: bool = False
    agent_timeout: int = 21600
    agent_final_grace: float = 300.0  # seconds of silence after a final answer before the agent is ended (0: never)
    prompt_template: str | None = None
    model: str | None = None
    model_endpoint: str | None = None
    model_key_env: str | None = None
    model_retry_budget: float = 600.0
    model_failures_scored: bool = False
    model_allow_server_tools: bool = False
    model_concurrency: int | None = None
    model_rpm: int | None = None
    model_tpm: int | None = None
    agent_replay: str | None = None
    budget: float | None = None
    submissions: str | None = None
    require_all: bool = False
    sandbox_cpus: float = field(default_factory=lambda: float(min(20, cores())))
    sandbox_memory: int = field(default_factory=lambda: min(60 << 30, int(total_memory() * 0.8)))
    image_tag: str = "task_cleanroom_v6"
    pull: str = "missing"
    cpus: int = field(default_factory=lambda: min(10, cores()))
    memory: int | None = None
    branch_workers: int = 1
    branch_retries: int = 1
    compile_timeout: int = 900
    test_timeout: int = 3600
    min_score: float = 1.0
    score_basis: str = "official"
    audit_hidden_tests: bool = True
    strict: bool = False
    allow_flags: bool = False
    output: str | None = None
    resume: str | None = None
    infra_retries: int = 1
    blob_dir: str | None = None
    min_mean: float | None = None
    junit_tests: bool = False
    docker_concurrency: int | None = None
    runtime: str | None = None  # --pb-runtime: every container's Docker runtime (None: the engine's default)
    docker_hosts: tuple[str, ...] = ()
    prune_images: bool = False
    keep_going: bool = False
    preflight: bool = False
    progress: str = "auto"
    progress_interval: float | None = None
    token_price: tuple[float, float] | None = None
    compare: tuple[str, ...] = ()
    report: str | None = None
    max_regression: float | None = None
    package: bool = False
    registry_ignore: str | None = None
    durations: str | None = None
    attempts: int = 1
    gold: int = 0
    gold_ledger: str | None = None
    ignore_flaky: bool = False

    @property
    def agent_clock_cap(self) -> float:
        """The most the agent's clock is given back for model requests the relay held (relay/held.py): the longer of
        the clock itself and the retry budget, so one request held for its whole budget never costs the agent its
        window, and a window otherwise at most doubles. 0 without a model endpoint."""
        if not self.agent or not self.model_endpoint:
            return 0.0
        return float(max(self.agent_timeout, self.model_retry_budget))


def default(name: str) -> Any:
    """A setting's default, as an unset option gives it: the one place it is written (``Settings``)."""
    spec = next(f for f in fields(Settings) if f.name == name)
    return spec.default_factory() if spec.default_factory is not MISSING else spec.default
