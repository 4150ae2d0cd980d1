"""Presets for the CLI agents people run: ``--pb-agent codex|claude-code|opencode[@VERSION]``.

Each CLI ships native builds in npm platform packages. They are installed once per machine on the host, into the
plugin's cache (``~/.cache/pytest-programbench/agents/<name>-<version>/<variant>/``, or ``$PB_AGENT_CACHE``), with
``npm install`` behind a file lock (xdist workers install once). Per task the build that runs in the task's image
(glibc, musl, or codex's static musl build for both) is copied read-only into the sandbox through the engine API: no
Node runtime in the sandbox, nothing downloaded there. Each CLI runs headless as the agent user, its own sandboxing
and approval prompts off (the container is the sandbox), no update checks, telemetry or model-list fetches, its
config under the agent's home (never ``/workspace/src``), project-level config in the workspace ignored, talking only
to the model relay with a placeholder key. Its own transcript is copied out as ``<id>/trajectory.jsonl``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from filelock import FileLock

from pytest_programbench.core.cache import cache_dir as plugin_cache_dir
from pytest_programbench.core.environment import AGENT_CACHE, NPM
from pytest_programbench.core.presets import DEFAULT_VERSIONS, parse_preset
from pytest_programbench.engine.tar_in import TarIn
from pytest_programbench.relay.contract import PLACEHOLDER_KEY
from pytest_programbench.sandbox.sandbox import Sandbox, SandboxError

INSTALL_TIMEOUT = 1800.0
SANDBOX_ROOT = "/opt/pb-agent"  # root-owned, read-only for the agent
RECIPE = "1"  # bump when the cached layout changes
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Where each CLI keeps its state, relative to the agent's home (never under /workspace/src).
STATE_DIR = ".pb-agent"
TRANSCRIPT_MAX = 256 << 20
ARCHES = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}
_MUSL_TRIPLES = {"x64": "x86_64-unknown-linux-musl", "arm64": "aarch64-unknown-linux-musl"}


class PresetError(Exception):
    """A CLI preset cannot be used as asked (unknown version, no npm, install failed)."""


@dataclass(frozen=True)
class Build:
    """One native build: the npm package holding it and the files to copy (path in the package -> name in bin/)."""

    variant: str  # "static" (runs anywhere), "glibc" or "musl"
    spec: str  # what ``npm install`` gets, ``name@version``
    package_dir: str  # node_modules/<package_dir> after install
    files: tuple[tuple[str, str], ...]

    @property
    def required(self) -> bool:
        """A missing glibc/static build fails the install; a musl one is optional (not every version has it)."""
        return self.variant != "musl"


@dataclass(frozen=True)
class Invocation:
    """What runs in the sandbox: a shell command, its env, config files (path under home -> bytes), and where
    the CLI's own transcript ends up (a file, or a directory searched for its newest ``*.jsonl``)."""

    command: str
    env: dict[str, str]
    files: dict[str, bytes]
    transcript: str


@dataclass(frozen=True)
class CliPreset:
    name: str
    npm_package: str  # the package users know; the builds come from its platform packages
    default_version: str
    api: str  # which model API it speaks
    default_model: str
    builds: Callable[[str, str], tuple[Build, ...]]  # (version, arch) -> builds
    invocation: Callable[[InvocationContext], Invocation]
    user_agent: str = "{name}/{version}"  # how the CLI names itself to the provider (--pb-preflight asks as it)

    def client(self, version: str) -> str:
        return self.user_agent.format(name=self.name, version=version)


@dataclass(frozen=True)
class InvocationContext:
    bin_dir: str
    home: str
    model: str
    relay_env: Mapping[str, str]  # from ModelRelay.sandbox_env() (empty without --pb-model-endpoint)
    prompt_file: str
    workdir: str

    @property
    def state(self) -> str:
        return f"{self.home}/{STATE_DIR}"


# -- the three CLIs ----------------------------------------------------------------------------------------------


