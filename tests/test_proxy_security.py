"""One test per security property of the proxy, each as the agent user in a real sandbox.

Each test fails when its property is broken (e.g. a readable reference makes the running child dumpable, so the
/proc and ptrace tests fail; not stripping LD_PRELOAD makes the injection test print PWNED). Needs Docker and the
test bed; fails, never skips, without them.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.sandbox.sandbox import Sandbox
from tests.proxy_support import CALCULATOR, CATLIKE, agent, open_sandbox, require_image

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def probe_box(engine: Any, run_labels: Labels, probe_image: str) -> Iterator[Sandbox]:
    box = open_sandbox(probe_image, run_labels, engine)
    try:
        yield box
    finally:
        box.close()


@pytest.fixture(scope="module")
def catlike_box(engine: Any, run_labels: Labels) -> Iterator[Sandbox]:
    require_image(engine, CATLIKE)
    box = open_sandbox(CATLIKE, run_labels, engine)
    try:
        yield box
    finally:
        box.close()


def _py(box: Sandbox, source: str, *, user: str = "agent", timeout: float = 120) -> Any:
    """Run a Python snippet (as the agent) that prints one JSON value on its last line."""
    code, text = agent(box, f"python3 -c {shlex.quote(textwrap.dedent(source))}", user=user, timeout=timeout)
    assert code == 0, text
    return json.loads(text.strip().splitlines()[-1])


# The positive control of the ptrace and /proc tests: a dumpable process of the agent user that is not the probe's
# descendant (an orphaned `sleep`, like the reference is no child of the agent's), so Yama's ptrace_scope=1 would
# refuse it too. The same attacks must succeed against it, or a refusal of the reference proves nothing on this host.
CONTROL = """
import os, subprocess
def control_pid():
    shell = subprocess.run(["sh", "-c", "sleep 30 </dev/null >/dev/null 2>&1 & echo $!"], capture_output=True,
                           text=True)
    return int(shell.stdout.strip())
def first_mapping(pid):
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return int(maps.readline().split("-")[0], 16)
    except OSError:
        return 0x400000
"""


# Starts a long-running proxied call (the probe sleeps), then tries every way to read the running child and the
# daemon processes. Prints {path: outcome} where outcome is "ok:<n bytes>" or the error name.
PROC_PROBE = CONTROL + """
import json, os, subprocess, time
child = subprocess.Popen(["/workspace/binary", "sleep", "30"], stdout=subprocess.PIPE)
line = child.stdout.readline().decode()
targets = {"child": int(line.split("=")[1]), "control": control_pid()}
for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
        continue
    try:
        argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\\0")
        status = open(f"/proc/{entry}/status").read()
    except OSError:
        continue
    if len(argv) > 1 and argv[1] == b"/var/lib/pb-proxy/daemon.py":
        uid = [l for l in status.splitlines() if l.startswith("Uid:")][0].split()[1]
        targets[("daemon-root-" if uid == "0" else "daemon-worker-") + entry] = int(entry)
out = {}
for name, target in targets.items():
    for leaf in ("exe", "mem", "maps", "smaps", "environ", "fd", "fd/0", "fd/3", "map_files", "auxv", "root/",
                 "cwd/"):
        path = f"/proc/{target}/{leaf}"
        try:
            if leaf in ("fd", "map_files") or leaf.endswith("/"):
                out[f"{name}:{leaf}"] = "ok:" + str(len(os.listdir(path)))
            elif leaf == "mem":  # opening it is the breach (it needs ptrace access); then read mapped code
                with open(path, "rb") as handle:
                    out[f"{name}:{leaf}"] = "ok:opened"
                    try:
                        handle.seek(first_mapping(target))
                        out[f"{name}:{leaf}"] = "ok:" + str(len(handle.read(64)))
                    except OSError:
                        pass
            else:
                with open(path, "rb") as handle:
                    out[f"{name}:{leaf}"] = "ok:" + str(len(handle.read(4096)))
        except OSError as exc:
            out[f"{name}:{leaf}"] = type(exc).__name__
    try:
        out[f"{name}:readlink-exe"] = "ok:" + os.readlink(f"/proc/{target}/exe")
    except OSError as exc:
        out[f"{name}:readlink-exe"] = type(exc).__name__
