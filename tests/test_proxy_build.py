"""Building and caching the static proxy client, and its fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench import RUN_LABEL
from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.sandbox import proxy_build
from pytest_programbench.sandbox.proxy_build import ProxyBuildError, build_client, elf_problem, source_hash
from tests.proxy_support import BASE_IMAGE, require_image


def test_elf_check(tmp_path: Path) -> None:
    built = build_client(cache_dir=tmp_path, allow_fallback=False)
    data = built.path.read_bytes()
    assert elf_problem(data, "x86_64") is None
    assert elf_problem(data, "aarch64") is not None
    assert elf_problem(Path("/bin/sh").resolve().read_bytes(), "x86_64") == "dynamically linked"
    assert elf_problem(b"#!/bin/sh\n" + bytes(100), "x86_64") == "not an ELF file"
    assert elf_problem(b"\x7fELF\x01\x01" + bytes(100), "x86_64") == "not a 64-bit little-endian ELF file"


def test_build_is_cached_by_source_hash(tmp_path: Path) -> None:
    first = build_client(cache_dir=tmp_path, allow_fallback=False)
    assert first.kind == "static-c"
    assert first.path == tmp_path / source_hash() / "pb-client"
    assert "on the host" in first.detail
    second = build_client(cache_dir=tmp_path, allow_fallback=False)
    assert second.path == first.path
    assert second.sha256 == first.sha256
    assert second.detail.endswith("cached")
    assert "static C client" in second.label


def test_concurrent_builds_build_once(tmp_path: Path) -> None:
    code = ("import json; from pytest_programbench.sandbox.proxy_build import build_client; "
            "c = build_client(allow_fallback=False); print(json.dumps([c.kind, str(c.path), c.sha256]))")
    env = {**os.environ, "PB_PROXY_CACHE": str(tmp_path)}
    processes = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE) for _ in range(4)]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in processes]
    assert all(p.returncode == 0 for p in processes)
    assert len({tuple(r) for r in results}) == 1
    assert sorted(p.name for p in (tmp_path / source_hash()).iterdir()) == ["build.lock", "how.txt", "pb-client"]


def test_python_client_can_be_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PB_PROXY_CLIENT", "python")
    chosen = build_client(cache_dir=tmp_path)
    assert chosen.kind == "python"
    assert chosen.path == proxy_build.PYTHON_CLIENT
    assert "Python fallback client" in chosen.label
    assert "forced" in chosen.label


def test_fallback_when_nothing_can_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(proxy_build.shutil, "which", lambda _name: None)
    chosen = build_client(cache_dir=tmp_path)
    assert chosen.kind == "python"
    assert "no C compiler on the host" in chosen.detail
    with pytest.raises(ProxyBuildError, match="no C compiler"):
        build_client(cache_dir=tmp_path, allow_fallback=False)
    monkeypatch.setenv("PB_PROXY_CLIENT", "static-c")
    with pytest.raises(ProxyBuildError):
        build_client(cache_dir=tmp_path)


@pytest.mark.docker
def test_builds_in_a_container_when_the_host_cannot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Any,
                                                    run_labels: Labels) -> None:
    require_image(engine, BASE_IMAGE)

    def no_host(*_args: Any) -> str:
        raise ProxyBuildError("no host compiler (test)")

    monkeypatch.setattr(proxy_build, "_compile_on_host", no_host)
    labels = run_labels.for_task("proxy-build")
    chosen = build_client(cache_dir=tmp_path, engine=engine, builder_images=["no/such-image:x", BASE_IMAGE],
                          labels=labels, allow_fallback=False)
    assert chosen.kind == "static-c"
    assert chosen.detail == f"built in a container of {BASE_IMAGE}"
    assert elf_problem(chosen.path.read_bytes(), "x86_64") is None
    left = engine.api.containers(all=True, filters={"label": [f"{RUN_LABEL}={labels.run_id}"]})
    assert [c for c in left if "pb-proxy-build" in c["Names"][0]] == []