def _codex_builds(version: str, arch: str) -> tuple[Build, ...]:
    # One static-pie musl build per arch (an alias version of @openai/codex itself): it runs on any libc.
    vendor = f"vendor/{_MUSL_TRIPLES[arch]}"
    return (Build("static", f"@openai/codex@{version}-linux-{arch}", "@openai/codex",
                  ((f"{vendor}/bin/codex", "codex"), (f"{vendor}/codex-path/rg", "rg"))),)


def _claude_builds(version: str, arch: str) -> tuple[Build, ...]:
    base = f"@anthropic-ai/claude-code-linux-{arch}"
    return (Build("glibc", f"{base}@{version}", base, (("claude", "claude"),)),
            Build("musl", f"{base}-musl@{version}", f"{base}-musl", (("claude", "claude"),)))


def _opencode_builds(version: str, arch: str) -> tuple[Build, ...]:
    base = f"opencode-linux-{arch}"
    return (Build("glibc", f"{base}@{version}", base, (("bin/opencode", "opencode"),)),
            Build("musl", f"{base}-musl@{version}", f"{base}-musl", (("bin/opencode", "opencode"),)))


def _tee(ctx: InvocationContext, argv: str) -> str:
    """Run ``argv`` with the prompt on stdin, its stdout both in agent.log and the transcript; keep its status."""
    state = shlex.quote(ctx.state)
    return (f"mkdir -p {state} && cd {shlex.quote(ctx.workdir)} && "
            f"{{ {argv} < {shlex.quote(ctx.prompt_file)}; echo $? > {state}/exit-status; }} "
            f"| tee {state}/trajectory.jsonl; exit \"$(cat {state}/exit-status 2>/dev/null || echo 1)\"")


def _codex(ctx: InvocationContext) -> Invocation:
    base_url = ctx.relay_env.get("OPENAI_BASE_URL", "")
    provider = (f'{{name="pb-relay", base_url={json.dumps(base_url)}, env_key="OPENAI_API_KEY", '
                'wire_api="responses", request_max_retries=2, stream_max_retries=2}')
    overrides = [
        f"model_providers.pb-relay={provider}", 'model_provider="pb-relay"',
        "analytics.enabled=false",  # offline it lingers ~5 s at exit otherwise
        "check_for_update_on_startup=false", "project_doc_max_bytes=0",  # no AGENTS.md from the workspace
        "history.persistence=\"none\"", 'web_search="disabled"', "tools.web_search=false",
    ]
    argv = ["codex", "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "--ignore-rules", "--color", "never", "-C", ctx.workdir, "-m", ctx.model]
    for item in overrides:
        argv += ["-c", item]
    argv.append("-")  # the prompt from stdin
    command = f"cd {shlex.quote(ctx.workdir)} && exec {shlex.join(argv)} < {shlex.quote(ctx.prompt_file)}"
    return Invocation(command, {"CODEX_HOME": f"{ctx.home}/.codex"}, {".codex/config.toml": b""},
                      f"{ctx.home}/.codex/sessions/")


def _claude(ctx: InvocationContext) -> Invocation:
    settings = {"permissions": {"defaultMode": "bypassPermissions"}, "autoUpdates": False,
                "includeCoAuthoredBy": False, "cleanupPeriodDays": 1}
    # No WebSearch (an Anthropic server tool the relay refuses) nor WebFetch: removed from what the model is offered.
    argv = ["claude", "-p", "--output-format", "stream-json", "--verbose", "--dangerously-skip-permissions",
            "--setting-sources", "user", "--strict-mcp-config", "--disallowedTools", "WebSearch,WebFetch",
            "--model", ctx.model]
    env = {"CLAUDE_CONFIG_DIR": f"{ctx.home}/.claude", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1"}
    files = {".claude/settings.json": json.dumps(settings, indent=2).encode()}
    return Invocation(_tee(ctx, shlex.join(argv)), env, files, f"{ctx.state}/trajectory.jsonl")


def _opencode(ctx: InvocationContext) -> Invocation:
    base_url = ctx.relay_env.get("OPENAI_BASE_URL", "")
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"pb-relay": {"npm": "@ai-sdk/openai-compatible", "name": "pytest-programbench relay",
                                  "options": {"baseURL": base_url, "apiKey": "{env:OPENAI_API_KEY}",
                                              "includeUsage": True},
                                  "models": {ctx.model: {"name": ctx.model}}}},
        "model": f"pb-relay/{ctx.model}", "small_model": f"pb-relay/{ctx.model}",
        "autoupdate": False, "share": "disabled", "snapshot": False, "lsp": False, "formatter": False,
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
    }
    config_path = ".config/pb-opencode/opencode.json"
    argv = ["opencode", "run", "--format", "json", "--auto", "-m", f"pb-relay/{ctx.model}"]
    env = {"OPENCODE_CONFIG": f"{ctx.home}/{config_path}", "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
           "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
           "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1"}
    return Invocation(_tee(ctx, shlex.join(argv)), env, {config_path: json.dumps(config, indent=2).encode()},
                      f"{ctx.state}/trajectory.jsonl")