out["_targets"] = sorted(targets)
child.kill(); child.wait()
os.kill(targets["control"], 9)
print(json.dumps(out))
"""


def test_reference_file_is_unreadable_by_any_path(probe_box: Sandbox) -> None:
    """No file in the sandbox readable by the agent has the reference's bytes; its directory is closed."""
    layout = probe_box.layout
    result = _py(probe_box, f"""
        import hashlib, json, os
        found, errors = [], {{}}
        for path in ("/var/lib/pb-proxy/executable", "/var/lib/pb-proxy", "/workspace/executable"):
            try:
                open(path, "rb").read(1) if not os.path.isdir(path) else os.listdir(path)
                found.append(path)
            except OSError as exc:
                errors[path] = type(exc).__name__
        for root, dirs, files in os.walk("/", onerror=lambda e: None):
            if root.startswith(("/proc", "/sys", "/dev")):
                dirs[:] = []
                continue
            for name in files:
                path = os.path.join(root, name)
                try:
                    if os.path.islink(path) or os.path.getsize(path) != {layout.reference_size}:
                        continue
                    if hashlib.sha256(open(path, "rb").read()).hexdigest() == "{layout.reference_sha256}":
                        found.append(path)
                except OSError:
                    pass
        print(json.dumps({{"found": found, "errors": errors}}))
    """)
    assert result["found"] == []
    assert result["errors"] == {"/var/lib/pb-proxy/executable": "PermissionError",
                                "/var/lib/pb-proxy": "PermissionError",
                                "/workspace/executable": "FileNotFoundError"}


def test_proc_of_running_child_and_daemon_is_closed(probe_box: Sandbox) -> None:
    result = _py(probe_box, PROC_PROBE)
    kinds = {name.rsplit("-", 1)[0] for name in result.pop("_targets")}
    assert kinds == {"child", "control", "daemon-root", "daemon-worker"}, kinds  # master and agent-uid workers
    # The control (a dumpable process of the agent's, not its descendant) is wide open: the probe works here.
    control = {key.split(":", 1)[1]: value for key, value in result.items() if key.startswith("control:")}
    opened = {leaf: control[leaf] for leaf in ("exe", "mem", "maps", "environ", "auxv", "readlink-exe")}
    assert opened["mem"] == "ok:64", control  # 64 bytes of its code, read through /proc/<pid>/mem
    assert all(value.startswith("ok") for value in opened.values()), control
    leaked = {key: value for key, value in result.items() if value.startswith("ok") and not key.startswith("control:")}
    assert leaked == {}


PTRACE_PROBE = CONTROL + """
import ctypes, ctypes.util, json, os, subprocess, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.waitpid.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc.process_vm_readv.restype = ctypes.c_ssize_t
def attack(pid):
    out = {}
    for name, request in (("attach", 16), ("seize", 0x4206)):
        rc = libc.ptrace(request, pid, None, None)
        out[name] = "ok" if rc == 0 else os.strerror(ctypes.get_errno())
        if rc == 0:
            if name == "attach":  # detaching needs the tracee stopped: wait for the attach's SIGSTOP
                libc.waitpid(pid, None, 0x40000000)  # __WALL
            else:
                libc.ptrace(0x4207, pid, None, None)  # PTRACE_INTERRUPT, then wait for the stop
                libc.waitpid(pid, None, 0x40000000)
            libc.ptrace(17, pid, None, None)
    buf = ctypes.create_string_buffer(64)
    local = iovec(ctypes.cast(buf, ctypes.c_void_p), 64)
    remote = iovec(first_mapping(pid), 64)
    rc = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    out["process_vm_readv"] = "ok" if rc == 64 else os.strerror(ctypes.get_errno())
    return out
child = subprocess.Popen(["/workspace/binary", "sleep", "30"], stdout=subprocess.PIPE)
pid = int(child.stdout.readline().decode().split("=")[1])
control = control_pid()
result = {"reference": attack(pid), "control": attack(control)}
child.kill(); child.wait()
os.kill(control, 9)
print(json.dumps(result))
"""


