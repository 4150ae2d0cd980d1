"""Every environment variable the harness reads, declared once (as ``pytest_layer.options.OPTIONS`` is for options):
its name, its default as the docs show it and what it tunes; the docs site's table (docs/options.md) is generated from
``OURS`` (``pytest_layer/reference_tables.py``).

A value that does not parse never stops a run: it is logged and the default is used. Each reader takes the
environment to read (default: this process's), so a caller that has one in hand (a test, a worker's copy) passes it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pytest_programbench.text.sizes import parse_size

log = logging.getLogger(__name__)

Environ = Mapping[str, str]


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``default`` is its value when unset or empty ("" when it has none)."""

    name: str
    default: str
    meaning: str

    def raw(self, environ: Environ | None = None) -> str:
        """The value as set, stripped ("" when unset)."""
        return (os.environ if environ is None else environ).get(self.name, "").strip()

    def is_set(self, environ: Environ | None = None) -> bool:
        return bool(self.raw(environ))

    def enabled(self, environ: Environ | None = None) -> bool:
        """A switch that is on unless set to ``0`` (the switches that restore the official behaviour)."""
        return self.raw(environ) != "0"

    def true(self, environ: Environ | None = None) -> bool:
        """A boolean as its owner reads it (``1``, ``true``, ``yes``, ``on``)."""
        return self.raw(environ).lower() in {"1", "true", "yes", "on"}

    def number(self, environ: Environ | None = None, *, minimum: float | None = None) -> float:
        """A number of seconds (or a count), the default when unset or not a number; clamped to ``minimum``."""
        raw = self.raw(environ)
        try:
            value = float(raw) if raw else float(self.default)
        except ValueError:
            log.warning("%s=%r is not a number; using %s", self.name, raw, self.default)
            value = float(self.default)
        return value if minimum is None else max(minimum, value)

    def integer(self, environ: Environ | None = None) -> int:
        raw = self.raw(environ)
        try:
            return int(raw) if raw else int(self.default)
        except ValueError:
            log.warning("%s=%r is not an integer; using %s", self.name, raw, self.default)
            return int(self.default)

    def size(self, environ: Environ | None = None, *, otherwise: int | None = None) -> int:
        """A size as people write them (``10g``, ``512m``, bytes); 0 where the meaning says so disables a check.
        ``otherwise`` stands in for the default where it is computed (the variable's own default is then "")."""
        raw = self.raw(environ)
        fallback = otherwise if otherwise is not None else parse_size(self.default)
        if not raw:
            return fallback
        try:
            return parse_size(raw)
        except ValueError:
            log.warning("%s=%r is not a size; using %s", self.name, raw, self.default or fallback)
            return fallback


# -- the engine ------------------------------------------------------------------------------------------------------
DOCKER_API_TIMEOUT = Variable(
    "PB_DOCKER_API_TIMEOUT", "300", "socket timeout (s) of request/response calls to the engine; never ends a "
    "command's window (agent, set-up, compile, hidden tests run until they exit or their own clock fires)")
DOCKER_PING_TIMEOUT = Variable("PB_DOCKER_PING_TIMEOUT", "10", "first contact with the engine (s)")
DOCKER_RETRY_SECONDS = Variable("PB_DOCKER_RETRY_SECONDS", "60", "how long one engine outage is waited out by retries")
SLOW_ENGINE_CALL = Variable("PB_SLOW_ENGINE_CALL", "30", "an engine call taking longer (s) is logged as slow")
RUN_LIFETIME = Variable("PB_RUN_LIFETIME", "604800", "lifetime of images and of containers whose lifetime is not "
                        "in their command")
ENGINE_PROBE_AFTER = Variable("PB_ENGINE_PROBE_AFTER", "120", "seconds an engine marked down (`--pb-docker-host`) is "
                              "avoided before it is pinged again")
REAP_UNLABELLED_AFTER = Variable("PB_REAP_UNLABELLED_AFTER", "86400", "age (s) after which a container of ours whose "
                                 "run id no marker names is reaped")
DOCKER_CONCURRENCY = Variable("PB_DOCKER_CONCURRENCY", "4", "heavy engine operations in flight at once (set by the "
                              "controller from `--pb-docker-concurrency` for its workers)")
DOCKER_SLOTS_DIR = Variable("PB_DOCKER_SLOTS_DIR", "", "the run's slot directory of that cap (set by the controller "
                            "for its workers)")
# -- disk and storage ------------------------------------------------------------------------------------------------
SANDBOX_STORAGE = Variable("PB_SANDBOX_STORAGE", "10g", "size limit of a sandbox's writable layer where the engine's "
                           "storage driver supports one (the header says; `0`: none; docs/security.md)")
EVAL_STORAGE = Variable("PB_EVAL_STORAGE", "30g", "the same for each evaluation container (compile and hidden tests; "
                        "the committed image's layer is the compile container's); `0`: none")
DISK_IMAGE_NEED = Variable("PB_DISK_IMAGE_NEED", "10g", "free space the engine's data root needs before an image is "
                           "pulled or built (`0`: no check)")
DISK_RUN_NEED = Variable("PB_DISK_RUN_NEED", "4g", "free space the engine's data root needs before a task (`0`: no "
                         "check)")
DISK_RUN_DIR_NEED = Variable("PB_DISK_RUN_DIR_NEED", "", "free space the run directory needs before a task (default: "
                             "what one task can write: submission + `agent.log` + call-log + `model-requests.jsonl` + "
                             "`model-replay.jsonl` caps + 64 MiB)")
