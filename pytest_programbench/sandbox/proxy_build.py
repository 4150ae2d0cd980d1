"""The client installed at ``/workspace/binary``: a static C program built once from the shipped source, cached.

A Python client costs ~20 ms per call in Python start-up alone; the static C client costs well under one. It is
built from ``proxy/client.c``:

1. on the host, when a C compiler there can link statically for the engine's architecture, else
2. in a short-lived builder container (no network, labelled) from an image that has a compiler, e.g. the test
   bed's base image or the task image itself,

and cached under ``<cache>/<source hash>/pb-client`` behind a file lock, so xdist workers build it once. When no
build works, the Python client (``proxy/client.py``) is the fallback; :attr:`ProxyClient.label` names which one
is in use for the report header.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import platform
import shutil
import struct
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from docker.errors import DockerException
from filelock import FileLock

from pytest_programbench.core import environment
from pytest_programbench.core.cache import cache_dir as plugin_cache_dir
from pytest_programbench.engine.protocol import DockerEngine
from pytest_programbench.engine.tar_in import TarIn

if TYPE_CHECKING:
    from pytest_programbench.engine.docker_engine import Labels

log = logging.getLogger(__name__)

PROXY_DIR = Path(__file__).resolve().parent / "proxy"
CLIENT_SOURCE = PROXY_DIR / "client.c"
PYTHON_CLIENT = PROXY_DIR / "client.py"
DAEMON_SOURCE = PROXY_DIR / "daemon.py"
CFLAGS = ("-static", "-Os", "-s", "-Wall", "-Wextra", "-o")
BUILD_RECIPE_VERSION = "1"
BUILDER_TIMEOUT = 300
BUILD_DIR = "/pb-proxy-build"  # in the throw-away builder container: the source and the client it compiles
# Environment knobs: force the Python client, point at another cache, or at another builder image.

_ELF_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}


class ProxyBuildError(Exception):
    """No static client could be built and the fallback was not allowed."""


@dataclass(frozen=True)
class ProxyClient:
    """The program that becomes ``/workspace/binary``."""

    kind: str  # "static-c" or "python"
    path: Path
    sha256: str
    detail: str  # how it was obtained, or why the fallback is in use

    @property
    def label(self) -> str:
        """One line for the report header."""
        if self.kind == "static-c":
            return f"static C client ({self.detail}, sha256 {self.sha256[:12]})"
        return f"Python fallback client (~20 ms per call: {self.detail})"

    def read_bytes(self) -> bytes:
        return self.path.read_bytes()


def source_hash() -> str:
    """Cache key: the client source plus everything that shapes the build."""
    digest = hashlib.sha256()
    digest.update(CLIENT_SOURCE.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(BUILD_RECIPE_VERSION.encode())
    return digest.hexdigest()


def default_cache_dir() -> Path:
    return plugin_cache_dir("proxy", environment.PROXY_CACHE)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def elf_problem(data: bytes, arch: str) -> str | None:
    """Why ``data`` is not a static ELF executable for ``arch`` (None when it is)."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "not an ELF file"
    if data[4] != 2 or data[5] != 1:
        return "not a 64-bit little-endian ELF file"
    machine = struct.unpack_from("<H", data, 18)[0]
    expected = _ELF_MACHINES.get(arch.lower())
    if expected is not None and machine != expected:
        return f"built for ELF machine {machine}, the engine runs {arch}"
    phoff = struct.unpack_from("<Q", data, 32)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    for index in range(phnum):
        offset = phoff + index * phentsize
        if offset + 4 > len(data):
            return "truncated program headers"
        if struct.unpack_from("<I", data, offset)[0] == 3:  # PT_INTERP: dynamically linked
            return "dynamically linked"
    return None


def _engine_arch(engine: DockerEngine | None) -> str:
    if engine is not None:
        try:
            arch = str(engine.info().get("Architecture") or "")
            if arch:
                return arch
        except Exception as exc:  # the engine is optional here: fall back to the host's architecture
            log.debug("engine architecture unknown: %s", exc)
    return platform.machine()


