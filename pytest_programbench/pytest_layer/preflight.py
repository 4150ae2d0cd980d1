"""``--pb-preflight``: before spending hours, check what the selection needs, without running any of it.

For the selected tasks: the images (present, pullable or buildable), the hidden test archives (present, or listed in
the Hugging Face dataset: nothing is downloaded), the agent command (``command -v`` in one sample sandbox, after
``--pb-agent-setup``; on the host for host-loop agents), the agent's inputs, the model endpoint (a TCP connection)
and its key variable, and disk space. For a CLI preset, one tiny model request (a one-token answer, the key added as
the relay adds it) asks the provider as the CLI names itself (its ``User-Agent``): a 400 refusing that version as
outdated is reported before any task runs. The result is a table of what is missing; the session exits non-zero when
anything is.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from docker.errors import DockerException, ImageNotFound
from programbench.constants import HF_REPO_ID, HF_REVISION
from programbench.utils.load_data import get_active_branches

from pytest_programbench.agents.agent import AgentEnvError, agent_env, find_solution
from pytest_programbench.agents.command_check import (
    COMMAND_CHECK_TIMEOUT,
    checkable_word,
    command_probe,
    command_word,
)
from pytest_programbench.core import environment
from pytest_programbench.engine import backpressure, disk, docker_engine, runtimes
from pytest_programbench.engine.engines import EngineSpecError, parse_docker_hosts
from pytest_programbench.engine.errors import EngineUnavailable
from pytest_programbench.engine.images import image_ref
from pytest_programbench.pipeline.room import run_dir_need
from pytest_programbench.relay.agent_loop import refuses_client
from pytest_programbench.relay.contract import RelayConfigError, Upstream, configured_key_style
from pytest_programbench.sandbox.sandbox import Sandbox, SandboxError, sandbox_storage_need
from pytest_programbench.tasks.catalogue import CatalogueError
from pytest_programbench.text.sizes import human

if TYPE_CHECKING:
    from pytest_programbench.agents.agent import AgentSpec
    from pytest_programbench.core.run_identity import RunIdentity
    from pytest_programbench.core.settings import Settings
    from pytest_programbench.engine.docker_engine import Engines
    from pytest_programbench.engine.protocol import DockerEngine
    from pytest_programbench.tasks.catalogue import Task

MODEL_CONNECT_TIMEOUT = 10.0


@dataclass(frozen=True)
class Check:
    kind: str  # input | engine | image | blobs | agent | model | disk
    subject: str
    ok: bool
    detail: str = ""


@dataclass
class PreflightReport:
    checks: list[Check] = field(default_factory=list)

    def add(self, kind: str, subject: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(kind, subject, ok, detail))

    @property
    def missing(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def lines(self) -> list[str]:
        """Per kind a count, then a table of what is missing (or a line saying nothing is)."""
        kinds = list(dict.fromkeys(c.kind for c in self.checks))
        counts = ", ".join(f"{kind} {sum(c.ok for c in self.checks if c.kind == kind)}/"
                           f"{sum(1 for c in self.checks if c.kind == kind)} ok" for kind in kinds)
        lines = [f"checked: {counts}"]
        missing = self.missing
        if not missing:
            return [*lines, "nothing is missing"]
        kind_w = max(len("check"), *(len(c.kind) for c in missing))
        subject_w = min(60, max(len("subject"), *(len(c.subject) for c in missing)))
        lines.append(f"{'check':<{kind_w}}  {'subject':<{subject_w}}  missing")
        lines.extend(f"{c.kind:<{kind_w}}  {c.subject:<{subject_w}}  {c.detail}" for c in missing)
        lines.append(f"{len(missing)} missing: fix them, then run again (the run itself would error or fail "
                     "on each)")
        return lines


def run_preflight(settings: Settings, tasks: Sequence[Task], agent_spec: AgentSpec | None, identity: RunIdentity,
                  *, engines: Engines, environ: Mapping[str, str] | None = None) -> PreflightReport:
    """``engines``: the session's (its run's owner labels go on the sample sandbox: if this process dies with it
    running, the reaper knows it is garbage)."""
    env = os.environ if environ is None else environ
    report = PreflightReport()
    check_inputs(report, settings, env)
    check_blobs(report, tasks, settings.blob_dir, env)
    if check_model(report, settings, env) and agent_spec is not None and agent_spec.cli is not None:
        check_client(report, settings, agent_spec, env)
    try:
        engine = engines.client()
    except EngineUnavailable as exc:
        report.add("engine", "Docker engine", False, str(exc))
        return report
    report.add("engine", "Docker engine", True)
    if settings.runtime:
        check_runtime(report, settings.runtime, engines, settings.docker_hosts)
    try:
        present, to_fetch = check_images(report, engine, tasks, settings)
        check_disk(report, engine, identity.path, images_to_fetch=to_fetch, agent=agent_spec is not None)
        if agent_spec is not None:
            check_agent(report, agent_spec, settings, tasks=tasks, present=present, identity=identity, env=env,
                        engine=engine)
    finally:
        backpressure.release_run(identity.run_id)
    return report


def check_runtime(report: PreflightReport, runtime: str, engines: Engines, docker_hosts: Sequence[str]) -> None:
    """--pb-runtime is registered on every engine of the run."""
    try:
        urls = [spec.url for spec in parse_docker_hosts(docker_hosts)] or [None]
    except EngineSpecError:
        return  # check_inputs' usage error says so
    for url in urls:
        name = engines.get(url).name
        try:
            problem = runtimes.missing(engines.client(url).api, runtime, name)
        except EngineUnavailable as exc:
            report.add("engine", f"runtime {runtime} on {name}", False, str(exc))
            continue
        report.add("engine", f"runtime {runtime} on {name}", problem is None, problem or "")


# ---------------------------------------------------------------------------------------------- inputs, model


def check_inputs(report: PreflightReport, settings: Settings, env: Mapping[str, str]) -> None:
    """What a run refuses at start-up (usage errors), listed together instead of one at a time."""
    for spec in settings.agent_env:
        try:
            agent_env((spec,), env)
        except AgentEnvError as exc:
            report.add("input", f"--pb-agent-env {spec.partition('=')[0]}", False, str(exc))
    if settings.prompt_template and not Path(settings.prompt_template).is_file():
        report.add("input", "--pb-prompt-template", False, f"{settings.prompt_template} is not a file")
    for spec in settings.agent_mounts:
        host = spec.partition(":")[0]
        if not Path(host).expanduser().exists():
            report.add("input", f"--pb-agent-mount {host}", False, f"{host} does not exist")
    if settings.model_key_env:
        report.add("model", f"key variable {settings.model_key_env}", settings.model_key_env in env,
                   "" if settings.model_key_env in env else f"{settings.model_key_env} is not set on the host")


def check_model(report: PreflightReport, settings: Settings, env: Mapping[str, str]) -> bool:
    """The endpoint answers a TCP connection (what the relay will open for each request): whether it did."""
    if not settings.model_endpoint:
        return False
    try:
        upstream = Upstream.parse(settings.model_endpoint)
    except RelayConfigError as exc:
        report.add("model", settings.model_endpoint, False, str(exc))
        return False
    try:
        with socket.create_connection((upstream.host, upstream.port), timeout=MODEL_CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        report.add("model", settings.model_endpoint, False,
                   f"no answer from {upstream.host}:{upstream.port} ({exc.strerror or exc})")
        return False
    report.add("model", settings.model_endpoint, True)
    return True


def _client_request(api: str, prefix: str, model: str) -> tuple[str, dict[str, object]]:
    """The smallest model call of the CLI's API: its path below the endpoint and its body."""
    message = [{"role": "user", "content": "Reply with: ok"}]
    if api.startswith("Anthropic"):  # claude-code's base URL has no /v1; it adds /v1/messages
        return prefix.removesuffix("/v1") + "/v1/messages", {"model": model, "max_tokens": 1, "messages": message}
    base = prefix or "/v1"
    if api.startswith("OpenAI Responses"):
        return base + "/responses", {"model": model, "input": "Reply with: ok", "max_output_tokens": 16}
    return base + "/chat/completions", {"model": model, "max_tokens": 1, "messages": message}


