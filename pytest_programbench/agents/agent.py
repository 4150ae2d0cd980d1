"""Step 5 of the pipeline: the agent. A shell command run in the sandbox as the agent user, a host-loop command that
drives the sandbox by container id, or a preset (``reference``, ``replay:DIR``, ``mini-swe-agent``).

The agent's window ends when it exits, crashes or its clock (``--pb-agent-timeout``) fires: the sandbox is frozen and
stopped with everything the agent left running, and ``/workspace/src`` is packed from the stopped container. Whatever
happened inside that window is the agent's (its sandbox brought down by its own memory use included); only the sandbox
failing for another reason is infrastructure.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

from pytest_programbench.agents.agent_presets import (
    Installed,
    Invocation,
    PresetError,
    install_for_spec,
    prepare,
    save_transcript,
)
from pytest_programbench.agents.agent_presets import environment as preset_environment
from pytest_programbench.agents.command_check import (
    COMMAND_CHECK_TIMEOUT,
    NOT_EXECUTABLE,
    NOT_FOUND,
    AgentCommandMissing,
    checkable_word,
    command_probe,
    missing_message,
)
from pytest_programbench.agents.mini_swe_agent import run_mini_swe_agent
from pytest_programbench.agents.prompt import PromptContext, render_prompt
from pytest_programbench.engine import docker_engine
from pytest_programbench.engine.tar_in import TarIn
from pytest_programbench.results.verdict import InfrastructureError
from pytest_programbench.sandbox.agent_log import CappedLog, pump
from pytest_programbench.sandbox.layout import BINARY_PATH, DOCS_DIR, PROMPT_PATH, SRC_DIR
from pytest_programbench.sandbox.sandbox import SandboxError

if TYPE_CHECKING:
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.sandbox.sandbox import Sandbox
    from pytest_programbench.tasks.catalogue import Task

PRESETS = ("reference", "replay:DIR", "mini-swe-agent", "codex[@VERSION]", "claude-code[@VERSION]",
           "opencode[@VERSION]")
SOLUTION_DIRS = ("solution",)  # inside a task dir: the known-good solution the ``reference`` preset replays


@dataclass(frozen=True)
class AgentSpec:
    """What ``--pb-agent`` asked for."""

    kind: str  # "command" | "reference" | "replay" | "mini-swe-agent" | "cli"
    command: str = ""
    replay_dir: Path | None = None
    on_host: bool = False
    cli: Installed | None = None  # kind "cli": the preset installed in the host cache (agent_presets.py)

    @classmethod
    def parse(cls, value: str, *, on_host: bool = False) -> AgentSpec:
        text = value.strip()
        if not text:
            raise pytest.UsageError("--pb-agent: empty command")
        if text == "reference":
            return cls("reference")
        if text.startswith("replay:"):
            directory = Path(text.removeprefix("replay:")).expanduser()
            if not directory.is_dir():
                raise pytest.UsageError(f"--pb-agent replay:DIR: {directory} is not a directory")
            return cls("replay", replay_dir=directory.resolve())
        if text == "mini-swe-agent":
            return cls("mini-swe-agent", on_host=True)
        installed = install_for_spec(text)  # codex / claude-code / opencode[@VERSION]: installed once per machine
        if installed is not None:
            return cls("cli", command=f"{installed.preset.name}@{installed.version}", cli=installed)
        return cls("command", command=text, on_host=on_host)

    @property
    def label(self) -> str:
        return {"command": self.command, "replay": f"replay:{self.replay_dir}", "cli": self.command}.get(
            self.kind, self.kind)


@dataclass
class AgentResult:
    exit_code: int | None
    timed_out: bool
    seconds: float
    log: Path
    notes: list[str] = field(default_factory=list)
    transcript: Path | None = None  # a CLI preset's own transcript, copied out of the sandbox
    clock_extended_s: float = 0.0  # seconds the clock gave back for model requests the harness held
    ended_after_answer: str | None = None  # why the harness ended the agent after its final answer (its grace)

    @property
    def clock_fired(self) -> str | None:
        return "agent" if self.timed_out else None

    def meta(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "timed_out": self.timed_out, "seconds": round(self.seconds, 3),
                "clock_fired": self.clock_fired, "notes": self.notes,
                "transcript": None if self.transcript is None else self.transcript.name,
                "clock_extended_s": round(self.clock_extended_s, 3), "ended_after_answer": self.ended_after_answer}


class AgentEnvError(Exception):
    """``--pb-agent-env NAME`` names a variable the host does not have."""


def agent_env(specs: tuple[str, ...], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``NAME`` takes the host's value, ``NAME=VALUE`` its own. Values are never logged."""
    source = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not name.isidentifier():
            raise AgentEnvError(f"--pb-agent-env: {name!r} is not a variable name")
        if not sep:
            if name not in source:
                raise AgentEnvError(f"--pb-agent-env: {name} is not set on the host")
            value = source[name]
        out[name] = value
    return out


