"""The ``mini-swe-agent`` preset: the official ProgramBench scaffold, run in the worker, acting in our sandbox.

Driven like ``mini-extra programbench`` (``minisweagent/run/benchmarks/programbench.py`` of mini-swe-agent 2.4.6):
its ``ProgramBenchAgent`` class, its default model class (litellm, chat completions with a ``bash`` tool), and its
``benchmarks/programbench.yaml`` config -- limits, observation and format-error templates, per-command timeout (180 s)
and command environment. Adapted to our layout:

* the system template is the official one with the reference named ``/workspace/binary`` (the rules stay whole);
* the instance template is our prompt (``prompt``: the task docs and rules for this sandbox) followed by the official
  template's "Command Execution Rules" and everything after it (the submit sentinel, system information, examples);
* commands run through :class:`SandboxEnvironment` in OUR sandbox as the agent user, in ``/workspace/src`` (never a
  container of mini-swe-agent's own), with only the ``PB_*`` variables and the official command environment: model
  keys and relay addresses stay on the host;
* the model is ``--pb-model`` (litellm's ``provider/name``), its API base the relay (``OPENAI_BASE_URL``, or
  ``ANTHROPIC_BASE_URL`` for ``anthropic/`` models) when ``--pb-model-endpoint`` is set; cost tracking errors are
  ignored (``cost_limit`` is 0 in the official config: the relay meters tokens instead);
* ``LITELLM_LOCAL_MODEL_COST_MAP=True`` (and the other ``LITELLM_LOCAL_*`` switches) so litellm fetches nothing.

The clock: ``wall_time_limit_seconds`` is the remaining agent clock; a command's timeout and a model call's timeout
are cut to what is left; past the deadline neither starts (the agent ends with ``TimeExceeded``); and a hard stop
abandons the agent thread a grace period later. The trajectory is saved after every step to
``<log_path parent>/<id>.traj.json``; every message is appended to ``log_path`` as it happens.

An optional YAML file named by ``PB_MINI_SWE_AGENT_CONFIG`` (``--pb-agent-env`` or the host's environment) is
merged over the config (like ``mini-extra -c``), e.g. for ``model.model_kwargs``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shlex
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import yaml

from pytest_programbench.core.environment import MINI_SWE_AGENT_CONFIG
from pytest_programbench.sandbox.agent_log import CappedLog
from pytest_programbench.sandbox.layout import BINARY_PATH, DOCS_DIR, SRC_DIR

if TYPE_CHECKING:
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.sandbox.sandbox import Sandbox
    from pytest_programbench.tasks.catalogue import Task

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
COMMAND_TIMEOUT = 180  # the official config's per-command timeout (environment.timeout)
MIN_SLICE = 1.0  # seconds: with less left on the clock, no command or model call starts
HARD_STOP_GRACE = 45.0  # seconds past the deadline before the agent thread is abandoned
STOP_WAIT = 5.0  # seconds the abandoned thread gets to notice (its processes killed) before the run goes on
MAX_OUTPUT = 8 << 20  # bytes of one command's output kept (the observation template shows 10,000 characters)
INSTALL_HINT = "pip install mini-swe-agent  (or: pip install 'pytest-programbench[mini]')"
# Set before litellm is imported: it would otherwise fetch its cost map and header tables at import.
LITELLM_OFFLINE = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
}
# Environment variables that never reach the sandbox's commands (they are the host-side model's business).
_HOST_ONLY = ("PB_MODEL_RELAY_URL",)
_OFFICIAL_SPLIT = "## Command Execution Rules"


class MiniSweAgentError(RuntimeError):
    """The preset cannot run as configured (package missing, no ``--pb-model``, unusable config)."""


# ---------------------------------------------------------------------------------------------------- config


def preflight(settings: Settings) -> None:
    """For session start: :func:`check` as a ``pytest.UsageError``."""
    try:
        check(settings)
    except MiniSweAgentError as exc:
        raise pytest.UsageError(str(exc)) from exc


def check(settings: Settings) -> None:
    """What can be checked before any sandbox exists: the model is named and the package imports."""
    if not settings.model:
        raise MiniSweAgentError("--pb-agent mini-swe-agent needs --pb-model NAME (a litellm model name such as "
                                "openai/gpt-5 or anthropic/claude-sonnet-4-5)")
    _import_minisweagent()


def _import_minisweagent() -> Any:
    for name, value in LITELLM_OFFLINE.items():
        os.environ[name] = value
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    try:
        import minisweagent  # noqa: PLC0415 - lazy: mini-swe-agent, the [mini] extra
    except ImportError as exc:
        raise MiniSweAgentError(f"--pb-agent mini-swe-agent needs the mini-swe-agent package: {INSTALL_HINT} "
                                f"({exc})") from exc
    return minisweagent


def official_config() -> dict[str, Any]:
    """mini-swe-agent's own ``benchmarks/programbench.yaml``, as shipped with the installed package."""
    _import_minisweagent()
    from minisweagent.config import builtin_config_dir  # noqa: PLC0415 - lazy: mini-swe-agent, the [mini] extra

    path = Path(builtin_config_dir) / "benchmarks" / "programbench.yaml"
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise MiniSweAgentError(f"{path}: not a mapping")
    return data