def check_client(report: PreflightReport, settings: Settings, spec: AgentSpec, env: Mapping[str, str]) -> None:
    """The provider accepts the CLI's version: a 400 naming it (or asking to upgrade) is what every model call of
    the run would get, an infrastructure error of each task (relay/agent_loop.py)."""
    installed = spec.cli
    if installed is None or not settings.model_endpoint:
        return
    preset = installed.preset
    client = preset.client(installed.version)
    subject = f"{preset.name}@{installed.version} accepted by the provider"
    upstream = Upstream.parse(settings.model_endpoint)
    path, body = _client_request(preset.api, upstream.prefix, settings.model or preset.default_model)
    headers = {"User-Agent": client, "Content-Type": "application/json"}
    key = env.get(settings.model_key_env or "", "") if settings.model_key_env else ""
    if configured_key_style(settings.model_endpoint, anthropic_client=preset.api.startswith("Anthropic")) == \
            "x-api-key":
        headers["anthropic-version"] = "2023-06-01"
        if key:
            headers["x-api-key"] = key
    elif key:
        headers["Authorization"] = f"Bearer {key}"
    import httpx  # noqa: PLC0415 - lazy: an HTTP stack only in a --pb-preflight run with a model endpoint

    try:
        # The endpoint only, no proxy of the environment: as the relay reaches it.
        with httpx.Client(trust_env=False, timeout=MODEL_CONNECT_TIMEOUT * 3) as http:
            response = http.post(upstream.origin + path, content=json.dumps(body),
                                 headers=headers)
    except httpx.HTTPError as exc:
        report.add("model", subject, True, f"not asked: {exc}")  # the endpoint's own check reports reachability
        return
    refused = refuses_client(response.status_code, response.content, client)
    if refused is not None:
        report.add("model", subject, False,
                   f"the provider refuses {client} as outdated (400: {refused!r}); every task would be an error: "
                   f"pin a newer --pb-agent {preset.name}@VERSION")
        return
    report.add("model", subject, True, f"asked as {client}: {response.status_code}")


