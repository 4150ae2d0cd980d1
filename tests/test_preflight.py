"""``--pb-preflight``: before spending hours, a table of what the selection lacks, and nothing run.

Real pytest sessions on the test bed and the local engine: one session where everything is in place (exit 0) and
one where each check has something missing (exit non-zero, one row per missing thing); the Hugging Face hub
offline or unreachable never hangs and never downloads. ``--co`` alone lists the tasks without the checks: the
checks start a sandbox and open connections, which a plain listing must not.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_programbench import RUN_LABEL
from tests.conftest import Testbed
from tests.scripted_models import ScriptedModels, Step

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
CATLIKE = "pbfix__catlike.c47c47c"
NOIMAGE = "pbpre__noimage.1111111"  # a copy of catlike without Dockerfile, image or hidden tests
PACKAGED = "abishekvashok__cmatrix.5c082c6"  # an official task: its archives come from the Hugging Face dataset
UNSET_KEY = "PB_PREFLIGHT_TEST_UNSET_KEY"
NO_IMAGE = "not present locally; --pb-pull never; no Dockerfile in"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_id(out: str) -> str:
    found = re.search(r"^programbench run ([0-9a-f]+): ", out, re.MULTILINE)
    assert found, out[-3000:]
    return found.group(1)


def _assert_nothing_ran(docker_client: Any, out: str, run_dir: Path) -> None:
    """No task container of the run is left (the sample sandbox is gone) and no run directory was written."""
    run_id = _run_id(out)
    left = docker_client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})
    assert left == [], [c.name for c in left]
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    last = out.splitlines()[-1]
    assert re.search(r"\b(passed|failed|error)", last) is None, last


def _hf_env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache of this test alone: after the session it must still hold no archive."""
    home = pytester.mkdir("hf-home")
    monkeypatch.setenv("HF_HOME", str(home))
    return home


def _archives(home: Path) -> list[Path]:
    return [p for p in home.rglob("*") if p.is_file() and p.name.endswith(".tar.gz")]


def test_all_in_place_exits_zero_under_xdist(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PB_PREFLIGHT_TEST_KEY", "sk-test")
    run_dir = pytester.path / "run"
    with ScriptedModels([Step("done", None, 1, 1)]) as models:
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-n", "2", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-pull", "never", "--pb-filter", RPN, "--pb-output", str(run_dir),
            "--pb-agent", "FOO=1 sh -c 'exit 0'", "--pb-model-endpoint", models.base_url,
            "--pb-model-key-env", "PB_PREFLIGHT_TEST_KEY", "--pb-preflight", timeout=300)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK, out[-3000:]
    result.stdout.fnmatch_lines([
        "programbench agent: \"FOO=1 sh -c 'exit 0'\" (in the sandbox)",
        f"*<ProgramBenchItem {RPN}>*",
        "*= programbench preflight =*",
        "checked: model 2/2 ok, blobs 1/1 ok, engine 1/1 ok, image 1/1 ok, disk 2/2 ok, agent 1/1 ok",
        "nothing is missing",
    ])
    assert "workers" not in out, "collect-only: xdist starts no worker"
    _assert_nothing_ran(docker_client, out, run_dir)