def adapt_system_template(official: str) -> str:
    """The official system prompt (the rules whole) with the reference where our sandbox has it."""
    text = official.replace("(`cp ./executable ./executable`)", f"(`cp {BINARY_PATH} ./executable`)")
    text = text.replace("`./executable`", f"`{BINARY_PATH}`")
    if "<RULES>" not in text or "</RULES>" not in text:
        raise MiniSweAgentError("the installed mini-swe-agent's programbench.yaml has no <RULES> block in its "
                                "system template: this preset is written for mini-swe-agent 2.4.6")
    return text


def adapt_instance_template(official: str) -> str:
    """Our prompt (passed as ``task``) followed by the official command rules, submit sentinel and examples."""
    _head, sep, tail = official.partition(_OFFICIAL_SPLIT)
    if not sep or SUBMIT_SENTINEL not in tail:
        raise MiniSweAgentError(f"the installed mini-swe-agent's programbench.yaml has no {_OFFICIAL_SPLIT!r} "
                                "section naming the submit command: this preset is written for mini-swe-agent 2.4.6")
    return "{{ task }}\n\n" + sep + tail


def build_config(settings: Settings, env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """The merged config: official, adapted to our sandbox, the user's file, then what this run fixes."""
    from minisweagent.utils.serialize import recursive_merge  # noqa: PLC0415 - lazy: mini-swe-agent, the [mini] extra

    official = official_config()
    agent = dict(official.get("agent") or {})
    adapted: dict[str, Any] = {
        "agent": {
            "system_template": adapt_system_template(str(agent.get("system_template", ""))),
            "instance_template": adapt_instance_template(str(agent.get("instance_template", ""))),
        },
        "environment": {"cwd": SRC_DIR},
        "model": {"cost_tracking": "ignore_errors"},
    }
    layers: list[dict[str, Any]] = [official, adapted]
    user_file = MINI_SWE_AGENT_CONFIG.raw(env) or MINI_SWE_AGENT_CONFIG.raw()
    if user_file:
        try:
            user = yaml.safe_load(Path(user_file).expanduser().read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise MiniSweAgentError(f"{MINI_SWE_AGENT_CONFIG.name}={user_file}: {exc}") from exc
        if not isinstance(user, dict):
            raise MiniSweAgentError(f"{MINI_SWE_AGENT_CONFIG.name}={user_file}: not a mapping")
        layers.append(user)
    config: dict[str, Any] = recursive_merge(*layers)
    wall = int(config["agent"].get("wall_time_limit_seconds") or 0)
    config["agent"]["wall_time_limit_seconds"] = max(1, min(wall, int(timeout)) if wall > 0 else int(timeout))
    model = config.setdefault("model", {})
    model["model_name"] = settings.model
    kwargs = dict(model.get("model_kwargs") or {})
    base_name, key_name = (("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY") if str(settings.model).startswith("anthropic/")
                           else ("OPENAI_BASE_URL", "OPENAI_API_KEY"))
    if env.get(base_name):
        kwargs["api_base"] = env[base_name]
        # The relay adds the real key when asked to; an endpoint that wants none still needs an SDK placeholder.
        kwargs.setdefault("api_key", env.get(key_name) or os.environ.get(key_name) or "pb-no-key")
    elif env.get(key_name):
        kwargs.setdefault("api_key", env[key_name])
    model["model_kwargs"] = kwargs
    return config


# ---------------------------------------------------------------------------------------------------- environment


@dataclass(frozen=True)
class SandboxEnvironmentConfig:
    cwd: str = SRC_DIR
    timeout: int = COMMAND_TIMEOUT
    env: dict[str, str] = field(default_factory=dict)
    interpreter: tuple[str, ...] = ("bash", "-lc")
    container_id: str = ""
    user: str = "agent"

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        data = asdict(self)
        data["interpreter"] = list(self.interpreter)
        data["env"] = sorted(self.env)  # names only: values stay out of trajectories
        return data


class SandboxEnvironment:
    """mini-swe-agent's Environment protocol over our sandbox: every command as the agent user, via ``exec``.

    ``execute`` returns ``{"output", "returncode", "exception_info"[, "extra"]}`` like the official
    ``DockerEnvironment`` (a timeout is returncode -1 with the partial output and an exception note) and raises
    ``Submitted`` on the submit sentinel through the official check. Past ``deadline`` (``time.monotonic()``) or
    once ``stop`` is set it runs nothing and ends the agent with ``TimeExceeded``.
    """

    def __init__(self, sandbox: Sandbox, config: SandboxEnvironmentConfig, *, deadline: float | None = None,
                 stop: threading.Event | None = None, uname: Mapping[str, str] | None = None) -> None:
        self.sandbox = sandbox
        self.config = config
        self.deadline = deadline
        self.stop = stop or threading.Event()
        self.uname = dict(uname) if uname is not None else dict(platform.uname()._asdict())

    @classmethod
    def for_sandbox(cls, sandbox: Sandbox, *, env: Mapping[str, str], timeout: int = COMMAND_TIMEOUT,
                    cwd: str = SRC_DIR, deadline: float | None = None,
                    stop: threading.Event | None = None) -> SandboxEnvironment:
        """Probe the sandbox once (its kernel for the template, whether it has bash) and build the environment."""
        probe = sandbox.exec("uname -s; uname -r; uname -v; uname -m; uname -n; command -v bash || echo no-bash",
                             timeout=30, user="agent", workdir=cwd, env=dict(env))
        lines = probe.text.splitlines()
        uname: dict[str, str] | None = None
        if probe.exit_code == 0 and len(lines) >= 6:
            uname = {"system": lines[0], "release": lines[1], "version": lines[2], "machine": lines[3],
                     "node": lines[4], "processor": ""}
        has_bash = probe.exit_code == 0 and bool(lines) and lines[-1].strip() != "no-bash"
        config = SandboxEnvironmentConfig(cwd=cwd, timeout=timeout, env=dict(env),
                                          interpreter=("bash", "-lc") if has_bash else ("sh", "-c"),
                                          container_id=sandbox.id)
        return cls(sandbox, config, deadline=deadline, stop=stop, uname=uname)

    def time_exceeded(self) -> Exception:
        """The official ``TimeExceeded`` interruption: the agent adds its exit message and stops."""
        from minisweagent.exceptions import TimeExceeded  # noqa: PLC0415 - lazy: mini-swe-agent, the [mini] extra

        return TimeExceeded({"role": "exit", "content": "TimeExceeded",
                             "extra": {"exit_status": "TimeExceeded", "submission": ""}})

    def out_of_time(self) -> bool:
        """Stopped, or less than :data:`MIN_SLICE` left on the clock."""
        return self.stop.is_set() or (self.deadline is not None and self.deadline - time.monotonic() < MIN_SLICE)

    def execute(self, action: dict[str, Any] | str, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action if isinstance(action, str) else str(action.get("command", ""))
        if self.out_of_time():
            raise self.time_exceeded()
        limit = int(timeout or self.config.timeout)
        if self.deadline is not None:  # whole seconds: what the in-sandbox ``timeout`` enforces
            limit = max(1, min(limit, int(self.deadline - time.monotonic())))
        argv = [*self.config.interpreter, command]
        try:
            result = self.sandbox.exec(argv, timeout=limit, user=self.config.user, workdir=cwd or self.config.cwd,
                                       env=self.config.env, max_output=MAX_OUTPUT)
        except Exception as exc:  # like the official environments: the model sees the error
            output: dict[str, Any] = {
                "output": "", "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {exc}",
                "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
            }
        else:
            text = result.text
            if result.truncated:
                text += f"\n[output truncated at {MAX_OUTPUT} bytes]"
            if result.timed_out or result.exit_code is None:
                message = f"Command {shlex.join(argv)!r} timed out after {limit} seconds"
                output = {"output": text, "returncode": -1,
                          "exception_info": f"An error occurred while executing the command: {message}",
                          "extra": {"exception_type": "TimeoutExpired", "exception": message}}
            else:
                output = {"output": text, "returncode": result.exit_code, "exception_info": ""}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        """The official sentinel check (raises ``Submitted`` when the output's first line is the sentinel)."""
        from minisweagent.environments.local import LocalEnvironment  # noqa: PLC0415 - lazy: mini-swe-agent, the [mini] extra

        LocalEnvironment._check_finished(self, output)  # type: ignore[arg-type]

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        from minisweagent.utils.serialize import recursive_merge  # noqa: PLC0415 - lazy: mini-swe-agent, the [mini] extra

        merged: dict[str, Any] = recursive_merge(self.config.model_dump(), self.uname, kwargs)
        return merged

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{type(self).__module__}.{type(self).__qualname__}",
        }}}

    def cleanup(self) -> None:
        """The sandbox is the pipeline's: nothing to remove here."""