# ---------------------------------------------------------------------------------------------- blobs


def check_blobs(report: PreflightReport, tasks: Iterable[Task], blob_dir: str | None,
                env: Mapping[str, str]) -> None:
    """Where each task's archives would come from, in the pipeline's order; nothing is hashed or downloaded."""
    listing: _HubListing | None = None
    for task in tasks:
        try:
            branches = list(get_active_branches(task.load_instance()))
        except CatalogueError as exc:
            report.add("blobs", task.instance_id, False, f"malformed task: {exc}")
            continue
        if blob_dir and (Path(blob_dir) / task.instance_id / "tests").is_dir():
            where = Path(blob_dir) / task.instance_id / "tests"
            absent = [b for b in branches if not (where / f"{b}.tar.gz").is_file()]
            report.add("blobs", task.instance_id, not absent,
                       f"{where} lacks {', '.join(f'{b}.tar.gz' for b in absent)}" if absent else "")
            continue
        trees = task.task_dir / "tests"
        if any((trees / b).is_dir() for b in branches):
            absent = [b for b in branches if not (trees / b).is_dir()]
            report.add("blobs", task.instance_id, not absent,
                       f"{trees} lacks the tree(s) {', '.join(absent)}" if absent else "")
            continue
        if not task.packaged:
            report.add("blobs", task.instance_id, False,
                       f"no hidden tests: not in --pb-blob-dir, no tests/<branch>/ in {task.task_dir}")
            continue
        if listing is None:
            listing = _HubListing(env)
        absent = [b for b in branches if not listing.has(f"{task.instance_id}/tests/{b}.tar.gz")]
        report.add("blobs", task.instance_id, not absent,
                   f"{', '.join(absent)}: {listing.why_missing}" if absent else "")


