"""docs/scaling.md's command ("Running on more than one machine"), as written: codex over three engines, one of them
reached over ``ssh://`` and one over ``tcp://`` with TLS client certificates. The remote machines are this one's shared
engine behind Debian's sshd on loopback and behind a TLS endpoint on loopback (certificates made here, as the docs'
``DOCKER_TLS_VERIFY``/``DOCKER_CERT_PATH`` ask); the rest of the outside world as tests/doc_commands.py substitutes it.
It needs no engine of its own, so it runs with the parallel suite (it was part of tests/test_engines.py's serial
phase, which holds a private engine for nothing here).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import ssl
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Testbed
from tests.doc_commands import Substitution, block, stand_in, written_run_dir
from tests.scripted_models import ScriptedModels

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


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The shared engine reached over ``tcp://127.0.0.1:<port>`` with TLS and client certificates, as a remote
    ``dockerd --tlsverify`` is: a CA, a server certificate for 127.0.0.1 and a client certificate made here
    (``DOCKER_CERT_PATH``'s ``ca.pem``, ``cert.pem``, ``key.pem``); the endpoint verifies the client's certificate
    and passes the bytes on to the engine's socket. Yields (URL, DOCKER_CERT_PATH)."""
    certs = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pb-test-ca",
             "-keyout", str(certs / "ca-key.pem"), "-out", str(certs / "ca.pem"))
    for who, extra in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        key, csr, cert = (certs / f"{who}-{part}.pem" for part in ("key", "csr", "cert"))
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", str(key), "-out", str(csr))
        (certs / f"{who}.ext").write_text(extra + "\n")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(certs / "ca.pem"), "-CAkey", str(certs / "ca-key.pem"),
                 "-CAcreateserial", "-days", "2", "-extfile", str(certs / f"{who}.ext"), "-out", str(cert))
    (certs / "cert.pem").write_bytes((certs / "client-cert.pem").read_bytes())
    (certs / "key.pem").write_bytes((certs / "client-key.pem").read_bytes())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "server-cert.pem", certs / "server-key.pem")
    context.load_verify_locations(certs / "ca.pem")
    context.verify_mode = ssl.CERT_REQUIRED
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    closing = threading.Event()

    def pump(raw: socket.socket) -> None:
        with contextlib.ExitStack() as stack:
            stack.callback(raw.close)
            try:
                tls = context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                return  # a client without our certificate
            stack.callback(tls.close)
            engine = socket.socket(socket.AF_UNIX)
            stack.callback(engine.close)
            engine.connect("/var/run/docker.sock")
            while not closing.is_set():
                ready = [tls] if tls.pending() else select.select([tls, engine], [], [], 1)[0]
                for source in ready:
                    data = source.recv(65536)
                    if not data:
                        return
                    (engine if source is tls else tls).sendall(data)

    def serve() -> None:
        while not closing.is_set():
            try:
                raw, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=pump, args=(raw,), daemon=True).start()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}", certs
    finally:
        closing.set()
        server.join(10)
        listener.close()


def test_the_scaling_command_runs_as_written_over_three_engines(
        pytester: pytest.Pytester, testbed: Testbed, docker_client: Any, ssh_engine: tuple[str, Path],
        tls_engine: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/scaling.md's command: ``-n 12`` over ``default=2``, an ``ssh://`` engine and a ``tcp://`` one, codex
    through the relay. Two tasks (copies of rpn, for the benchmark: tests/doc_commands.py) start at once: the first
    takes a slot of ``default``, the second the least busy engine, the one over ssh://, so a whole task (codex in its
    sandbox reaching the model through the tunnel, pack, evaluation) runs over ssh://; the engine over tcp:// with TLS
    is asked (its CPUs, the sweep) and left clean. Both pass; summary.json says where each ran."""
    from tests.test_cli_agents import STEPS

    ssh_url, bin_dir = ssh_engine
    tcp_url, certs = tls_engine
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    monkeypatch.setenv("DOCKER_CERT_PATH", str(certs))
    commands = block("scaling.md", "Running on more than one machine")
    assert len(commands) == 1, commands
    with ScriptedModels(STEPS) as server:
        table = Substitution({"https://api.example": server.base_url.removesuffix("/v1"),
                              "ssh://runner@gpu-box-1": ssh_url, "tcp://10.0.0.12:2376": tcp_url}, {})
        words = table.words(commands[0])
        table.check_all_used()
        assert table.env(commands) == {}
        with stand_in(pytester.path / "bench", testbed, docker_client, words, tasks=2) as bench:
            result = pytester.runpytest_subprocess(*words, *bench.args, timeout=900)
        keys = set(server.keys)
    assert result.ret == 0, "\n".join([*result.outlines[-60:], *result.errlines[-30:]])
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"*programbench engines: *{ssh_url}*{tcp_url}*"])
    summary = json.loads((written_run_dir(pytester.path) / "summary.json").read_text())
    ran = {summary["tasks"][task]["engine"] for task in bench.tasks}
    assert len(ran) == 2, summary["by_engine"]  # default's and the one over ssh://
    assert ssh_url in ran, summary["by_engine"]
    assert tcp_url not in ran, summary["by_engine"]
    assert all(summary["tasks"][task]["score"] == 1.0 for task in bench.tasks)
    assert keys == {"pb-relay-adds-the-key"}, keys  # no --pb-model-key-env: the placeholder, as the docs say
    assert (pytester.path / "out.xml").is_file()
    left = docker_client.containers.list(all=True, filters={"label": "pytest-programbench"})
    run_id = json.loads((written_run_dir(pytester.path) / "pb-run.json").read_text())["run_id"]
    assert [c.name for c in left if c.labels.get("pytest-programbench") == run_id] == []