# ---------------------------------------------------------------------------------------------------- logging


class _StreamLog:
    """Appends to ``agent.log`` as things happen, within its cap (``agent_log.CappedLog``: head and tail kept)."""

    def __init__(self, path: Path) -> None:
        self._file = CappedLog(path)

    def write(self, text: str) -> None:
        self._file.text(text)

    def line(self, text: str) -> None:
        self.write(f"[mini-swe-agent] {text}")

    def handler(self) -> logging.Handler:
        log_self = self

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                with contextlib.suppress(Exception):
                    log_self.line(f"{record.name}: {record.levelname}: {record.getMessage()}")

        handler = _Handler(logging.INFO)
        return handler

    def close(self) -> None:
        self._file.close()


SECRET_KWARGS = ("api_key", "extra_headers", "headers", "aws_secret_access_key", "aws_session_token")


def redact(data: dict[str, Any]) -> dict[str, Any]:
    """Trajectories name no key: the model's secret-bearing kwargs are replaced by a marker."""
    model = data.get("info", {}).get("config", {}).get("model")
    if isinstance(model, dict) and isinstance(model.get("model_kwargs"), dict):
        model["model_kwargs"] = {k: ("<redacted>" if k in SECRET_KWARGS else v)
                                 for k, v in model["model_kwargs"].items()}
    return data