class _HubListing:
    """The Hugging Face dataset's files: the local cache, plus one listing of the repository when online."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.repo = HF_REPO_ID
        self.revision = HF_REVISION or None
        self.offline = environment.HF_HUB_OFFLINE.true(env)
        self.remote: set[str] | None = None
        self.why_missing = (f"not in the Hugging Face cache and HF_HUB_OFFLINE=1 ({HF_REPO_ID}); pass --pb-blob-dir"
                            if self.offline else f"not in the dataset {HF_REPO_ID}")
        if not self.offline:
            try:
                from huggingface_hub import HfApi  # noqa: PLC0415 - lazy: the Hub's client only when archives come from it

                self.remote = set(HfApi().list_repo_files(self.repo, repo_type="dataset", revision=self.revision))
            except Exception as exc:  # unreachable hub: only the cache counts
                self.why_missing = (f"not in the Hugging Face cache and the dataset {HF_REPO_ID} could not be "
                                    f"listed ({type(exc).__name__}: {exc}); pass --pb-blob-dir")

    def has(self, filename: str) -> bool:
        from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - lazy: the Hub's client only when archives come from it

        cached = try_to_load_from_cache(self.repo, filename, repo_type="dataset", revision=self.revision)
        if isinstance(cached, str):
            return True
        return self.remote is not None and filename in self.remote


# ---------------------------------------------------------------------------------------------- images, disk


def check_images(report: PreflightReport, engine: DockerEngine, tasks: Iterable[Task],
                 settings: Settings) -> tuple[dict[str, str], int]:
    """Per task: present, else pullable (the registry's manifest, not the layers), else buildable.

    Returns the image ids of the tasks whose image is present, and how many images a run would pull or build."""
    present: dict[str, str] = {}
    to_fetch = 0
    for task in tasks:
        ref = image_ref(task, settings.image_tag)
        try:
            present[task.instance_id] = str(engine.api.inspect_image(ref)["Id"])
            report.add("image", ref, True)
            continue
        except ImageNotFound:
            pass
        except DockerException as exc:
            report.add("image", ref, False, f"the engine could not inspect it: {exc}")
            continue
        why = "not present locally"
        if settings.pull == "missing":
            try:
                engine.api.inspect_distribution(ref)
            except DockerException as exc:
                why += f"; not pullable ({getattr(exc, 'explanation', None) or exc})"
            else:
                to_fetch += 1
                report.add("image", ref, True, "to pull")
                continue
        else:
            why += "; --pb-pull never"
        if task.dockerfile is not None:
            to_fetch += 1
            report.add("image", ref, True, f"to build from {task.dockerfile}")
            continue
        report.add("image", ref, False, f"{why}; no Dockerfile in {task.task_dir}")
    return present, to_fetch


def check_disk(report: PreflightReport, engine: DockerEngine, run_dir: Path, *, images_to_fetch: int,
               agent: bool) -> None:
    root = disk.docker_root(engine.api)
    if root is not None:
        need = disk.run_need() + images_to_fetch * disk.image_need()
        if agent:
            need += sandbox_storage_need(engine.api)
        _space(report, "Docker data root", root, need,
               f"a task at a time plus {images_to_fetch} image(s) to pull or build")
    _space(report, "run directory", run_dir, run_dir_need(), "the most one task can write")


def _space(report: PreflightReport, what: str, path: Path, need: int, why: str) -> None:
    space = disk.free_space(path)
    ok = space.free >= need
    report.add("disk", f"{what} {path}", ok,
               "" if ok else f"{human(space.free)} free, {human(need)} needed ({why})")


# ---------------------------------------------------------------------------------------------- agent


def check_agent(report: PreflightReport, spec: AgentSpec, settings: Settings, *, tasks: Sequence[Task],
                present: Mapping[str, str], identity: RunIdentity, env: Mapping[str, str],
                engine: DockerEngine) -> None:
    """The agent's command is found where it will run: the host, or a sample sandbox (after the set-up command)."""
    if spec.kind == "reference":
        report.add("agent", spec.label, *_solutions(tasks))
        return
    if spec.kind != "command":
        report.add("agent", spec.label, True, "a preset")
        return
    if command_word(spec.command) is None:
        report.add("agent", spec.command, False, "the command cannot be parsed (unbalanced quotes?)")
        return
    word = checkable_word(spec.command)
    if word is None:  # e.g. `n=$(cat f); ...`: a first word read statically would be wrong
        report.add("agent", spec.command, True, "not checked: only the shell knows its first program")
        return
    if spec.on_host:
        found = (word if os.access(word, os.X_OK) else None) if "/" in word else shutil.which(word, path=env.get(
            "PATH"))
        report.add("agent", f"{word} (on the host)", found is not None,
                   "" if found else f"`command -v {word}` finds nothing on the host's PATH")
        return
    sample = next((t for t in tasks if t.instance_id in present), None)
    if sample is None:
        report.add("agent", word, False, "no selected task's image is present to start a sample sandbox in")
        return
    report.add(*_command_in_sandbox(word, settings, sample, image_id=present[sample.instance_id], identity=identity,
                                    env=env, engine=engine))


def _solutions(tasks: Sequence[Task]) -> tuple[bool, str]:
    """``reference`` replays a task's known-good solution: a task without one could only fail to compile."""
    lacking = [t.instance_id for t in tasks if find_solution(t) is None]
    if not lacking:
        return True, "a preset; every selected task has a known-good solution"
    shown = ", ".join(lacking[:5]) + (f" and {len(lacking) - 5} more" if len(lacking) > 5 else "")
    return False, (f"{len(lacking)} of {len(tasks)} selected tasks have no known-good solution for `reference` to "
                   f"replay (<task dir>/solution/ or <tasks dir>/../solutions/<id>/): {shown}")


def _command_in_sandbox(word: str, settings: Settings, task: Task, *, image_id: str, identity: RunIdentity,
                        env: Mapping[str, str], engine: DockerEngine) -> tuple[str, str, bool, str]:
    subject = f"{word} (in the sandbox of {task.instance_id})"
    try:
        extra = agent_env(settings.agent_env, env)
    except AgentEnvError:
        extra = {}  # reported as an input
    labels = docker_engine.Labels(identity.run_id, "preflight", task.instance_id)
    sandbox = Sandbox.for_task(task, settings, labels, image_id=image_id, engine=engine)
    try:
        sandbox.start()
        if settings.agent_setup:
            setup = sandbox.exec(settings.agent_setup, user="root", workdir="/", timeout=settings.agent_timeout)
            if setup.exit_code != 0:
                return "agent", subject, False, (f"--pb-agent-setup exited {setup.exit_code}: "
                                                 f"{setup.text.strip()[-300:]}")
        probe = command_probe(word)
        result = sandbox.exec(probe, user="agent", timeout=COMMAND_CHECK_TIMEOUT, env=extra)
    except (SandboxError, EngineUnavailable, RuntimeError) as exc:
        return "agent", subject, False, f"the sample sandbox failed: {exc}"
    finally:
        sandbox.close()
    if result.exit_code == 0:
        return "agent", subject, True, result.text.strip()
    return "agent", subject, False, (f"`command -v {word}` finds nothing for the agent user "
                                     f"({result.text.strip()[-300:]}); install it with --pb-agent-setup or mount it "
                                     "with --pb-agent-mount")