def test_each_missing_thing_is_a_row_and_the_exit_is_non_zero(
        pytester: pytest.Pytester, testbed: Testbed, docker_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tasks = pytester.mkdir("tasks")
    (tasks / NOIMAGE).mkdir()
    for meta in ("task.yaml", "tests.json"):
        shutil.copy2(testbed.tasks_dir / CATLIKE / meta, tasks / NOIMAGE / meta)
    hf_home = _hf_env(pytester, monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(UNSET_KEY, raising=False)
    monkeypatch.setenv("PB_DISK_RUN_NEED", "1000t")
    port = _closed_port()
    run_dir = pytester.path / "run"
    started = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-tasks-dir", str(tasks),
        "--pb-blob-dir", str(testbed.blob_dir), "--pb-pull", "never", "--pb-output", str(run_dir),
        "--pb-filter", f"{re.escape(RPN)}|{re.escape(NOIMAGE)}|{re.escape(PACKAGED)}",
        "--pb-agent", "mini-swe-agnet --yolo", "--pb-model-endpoint", f"http://127.0.0.1:{port}/v1",
        "--pb-model-key-env", UNSET_KEY, "--pb-preflight", timeout=300)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    assert time.monotonic() - started < 120, "the hub offline is said at once, not waited for"
    rows = out.split("= programbench preflight =")[1].splitlines()
    result.stdout.fnmatch_lines(["checked: model 0/2 ok, blobs 1/3 ok, engine 1/1 ok, image 1/3 ok, disk 1/2 ok, "
                                 "agent 0/1 ok",
                                 "check*subject*missing"])
    expected = {
        ("model", f"key variable {UNSET_KEY}"): f"{UNSET_KEY} is not set on the host",
        ("model", f"http://127.0.0.1:{port}/v1"): f"no answer from 127.0.0.1:{port} (Connection refused)",
        ("blobs", NOIMAGE): "no hidden tests: not in --pb-blob-dir, no tests/<branch>/ in",
        ("blobs", PACKAGED): "not in the Hugging Face cache and HF_HUB_OFFLINE=1",
        ("image", "programbench/pbpre_1776_noimage.1111111:task_cleanroom_v6"): NO_IMAGE,
        ("image", "programbench/abishekvashok_1776_cmatrix.5c082c6:task_cleanroom_v6"): NO_IMAGE,
        ("disk", "Docker data root"): "1000.0 TiB needed",
        ("agent", f"mini-swe-agnet (in the sandbox of {RPN})"): "`command -v mini-swe-agnet` finds nothing for the "
                                                                "agent user",
    }
    for (kind, subject), detail in expected.items():
        matching = [r for r in rows if r.startswith(kind + " ") and f" {subject}" in r and detail in r]
        assert len(matching) == 1, (kind, subject, detail, rows)
    result.stdout.fnmatch_lines([f"{len(expected)} missing: fix them, then run again*"])
    assert not any(r.startswith(("blobs ", "image ")) and RPN in r for r in rows), "what is there is no row"
    assert _archives(hf_home) == [], "preflight downloads nothing"
    _assert_nothing_ran(docker_client, out, run_dir)


class LoopbackHub:
    """A Hugging Face endpoint on loopback answering the dataset's tree listing with ``files``; it records every
    request path, so a download (``/resolve/``) would show."""

    def __init__(self, files: list[str]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hub = self
        self.requests: list[str] = []
        body = json.dumps([{"type": "file", "path": f, "size": 1, "oid": "0" * 40} for f in files]).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.requests.append(self.path)
                listing = "/api/datasets/" in self.path and "/tree/" in self.path
                self.send_response(200 if listing else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body) if listing else 2))
                self.end_headers()
                self.wfile.write(body if listing else b"{}")

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> LoopbackHub:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_archives_listed_in_the_dataset_count_as_downloadable(pytester: pytest.Pytester,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Online: one listing of the dataset decides for the whole selection; nothing is downloaded (no agent: no
    engine work). The hub lists every archive of one task and all but the last of another's."""
    from programbench.utils.load_data import get_active_branches

    from pytest_programbench.tasks.catalogue import load_packaged

    complete, partial = load_packaged()[:2]
    hf_home = _hf_env(pytester, monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    last = list(get_active_branches(partial.load_instance()))[-1]
    files = [f"{task.instance_id}/tests/{b}.tar.gz" for task in (complete, partial)
             for b in get_active_branches(task.load_instance())]
    with LoopbackHub([f for f in files if not f.endswith(f"/{last}.tar.gz")]) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        both = f"{re.escape(complete.instance_id)}|{re.escape(partial.instance_id)}"
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-filter", both, "--pb-pull", "never",
                                               "--pb-preflight", timeout=300)
    rows = result.stdout.str().split("= programbench preflight =")[1].splitlines()
    assert rows[1].startswith("checked: blobs 1/2 ok"), rows
    assert not any(r.startswith("blobs ") and complete.instance_id in r for r in rows), rows
    assert [r for r in rows if r.startswith("blobs ")] == [
        r for r in rows if r.startswith("blobs ") and partial.instance_id in r and r.endswith(
            f"{last}: not in the dataset programbench/ProgramBench-Tests")], rows
    # One listing for the selection, never a request per archive, never a download (/resolve/).
    listings = [r for r in hub.requests if r.startswith("/api/datasets/programbench/ProgramBench-Tests/tree/")]
    assert len(listings) == 1, hub.requests
    assert not any("/resolve/" in r or complete.instance_id in r for r in hub.requests), hub.requests
    assert _archives(hf_home) == []


def test_unreachable_hub_is_a_row_not_a_hang(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online but the hub does not answer: the listing fails once and says so (no agent: no engine work)."""
    hf_home = _hf_env(pytester, monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-filter", re.escape(PACKAGED),
                                           "--pb-pull", "never", "--pb-preflight", timeout=300)
    assert time.monotonic() - started < 120
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"blobs *{PACKAGED}*not in the Hugging Face cache and the dataset * could not be "
                                 "listed*; pass --pb-blob-dir"])
    assert _archives(hf_home) == []


def test_co_alone_lists_without_the_checks(pytester: pytest.Pytester, testbed: Testbed) -> None:
    """``--co`` stays a listing (fast, no engine, no connections); ``--pb-preflight`` is ``--co`` plus the checks."""
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir),
                                           "--pb-filter", RPN, "--pb-agent", "no-such-agent", "--co", timeout=120)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([f"*<ProgramBenchItem {RPN}>*", "*1 test collected*"])
    assert "programbench preflight" not in result.stdout.str()