def _describe(message: Mapping[str, Any]) -> str:
    role = str(message.get("role", "?"))
    extra = message.get("extra") or {}
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, list):  # multimodal content blocks
        content = "\n".join(str(block.get("text", block)) if isinstance(block, Mapping) else str(block)
                            for block in content)
    if content:
        parts.append(str(content).rstrip("\n"))
    for action in extra.get("actions") or []:
        parts.append(f"$ {action.get('command', '')}")
    if role == "exit":
        parts.append(f"exit status: {extra.get('exit_status', '')}")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class _Outcome:
    exit_status: str = ""
    error: BaseException | None = None
    traceback: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def _make_agent(model: Any, env: SandboxEnvironment, stream: _StreamLog, instance_id: str,
                agent_config: dict[str, Any]) -> Any:
    from minisweagent.run.benchmarks.programbench import ProgramBenchAgent  # noqa: PLC0415 - lazy: mini-swe-agent, the [mini] extra

    class _Progress:
        """The official agent reports progress to a batch manager; ours goes to agent.log."""

        def update_instance_status(self, instance_id: str, message: str) -> None:
            stream.line(f"{instance_id}: {message.strip()}")

    class PytestProgramBenchAgent(ProgramBenchAgent):  # type: ignore[misc,unused-ignore]
        """The official ProgramBench agent; messages streamed to agent.log, saving stopped once finalised."""

        finalized = False

        def query(self) -> dict[str, Any]:
            if env.out_of_time():  # before the call is counted, like the official wall-clock check
                raise env.time_exceeded()
            message: dict[str, Any] = super().query()
            return message

        def add_messages(self, *messages: dict[str, Any]) -> list[dict[str, Any]]:
            for message in messages:
                stream.write(f"\n[mini-swe-agent] ---- {message.get('role', '?')} (step {self.n_calls}) ----")
                stream.write(_describe(message))
            added: list[dict[str, Any]] = super().add_messages(*messages)
            return added

        def save(self, path: Path | None, *extra_dicts: dict[str, Any]) -> dict[str, Any]:
            if self.finalized:  # an abandoned thread must not overwrite the final trajectory
                data: dict[str, Any] = self.serialize(*extra_dicts)
                return data
            saved: dict[str, Any] = super().save(path, *extra_dicts)
            return saved

        def serialize(self, *extra_dicts: dict[str, Any]) -> dict[str, Any]:
            data: dict[str, Any] = super().serialize(*extra_dicts)
            return redact(data)

        def final_save(self, path: Path, *extra_dicts: dict[str, Any]) -> None:
            """The last word on the trajectory: later saves (from an abandoned thread) are ignored."""
            self.finalized = True
            super().save(path, *extra_dicts)

    return PytestProgramBenchAgent(model, env, progress_manager=cast(Any, _Progress()), instance_id=instance_id,
                                   **agent_config)


