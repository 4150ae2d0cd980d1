"""Every ``--pb-*`` option, declared once: CLI flag, ini key ``pb_<name>``, parsing and validation.

The declarations are data so that the plugin hook stays a loop, the docs site's table is generated from them
(``reference_tables.py``), and the opt-in rule ("any ``--pb-*`` option given") has one source of truth.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench.core import environment
from pytest_programbench.core.settings import PROGRESS_MODES, SCORE_BASES, Settings
from pytest_programbench.results import foreign_files
from pytest_programbench.text.sizes import parse_size

GROUP = "programbench"


@dataclass(frozen=True)
class Option:
    """One ``--pb-<name>`` flag with its ini twin ``pb_<name>``: its ``--help`` section, parser and Settings field."""

    name: str
    help: str
    section: str  # one of SECTIONS
    kind: str = "str"  # str | int | float | bool | list: the argparse action, the ini type and the default parser
    metavar: str | None = None
    parser: Callable[[str, Any], Any] | None = None  # (flag, raw value) -> value; None: the kind's
    field_names: tuple[str, ...] = ()  # Settings fields set; None: the name's; several: the parser returns a tuple
    # The docs site's options table (pytest_layer/reference_tables.py): the default as a reader should see it, where
    # Settings' value does not say it (one computed from the machine, or None standing for a behaviour); and Markdown
    # after the help, for what only the docs can give (links into the site).
    default_text: str = ""
    docs: str = ""

    @property
    def flag(self) -> str:
        return "--pb-" + self.name

    @property
    def dest(self) -> str:
        return "pb_" + self.name.replace("-", "_")

    @property
    def ini(self) -> str:
        return self.dest

    @property
    def settings_fields(self) -> tuple[str, ...]:
        return self.field_names or (self.name.replace("-", "_"),)

    def parse(self, raw: Any) -> dict[str, Any]:
        """The Settings fields this option sets from a raw CLI/ini value; bad input is a UsageError."""
        value = (self.parser or _KIND_PARSERS[self.kind])(self.flag, raw)
        names = self.settings_fields
        return dict(zip(names, value if len(names) > 1 else (value,), strict=True))


# ``--help`` sections, in pytest's style (one option group each), in this order.
SECTIONS = ("selection", "agent", "model", "sandbox", "evaluation", "run")


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


def to_bytes(flag: str, value: Any) -> int:
    """Sizes as ``text.sizes`` reads them (``512m``, ``60g``, ``1073741824``): one grammar for options and variables."""
    try:
        return parse_size(str(value))
    except ValueError:
        raise pytest.UsageError(f"{flag}: {value!r} is not a size (examples: 512m, 8g, 1073741824)") from None


def existing_dir(flag: str, value: Any) -> Path:
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        raise pytest.UsageError(f"{flag}: {value} is not a directory")
    return path.resolve()


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


def _text(_flag: str, value: Any) -> str:
    return str(value)


def _seq(_flag: str, value: Any) -> tuple[str, ...]:
    return tuple(split_list(value))


def _raw_seq(_flag: str, value: Any) -> tuple[str, ...]:
    # agent env/mounts may legitimately contain commas: repeat the flag instead.
    return tuple(str(x) for x in (value if isinstance(value, list | tuple) else [value]))


def _bool(_flag: str, value: Any) -> bool:
    return to_bool(value)


def _int(minimum: int) -> Callable[[str, Any], int]:
    return lambda flag, value: to_int(flag, value, minimum=minimum)


def _float(minimum: float, maximum: float | None = None) -> Callable[[str, Any], float]:
    return lambda flag, value: to_float(flag, value, minimum=minimum, maximum=maximum)


def _dir(flag: str, value: Any) -> str:
    return str(existing_dir(flag, value))


def _file(flag: str, value: Any) -> str:
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise pytest.UsageError(f"{flag}: {value} is not a file")
    return str(path.resolve())


def _score_basis(flag: str, value: Any) -> str:
    if str(value) not in SCORE_BASES:
        raise pytest.UsageError(f"{flag}: {value!r} is not one of: {', '.join(SCORE_BASES)}")
    return str(value)


def _on_off(flag: str, value: Any) -> bool:
    if str(value) not in ("on", "off"):
        raise pytest.UsageError(f"{flag}: {value!r} is not one of: on, off")
    return str(value) == "on"


def registry_ignore_map(flag: str, value: Any) -> str:
    """``--pb-registry-ignore FILE``: the leaderboard registry's ``ignored_tests.json``, ``{instance_id: [test]}``
    (each test ``<branch>/<name>``, as ``_stats/score.json`` keys them), checked here; its path is kept."""
    path = _file(flag, value)
    try:  # capped before reading, as every file of a foreign run (a registry's file is one)
        data = foreign_files.read_json(Path(path), root=Path(path).resolve().parent)
    except foreign_files.ForeignFileError as exc:
        raise pytest.UsageError(f"{flag}: {exc}") from None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(t, str) for t in v) for k, v in data.items()):
        raise pytest.UsageError(f"{flag}: {value} is not an {{instance_id: [test, ...]}} map")
    return path


def _dirs(flag: str, value: Any) -> tuple[str, ...]:
    return tuple(_dir(flag, d) for d in split_list(value))


def _pull(flag: str, value: Any) -> str:
    if str(value) not in {"never", "missing"}:
        raise pytest.UsageError(f"{flag}: {value!r} is not one of: never, missing")
    return str(value)


# A Docker runtime name as daemon.json's ``runtimes`` keys them: what the engine's API accepts in HostConfig.Runtime.
_RUNTIME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")


def _validate_runtime(flag: str, value: Any) -> str | None:
    """``--pb-runtime``: a runtime's name; empty or ``default`` is the engine's own default runtime."""
    name = str(value).strip()
    if name in ("", "default"):
        return None
    if not _RUNTIME_NAME.fullmatch(name):
        raise pytest.UsageError(f"{flag}: {name!r} is not a runtime name (letters, digits, '_', '.', '+', '-')")
    return name


def _run_dirs(flag: str, value: Any) -> tuple[str, ...]:
    """``--pb-compare``: one earlier run directory (against this run) or two finished ones (base, new)."""
    dirs = _dirs(flag, value)
    if len(dirs) > 2:
        raise pytest.UsageError(f"{flag}: at most two run directories (BASE, or BASE,NEW), got {len(dirs)}")
    return dirs


def _docker_hosts(flag: str, value: Any) -> tuple[str, ...]:
    # lazy: the entry point imports the options, never the engine (docker, requests)
    from pytest_programbench.engine.engines import EngineSpecError, parse_docker_hosts  # noqa: PLC0415

    values = _raw_seq(flag, value)
    try:
        parse_docker_hosts(values)
    except EngineSpecError as exc:
        raise pytest.UsageError(str(exc)) from exc
    return values


_KIND_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "str": _text, "int": to_int, "float": to_float, "bool": _bool, "list": _seq,
}

_TO_1 = (0.0, 1.0)
CLI_AGENTS = "agents.md#cli-agents-codex-claude-code-opencode"  # the docs site's page of the agent presets

# The one table: listing order is ``--help`` order within a section. Unset options take Settings' defaults.
OPTIONS: tuple[Option, ...] = (
    # Selection
    Option("language", "Select tasks by language (c, cpp, go, rust, haskell, java; aliases rs, hs). "
           "Repeatable or comma-separated.", "selection", "list", "LANG", field_names=("languages",),
           default_text="all"),
    Option("difficulty", "Select tasks by difficulty (easy, medium, hard, unset). Repeatable or comma-separated.",
           "selection", "list", "LEVEL", field_names=("difficulties",), default_text="all"),
    Option("filter", "Select task ids matching this regex (re.match, like programbench's --filter).",
           "selection", metavar="REGEX"),
    Option("slice", "Keep tasks[A:B] after filtering (like programbench's --slice).", "selection", metavar="A:B"),
    Option("shuffle", "Shuffle tasks with this seed before filtering and slicing.", "selection", "int", "SEED"),
    Option("tasks-dir", "Add tasks from DIR (official layout: <id>/task.yaml, tests.json, optional Dockerfile, "
           "optional tests/<branch>/). Repeatable.", "selection", "list", "DIR", _dirs, ("tasks_dirs",)),
    Option("include-fixtures", "Include the bundled `testorg__*` fixture tasks.", "selection", "bool"),
    # Work
    Option("agent", "Agent: a shell command run as the agent user in /workspace/src of each task's sandbox, or a "
           "preset: reference, replay:DIR, mini-swe-agent, codex, claude-code, opencode (optionally NAME@VERSION).",
           "agent", metavar="CMD", docs=f"See [CLI agents]({CLI_AGENTS}) and [Customising](customising.md) (an agent "
           "written in Python)."),
    Option("agent-env", "Pass NAME (from the host environment) or NAME=VALUE to the agent (values never written "
           "out). Repeatable.", "agent", "list", "NAME[=VALUE]", _raw_seq,
           docs="See [the agent's environment](agents.md#the-agents-environment)."),
    Option("agent-mount", "Mount HOST_DIR read-only into the sandbox (at DIR, default the same path). Repeatable.",
           "agent", "list", "HOST_DIR[:DIR]", _raw_seq, ("agent_mounts",)),
    Option("agent-setup", "Command run as root in the sandbox before the agent, on the agent's clock; a failure is a "
           "note in the item's message and pb-meta.json, and the agent runs whatever it was.", "agent", metavar="CMD"),
    Option("agent-on-host", "Run the agent command on the host; it drives the sandbox by container id, with "
           "PB_CONTAINER_ID and PB_SANDBOX_EXEC (a prefix running a shell command in the sandbox as the agent).",
           "agent", "bool", docs="See [the agent's environment](agents.md#the-agents-environment)."),
    Option("agent-timeout", "Agent wall clock in seconds, inside the sandbox and from the host; seconds the relay "
           "held its model requests are given back (up to this much again or --pb-model-retry-budget, the longer).",
           "agent", "int", "SECONDS", _int(1), docs=f"See [CLI agents]({CLI_AGENTS}): held requests give the clock "
           "back."),
    Option("agent-final-grace", "Seconds an agent working by tool calls may go on without a model request after "
           "its final answer (a reply with no tool call) before its processes are ended and its work scored; the "
           "record says so (a CLI can hang after its last message). 0: never.", "agent", "float", "SECONDS",
           _float(0.0), docs=f"See [CLI agents]({CLI_AGENTS})."),
    Option("prompt-template", "Jinja2 template for the agent prompt (written to PB_PROMPT_FILE).", "agent",
           metavar="FILE", default_text="built in"),
    Option("model", "Model name for agent presets such as mini-swe-agent.", "model", metavar="NAME",
           docs=f"The relay pins it: a call naming another model is refused ([CLI agents]({CLI_AGENTS}))."),
    Option("model-endpoint", "The only address the agent may reach, through a recording relay.", "model",
           metavar="URL"),
    Option("model-key-env", "Host environment variable whose value the relay adds as the API key (the sandbox "
           "never sees it).", "model", metavar="NAME"),
    Option("model-retry-budget", "Seconds one model request may be retried for (429, 5xx, 529, connection "
           "errors, before any byte reaches the agent); a request still failing then makes the task an error "
           "(model API unavailable).", "model", "float", "SECONDS", _float(0.0)),
    Option("model-allow-server-tools", "Let the relay forward provider-side tools (web search, code execution, "
           "MCP, file search...) and every API of the endpoint (files, batches, stored responses...), not only model "
           "calls: the internet through the model API. Recorded in the run and its leaderboard package.", "model",
           "bool", docs="Without it the relay forwards model calls only and refuses the rest with a 403 the agent can "
           "read, and the item is flagged `provider_tools_requested` (see [CLI agents]("
           f"{CLI_AGENTS})); recorded in the run's identity and in `submission.yaml` (`harness.model_server_tools`)."),
    Option("model-failures-scored", "Score tasks whose model API was unavailable or rejected the key (the "
           "agent's half-finished work; today's behaviour elsewhere) instead of making them errors.", "model", "bool"),
    Option("budget", "USD the run may spend on the model (tokens at --pb-token-price): no new task starts once spent "
           "plus the running tasks' projected cost passes it; past 1.1 times it the relay refuses model requests and "
           "the running tasks end as errors naming the budget.", "model", "float", "USD", _float(0.0),
           default_text="no budget", docs=f"See [CLI agents]({CLI_AGENTS}): budget."),
    Option("agent-replay", "Answer the agent's model requests from RUN_DIR's recorded conversation (each task's "
           "model-replay.jsonl), never calling the endpoint; the first request that differs makes the task an error "
           "naming it, with a diff.", "agent", metavar="RUN_DIR", parser=_dir,
           docs=f"See [CLI agents]({CLI_AGENTS}): replay."),
    Option("model-concurrency", "At most N model requests in flight upstream at once across every worker of the "
           "run (lock files in the run directory; a request waits for a slot, recorded and shown live).", "model",
           "int", "N", _int(1), default_text="no cap"),
    Option("model-rpm", "At most N model requests a minute upstream across every worker of the run (a token bucket "
           "of N in the run directory, refilled at N a minute; every retry counts; a request waits for a token, "
           "recorded and shown live).", "model", "int", "N", _int(1), default_text="no cap"),
    Option("model-tpm", "At most N model tokens a minute across every worker of the run (a token bucket of N, "
           "refilled at N a minute, charged with each answer's metered tokens; requests wait while it is below "
           "zero, recorded and shown live).", "model", "int", "N", _int(1), default_text="no cap"),
    Option("submissions", "Evaluate existing submissions (<id>/submission.tar.gz) instead of running an agent; a "
           "selected task without one is deselected (see --pb-require-all).", "agent", metavar="DIR", parser=_dir),
    Option("require-all", "With --pb-submissions, selected tasks without a submission fail with score 0.",
           "agent", "bool"),
    # Sandbox
    Option("sandbox-cpus", "CPUs of the agent sandbox (default min(20, cores)).", "sandbox", "float", "N",
           _float(0.01), default_text="min(20, cores)"),
    Option("sandbox-memory", "Memory of the agent sandbox (default min(60g, 80% of RAM)).", "sandbox",
           metavar="SIZE", parser=to_bytes, default_text="min(60g, 80% of RAM)"),
    # Evaluation
    Option("image-tag", "Tag of the task images.", "evaluation", metavar="TAG"),
    Option("pull", "Pull missing task images (missing) or never.", "evaluation", metavar="never|missing",
           parser=_pull),
    Option("cpus", "CPUs per evaluation container (default min(10, cores)); exported as "
           "PYTEST_XDIST_AUTO_NUM_WORKERS.", "evaluation", "int", "N", _int(1), default_text="min(10, cores)"),
    Option("memory", "Memory limit per evaluation container (default: none).", "evaluation", metavar="SIZE",
           parser=to_bytes, default_text="none"),
    Option("branch-workers", "Hidden test branches evaluated in parallel per task.", "evaluation", "int", "N",
           _int(1), docs="As `programbench eval`."),
    Option("branch-retries", "Retries of a branch whose JUnit shows an xdist worker crash.", "evaluation", "int",
           "N", _int(0), docs="As `programbench eval`."),
    Option("compile-timeout", "compile.sh wall clock in seconds.", "evaluation", "int", "SECONDS", _int(1)),
    Option("test-timeout", "Wall clock of one hidden branch run in seconds.", "evaluation", "int", "SECONDS",
           _int(1)),
    Option("min-score", "Score at or above which an item passes.", "evaluation", "float", "X", _float(*_TO_1),
           default_text="1.0"),
    Option("strict", "Neutralise flagged files (conftest.py, pytest config, sitecustomize) before evaluating.",
           "evaluation", "bool", docs="A deliberate difference: see [Evaluation](evaluation.md)."),
    Option("allow-flags", "Let flagged submissions pass on their score alone.", "evaluation", "bool"),
    Option("score", "Which score decides the verdict, the headline and --pb-min-mean: official (programbench's, the "
           "leaderboard's) or corrected (the official scoring with test names compared without a leading 'eval.', "
           "upstream ProgramBench issue #56). Both are always reported.", "evaluation", metavar="official|corrected",
           parser=_score_basis, field_names=("score_basis",), docs="See [the official scorer's name defect]("
           "evaluation.md#the-official-scorers-name-defect-and-the-corrected-score)."),
    Option("audit-hidden-tests", "For a task that passed any test: run the hidden tests of 2 of its branches (drawn "
           "after the official run) once more with their sources withheld once collected and PYTEST_CURRENT_TEST "
           "naming no test; tests that then fail (twice) flag the item reads_hidden_tests, a module the test "
           "processes load from the workspace flags it workspace_import, an audit it obstructs audit_obstructed. The "
           "score stays the official one.", "evaluation",
           metavar="on|off", parser=_on_off, docs="See [Evaluation](evaluation.md): the audit of the hidden tests."),
    # Run
    Option("output", "Run directory (default pb-runs/<UTC>-<run id>).", "run", metavar="DIR",
           default_text="`pb-runs/<UTC>-<run id>` where pytest runs"),
    Option("resume", "Resume RUN_DIR: reuse finished results, re-run missing and errored tasks, with the run's "
           "recorded settings.", "run", metavar="RUN_DIR", parser=_dir, docs="See [Results](results.md)."),
    Option("infra-retries", "Retries of an item that errored for infrastructure reasons (never of agent "
           "failures).", "run", "int", "N", _int(0)),
    Option("docker-host", "A Docker engine to run tasks on, with how many tasks it may run at once (default: its "
           "CPUs / --pb-sandbox-cpus); unix://, tcp:// (TLS from DOCKER_TLS_VERIFY/DOCKER_CERT_PATH), ssh://, or "
           "'default' for DOCKER_HOST's. Repeatable: tasks spread over every engine.", "run", "list",
           "URL[=SLOTS]", _docker_hosts, ("docker_hosts",), default_text="`DOCKER_HOST`'s engine",
           docs="See [Scaling](scaling.md)."),
    Option("runtime", "The Docker runtime of every container of a task (sandbox, compile, hidden-test branches, "
           "audit, helpers), e.g. runsc for gVisor: registered on every engine (daemon.json `runtimes`), else a "
           "usage error naming the engine (default: the engine's own).", "run", metavar="NAME",
           parser=_validate_runtime, default_text="the engine's own",
           docs="Recorded in pb-meta.json and the run's fingerprint; see [Under gVisor]"
           "(security.md#under-gvisor---pb-runtime-runsc)."),
    Option("docker-concurrency", "Heavy engine operations (create, start, build, pull, commit, remove) in flight "
           "at once across all workers (0: no cap).", "run", "int", "N", _int(0), default_text="4"),
    Option("prune-images", "Remove a task's image when it is done, if this run built or pulled it.", "run",
           "bool"),
    Option("junit-tests", "Add every hidden test's status to the task's JUnit properties.", "evaluation", "bool"),
    Option("blob-dir", "Hidden test archives in the PROGRAMBENCH_BLOB_DIR layout; else a task dir's "
           "tests/<branch>/, else the Hugging Face dataset.", "evaluation", metavar="DIR", parser=_dir,
           default_text="`$PROGRAMBENCH_BLOB_DIR`"),
    Option("min-mean", "Fail the session when the mean score over the selection is below X.", "run", "float",
           "X", _float(*_TO_1)),
    Option("compare", "Compare this run with the earlier run BASE at session end; BASE,NEW compares two finished "
           "runs and runs nothing (compare.json, compare.html in the newer run's directory). Either may be a "
           "`programbench eval` output directory or a leaderboard entry.", "run", "list",
           "BASE[,NEW]", _run_dirs, docs="See [Comparing runs](comparing.md)."),
    Option("report", "Write report.html for a run that is not ours (a `programbench eval` output directory or a "
           "leaderboard entry) into DIR, from its files; nothing is collected or run.", "run", metavar="DIR",
           parser=_dir, docs="See [Comparing runs]"
           "(comparing.md#against-a-programbench-eval-run-or-a-leaderboard-entry)."),
    Option("max-regression", "With --pb-compare: fail the session when the 95% CI of the mean score difference "
           "(new - base) reaches below -X.", "run", "float", "X", _float(*_TO_1)),
    Option("attempts", "Independent attempts per task (own sandbox, agent run, submission, evaluation; items "
           "<id>[attempt-N]): per task mean, best, pass@k, resolved@k; the headline's interval resamples attempts "
           "within tasks.", "run", "int", "K", _int(1),
           docs="See [Attempts](attempts.md)."),
    Option("gold", "Evaluate the reference itself as the submission N times per task (items <id>[gold-N]), "
           "through the same evaluation, and write gold-ledger.json: per hidden test passes out of N, the tests "
           "that never pass (impossible) or only sometimes (flaky), per task the ceiling.", "run", "int", "N",
           _int(1), docs="See [Attempts](attempts.md)."),
    Option("gold-ledger", "A gold-ledger.json (from --pb-gold): each task's ceiling beside its score, and flips "
           "it explains marked in comparisons.", "run", metavar="FILE", parser=_file),
    Option("ignore-flaky", "With --pb-gold-ledger: also score with the ledger's impossible and flaky tests "
           "ignored (a deliberate difference, beside the official score, never instead of it).", "run", "bool"),
    Option("durations", "Start the longest tasks first, by the durations of the earlier run RUN_DIR (default: "
           "pytest's cache of the last run, else each task's hidden tests and branches).", "run",
           metavar="RUN_DIR", parser=_dir, default_text="pytest's cache of the last run, else an estimate",
           docs="See [Running](running.md#longest-first)."),
    Option("package", "Make the run directory a leaderboard submission at session end (programbench submit "
           "package, then the system metadata, trajectories and cost/call statistics it leaves as TODO).", "run",
           "bool", docs="Also on a finished run: `--pb-resume DIR --pb-package`; see [Comparing runs](comparing.md)."),
    Option("registry-ignore", "The leaderboard registry's ignored_tests.json ({instance_id: [test]}): the terminal "
           "and report show the number the leaderboard will show (its per-test map with these tests struck, over 200 "
           "tasks, resolved at 1.0, near-resolved at 0.95) beside ours.", "run", metavar="FILE",
           parser=registry_ignore_map),
    Option("keep-going", "Run every task even when the agent command is not found in the first sandbox (`command -v` "
           "before the agent runs: by default that task is an error naming it and the session stops, nothing "
           "evaluated), or the agents of the first 3 tasks all exited 127/126 (command not found, not executable; by "
           "default the session stops then, saying why).", "agent", "bool"),
    Option("preflight", "Check the selection before spending hours (images, hidden test archives, the agent "
           "command in a sample sandbox, the model endpoint and key, disk space), list the tasks like --co, print "
           "what is missing and exit non-zero if anything is.", "run", "bool",
           docs="See [Before spending hours](running.md#before-spending-hours---pb-preflight)."),
    Option("progress", "Live view of in-flight tasks: auto (in place on a terminal without live logging, periodic "
           "lines otherwise), "
           "live, lines or off; :SECONDS sets the refresh (live 1, lines 60).", "run", metavar="MODE[:SECONDS]",
           parser=progress_mode, field_names=("progress", "progress_interval")),
    Option("token-price", "USD per million input and output tokens, for the cost in the summary and report.",
           "model", metavar="IN,OUT", parser=token_price),
)

BY_DEST = {o.dest: o for o in OPTIONS}


def register(parser: pytest.Parser) -> None:
    groups = {name: parser.getgroup(f"{GROUP}-{name}", f"ProgramBench {name} (pytest-programbench)")
              for name in SECTIONS}
    for opt in OPTIONS:
        group = groups[opt.section]
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
    """CLI value, else ini value (``None`` when unset: Settings' default applies)."""
    value = config.getoption(opt.dest, None)
    if value is None:
        ini = config.getini(opt.ini)
        if ini not in (None, "", []):
            value = ini
    return value


def parse(config: pytest.Config, *, environ: Sequence[tuple[str, str]] | None = None) -> Settings:
    """Read every option from the command line or ini and validate it; bad input is a UsageError."""
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        raw = raw_value(config, opt)
        if raw is not None:
            values.update(opt.parse(raw))
    env = dict(environ) if environ is not None else dict(os.environ)
    if "blob_dir" not in values and environment.BLOB_DIR.is_set(env):
        values["blob_dir"] = str(existing_dir(environment.BLOB_DIR.name, environment.BLOB_DIR.raw(env)))
    return Settings(**values)
