"""Every ``--pb-*`` option, declared once: CLI flag, ini key ``pb_<name>``, parsing and validation.

The declarations are data so that the plugin hook stays a loop, the README table can be generated, and the
opt-in rule ("any ``--pb-*`` option given") has one source of truth.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

GROUP = "programbench"


def cores() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Option:
    """One ``--pb-<name>`` flag with its ini twin ``pb_<name>``."""

    name: str
    help: str
    kind: str = "str"  # str | int | float | bool | list
    default: Any = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--pb-" + self.name

    @property
    def dest(self) -> str:
        return "pb_" + self.name.replace("-", "_")

    @property
    def ini(self) -> str:
        return self.dest


OPTIONS: tuple[Option, ...] = (
    # Selection
    Option("language", "Select tasks by language (c, cpp, go, rust, haskell, java; aliases rs, hs). "
           "Repeatable or comma-separated.", "list", metavar="LANG"),
    Option("difficulty", "Select tasks by difficulty (easy, medium, hard, unset). Repeatable or comma-separated.",
           "list", metavar="LEVEL"),
    Option("filter", "Select task ids matching this regex (re.match, like programbench's --filter).",
           metavar="REGEX"),
    Option("slice", "Keep tasks[A:B] after filtering (like programbench's --slice).", metavar="A:B"),
    Option("shuffle", "Shuffle tasks with this seed before filtering and slicing.", "int", metavar="SEED"),
    Option("tasks-dir", "Add tasks from DIR (official layout: <id>/task.yaml, tests.json, optional Dockerfile, "
           "optional tests/<branch>/). Repeatable.", "list", metavar="DIR"),
    Option("include-fixtures", "Include the bundled testorg__* fixture tasks.", "bool", False),
    # Work
    Option("agent", "Agent command run in each task's sandbox (or a preset: reference, replay:DIR, "
           "mini-swe-agent).", metavar="CMD"),
    Option("agent-env", "Pass NAME (from the host environment) or NAME=VALUE to the agent. Repeatable.",
           "list", metavar="NAME[=VALUE]"),
    Option("agent-mount", "Mount HOST_DIR read-only into the sandbox (at DIR, default the same path). Repeatable.",
           "list", metavar="HOST_DIR[:DIR]"),
    Option("agent-setup", "Command run as root in the sandbox before the agent.", metavar="CMD"),
    Option("agent-on-host", "Run the agent command on the host; it drives the sandbox by container id.",
           "bool", False),
    Option("agent-timeout", "Agent wall clock in seconds.", "int", 21600, metavar="SECONDS"),
    Option("prompt-template", "Jinja2 template for the agent prompt.", metavar="FILE"),
    Option("model", "Model name for agent presets such as mini-swe-agent.", metavar="NAME"),
    Option("model-endpoint", "The only address the agent may reach, through a relay.", metavar="URL"),
    Option("model-key-env", "Host environment variable whose value the relay adds as the API key (the sandbox "
           "never sees it).", metavar="NAME"),
    Option("submissions", "Evaluate existing submissions (<id>/submission.tar.gz) instead of running an agent.",
           metavar="DIR"),
    Option("require-all", "With --pb-submissions, selected tasks without a submission fail with score 0.",
           "bool", False),
    # Sandbox
    Option("sandbox-cpus", "CPUs of the agent sandbox (default min(20, cores)).", "float", metavar="N"),
    Option("sandbox-memory", "Memory of the agent sandbox (default min(60g, 80% of RAM)).", metavar="SIZE"),
    # Evaluation
    Option("image-tag", "Tag of the task images.", "str", "task_cleanroom_v6", metavar="TAG"),
    Option("pull", "Pull missing task images (missing) or never.", "str", "missing", metavar="never|missing"),
    Option("cpus", "CPUs per evaluation container (default min(10, cores)); exported as "
           "PYTEST_XDIST_AUTO_NUM_WORKERS.", "int", metavar="N"),
    Option("memory", "Memory limit per evaluation container (default: none).", metavar="SIZE"),
    Option("branch-workers", "Hidden test branches evaluated in parallel per task.", "int", 1, metavar="N"),
    Option("branch-retries", "Retries of a branch whose JUnit shows an xdist worker crash.", "int", 1,
           metavar="N"),
    Option("compile-timeout", "compile.sh wall clock in seconds.", "int", 900, metavar="SECONDS"),
    Option("test-timeout", "Wall clock of one hidden branch run in seconds.", "int", 3600, metavar="SECONDS"),
    Option("min-score", "Score at or above which an item passes.", "float", 1.0, metavar="X"),
    Option("strict", "Neutralise flagged files (conftest.py, pytest config, sitecustomize) before evaluating.",
           "bool", False),
    Option("allow-flags", "Let flagged submissions pass on their score alone.", "bool", False),
    # Run
    Option("output", "Run directory (default pb-runs/<UTC>-<run id>).", metavar="DIR"),
    Option("resume", "Resume RUN_DIR: reuse finished results, re-run missing and errored tasks.",
           metavar="RUN_DIR"),
    Option("infra-retries", "Retries of an item that errored for infrastructure reasons.", "int", 1, metavar="N"),
    Option("docker-host", "A Docker engine to run tasks on, with how many tasks it may run at once (default: its "
           "CPUs / --pb-sandbox-cpus); unix://, tcp:// (TLS from DOCKER_TLS_VERIFY/DOCKER_CERT_PATH), ssh://, or "
           "'default' for DOCKER_HOST's. Repeatable: tasks spread over every engine.", "list",
           metavar="URL[=SLOTS]"),
    Option("docker-concurrency", "Heavy engine operations (create, start, build, pull, commit, remove) in flight "
           "at once across all workers (0: no cap).", "int", metavar="N"),
    Option("prune-images", "Remove a task's image when it is done, if this run built or pulled it.", "bool",
           False),
    Option("junit-tests", "Add every hidden test's status to the task's JUnit properties.", "bool", False),
    Option("blob-dir", "Hidden test archives in the PROGRAMBENCH_BLOB_DIR layout.", metavar="DIR"),
    Option("min-mean", "Fail the session when the mean score over the selection is below X.", "float",
           metavar="X"),
    Option("keep-going", "Run every task even when the agent of the first tasks exited 127/126 (command not found "
           "or not executable); by default the session stops after 3 such tasks.", "bool", False),
    Option("preflight", "Check the selection before spending hours (images, hidden test archives, the agent "
           "command in a sample sandbox, the model endpoint and key, disk space), list the tasks like --co, print "
           "what is missing and exit non-zero if anything is.", "bool", False),
    Option("progress", "Live view of in-flight tasks: auto (in place on a terminal, periodic lines otherwise), "
           "live, lines or off; :SECONDS sets the refresh (live 1, lines 60).", "str", "auto",
           metavar="MODE[:SECONDS]"),
    Option("token-price", "USD per million input and output tokens, for the cost in the summary and report.",
           metavar="IN,OUT"),
)

BY_DEST = {o.dest: o for o in OPTIONS}

# ``--help`` sections, in pytest's style (one option group each); an option named nowhere is listed under "run".
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("selection", ("language", "difficulty", "filter", "slice", "shuffle", "tasks-dir", "include-fixtures")),
    ("agent", ("agent", "agent-env", "agent-mount", "agent-setup", "agent-on-host", "agent-timeout",
               "prompt-template", "submissions", "require-all", "keep-going")),
    ("model", ("model", "model-endpoint", "model-key-env", "token-price")),
    ("sandbox", ("sandbox-cpus", "sandbox-memory")),
    ("evaluation", ("image-tag", "pull", "blob-dir", "cpus", "memory", "branch-workers", "branch-retries",
                    "compile-timeout", "test-timeout", "min-score", "strict", "allow-flags", "junit-tests")),
    ("run", ()),
)


def section_of(opt: Option) -> str:
    return next((name for name, members in SECTIONS if opt.name in members), "run")


def register(parser: pytest.Parser) -> None:
    groups = {name: parser.getgroup(f"{GROUP}-{name}", f"ProgramBench {name} (pytest-programbench)")
              for name, _ in SECTIONS}
    for opt in OPTIONS:
        group = groups[section_of(opt)]
        # argparse %-formats help texts: a bare "%" would crash `pytest --help` in every project.
        cli_help = opt.help.replace("%", "%%")
        if opt.kind == "bool":
            group.addoption(opt.flag, dest=opt.dest, action="store_const", const=True, default=None, help=cli_help)
        elif opt.kind == "list":
            group.addoption(opt.flag, dest=opt.dest, action="append", default=None, metavar=opt.metavar,
                            help=cli_help)
        else:
            group.addoption(opt.flag, dest=opt.dest, default=None, metavar=opt.metavar, help=cli_help)
        ini_type = {"bool": "bool", "list": "args"}.get(opt.kind, "string")
        parser.addini(opt.ini, f"{opt.help} (ini twin of {opt.flag})", type=ini_type,  # type: ignore[arg-type]
                      default=None)
    parser.addini("pb_enable", "Collect the ProgramBench suite when pytest runs from the rootdir with no path.",
                  type="bool", default=False)


def given_on_command_line(config: pytest.Config) -> list[str]:
    """The ``--pb-*`` flags the user typed: any of them opts the session in."""
    return [o.flag for o in OPTIONS if config.getoption(o.dest, None) is not None]


def raw_value(config: pytest.Config, opt: Option) -> Any:
    """CLI value, else ini value, else the declared default (``None`` when unset)."""
    value = config.getoption(opt.dest, None)
    if value is None:
        ini = config.getini(opt.ini)
        if ini not in (None, "", []):
            value = ini
    if value is None:
        return opt.default
    return value


def split_list(values: Any) -> list[str]:
    """Flatten repeatable, comma-separated values (``--pb-language go,rust --pb-language c``)."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for v in values:
        out.extend(p.strip() for p in str(v).split(",") if p.strip())
    return out