def put_tree(sandbox: Sandbox, source: Path, dest: str) -> None:
    """Copy a host directory's contents into the sandbox, owned by the agent (symlinks kept as links)."""
    layout = sandbox.layout

    def as_agent(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid, info.gid, info.uname, info.gname = layout.agent_uid, layout.agent_gid, "", ""
        return info

    archive = TarIn()
    for path in sorted(source.iterdir()):
        archive.tree(path, path.name, as_agent)
    if not archive.put(sandbox.engine.api, sandbox.id, dest):
        raise OSError(f"could not copy {source} into the sandbox at {dest}")


def kill_window_processes(window: str, *, group: int | None = None, rounds: int = 5) -> list[int]:
    """SIGKILL every process on this host whose environment says it belongs to ``window`` (``PB_AGENT_WINDOW``).

    The process group catches what a host-loop agent forks; this catches what it detached from the group (``setsid``,
    a daemon's double fork). Each round stops all it finds before killing any, so none forks a replacement meanwhile.
    Only this user's processes can be read (and a host-loop agent runs as this user). Returns the pids killed that
    were not in process group ``group``: members of the group the caller just killed may still be dying when the
    scan reads them (under load), and they were never detached.
    """
    killed: list[int] = []
    for _ in range(rounds):
        found = []
        for process in psutil.process_iter():
            try:
                if process.pid != os.getpid() and process.environ().get("PB_AGENT_WINDOW") == window:
                    found.append(process)
            except (psutil.Error, OSError):  # another user's, gone, or a zombie
                continue
        if not found:
            break
        for process in found:
            with contextlib.suppress(psutil.Error):
                process.suspend()
        for process in found:
            with contextlib.suppress(psutil.Error, OSError):
                in_group = group is not None and os.getpgid(process.pid) == group
                process.kill()
                if not in_group:
                    killed.append(process.pid)
    return sorted(set(killed))


def find_solution(task: Task) -> Path | None:
    """The known-good solution of a fixture task: ``<task dir>/solution/`` or ``<tasks dir>/../solutions/<id>/``."""
    candidates = [task.task_dir / name for name in SOLUTION_DIRS]
    candidates.append(task.task_dir.parent.parent / "solutions" / task.instance_id)
    return next((c for c in candidates if (c / "compile.sh").is_file()), None)


class AgentRunner:
    """Runs one agent against one sandbox; streams its output to ``agent.log``."""

    def __init__(self, spec: AgentSpec, task: Task, settings: Settings, *, log_path: Path,
                 extra_env: Mapping[str, str] | None = None, config: pytest.Config | None = None,
                 attempt: int = 1, held: Callable[[], float] | None = None, check_command: bool = False,
                 answered_idle: Callable[[], float | None] | None = None) -> None:
        self.spec = spec
        # The first task of a process asks whether the command exists before running it (command_check.py).
        self.check_command = check_command
        self.command_checked = False
        self.attempt = attempt  # --pb-attempts: which one (PB_ATTEMPT)
        self.task = task
        self.settings = settings
        self.log_path = log_path
        self.extra_env = dict(extra_env or {})
        self.config = config  # its hooks (pytest_layer/newhooks.py): the prompt and the agent's environment
        self._invocation: Invocation | None = None
        self.transcript: Path | None = None
        # The relay's held seconds (relay/held.py): the clock gives them back, up to Settings.agent_clock_cap.
        self.held = held
        self.clock_cap = settings.agent_clock_cap if held is not None else 0.0
        # The relay's silence since the agent's final answer (relay/agent_loop.py): past the grace, the window ends.
        self.answered_idle = answered_idle
        self.ended_after_answer: str | None = None

    def given_back(self) -> float:
        """Seconds added to the agent's clock so far: the harness held its model requests that long."""
        return min(self.clock_cap, self.held()) if self.held is not None else 0.0

    def after_answer(self) -> str | None:
        """Why the agent's window ends now: it gave its final answer and made no model request for the grace
        (``--pb-agent-final-grace``; a CLI can hang after its last message); ``None`` while it should go on."""
        grace = self.settings.agent_final_grace
        idle = self.answered_idle() if self.answered_idle is not None and grace > 0 else None
        if idle is None or idle < grace:
            return None
        self.ended_after_answer = (f"the agent gave its final answer and made no model request for {grace:g} s "
                                   "(--pb-agent-final-grace): its processes were ended and its work scored")
        return self.ended_after_answer

    def environment(self, sandbox: Sandbox) -> dict[str, str]:
        env = {
            "PB_PROMPT_FILE": PROMPT_PATH, "PB_TASK_ID": self.task.instance_id, "PB_LANGUAGE": self.task.language,
            "PB_BINARY": BINARY_PATH, "PB_DOCS": DOCS_DIR, "PB_SRC": SRC_DIR, "PAGER": "cat", "MANPAGER": "cat",
            "PB_ATTEMPT": str(self.attempt),
        }
        env.update(self.extra_env)
        env.update(agent_env(self.settings.agent_env))
        if self.config is not None:
            self.config.hook.pytest_programbench_agent_env(task=self.task, env=env, command=self.spec.label,
                                                           config=self.config)
        return env

    def write_prompt(self, sandbox: Sandbox) -> str:
        readme = ""
        for name in sandbox.layout.docs:
            if Path(name).name.lower().startswith("readme"):
                try:
                    readme = sandbox.read_file(f"{DOCS_DIR}/{name}", max_bytes=1 << 20).decode("utf-8", "replace")
                except (OSError, SandboxError):  # an unreadable README only shortens the prompt
                    readme = ""
                break
        template = Path(self.settings.prompt_template) if self.settings.prompt_template else None
        prompt = render_prompt(PromptContext(self.task, sandbox.layout.docs, readme,
                                             # A host-loop agent's sandbox reaches nothing at all.
                                             model_relay=bool(self.settings.model_endpoint) and not self.spec.on_host),
                                 template)
        if self.config is not None:
            changed = self.config.hook.pytest_programbench_prompt(task=self.task, prompt=prompt, config=self.config)
            if changed is not None:
                prompt = str(changed)
        sandbox.put_file(prompt.encode(), PROMPT_PATH, mode=0o644, owner="root")
        return prompt

    def run(self, sandbox: Sandbox, prompt: str | None = None) -> AgentResult:
        """``prompt``: already written to the sandbox (the ``pb_agent_run`` fixture does), else written here."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        notes: list[str] = []
        if self.settings.agent_setup:
            setup = sandbox.exec(self.settings.agent_setup, user="root", workdir="/", timeout=self.settings.
                                 agent_timeout, output=self.log_path)
            notes.append(f"agent set-up exited {setup.exit_code}")
        if prompt is None:
            prompt = self.write_prompt(sandbox)
        if self.check_command and self.spec.kind == "command":
            self._require_command(sandbox)
        # Whole seconds: the in-sandbox `timeout` takes an integer, and the clock's verdict compares against it.
        timeout = float(max(1, int(self.settings.agent_timeout - (time.monotonic() - started))))
        if self.spec.kind in ("reference", "replay"):
            exit_code, timed_out = self._replay(sandbox, timeout, notes)
        elif self.spec.kind == "mini-swe-agent":
            exit_code, timed_out = run_mini_swe_agent(
                sandbox, task=self.task, settings=self.settings, prompt=prompt, env=self.environment(sandbox),
                log_path=self.log_path, timeout=timeout)
        elif self.spec.kind == "cli":
            exit_code, timed_out = self._cli(sandbox, timeout, notes)
        elif self.spec.on_host:
            exit_code, timed_out = self._on_host(sandbox, timeout, notes)
        else:
            result = sandbox.exec(self.spec.command, user="agent", timeout=timeout,
                                  env=self.environment(sandbox), output=self.log_path,
                                  extension=self.given_back, extension_cap=self.clock_cap, stop=self.after_answer)
            exit_code, timed_out = result.exit_code, result.timed_out
        # The window ends here: the sandbox is frozen and stopped with whatever the agent left running, before
        # packing (from the stopped container). A sandbox the agent brought down itself says so.
        if self.ended_after_answer is not None:
            notes.append(self.ended_after_answer)
            self._log(self.ended_after_answer)
        notes += sandbox.end_agent_window().notes()
        if self._invocation is not None:  # the CLI's own transcript, copied out before packing
            self.transcript = save_transcript(sandbox, self._invocation, self.log_path.parent)
        return AgentResult(exit_code, timed_out, time.monotonic() - started, self.log_path, notes,
                           transcript=self.transcript, clock_extended_s=self.given_back(),
                           ended_after_answer=self.ended_after_answer)

    def _require_command(self, sandbox: Sandbox) -> None:
        """The command's first word is found where it will run, as the agent; else ``AgentCommandMissing``."""
        word = checkable_word(self.spec.command)
        if word is None:  # only the shell knows it: the agent runs, its exit status says
            return
        probe = command_probe(word)
        code: int | None
        if self.spec.on_host:
            where = "on the host"
            try:
                done = subprocess.run(["sh", "-c", probe], env={**os.environ, **self.environment(sandbox)},
                                      stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                      timeout=COMMAND_CHECK_TIMEOUT)
            except subprocess.TimeoutExpired:
                return  # no answer is no proof: the agent runs
            code, detail = done.returncode, done.stdout + done.stderr
        else:
            where = f"in the sandbox of {self.task.instance_id}"
            result = sandbox.exec(probe, user="agent", timeout=COMMAND_CHECK_TIMEOUT, env=self.environment(sandbox))
            code, detail = result.exit_code, result.text
        if code is not None and code in (NOT_FOUND, NOT_EXECUTABLE):
            message = missing_message(self.spec.command, word, code, where, detail,
                                      setup=bool(self.settings.agent_setup))
            self._log(message)
            raise AgentCommandMissing(message)
        self.command_checked = True  # found: this process's later tasks need not ask again

    # -- presets ----------------------------------------------------------------------------------------------

    def _replay(self, sandbox: Sandbox, timeout: float, notes: list[str]) -> tuple[int | None, bool]:
        if self.spec.kind == "reference":
            source = find_solution(self.task)
            if source is None:
                notes.append(f"no known-good solution for {self.task.instance_id} (looked for "
                             f"{self.task.task_dir / 'solution'} and ../solutions/{self.task.instance_id})")
                self._log(notes[-1])
                if self.check_command:  # the user's input, like a missing command: an error, and the session stops
                    raise AgentCommandMissing(f"--pb-agent reference: {notes[-1]}; `reference` replays a task's "
                                              "known-good solution, so it runs only on tasks that have one")
                return 1, False
        else:
            assert self.spec.replay_dir is not None
            source = self.spec.replay_dir / self.task.instance_id
            if not source.is_dir():
                notes.append(f"replay: {source} does not exist; the submission stays empty")
                self._log(notes[-1])
                return 1, False
        put_tree(sandbox, source, SRC_DIR)
        # Like an agent would: build once in the sandbox and touch the reference through the proxy, so the
        # preset exercises the same path end to end (the built executable is not part of the submission).
        script = (
            f"{shlex.quote(BINARY_PATH)} </dev/null >/dev/null 2>&1; echo \"reference exited $?\"; "
            "sh ./compile.sh && test -x ./executable && echo 'compile.sh built ./executable'; rc=$?; "
            "rm -f ./executable; exit $rc"
        )
        result = sandbox.exec(script, user="agent", timeout=timeout, env=self.environment(sandbox),
                              output=self.log_path)
        return result.exit_code, result.timed_out

    def _cli(self, sandbox: Sandbox, timeout: float, notes: list[str]) -> tuple[int | None, bool]:
        """codex / claude-code / opencode: the native build copied in, configured headless, run as the agent."""
        assert self.spec.cli is not None
        relay = dict(self.extra_env)
        try:
            invocation, line = prepare(sandbox, self.spec.cli, model=self.settings.model, relay_env=relay,
                                       prompt_file=PROMPT_PATH, workdir=SRC_DIR)
        except PresetError as exc:  # before the agent started: the harness's doing, and a retry cannot help
            raise InfrastructureError(f"agent preset: {exc}", retryable=False) from exc
        self._invocation = invocation
        self._log(line)
        if not relay:
            notes.append("no --pb-model-endpoint: the CLI has no model to talk to")
            self._log(notes[-1])
        env = preset_environment(invocation, self.spec.cli, relay)
        env.update(self.environment(sandbox))  # the task's variables and --pb-agent-env win
        result = sandbox.exec(invocation.command, user="agent", timeout=timeout, env=env, output=self.log_path,
                              extension=self.given_back, extension_cap=self.clock_cap, stop=self.after_answer)
        return result.exit_code, result.timed_out

    def _on_host(self, sandbox: Sandbox, timeout: float, notes: list[str]) -> tuple[int | None, bool]:
        """A host-loop agent: it gets the container id and a ready prefix for running commands as the agent."""
        layout = sandbox.layout
        prefix = (f"docker exec -i --user {layout.agent_uid}:{layout.agent_gid} --workdir {SRC_DIR} "
                  + " ".join(f"-e {shlex.quote(k)}" for k in self.environment(sandbox))
                  + f" {sandbox.id} sh -c")
        window = uuid.uuid4().hex  # marks every process of this window, those that leave its process group too
        env = {**os.environ, **self.environment(sandbox), "PB_CONTAINER_ID": sandbox.id, "PB_SANDBOX_EXEC": prefix,
               "PB_AGENT_UID": str(layout.agent_uid), "PB_AGENT_WINDOW": window}
        engine_url = docker_engine.url_of(sandbox.engine.api)
        if engine_url:  # --pb-docker-host: `docker exec` in PB_SANDBOX_EXEC must reach the sandbox's engine
            env["DOCKER_HOST"] = engine_url
        command = self.spec.command
        # Through a pipe into the capped agent.log: the host's disk is not the agent's to fill.
        read_fd, write_fd = os.pipe()
        stop = threading.Event()
        with CappedLog(self.log_path) as log:
            try:
                # A session of its own, so the whole process group can be stopped by id when the clock fires.
                proc = subprocess.Popen(["sh", "-c", command], stdout=write_fd, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            finally:
                os.close(write_fd)
            reader = threading.Thread(target=pump, args=(read_fd, log, stop), daemon=True)
            reader.start()
            try:
                return self._wait_host_loop(proc, time.monotonic() + timeout), False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                return proc.returncode, True
            finally:
                # The window ended: nothing of the group outlives it (nor keeps the pipe open).
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                # setsid, a double fork: out of the group, still marked
                detached = kill_window_processes(window, group=proc.pid)
                if detached:
                    notes.append(f"{len(detached)} process(es) the agent detached from its process group were killed "
                                 "when its window ended")
                reader.join(5)
                stop.set()
                reader.join()
                os.close(read_fd)

    def _wait_host_loop(self, proc: subprocess.Popen[bytes], deadline: float) -> int:
        """``proc``'s exit status; TimeoutExpired once ``deadline`` plus what the clock gave back has passed."""
        while True:
            remaining = deadline + self.given_back() - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(proc.args, 0)
            if self.after_answer() is not None:  # the finally of _on_host ends the group and what it detached
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()
            try:
                return proc.wait(timeout=min(remaining, 1.0))
            except subprocess.TimeoutExpired:
                continue

    def _log(self, line: str) -> None:
        with CappedLog(self.log_path) as log:
            log.text(f"[pytest-programbench] {line}")