class _SeccompOff:
    """The real engine, whose containers are created with Docker's seccomp filter off (nothing else changed).

    Docker's default profile (20.10) refuses ``process_vm_readv`` to a container without ``CAP_SYS_PTRACE`` whatever
    the target: in a default sandbox that refusal says nothing about the reference. Without the filter, only the
    reference's non-dumpability stands between the agent and its memory."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    @property
    def containers(self) -> Any:
        collection = self._client.containers

        class Creating:
            def __getattr__(self, name: str) -> Any:
                return getattr(collection, name)

            def create(self, *args: Any, **kwargs: Any) -> Any:
                kwargs["security_opt"] = [*kwargs.get("security_opt", []), "seccomp=unconfined"]
                return collection.create(*args, **kwargs)

        return Creating()


@pytest.fixture(scope="module")
def unfiltered_probe_box(engine: Any, run_labels: Labels, probe_image: str) -> Iterator[Sandbox]:
    box = open_sandbox(probe_image, run_labels, engine=_SeccompOff(engine))
    try:
        yield box
    finally:
        box.close()


DENIED = {"attach": "Operation not permitted", "seize": "Operation not permitted",
          "process_vm_readv": "Operation not permitted"}


def test_ptrace_and_process_vm_readv_are_denied(probe_box: Sandbox, unfiltered_probe_box: Sandbox) -> None:
    """Against the running reference, refused; against the control (a dumpable process of the agent's), the same
    code succeeds: with the engine's seccomp filter off, every attack; in the sandbox as configured, ptrace."""
    unfiltered = _py(unfiltered_probe_box, PTRACE_PROBE)
    assert unfiltered["control"] == {"attach": "ok", "seize": "ok", "process_vm_readv": "ok"}, unfiltered
    assert unfiltered["reference"] == DENIED, unfiltered  # non-dumpability alone
    configured = _py(probe_box, PTRACE_PROBE)
    assert {k: configured["control"][k] for k in ("attach", "seize")} == {"attach": "ok", "seize": "ok"}, configured
    assert configured["reference"] == DENIED, configured


def test_no_core_dump_of_the_reference(probe_box: Sandbox) -> None:
    """With cores enabled, an agent program of its own dumps core (control); the reference never does."""
    script = textwrap.dedent("""
        set -u; mkdir -p /tmp/cores && cd /tmp/cores && rm -f core*
        ulimit -c unlimited
        printf 'int main(void){ *(volatile int*)0 = 1; return 0; }' > crash.c && gcc -o crash crash.c
        ./crash; echo control=$?; echo control-files: $(ls core* 2>/dev/null)
        rm -f core*
        /workspace/binary segv; echo reference=$?; echo reference-files: $(ls core* 2>/dev/null)
    """)
    _code, text = agent(probe_box, script)
    lines = dict(line.split("=", 1) if "=" in line else line.split(":", 1) for line in text.strip().splitlines()
                 if line.startswith(("control", "reference")))
    assert lines["reference"].strip() == "139"
    assert lines["reference-files"].strip() == ""
    record = [r for r in probe_box.call_log() if r.get("argv", [None, None])[1:2] == ["segv"]][-1]
    assert record["signal"] == 11
    assert record["core"] is False
    # The control shows the environment can produce cores, so the absence above is meaningful.
    assert lines["control"].strip() == "139"
    assert lines["control-files"].strip().startswith("core"), text


def test_reference_cannot_read_itself(catlike_box: Sandbox) -> None:
    """A cat-like reference fails on /proc/self/exe, /proc/self/fd/*, /proc/self/mem, /proc/self/map_files."""
    layout = catlike_box.layout
    result = _py(catlike_box, f"""
        import hashlib, json, subprocess
        out = {{}}
        paths = ["/proc/self/exe", "/proc/self/mem", "/proc/self/environ", "/proc/self/maps"]
        paths += ["/proc/self/fd/%d" % n for n in [0, *range(3, 16)]]  # (1, 2: its own output pipes)
        paths += ["/dev/fd/3", "/proc/thread-self/exe"]
        for path in paths:
            done = subprocess.run(["/workspace/binary", path], stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=20)
            data = done.stdout
            out[path] = {{"rc": done.returncode, "elf": data[:4] == b"\\x7fELF", "size": len(data),
                         "same": hashlib.sha256(data).hexdigest() == "{layout.reference_sha256}",
                         "err": done.stderr.decode(errors="replace").strip()}}
        print(json.dumps(out))
    """)
    for path, outcome in result.items():
        assert not outcome["elf"], (path, outcome)
        assert not outcome["same"], (path, outcome)
        if path.startswith("/proc/self/fd/") and path != "/proc/self/fd/0":
            assert outcome["rc"] == 1, (path, outcome)
    assert "Permission denied" in result["/proc/self/exe"]["err"]
    assert "Permission denied" in result["/proc/self/mem"]["err"]


def test_reference_cannot_read_its_own_memory(probe_box: Sandbox) -> None:
    """Even a reference that seeks in /proc/self/mem gets nothing: non-dumpable, its /proc files are root's."""
    _code, text = agent(probe_box, "/workspace/binary selfmem; echo rc=$?")
    assert "rc=1" in text, text
    assert "/proc/self/mem: Permission denied" in text, text


def test_dynamic_loader_variables_are_stripped(probe_box: Sandbox) -> None:
    variables = ["LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "LD_DEBUG", "LD_BIND_NOW", "GCONV_PATH",
                 "GLIBC_TUNABLES", "LOCPATH", "MALLOC_TRACE", "JAVA_TOOL_OPTIONS", "NODE_OPTIONS"]
    assignments = " ".join(f"{name}=/tmp/x" for name in variables)
    _code, text = agent(probe_box, f"env {assignments} KEEP=1 /workspace/binary env")
    names = {line.split("=", 1)[0] for line in text.splitlines() if "=" in line}
    assert "KEEP" in names
    assert names.isdisjoint(variables), names & set(variables)
    record = probe_box.call_log()[-1]
    assert set(record["stripped_env"]) == set(variables)


def test_ld_preload_injection_does_not_run(probe_box: Sandbox) -> None:
    """The attack that works on the official layout (a constructor dumping the process) does nothing here."""
    script = textwrap.dedent("""
        cd /tmp && cat > evil.c <<'EOF'
        #include <stdio.h>
        #include <unistd.h>
        __attribute__((constructor)) static void evil(void) { fprintf(stderr, "PWNED uid=%d\\n", getuid()); }
        EOF
        gcc -shared -fPIC -o /tmp/evil.so evil.c
        LD_AUDIT=/tmp/evil.so /workspace/binary exit 0 2> /tmp/audit.err
        LD_PRELOAD=/tmp/evil.so /workspace/binary exit 0 2> /tmp/preload.err
        LD_PRELOAD=/tmp/evil.so /bin/true 2> /tmp/control.err
        for run in audit preload control; do echo "$run $(grep -c PWNED /tmp/$run.err)"; done
    """)
    # Each run's stderr in a file of its own, counted after all ran: the merged output's order is not defined.
    _code, text = agent(probe_box, script)
    counts = dict(line.split() for line in text.splitlines() if line.split()[:1] in (["audit"], ["preload"],
                                                                                      ["control"]))
    assert counts["control"] == "1", text  # the injection itself works...
    assert (counts["audit"], counts["preload"]) == ("0", "0"), text  # ...but never through the proxy


def test_other_users_are_refused(probe_box: Sandbox) -> None:
    _code, text = agent(probe_box, "/workspace/binary exit 0; echo rc=$?", user="65534:65534")
    assert "rc=126" in text, text
    assert "permission denied: uid 65534" in text, text
    _code, text = agent(probe_box, "/workspace/binary exit 0; echo rc=$?", user="root")
    assert "rc=126" in text, text
    assert "permission denied: uid 0" in text, text
    refusals = [r for r in probe_box.call_log() if "refused" in r.get("error", "")]
    assert {r["uid"] for r in refusals} >= {0, 65534}


HOSTILE = """
import json, os, socket, struct, subprocess, time
PATH = "/run/pb-proxy/proxy.sock"
HEADER = struct.Struct("<4sIIIIIIIQQII")

def master():
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\\0")
                if len(argv) > 1 and argv[1] == b"/var/lib/pb-proxy/daemon.py":
                    status = open(f"/proc/{entry}/status").read()
                    if "\\nUid:\\t0\\t" in status:
                        return int(entry)
            except OSError:
                pass

def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(PATH)
    return s

def reply(s):
    s.settimeout(40)
    data = b""
    try:
        while len(data) < 16:
            chunk = s.recv(16 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        return type(exc).__name__
    return data[:4].decode(errors="replace") + (str(struct.unpack("<i", data[8:12])[0]) if len(data) == 16 else "")

before = master()
long_call = subprocess.Popen(["/workspace/binary", "sleep", "4"], stdout=subprocess.PIPE)
outcomes = {}
slow = conn(); slow.send(b"PBX1")  # never finishes its request
s = conn(); s.send(b"GARBAGE" * 20); outcomes["garbage"] = reply(s)
s = conn(); s.close(); outcomes["connect-close"] = "done"
s = conn(); s.send(HEADER.pack(b"PBX1", 1, 0xF, 0, 1, 0, 0, 0, 0, 0, 2, 0) + b"x\\0"); outcomes["fdmask"] = reply(s)
s = conn(); s.send(HEADER.pack(b"PBX1", 1, 0, 0, 1, 0, 0, 0, 0, 0, 1 << 31, 0)); outcomes["huge"] = reply(s)
s = conn(); s.send(HEADER.pack(b"PBX1", 1, 0, 0, 5, 0, 0, 0, 0, 0, 4, 0) + b"a\\0b\\0"); outcomes["count"] = reply(s)
s = conn(); s.send(HEADER.pack(b"PBX1", 1, 0, 0, 1, 0, 0, 0, 0, 0, 3, 0) + b"abc"); outcomes["unterminated"] = reply(s)
s = conn()
r, w = os.pipe()
fds = [r] * 4 + [w] * 4
s.sendmsg([HEADER.pack(b"PBX1", 1, 0xF, 0, 1, 0, 0, 0, 0, 0, 2, 0)],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("8i", *fds))])
s.send(b"x\\0"); outcomes["too-many-fds"] = reply(s)
s = conn(); s.send(os.urandom(4096)); outcomes["random"] = reply(s)
for i in range(40):
    s = conn(); s.send(os.urandom(i * 7)); s.close()
# A bare request with no descriptors at all: runs with stdio closed; must not hurt anything.
s = conn(); s.send(HEADER.pack(b"PBX1", 1, 0, 0, 3, 0, 0, 0, 0, 0, 9, 0) + b"x\\0exit\\x003\\0")
outcomes["no-fds"] = reply(s)
normal = subprocess.run(["/workspace/binary", "argv", "still", "works"], capture_output=True)
outcomes["normal"] = [normal.returncode, normal.stdout.decode()]
outcomes["long"] = [long_call.wait(30), long_call.stdout.read().decode().startswith("pid=")]
outcomes["master-same"] = master() == before and before is not None
slow.close()
print(json.dumps(outcomes))
"""


def test_hostile_requests_kill_neither_the_daemon_nor_other_calls(probe_box: Sandbox) -> None:
    result = _py(probe_box, HOSTILE)
    assert result["normal"] == [0, "[/workspace/binary]\n[argv]\n[still]\n[works]\n"]
    assert result["long"] == [0, True]
    assert result["master-same"] is True
    assert result["no-fds"] == "PBR13"  # a well-formed call without descriptors just runs (stdio closed)
    for name in ("garbage", "fdmask", "huge", "count", "unterminated", "too-many-fds", "random"):
        assert result[name] == "PBR1125", (name, result[name])  # a plain refusal, not a crash
    errors = [r.get("error", "") for r in probe_box.call_log()]
    assert sum("bad request" in e for e in errors) >= 7


def test_files_created_by_the_reference_belong_to_the_agent(probe_box: Sandbox) -> None:
    _code, text = agent(probe_box, "cd /workspace/src && /workspace/binary touch made-by-ref && stat -c '%u:%g %a' "
                                  "made-by-ref && rm made-by-ref && echo removed")
    assert f"uid={probe_box.layout.agent_uid} gid={probe_box.layout.agent_gid} mode=644" in text
    assert f"{probe_box.layout.agent_uid}:{probe_box.layout.agent_gid} 644" in text
    assert "removed" in text


def test_no_daemon_descriptor_reaches_the_reference(probe_box: Sandbox) -> None:
    _code, text = agent(probe_box, "/workspace/binary fds < /dev/null 2>/dev/null | cat")
    assert [line.split(" -> ")[0] for line in text.strip().splitlines()] == ["0", "1", "2"], text


def test_calls_are_recorded_and_proc_mem_flagged(probe_box: Sandbox) -> None:
    agent(probe_box, "cd /workspace/src && ln -sf /proc/self/mem m && /workspace/binary cat m; "
                     "/workspace/binary cat /proc/1/mem; /workspace/binary argv logged 'two words'")
    records = probe_box.call_log()
    last = records[-3:]
    assert last[0]["flags"] == ["proc-mem"]
    assert last[1]["flags"] == ["proc-mem"]
    assert last[2]["argv"] == ["/workspace/binary", "argv", "logged", "two words"]
    assert last[2]["cwd"] == "/workspace/src"
    assert last[2]["exit"] == 0
    assert last[2]["duration_s"] >= 0
    assert last[2]["uid"] == probe_box.layout.agent_uid


def test_script_reference_gets_a_plain_message(engine: Any, run_labels: Labels) -> None:
    require_image(engine, CALCULATOR)
    with Sandbox(CALCULATOR, labels=run_labels, cpus=1, memory=1 << 30, lifetime=600, engine=engine) as box:
        assert box.layout.reference_kind == "script"
        _code, text = agent(box, "/workspace/binary 1 + 2; echo rc=$?")
    assert "rc=126" in text
    assert "is a script (#!/bin/bash" in text or "is a script (#!/usr/bin/env bash" in text, text
    assert "cannot run from an execute-only file (mode 111)" in text


def test_daemon_refuses_to_serve_when_suid_dumpable_is_1(tmp_path: Any) -> None:
    """fs.suid_dumpable=1 would make execute-only programs dumpable: the daemon must not start."""
    import importlib.util

    from pytest_programbench.sandbox.proxy_build import DAEMON_SOURCE

    spec = importlib.util.spec_from_file_location("pb_proxy_daemon_under_test", DAEMON_SOURCE)
    assert spec is not None
    assert spec.loader is not None
    daemon = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(daemon)
    flag = tmp_path / "suid_dumpable"
    flag.write_text("1\n")
    daemon.SUID_DUMPABLE = str(flag)
    args = daemon._parser().parse_args(["serve", "--agent-uid", "1777", "--agent-gid", "1777",
                                        "--socket", str(tmp_path / "s.sock"), "--reference", "/bin/true"])
    assert daemon.serve(daemon.Config(args)) == 3
    assert not (tmp_path / "s.sock").exists()