def litellm_workarounds(model_kwargs: dict[str, Any]) -> list[str]:
    """Known litellm defects worked around for this run; returns what was done (for agent.log).

    Some litellm releases (1.106.x) import their proxy's MCP gateway, which needs the ``mcp`` package of the
    ``litellm[proxy]`` extra, for every completion that has tools: without it every call fails with
    ``ModuleNotFoundError: mcp``. The gateway only acts on MCP tools (ours is a plain function tool), so its own
    switch to skip it is safe; it is used only where that import fails.
    """
    done: list[str] = []
    try:
        import litellm.responses.mcp.chat_completions_handler  # noqa: F401, PLC0415 - lazy: litellm, the model client's heavy wing
    except ModuleNotFoundError as exc:
        if "_skip_mcp_handler" not in model_kwargs:
            model_kwargs["_skip_mcp_handler"] = True
            done.append(f"litellm's MCP gateway skipped (it cannot import: {exc})")
    except ImportError:
        pass
    return done


def _guard_model(model: Any, deadline: float, stop: threading.Event,
                 time_exceeded: Callable[[], Exception]) -> None:
    """No model call starts past the deadline, and none outlives it (litellm's ``timeout``, no SDK retries); retries
    stop too."""
    original = model._query
    exc_type = type(time_exceeded())

    def _query(messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        remaining = deadline - time.monotonic()
        if stop.is_set() or remaining < MIN_SLICE:
            raise time_exceeded()
        kwargs.setdefault("timeout", remaining)
        # The OpenAI SDK under litellm retries a timed-out call twice, each with the whole timeout: the call would
        # outlive the clock threefold. One attempt per call; mini-swe-agent's own retries stop at the deadline.
        kwargs["max_retries"] = 0
        return original(messages, **kwargs)

    model._query = _query
    # Past the deadline nothing is retried; a missing module never heals by retrying either.
    model.abort_exceptions = [*model.abort_exceptions, exc_type, ImportError]


def run_mini_swe_agent(sandbox: Sandbox, *, task: Task, settings: Settings, prompt: str, env: Mapping[str, str],
                       log_path: Path, timeout: float) -> tuple[int | None, bool]:
    """Run the official mini-swe-agent ProgramBench scaffold against ``sandbox`` for at most ``timeout`` seconds.

    Returns ``(exit_code, timed_out)``: 0 when the agent submitted; 124 and ``True`` when its wall-clock limit
    ended it (``TimeExceeded``); ``None`` and ``True`` when the hard stop ``HARD_STOP_GRACE`` s past the deadline had
    to abandon its thread; 1 for any other end (step limit, repeated format errors, an exception: the traceback is
    in ``log_path``). ``timed_out`` is also ``True`` for any end that came only after the hard stop. Raises
    :class:`MiniSweAgentError` when the package is missing or ``--pb-model`` is not set.
    """
    check(settings)
    started = time.monotonic()
    deadline = started + timeout
    stop = threading.Event()
    stream = _StreamLog(log_path)
    traj_path = log_path.parent / f"{task.instance_id}.traj.json"
    traj_path.unlink(missing_ok=True)
    loggers = [logging.getLogger(name) for name in ("minisweagent", "litellm_model")]
    handler = stream.handler()
    for logger in loggers:
        logger.addHandler(handler)

    def detach() -> None:
        for logger in loggers:
            logger.removeHandler(handler)
        stream.close()

    try:
        agent = _start_agent(sandbox, task=task, settings=settings, env=env, stream=stream, timeout=timeout,
                             deadline=deadline, stop=stop, traj_path=traj_path)
    except MiniSweAgentError:
        detach()
        raise
    except Exception as exc:  # e.g. the sandbox gone before the first command: the pipeline decides what it was
        stream.line(f"could not start: {type(exc).__name__}: {exc}")
        stream.write(traceback.format_exc())
        detach()
        return 1, False

    outcome = _Outcome()
    thread = threading.Thread(target=_run_agent, args=(agent, prompt, outcome),
                              name=f"mini-swe-agent-{task.instance_id}", daemon=True)
    hard_stop = False
    try:
        thread.start()
        if not outcome.done.wait(max(0.0, deadline - time.monotonic()) + HARD_STOP_GRACE):
            hard_stop = True
            stream.line(f"hard stop: still running {HARD_STOP_GRACE:g} s past the agent clock")
    finally:
        stop.set()  # whatever the thread does next, it starts no command and no model call
        abandoned = _stop_agent(sandbox, outcome)
        exit_status = "HardStop" if abandoned else outcome.exit_status
        _save_trajectory(agent, outcome, stream, traj_path, exit_status=exit_status, instance_id=task.instance_id)
        stream.line(f"exit status {exit_status or '?'} after {time.monotonic() - started:.1f} s, "
                    f"{agent.n_calls} model calls" + (" (agent thread abandoned)" if abandoned else "")
                    + f"; trajectory {traj_path}")
        detach()
    return _exit(exit_status, abandoned=abandoned, hard_stop=hard_stop)


def _start_agent(sandbox: Sandbox, *, task: Task, settings: Settings, env: Mapping[str, str], stream: _StreamLog,
                 timeout: float, deadline: float, stop: threading.Event, traj_path: Path) -> Any:
    """The official agent built from the run's config: its model guarded by the deadline, its commands run in the
    sandbox's environment, its trajectory bound for ``traj_path``."""
    import litellm  # noqa: PLC0415 - lazy: litellm, the model client's heavy wing (seconds to import)

    litellm.suppress_debug_info = True
    from minisweagent.models import get_model  # noqa: PLC0415 - lazy: mini-swe-agent, the [mini] extra

    config = build_config(settings, env, timeout)
    for note in litellm_workarounds(config["model"]["model_kwargs"]):
        stream.line(note)
    stream.line(f"model {settings.model}" + (f" via {config['model']['model_kwargs']['api_base']}"
                                              if "api_base" in config["model"]["model_kwargs"] else "")
                + f"; wall-clock limit {config['agent']['wall_time_limit_seconds']} s")
    env_config = dict(config.get("environment") or {})
    environment = SandboxEnvironment.for_sandbox(
        sandbox, env=_command_env(env_config, env), timeout=int(env_config.get("timeout") or COMMAND_TIMEOUT),
        cwd=str(env_config.get("cwd") or SRC_DIR), deadline=deadline, stop=stop)
    model = get_model(config=dict(config.get("model") or {}))
    _guard_model(model, deadline, stop, environment.time_exceeded)
    agent_config = dict(config.get("agent") or {})
    agent_config["output_path"] = traj_path
    agent = _make_agent(model, environment, stream, task.instance_id, agent_config)
    agent.extra_template_vars = {"instance": {
        "instance_id": task.instance_id, "language": task.language, "difficulty": task.difficulty,
        "image_name": task.image_name, "binary": BINARY_PATH, "docs": DOCS_DIR, "src": SRC_DIR}}
    return agent


def _command_env(env_config: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """The agent's commands' environment: the config's, the run's PB_ variables (not the host-only ones), no pager."""
    command_env = {k: str(v) for k, v in (env_config.get("env") or {}).items()}
    command_env.update({k: v for k, v in env.items() if k.startswith("PB_") and k not in _HOST_ONLY})
    command_env.setdefault("PAGER", "cat")
    command_env.setdefault("MANPAGER", "cat")
    return command_env


def _run_agent(agent: Any, prompt: str, outcome: _Outcome) -> None:
    """The agent's thread: its run, and how it ended."""
    try:
        info = agent.run(task=prompt)
        outcome.exit_status = str(info.get("exit_status", ""))
    except BaseException as exc:
        outcome.error = exc
        outcome.exit_status = type(exc).__name__
        outcome.traceback = traceback.format_exc()
    finally:
        outcome.done.set()


def _stop_agent(sandbox: Sandbox, outcome: _Outcome) -> bool:
    """The agent's processes killed when its thread still runs, and a short wait for it; whether it was abandoned."""
    if not outcome.done.is_set():
        with contextlib.suppress(Exception):
            sandbox.kill_agent_processes()
        outcome.done.wait(STOP_WAIT)
    return not outcome.done.is_set()


def _save_trajectory(agent: Any, outcome: _Outcome, stream: _StreamLog, traj_path: Path, *, exit_status: str,
                     instance_id: str) -> None:
    """The trajectory written with how the agent ended (its exception, said in agent.log too)."""
    extra: dict[str, Any] = {}
    if outcome.error is not None:
        extra = {"traceback": outcome.traceback, "exception_str": str(outcome.error)}
        stream.line(f"agent raised {type(outcome.error).__name__}: {outcome.error}")
        stream.write(outcome.traceback)
    try:
        agent.final_save(traj_path, {"info": {"exit_status": exit_status, **extra}, "instance_id": instance_id})
    except Exception as exc:  # a trajectory that cannot be written must not hide the agent's work
        stream.line(f"could not save the trajectory: {type(exc).__name__}: {exc}")


def _exit(exit_status: str, *, abandoned: bool, hard_stop: bool) -> tuple[int | None, bool]:
    """``(exit_code, timed_out)`` of the agent's end (see :func:`run_mini_swe_agent`)."""
    timed_out = hard_stop or exit_status == "TimeExceeded"
    if abandoned:
        return None, True
    if exit_status == "Submitted":
        return 0, timed_out
    if exit_status == "TimeExceeded":
        return 124, True
    return 1, timed_out