PRESETS: dict[str, CliPreset] = {
    "codex": CliPreset("codex", "@openai/codex", DEFAULT_VERSIONS["codex"], "OpenAI Responses (streamed)",
                       "gpt-5-codex", _codex_builds, _codex, "codex_exec/{version} (codex_exec; {version})"),
    "claude-code": CliPreset("claude-code", "@anthropic-ai/claude-code", DEFAULT_VERSIONS["claude-code"],
                             "Anthropic Messages (streamed)", "claude-sonnet-4-5", _claude_builds, _claude,
                             "claude-cli/{version} (external, sdk-cli)"),
    "opencode": CliPreset("opencode", "opencode-ai", DEFAULT_VERSIONS["opencode"],
                          "OpenAI Chat Completions (streamed, usage)", "gpt-5", _opencode_builds, _opencode,
                          "opencode/{version}"),
}


def parse(value: str) -> tuple[CliPreset, str] | None:
    """``NAME[@VERSION]`` of a CLI preset, else ``None`` (an ordinary command)."""
    try:
        parsed = parse_preset(value)
    except ValueError as exc:
        raise pytest.UsageError(f"--pb-agent {value}: {exc}") from None
    return None if parsed is None else (PRESETS[parsed[0]], parsed[1])


# -- install on the host -----------------------------------------------------------------------------------------


def cache_dir() -> Path:
    return plugin_cache_dir("agents", AGENT_CACHE)


def host_arch() -> str:
    machine = os.uname().machine.lower()
    if machine not in ARCHES:
        raise PresetError(f"no native builds for this machine's architecture {machine!r}")
    return ARCHES[machine]


@dataclass(frozen=True)
class Installed:
    """A preset installed in the cache: one sandbox-ready tar per variant (``opt/pb-agent/<name>-<version>/bin``)."""

    preset: CliPreset
    version: str
    directory: Path
    variants: dict[str, str]  # variant -> tar file name in ``directory``

    @property
    def bin_dir(self) -> str:
        return f"{SANDBOX_ROOT}/{self.preset.name}-{self.version}/bin"

    def pick(self, libc: str) -> tuple[str, Path] | None:
        """The build for an image of ``libc`` ("glibc", "musl" or "unknown"): static first, musl when not glibc."""
        order = ["static", "glibc"] if libc == "glibc" else ["static", "musl"]
        for variant in order:
            if variant in self.variants:
                return variant, self.directory / self.variants[variant]
        return None