def _compile_on_host(output: Path, arch: str) -> str:
    """Compile with the host's compiler; returns a description. Raises ProxyBuildError."""
    if platform.system() != "Linux":
        raise ProxyBuildError("the host is not Linux")
    if _ELF_MACHINES.get(platform.machine().lower()) != _ELF_MACHINES.get(arch.lower()):
        raise ProxyBuildError(f"the host is {platform.machine()}, the engine runs {arch}")
    compilers = [c for c in (environment.CC.raw(), "gcc", "cc", "clang") if c]
    last = "no C compiler on the host"
    for compiler in compilers:
        path = shutil.which(compiler)
        if path is None:
            continue
        try:
            done = subprocess.run([path, *CFLAGS, str(output), str(CLIENT_SOURCE)], capture_output=True, text=True,
                                  timeout=BUILDER_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            last = f"{compiler}: {exc}"
            continue
        if done.returncode != 0:
            last = f"{compiler} failed: {(done.stderr or done.stdout).strip()[-400:]}"
            continue
        return f"{Path(path).name} on the host"
    raise ProxyBuildError(last)


def _compile_in_container(output: Path, engine: DockerEngine, image: str, labels: Labels | None) -> str:
    """Compile inside a throw-away container of ``image`` (no network); returns a description."""
    name = f"pb-proxy-build-{uuid.uuid4().hex[:10]}"
    label_dict = labels.as_dict() if labels is not None else {}
    container = None
    try:
        container = engine.containers.create(
            image, command=["sleep", str(BUILDER_TIMEOUT)], entrypoint=[], user="0:0", network_mode="none",
            labels=label_dict, name=name, detach=True, working_dir="/")
        container.start()
        source = CLIENT_SOURCE.read_bytes()
        # At the root, never in /tmp: a runtime may keep the container's /tmp from the engine's archive API (gVisor
        # mounts a tmpfs of its own over an empty /tmp).
        TarIn().file(f"{BUILD_DIR.lstrip('/')}/client.c", source, 0o644).put(engine.api, container.id, "/")
        script = ("for cc in gcc cc clang; do command -v $cc >/dev/null 2>&1 && exec $cc "
                  + " ".join(CFLAGS) + f" {BUILD_DIR}/pb-client {BUILD_DIR}/client.c; done; "
                  "echo 'no C compiler in the builder image' >&2; exit 127")
        result = container.exec_run(["sh", "-c", script], user="0:0")
        if result.exit_code != 0:
            text = result.output.decode("utf-8", "replace").strip()[-400:]
            raise ProxyBuildError(f"builder container ({image}) failed: {text}")
        stream, _stat = container.get_archive(f"{BUILD_DIR}/pb-client")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.extractfile("pb-client")
            if member is None:
                raise ProxyBuildError("the builder produced no client")
            output.write_bytes(member.read())
        return f"built in a container of {image}"
    except DockerException as exc:
        raise ProxyBuildError(f"builder container ({image}): {exc}") from exc
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except DockerException as exc:
                log.warning("could not remove builder container %s: %s", name, exc)


def _python_client(reason: str) -> ProxyClient:
    return ProxyClient("python", PYTHON_CLIENT, _sha256(PYTHON_CLIENT), reason)


def build_client(*, cache_dir: Path | None = None, engine: DockerEngine | None = None,
                 builder_images: Sequence[str] | Iterable[str] = (), labels: Labels | None = None,
                 allow_fallback: bool = True) -> ProxyClient:
    """The static client from the cache, else built now (host compiler, then builder images), else the fallback.

    ``builder_images`` are tried in order after the host compiler (``$PB_PROXY_BUILDER_IMAGE`` first when set);
    a build failure is logged and the next way is tried. Safe to call from several processes at once.
    """
    forced = environment.PROXY_CLIENT.raw().lower()
    if forced == "python":
        return _python_client(f"forced by {environment.PROXY_CLIENT.name}=python")
    if forced == "static-c":
        allow_fallback = False
    cache = (cache_dir or default_cache_dir()) / source_hash()
    target = cache / "pb-client"
    arch = _engine_arch(engine)
    cached = _cached(target, arch)
    if cached is not None:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / "build.lock"), timeout=BUILDER_TIMEOUT * 2):
        cached = _cached(target, arch)
        if cached is not None:
            return cached
        problems: list[str] = []
        images = [i for i in (environment.PROXY_BUILDER_IMAGE.raw(), *builder_images) if i]
        attempts: list[tuple[str, Any]] = [("host", None), *((image, engine) for image in images if engine)]
        for where, handle in attempts:
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                output = Path(tmp) / "pb-client"
                try:
                    if handle is None:
                        how = _compile_on_host(output, arch)
                    else:
                        how = _compile_in_container(output, handle, where, labels)
                except ProxyBuildError as exc:
                    problems.append(str(exc))
                    continue
                problem = elf_problem(output.read_bytes(), arch)
                if problem is not None:
                    problems.append(f"{where}: {problem}")
                    continue
                output.chmod(0o755)
                (cache / "how.txt").write_text(how + "\n")
                os.replace(output, target)
                log.info("proxy client built (%s): %s", how, target)
                return ProxyClient("static-c", target, _sha256(target), how)
        reason = "; ".join(problems) or "no way to build it"
        if not allow_fallback:
            raise ProxyBuildError(f"cannot build the static proxy client: {reason}")
        log.warning("using the Python proxy client (slow): %s", reason)
        return _python_client(f"no static build: {reason}")


def _cached(target: Path, arch: str) -> ProxyClient | None:
    if not target.is_file():
        return None
    data = target.read_bytes()
    if elf_problem(data, arch) is not None:
        return None
    how_file = target.parent / "how.txt"
    how = how_file.read_text().strip() if how_file.is_file() else "cached"
    return ProxyClient("static-c", target, hashlib.sha256(data).hexdigest(), f"{how}, cached")