# -- caps of what an agent controls ----------------------------------------------------------------------------------
AGENT_LOG_MAX = Variable("PB_AGENT_LOG_MAX", "64m", "cap of `agent.log`: its first half as it comes, its last half at "
                         "the end, one line saying how much was dropped")
MODEL_REQUESTS_MAX = Variable("PB_MODEL_REQUESTS_MAX", "32m", "cap of `model-requests.jsonl` (records of 4 KiB at "
                              "most): its first half as it comes, its last half at the end, one line saying how many "
                              "records were dropped (every request still counted in `pb-meta.json`)")
MODEL_REPLAY_MAX = Variable("PB_MODEL_REPLAY_MAX", "64m", "cap of `model-replay.jsonl` (the conversation "
                            "`--pb-agent-replay` answers from): its head, then one line saying how many exchanges were "
                            "left out")
RELAY_REQUEST_MAX = Variable("PB_RELAY_REQUEST_MAX", "64m", "the relay's largest request body (more: 413)")
RELAY_INFLIGHT_MAX = Variable("PB_RELAY_INFLIGHT_MAX", "256m", "the request bodies the relay holds at once per task")
RELAY_BUDGET_WAIT = Variable("PB_RELAY_BUDGET_WAIT", "30", "seconds a request that does not fit waits, then gets a "
                             "503 (docs/security.md)")
# -- agents ----------------------------------------------------------------------------------------------------------
AGENT_CACHE = Variable("PB_AGENT_CACHE", "", "where the CLI agent presets are installed, once per machine (default: "
                       "`agents/` in the plugin's cache)")
NPM = Variable("PB_NPM", "", "the npm command that installs them (default: `npm` on PATH)")
MINI_SWE_AGENT_CONFIG = Variable("PB_MINI_SWE_AGENT_CONFIG", "", "a YAML file merged over mini-swe-agent's "
                                 "ProgramBench configuration")
# -- the proxy client ------------------------------------------------------------------------------------------------
PROXY_CLIENT = Variable("PB_PROXY_CLIENT", "", "`python` forces the Python client at `/workspace/binary`; `static-c` "
                        "forbids that fallback")
PROXY_CACHE = Variable("PB_PROXY_CACHE", "", "where the static client is built once per machine (default: `proxy/` "
                       "in the plugin's cache)")
PROXY_BUILDER_IMAGE = Variable("PB_PROXY_BUILDER_IMAGE", "", "an image with a C compiler to build the static client "
                               "in when the host has none")
# -- the plugin's cache and the evaluation's shortcuts ---------------------------------------------------------------
CACHE = Variable("PYTEST_PROGRAMBENCH_CACHE", "", "the plugin's cache (default: `$XDG_CACHE_HOME/pytest-programbench`,"
                 " else `~/.cache/pytest-programbench`)")
WHEELS = Variable("PYTEST_PROGRAMBENCH_WHEELS", "", "a directory of the pytest-rerunfailures wheels the install step "
                  "uses (default: downloaded once into the cache)")
PIP_REPLAY = Variable("PYTEST_PROGRAMBENCH_PIP_REPLAY", "1", "`0`: pip runs in every evaluation (no replay of a "
                      "recorded install)")
STEP_BATCH = Variable("PYTEST_PROGRAMBENCH_STEP_BATCH", "1", "`0`: one `docker exec` per official step (no batching)")
PREFETCH = Variable("PYTEST_PROGRAMBENCH_PREFETCH", "1", "`0`: no branch container made ready ahead")
QUICK_ACKS = Variable("PYTEST_PROGRAMBENCH_QUICK_ACKS", "1", "`0`: evaluation containers keep the engine kernel's "
                      "delayed-ACK threshold (no `net.ipv4.tcp_pingpong_thresh`)")
AUDIT_EARLY = Variable("PYTEST_PROGRAMBENCH_AUDIT_EARLY", "1",
                       "`0`: the audit runs its branches after the official's, none beside them")
# -- others' variables, read as their owners define them -------------------------------------------------------------
XDG_CACHE_HOME = Variable("XDG_CACHE_HOME", "", "the base of the plugin's cache")
BLOB_DIR = Variable("PROGRAMBENCH_BLOB_DIR", "", "hidden test archives in programbench's layout (as `--pb-blob-dir`)")
HF_HUB_OFFLINE = Variable("HF_HUB_OFFLINE", "", "huggingface_hub's offline switch: no archive is downloaded")
DOCKER_HOST = Variable("DOCKER_HOST", "", "the default engine (`--pb-docker-host default`)")
XDIST_WORKER = Variable("PYTEST_XDIST_WORKER", "", "pytest-xdist's name of this worker")
XDIST_TESTRUNUID = Variable("PYTEST_XDIST_TESTRUNUID", "", "pytest-xdist's id of the session this worker serves")
PYTEST_ADDOPTS = Variable("PYTEST_ADDOPTS", "", "pytest's extra command-line words")
TERM = Variable("TERM", "", "the terminal's kind (`dumb` and `unknown` get no live view)")
CC = Variable("CC", "", "the C compiler that builds the static proxy client on the host (else gcc, cc, clang)")

# Every variable above, in the order declared (the docs' table follows it).
VARIABLES: tuple[Variable, ...] = tuple(v for v in globals().values() if isinstance(v, Variable))
# Ours, in the docs' table; the others' are documented by their owners.
OURS: tuple[Variable, ...] = tuple(v for v in VARIABLES if v.name.startswith(("PB_", "PYTEST_PROGRAMBENCH_")))