def ensure_installed(preset: CliPreset, version: str, *, cache: Path | None = None) -> Installed:
    """The preset from the cache, else installed now with npm (a file lock: concurrent workers install once)."""
    directory = (cache or cache_dir()) / f"{preset.name}-{version}"
    manifest = directory / "manifest.json"
    loaded = _load(preset, version, directory, manifest)
    if loaded is not None:
        return loaded
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory / "install.lock"), timeout=INSTALL_TIMEOUT * 2):
        loaded = _load(preset, version, directory, manifest)
        if loaded is not None:
            return loaded
        npm = NPM.raw() or shutil.which("npm")
        if not npm:
            raise PresetError(f"--pb-agent {preset.name}: npm is not on PATH (needed once per machine to install "
                              f"{preset.npm_package}@{version} from the npm registry; or set ${NPM.name})")
        variants: dict[str, str] = {}
        problems: list[str] = []
        for build in preset.builds(version, host_arch()):
            try:
                variants[build.variant] = _install_build(npm, preset, version, build, directory)
            except PresetError as exc:
                if build.required:
                    raise
                problems.append(str(exc))
        data = {"recipe": RECIPE, "name": preset.name, "version": version, "variants": variants,
                "optional_missing": problems}
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(manifest)
    return Installed(preset, version, directory, variants)


def _load(preset: CliPreset, version: str, directory: Path, manifest: Path) -> Installed | None:
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    variants = data.get("variants") or {}
    if data.get("recipe") != RECIPE or not all((directory / name).is_file() for name in variants.values()):
        return None
    return Installed(preset, version, directory, dict(variants))


def _install_build(npm: str, preset: CliPreset, version: str, build: Build, directory: Path) -> str:
    """npm-install one platform package into a scratch prefix and pack its files as the sandbox's tar."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=f"npm-{build.variant}-") as scratch:
        # --force: npm would refuse a musl package on a glibc host (its "libc" field); --ignore-scripts: the
        # native build is all we take, no package code runs on the host, so the host's Node version is no concern
        # (--engine-strict=false: claude-code from 2.1.198 declares node >= 22).
        argv = [npm, "install", "--prefix", scratch, "--no-save", "--no-package-lock", "--ignore-scripts",
                "--no-audit", "--no-fund", "--force", "--engine-strict=false", "--loglevel", "error", build.spec]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PresetError(f"--pb-agent {preset.name}@{version}: `npm install {build.spec}` failed: {exc}") \
                from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise PresetError(f"--pb-agent {preset.name}@{version}: `npm install {build.spec}` exited "
                              f"{done.returncode}: " + " | ".join(tail))
        package = Path(scratch) / "node_modules" / build.package_dir
        name = f"sandbox-{build.variant}.tar"
        target = directory / name
        tmp = directory / f".{name}.tmp"
        root = PurePosixPath(SANDBOX_ROOT.lstrip("/"))
        with tarfile.open(tmp, "w") as tar:
            for part in (root, root / f"{preset.name}-{version}", root / f"{preset.name}-{version}" / "bin"):
                _dir(tar, str(part))
            for source, dest in build.files:
                path = package / source
                if not path.is_file():
                    raise PresetError(f"--pb-agent {preset.name}@{version}: {build.spec} has no {source}")
                info = tar.gettarinfo(str(path), arcname=str(root / f"{preset.name}-{version}" / "bin" / dest))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mode = 0o555
                with path.open("rb") as handle:
                    tar.addfile(info, handle)
        tmp.replace(target)
        return name


def _dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, 0, 0
    tar.addfile(info)


def install_for_spec(value: str) -> Installed | None:
    """``--pb-agent`` naming a CLI preset: installed (or found in the cache) now; a usage error if it cannot be."""
    parsed = parse(value)
    if parsed is None:
        return None
    try:
        return ensure_installed(*parsed)
    except PresetError as exc:
        raise pytest.UsageError(str(exc)) from exc


# -- in the sandbox ----------------------------------------------------------------------------------------------

_PROBE = ("for f in /lib/ld-musl-*.so.1; do [ -e \"$f\" ] && echo musl && exit 0; done; "
          "for f in /lib64/ld-linux-*.so.2 /lib/ld-linux-*.so.* /lib/*-linux-gnu/ld-linux-*.so.*; do "
          "[ -e \"$f\" ] && echo glibc && exit 0; done; echo unknown")


def image_libc(sandbox: Sandbox) -> str:
    result = sandbox.exec(_PROBE, user="root", workdir="/", timeout=60)
    word = result.text.strip().splitlines()[-1:] if result.exit_code == 0 else []
    return word[0] if word and word[0] in ("glibc", "musl") else "unknown"


def prepare(sandbox: Sandbox, installed: Installed, *, model: str | None, relay_env: Mapping[str, str],
            prompt_file: str, workdir: str) -> tuple[Invocation, str]:
    """Copy the build that runs in this image into the sandbox and write the CLI's config. Returns the invocation
    and a one-line description for agent.log."""
    libc = image_libc(sandbox)
    picked = installed.pick(libc)
    if picked is None:
        raise PresetError(f"{installed.preset.name}@{installed.version} has no build for this image (libc: {libc}; "
                          f"installed: {', '.join(installed.variants) or 'none'})")
    variant, tar_path = picked
    with tar_path.open("rb") as handle:  # streamed, not read into memory: the builds are hundreds of MB
        if not sandbox.engine.api.put_archive(sandbox.id, "/", handle):
            raise PresetError(f"could not copy {installed.preset.name} into the sandbox")
    layout = sandbox.layout
    ctx = InvocationContext(installed.bin_dir, layout.agent_home, model or installed.preset.default_model,
                            relay_env, prompt_file, workdir)
    invocation = installed.preset.invocation(ctx)
    _put_home_files(sandbox, invocation.files)
    return invocation, (f"{installed.preset.name}@{installed.version} ({variant} build for a {libc} image, "
                        f"{installed.preset.api}, model {ctx.model})")


def _put_home_files(sandbox: Sandbox, files: Mapping[str, bytes]) -> None:
    """Config files under the agent's home, owned by the agent (the CLIs write their state next to them)."""
    layout = sandbox.layout
    owner = {"uid": layout.agent_uid, "gid": layout.agent_gid}
    home = PurePosixPath(layout.agent_home)
    dirs: set[PurePosixPath] = {PurePosixPath(STATE_DIR)}
    for rel in files:
        dirs.update(p for p in PurePosixPath(rel).parents if str(p) != ".")
    archive = TarIn()
    for directory in sorted(dirs, key=lambda p: len(p.parts)):
        archive.directory(str(directory), 0o700, **owner)
    for rel, data in files.items():
        archive.file(rel, data, 0o600, **owner)
    if not archive.put(sandbox.engine.api, sandbox.id, str(home)):
        raise PresetError(f"could not write the agent's config under {home}")