def to_int(flag: str, value: Any, *, minimum: int | None = None) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{flag}: {value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise pytest.UsageError(f"{flag}: {number} is below the minimum of {minimum}")
    return number


def to_float(flag: str, value: Any, *, minimum: float | None = None, maximum: float | None = None) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{flag}: {value!r} is not a number") from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise pytest.UsageError(f"{flag}: {number} is out of range (minimum {minimum}, maximum {maximum})")
    return number


def to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)b?$", re.IGNORECASE)


def to_bytes(flag: str, value: Any) -> int:
    """Docker-style sizes: ``512m``, ``60g``, ``1073741824``."""
    match = _SIZE.match(str(value).strip())
    if not match:
        raise pytest.UsageError(f"{flag}: {value!r} is not a size (examples: 512m, 8g, 1073741824)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def existing_dir(flag: str, value: Any) -> Path:
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        raise pytest.UsageError(f"{flag}: {value} is not a directory")
    return path.resolve()


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


@dataclass(frozen=True)
class Settings:
    """Parsed, validated values of every option. Plain data: safe to ship to xdist workers as a dict."""

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
    prompt_template: str | None = None
    model: str | None = None
    model_endpoint: str | None = None
    model_key_env: str | None = None
    submissions: str | None = None
    require_all: bool = False
    sandbox_cpus: float = field(default_factory=lambda: float(min(20, cores())))
    sandbox_memory: int = field(default_factory=lambda: min(60 << 30, int(_total_memory() * 0.8)))
    image_tag: str = "task_cleanroom_v6"
    pull: str = "missing"
    cpus: int = field(default_factory=lambda: min(10, cores()))
    memory: int | None = None
    branch_workers: int = 1
    branch_retries: int = 1
    compile_timeout: int = 900
    test_timeout: int = 3600
    min_score: float = 1.0
    strict: bool = False
    allow_flags: bool = False
    output: str | None = None
    resume: str | None = None
    infra_retries: int = 1
    blob_dir: str | None = None
    min_mean: float | None = None
    junit_tests: bool = False
    docker_concurrency: int | None = None
    docker_hosts: tuple[str, ...] = ()
    prune_images: bool = False
    keep_going: bool = False
    preflight: bool = False
    progress: str = "auto"
    progress_interval: float | None = None
    token_price: tuple[float, float] | None = None


def _parsers() -> dict[str, Callable[[str, Any], Any]]:
    def text(_flag: str, v: Any) -> str:
        return str(v)

    def seq(_flag: str, v: Any) -> tuple[str, ...]:
        return tuple(split_list(v))

    def raw_seq(_flag: str, v: Any) -> tuple[str, ...]:
        # agent env/mounts may legitimately contain commas: repeat the flag instead.
        return tuple(str(x) for x in (v if isinstance(v, list | tuple) else [v]))

    def docker_hosts(flag: str, v: Any) -> tuple[str, ...]:
        from pytest_programbench.engine.engines import EngineSpecError, parse_docker_hosts

        values = raw_seq(flag, v)
        try:
            parse_docker_hosts(values)
        except EngineSpecError as exc:
            raise pytest.UsageError(str(exc)) from exc
        return values

    def pull(flag: str, v: Any) -> str:
        if str(v) not in {"never", "missing"}:
            raise pytest.UsageError(f"{flag}: {v!r} is not one of: never, missing")
        return str(v)

    return {
        "languages": seq, "difficulties": seq, "filter": text, "slice": text,
        "shuffle": to_int,
        "tasks_dirs": lambda f, v: tuple(str(existing_dir(f, d)) for d in split_list(v)),
        "include_fixtures": lambda _f, v: to_bool(v),
        "agent": text, "agent_env": raw_seq, "agent_mounts": raw_seq, "agent_setup": text,
        "agent_on_host": lambda _f, v: to_bool(v),
        "agent_timeout": lambda f, v: to_int(f, v, minimum=1),
        "prompt_template": text, "model": text, "model_endpoint": text, "model_key_env": text,
        "submissions": lambda f, v: str(existing_dir(f, v)),
        "require_all": lambda _f, v: to_bool(v),
        "sandbox_cpus": lambda f, v: to_float(f, v, minimum=0.01),
        "sandbox_memory": to_bytes,
        "image_tag": text, "pull": pull,
        "cpus": lambda f, v: to_int(f, v, minimum=1),
        "memory": to_bytes,
        "branch_workers": lambda f, v: to_int(f, v, minimum=1),
        "branch_retries": lambda f, v: to_int(f, v, minimum=0),
        "compile_timeout": lambda f, v: to_int(f, v, minimum=1),
        "test_timeout": lambda f, v: to_int(f, v, minimum=1),
        "min_score": lambda f, v: to_float(f, v, minimum=0.0, maximum=1.0),
        "strict": lambda _f, v: to_bool(v), "allow_flags": lambda _f, v: to_bool(v),
        "output": text, "resume": lambda f, v: str(existing_dir(f, v)),
        "infra_retries": lambda f, v: to_int(f, v, minimum=0),
        "blob_dir": lambda f, v: str(existing_dir(f, v)),
        "min_mean": lambda f, v: to_float(f, v, minimum=0.0, maximum=1.0),
        "junit_tests": lambda _f, v: to_bool(v),
        "docker_concurrency": lambda f, v: to_int(f, v, minimum=0),
        "docker_hosts": docker_hosts,
        "prune_images": lambda _f, v: to_bool(v),
        "keep_going": lambda _f, v: to_bool(v),
        "preflight": lambda _f, v: to_bool(v),
        "progress": lambda f, v: progress_mode(f, v)[0],
        "progress_interval": lambda f, v: progress_mode(f, v)[1],
        "token_price": token_price,
    }


PROGRESS_MODES = ("auto", "live", "lines", "off")


def progress_mode(flag: str, value: Any) -> tuple[str, float | None]:
    """``MODE[:SECONDS]``: the mode and its refresh interval (``None``: the mode's default)."""
    mode, _, seconds = str(value).strip().lower().partition(":")
    if mode not in PROGRESS_MODES:
        raise pytest.UsageError(f"{flag}: {value!r} is not one of: {', '.join(PROGRESS_MODES)} (optionally "
                                ":SECONDS)")
    return mode, (to_float(flag, seconds, minimum=0.05) if seconds else None)


def token_price(flag: str, value: Any) -> tuple[float, float]:
    parts = [p.strip() for p in str(value).split(",")]
    if len(parts) != 2:
        raise pytest.UsageError(f"{flag}: {value!r} is not IN,OUT (USD per million input and output tokens)")
    return to_float(flag, parts[0], minimum=0.0), to_float(flag, parts[1], minimum=0.0)


# Settings field -> option dest, where the names differ (plural fields for repeatable options).
_FIELD_TO_DEST = {"languages": "pb_language", "difficulties": "pb_difficulty", "tasks_dirs": "pb_tasks_dir",
                  "agent_mounts": "pb_agent_mount", "progress_interval": "pb_progress",
                  "docker_hosts": "pb_docker_host"}


def parse(config: pytest.Config, *, environ: Sequence[tuple[str, str]] | None = None) -> Settings:
    """Read every option from the command line or ini and validate it; bad input is a UsageError."""
    values: dict[str, Any] = {}
    for name, parser in _parsers().items():
        opt = BY_DEST[_FIELD_TO_DEST.get(name, "pb_" + name)]
        raw = raw_value(config, opt)
        if raw is None:
            continue
        values[name] = parser(opt.flag, raw)
    env = dict(environ) if environ is not None else dict(os.environ)
    if "blob_dir" not in values and env.get("PROGRAMBENCH_BLOB_DIR"):
        values["blob_dir"] = str(existing_dir("PROGRAMBENCH_BLOB_DIR", env["PROGRAMBENCH_BLOB_DIR"]))
    return Settings(**values)
