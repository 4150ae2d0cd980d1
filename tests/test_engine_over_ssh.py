"""An engine reached over ``ssh://`` (``--pb-docker-host ssh://...``): the shared engine behind Debian's sshd on
loopback, a task run end to end through it by the reference agent. It needs no engine of its own, so it runs with the
parallel suite (it was part of tests/test_engines.py's serial phase, which holds a private engine for nothing here).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Testbed
from tests.test_engines import RPN, _session, _tasks

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("clean_env")]


@pytest.fixture(scope="module")
def ssh_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The shared engine reached over ``ssh://root@127.0.0.1:<port>``: Debian's sshd on loopback with keys made
    here, and an ``ssh`` wrapper first on PATH that uses them (docker-py runs the system's ``ssh``)."""
    sshd = Path("/usr/sbin/sshd")
    if not sshd.exists():
        pytest.fail("openssh-server is not installed (scripts/test-suite.sh installs it)", pytrace=False)
    root = tmp_path_factory.mktemp("ssh")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / key)], check=True)
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    (root / "authorized_keys").chmod(0o600)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (root / "sshd_config").write_text(textwrap.dedent(f"""\
        ListenAddress 127.0.0.1
        Port {port}
        HostKey {root / "host_key"}
        AuthorizedKeysFile {root / "authorized_keys"}
        PermitRootLogin prohibit-password
        PasswordAuthentication no
        StrictModes no
        UsePAM no
        PidFile {root / "sshd.pid"}
        """))
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    proc = subprocess.Popen([str(sshd), "-D", "-f", str(root / "sshd_config"), "-E", str(root / "sshd.log")])
    bin_dir = root / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -i {root / 'client_key'} -o StrictHostKeyChecking=no "
                       "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o BatchMode=yes \"$@\"\n")
    wrapper.chmod(0o755)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as attempt:
                if attempt.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield f"ssh://root@127.0.0.1:{port}", bin_dir
    finally:
        proc.terminate()  # the sshd we started, by its pid
        proc.wait(30)


def test_an_engine_over_ssh_runs_a_task_end_to_end(pytester: pytest.Pytester, testbed: Testbed,
                                                   ssh_engine: tuple[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url, bin_dir = ssh_engine
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run_dir = pytester.path / "run"
    result = _session(pytester, testbed, run_dir, "--pb-filter", RPN, "--pb-agent", "reference",
                      "--pb-docker-host", url)
    result.assert_outcomes(passed=1)
    task = _tasks(run_dir)["tasks"][RPN]
    assert task["engine"] == url
    assert task["score"] == 1.0
    meta = json.loads((run_dir / RPN / "pb-meta.json").read_text())
    assert meta["agent"]["exit_code"] == 0, meta["agent"]