def environment(invocation: Invocation, installed: Installed, relay_env: Mapping[str, str]) -> dict[str, str]:
    """The CLI's env: its bin dir first on PATH, a placeholder key (the relay adds the real one), its settings."""
    env = {"PATH": f"{installed.bin_dir}:{SYSTEM_PATH}", "NO_COLOR": "1", "TERM": "dumb", "CI": "1",
           "OPENAI_API_KEY": PLACEHOLDER_KEY, "ANTHROPIC_API_KEY": PLACEHOLDER_KEY}
    env.update(relay_env)
    env.update(invocation.env)
    return env


def save_transcript(sandbox: Sandbox, invocation: Invocation, dest_dir: Path) -> Path | None:
    """Copy the CLI's own transcript out of the sandbox (after the agent's window, before packing)."""
    path = invocation.transcript
    try:
        if path.endswith("/"):  # a directory: its newest JSON-lines file (the sandbox is stopped by now)
            found = sandbox.newest_file(path, ".jsonl")
            if found is None:
                return None
            path = found
        data = sandbox.read_file(path, max_bytes=TRANSCRIPT_MAX)
    except (FileNotFoundError, SandboxError):
        return None
    target = dest_dir / ("trajectory" + (PurePosixPath(path).suffix or ".jsonl"))
    target.write_bytes(data)
    return target


def describe(installed: Installed) -> dict[str, Any]:
    return {"preset": installed.preset.name, "version": installed.version, "npm_package": installed.preset.npm_package,
            "variants": sorted(installed.variants), "cache": str(installed.directory)}
