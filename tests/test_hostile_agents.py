# ruff: noqa: F811 - pytest fixtures imported from proxy_support are parameters here
"""Hostile agents (issue 13): nothing an agent does becomes an unscored error, outlives its window or fills the host.

Each finding is an agent script run through a real session (``pytester.runpytest_subprocess``, real sandboxes): the
item is scored (failed, with the right note), never an error; the agent ran once; no container is left. The sandbox
tests below check the mechanisms directly (freeze-then-kill, the /proc/*/mem audit, the strip list in a real call);
the pure tests pin the bounds. Needs Docker and the test bed; fails, never skips, without them.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import stat
import tarfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker.errors import ImageNotFound

from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.sandbox import sandbox as sandbox_module
from pytest_programbench.sandbox.agent_log import CappedLog
from pytest_programbench.sandbox.sandbox import Sandbox, merge_call_records
from tests.conftest import Testbed
from tests.proxy_support import (  # noqa: F401 - fixtures
    RPN,
    agent,
    engine,
    load_daemon,
    open_sandbox,
    probe_image,
    require_image,
    run_labels,
)
from tests.test_outcomes import leaked

RPN_ID = "pbfix__rpn.0b5e55e"
ATTACKS = ("flood", "calls", "chain", "setuid", "interrupt")
WINDOW_ATTACKS = ("shmdeath", "shmbound", "forkpth")  # issue 21 §2, §5: the sandbox and the window's end
CHAINS = 20




daemon = load_daemon("pb_proxy_daemon_hostile")

# The hostile agent, one attack per task (the task id names it). Mounted read-only into every sandbox.
HOSTILE_AGENT = r'''
import os, subprocess, sys, time

attack = os.environ["PB_TASK_ID"].split("__")[1].split(".")[0]
print("AGENT-START", attack, flush=True)


def own_processes():
    """(pid, ppid, cmdline) of every process of this uid."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = open("/proc/%s/status" % name).read()
            cmd = open("/proc/%s/cmdline" % name, "rb").read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == os.getuid():
            out.append((int(name), int(fields["PPid"]), cmd))
    return out


if attack == "flood":  # finding 3: gigabytes of output (here 5 MiB against a 1 MiB cap)
    out = sys.stdout.buffer
    out.write(b"HEAD-MARK\n")
    for _ in range(80):
        out.write(b"x" * 65535 + b"\n")
    out.write(b"TAIL-MARK\n")
    out.flush()
elif attack == "calls":  # finding 1: records made huge by stripped names and escaped arguments
    env = {"PATH": os.environ["PATH"]}
    for i in range(7):
        env["LD_" + "\x01" * 120000 + str(i)] = "1"
    for _ in range(3):
        subprocess.run(["/workspace/binary"] + ["\x01" * 120000] * 7, env=env, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("CALLS-DONE", flush=True)
elif attack == "chain":  # finding 2: a fork chain that keeps changing pid, calls the reference, rewrites src
    chain = (
        "import os, subprocess\n"
        "while True:\n"
        "    open('/workspace/src/chain.txt', 'a').write('tick\\n')\n"
        "    subprocess.run(['/workspace/binary'], input=b'1 2 +\\n', capture_output=True)\n"
        "    with open('/workspace/src/big.bin', 'wb') as f:\n"
        "        f.write(os.urandom(1 << 20) * 8)\n"
        "    if os.fork():\n"
        "        os._exit(0)\n"
    )
    subprocess.Popen([sys.executable, "-c", chain], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists("/workspace/src/chain.txt") or \
            open("/workspace/src/chain.txt").read().count("tick") < 3:
        time.sleep(0.05)
    print("CHAIN-RUNNING", flush=True)
elif attack == "setuid":  # finding 6: setuid/setgid/sticky bits in the submission
    with open("/bin/true", "rb") as src, open("/workspace/src/tool", "wb") as dst:
        dst.write(src.read())
    os.chmod("/workspace/src/tool", 0o6755)
    os.mkdir("/workspace/src/shared")
    os.chmod("/workspace/src/shared", 0o1777)
    print("SETUID-DONE", oct(os.stat("/workspace/src/tool").st_mode), flush=True)
elif attack in ("shmbound", "shmdeath"):  # issue 21 §2: shared memory that nothing reclaims fills the sandbox
    open("/workspace/src/before.txt", "w").write("written before the memory filled\n")
    fill = (
        "import ctypes, os, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.shmat.restype = ctypes.c_void_p\n"
        "libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]\n"
        "libc.shmdt.argtypes = [ctypes.c_void_p]\n"
        "made = 0\n"
        "while True:\n"
        "    seg = libc.shmget(0, 8 << 20, 0o1000 | 0o600)\n"
        "    addr = libc.shmat(seg, None, 0) if seg >= 0 else None\n"
        "    if addr is None or addr == ctypes.c_void_p(-1).value:\n"
        "        print('SHM-REFUSED', made, os.strerror(ctypes.get_errno()), flush=True)\n"
        "        break\n"
        "    ctypes.memset(addr, 1, 8 << 20)\n"
        "    if sys.argv[1] == 'detach':\n"
        "        libc.shmdt(ctypes.c_void_p(addr))\n"
        "    made += 1\n"
    )
    open("/tmp/fill.py", "w").write(fill)
    if attack == "shmbound":  # attached segments up to the namespace's bound, then /dev/shm up to its size
        subprocess.run([sys.executable, "/tmp/fill.py", "attach"])
        written = 0
        try:
            with open("/dev/shm/fill", "wb") as handle:
                while True:
                    handle.write(b"\1" * (1 << 20))
                    handle.flush()
                    written += 1
        except OSError as exc:
            print("DEVSHM-FULL", written, exc.errno, flush=True)
    else:  # detached segments, from fillers started again and again, until the sandbox dies
        for _ in range(3):
            subprocess.Popen(["sh", "-c", "while :; do python3 /tmp/fill.py detach; done"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(240)
        print("SANDBOX-SURVIVED", flush=True)
elif attack == "forkpth":  # issue 21 §5: fork chains calling the reference, and a .pth in the agent's user site
    chain = (
        "import os, subprocess, sys\n"
        "while True:\n"
        "    done = subprocess.run(['/workspace/binary'], input=b'1 2 +\\n', capture_output=True)\n"
        "    with open('/workspace/src/calls-%s.txt' % sys.argv[1], 'a') as handle:\n"
        "        handle.write('%d\\n' % done.returncode)\n"
        "    if os.fork():\n"
        "        os._exit(0)\n"
    )
    for n in range(int(os.environ["PB_CHAINS"])):
        subprocess.Popen([sys.executable, "-c", chain, str(n)], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def calls(n):
        try:
            return open("/workspace/src/calls-%d.txt" % n).read().count("\n")
        except OSError:
            return 0
    while min(calls(n) for n in range(int(os.environ["PB_CHAINS"]))) < 2:
        time.sleep(0.05)
    # From now on any Python of this uid exits at start-up (the old kill pass ran one as the agent).
    site = subprocess.run([sys.executable, "-c", "import site; print(site.getusersitepackages())"],
                          capture_output=True, text=True).stdout.strip()
    os.makedirs(site, exist_ok=True)
    open(os.path.join(site, "zz-exit.pth"), "w").write("import os; os._exit(0)\n")
    print("CHAINS-RUNNING", flush=True)
elif attack == "interrupt":  # finding 4: the proxy worker killed mid-call
    client = subprocess.Popen(["/workspace/binary"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    while True:
        procs = own_processes()
        workers = {pid for pid, _ppid, cmd in procs if b"/var/lib/pb-proxy/daemon.py" in cmd}  # (forked, not exec'd)
        if any(ppid in workers and pid not in workers for pid, ppid, _cmd in procs):
            break  # the reference runs: its "started" line is written
        time.sleep(0.05)
    for pid in workers:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    print("KILLED-WORKERS", len(workers), flush=True)
'''


@pytest.fixture
def hostile_tasks(pytester: pytest.Pytester, testbed: Testbed, docker_client: Any) -> Iterator[Path]:
    """Copies of the rpn task, one per attack, its image tagged under each copy's name."""
    root = pytester.mkdir("tasks")
    # A commit hash of its own per test: two tests on two xdist workers never share (nor untag) an image tag.
    (root.parent / "suffix.txt").write_text(uuid.uuid4().hex[:7])
    image = docker_client.images.get(f"programbench/{RPN_ID.replace('__', '_1776_')}:task_cleanroom_v6")
    tags = []
    for attack in (*ATTACKS, *WINDOW_ATTACKS, "unreadable"):
        iid = f"pbhostile__{attack}.{(root.parent / 'suffix.txt').read_text()}"
        shutil.copytree(testbed.tasks_dir / RPN_ID, root / iid)
        repository = f"programbench/{iid.replace('__', '_1776_')}"
        image.tag(repository, "task_cleanroom_v6")
        tags.append(f"{repository}:task_cleanroom_v6")
    agents = pytester.mkdir("hostile")
    (agents / "hostile.py").write_text(HOSTILE_AGENT)
    try:
        yield root
    finally:
        for tag in tags:
            with contextlib.suppress(ImageNotFound):
                docker_client.images.remove(tag, noprune=True)


def _run(pytester: pytest.Pytester, testbed: Testbed, tasks: Path, run_dir: Path, pattern: str,
         *extra: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", *extra, "--pb-tasks-dir", str(tasks), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", pattern, "--pb-agent", "python3 /pb-hostile/hostile.py",
        "--pb-agent-mount", f"{pytester.path / 'hostile'}:/pb-hostile", "--pb-pull", "never",
        "--pb-output", str(run_dir), "--pb-cpus", "2", "--pb-agent-timeout", "300", timeout=1200)


# Makes the OOM killer end the sandbox's init once the agent filled its memory (as it did on the engine of issue 21
# §2): for the shmdeath task only, the IPC bounds are lifted and init's child holds 256 MiB (the largest process).
OOM_DEATH_PLUGIN = textwrap.dedent("""
    from docker.models.containers import ContainerCollection

    original = ContainerCollection.create
    HOG = "import sys, time; hold = b'\\1' * (256 << 20); time.sleep(float(sys.argv[1]))"

    def create(self, image, command=None, **kwargs):
        if "shmdeath" in str((kwargs.get("labels") or {}).get("pytest-programbench.task")) and "sysctls" in kwargs:
            kwargs["sysctls"] = {"kernel.shm_rmid_forced": "0", "kernel.shmall": str(1 << 30),
                                 "kernel.shmmax": str(1 << 40)}
            kwargs["entrypoint"] = ["python3", "-c", HOG]
        return original(self, image, command, **kwargs)

    ContainerCollection.create = create

    # After the window's end, what of the agent's uid is left, seen from the engine's host (docker top).
    import json, os
    from pytest_programbench.sandbox.sandbox import Sandbox

    end_window = Sandbox.end_agent_window

    def probed(self):
        ended = end_window(self)
        state = self.engine.api.inspect_container(self.id)["State"]
        left = []
        if state["Running"]:
            top = self.engine.api.top(self.id, ps_args="-eo pid,ruid,stat,args")
            left = [row for row in top["Processes"] if row[1] == str(self.layout.agent_uid) and row[2][0] != "Z"]
        with open(os.path.join(os.environ["PB_WINDOW_PROBE"], self.labels.task + ".json"), "w") as handle:
            json.dump({"running": state["Running"], "agent_processes": left}, handle)
        return ended

    Sandbox.end_agent_window = probed
""")


@pytest.mark.usefixtures("clean_env")
def test_the_window_ends_frozen_and_a_sandbox_the_agent_kills_is_scored(
        pytester: pytest.Pytester, testbed: Testbed, hostile_tasks: Path, docker_client: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21 §2 and §5 in one session: a sandbox the agent fills to death is scored from its stopped container
    (never re-run); the IPC bounds hold; fork chains and a .pth in the agent's user site do not outlive the window,
    every call is recorded and the count of what was left running is right."""
    pytester.makepyfile(pb_oom_death=OOM_DEATH_PLUGIN)
    monkeypatch.setenv("PB_CHAINS", str(CHAINS))
    probes = pytester.mkdir("window-probe")
    monkeypatch.setenv("PB_WINDOW_PROBE", str(probes))
    run_dir = pytester.path / "run"
    result = _run(pytester, testbed, hostile_tasks, run_dir, "pbhostile__(" + "|".join(WINDOW_ATTACKS) + ")",
                  "-p", "pb_oom_death", "-n", "2", "--pb-sandbox-memory", "768m", "--pb-agent-env", "PB_CHAINS")
    result.assert_outcomes(failed=len(WINDOW_ATTACKS))
    summary = json.loads((run_dir / "summary.json").read_text())
    suffix = (hostile_tasks.parent / "suffix.txt").read_text()
    ids = {attack: f"pbhostile__{attack}.{suffix}" for attack in WINDOW_ATTACKS}
    for attack, iid in ids.items():
        task = summary["tasks"][iid]
        assert task["outcome"] == "failed", (attack, task)
        assert (run_dir / iid / "agent.log").read_bytes().count(b"AGENT-START") == 1, (attack, "ran twice")
        assert not any(r.startswith("[gw") for r in task["reasons"]), task["reasons"]  # the cause, not the worker
    reasons = {attack: "\n".join(summary["tasks"][iid]["reasons"]) for attack, iid in ids.items()}
    meta = {attack: json.loads((run_dir / iid / "pb-meta.json").read_text()) for attack, iid in ids.items()}

    # §2: the OOM killer ended the sandbox; the agent's files written before are scored, the agent not re-run.
    assert b"SANDBOX-SURVIVED" not in (run_dir / ids["shmdeath"] / "agent.log").read_bytes()
    assert meta["shmdeath"]["sandbox_end"]["agent_caused"] is True, meta["shmdeath"]
    assert "OOM killed: True" in meta["shmdeath"]["sandbox_end"]["died"]
    assert "the agent's doing (it filled its memory limit)" in reasons["shmdeath"]
    with tarfile.open(run_dir / ids["shmdeath"] / "submission.tar.gz") as tar:
        assert "before.txt" in tar.getnames()
    # ... and where the bounds hold, SysV segments stop at a quarter of the memory, /dev/shm at as much.
    bound = (run_dir / ids["shmbound"] / "agent.log").read_text()
    assert "SHM-REFUSED 24 No space left on device" in bound  # 24 x 8 MiB = 192 MiB = 768m / 4
    assert re.search(r"DEVSHM-FULL (19[0-2]) 28", bound), bound
    assert meta["shmbound"]["sandbox_end"]["died"] is None

    # §5: the chains were frozen with the sandbox (their .pth stopped nothing), counted, and every call they saw
    # end is in the call log (a call after the log was read would be missing from it). After the window nothing of
    # the agent's uid is left (the sandbox is stopped; seen from the engine's host).
    assert b"CHAINS-RUNNING" in (run_dir / ids["forkpth"] / "agent.log").read_bytes()
    for attack, iid in ids.items():
        probe = json.loads((probes / f"{iid}.json").read_text())
        assert probe == {"running": False, "agent_processes": []}, (attack, probe)
    survivors = meta["forkpth"]["sandbox_end"]["survivors"]
    assert survivors is not None, meta["forkpth"]["sandbox_end"]
    # Each chain: its Python, and perhaps the client and the reference of a call in flight, or a parent not yet
    # gone after its fork.
    assert CHAINS <= survivors <= 4 * CHAINS, survivors
    assert f"{survivors} process(es) of the agent were still running at the end of its window" in reasons["forkpth"]
    seen = 0
    with tarfile.open(run_dir / ids["forkpth"] / "submission.tar.gz") as tar:
        for member in tar.getmembers():
            handle = tar.extractfile(member) if member.name.startswith("calls-") else None
            seen += handle.read().count(b"\n") if handle is not None else 0
    records = [json.loads(line) for line in (run_dir / ids["forkpth"] / "binary-calls.jsonl").read_text()
               .splitlines()]
    assert seen >= 2 * CHAINS
    assert len(records) >= seen, (len(records), seen)
    assert meta["forkpth"]["binary_calls"] >= len(records)

    assert leaked(docker_client, run_dir) == []


@pytest.mark.usefixtures("clean_env")
def test_hostile_agents_are_scored_never_errors(pytester: pytest.Pytester, testbed: Testbed, hostile_tasks: Path,
                                                docker_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PB_AGENT_LOG_MAX", "1m")
    run_dir = pytester.path / "run"
    # Five attacks in one session (-n 2): each is one real agent window, packing and evaluation.
    result = _run(pytester, testbed, hostile_tasks, run_dir, "pbhostile__(" + "|".join(ATTACKS) + ")", "-n", "2")
    result.assert_outcomes(failed=len(ATTACKS))
    tasks = json.loads((run_dir / "summary.json").read_text())["tasks"]
    ids = {attack: f"pbhostile__{attack}.{(hostile_tasks.parent / 'suffix.txt').read_text()}" for attack in ATTACKS}
    for attack, iid in ids.items():
        assert tasks[iid]["outcome"] == "failed", (attack, tasks[iid])
        log = (run_dir / iid / "agent.log").read_bytes()
        assert log.count(b"AGENT-START") == 1, (attack, "the agent ran more than once")

    # 3: agent.log capped, head and tail kept, the drop said.
    flood = (run_dir / ids["flood"] / "agent.log").read_bytes()
    assert len(flood) <= (1 << 20) + 1024
    assert b"HEAD-MARK" in flood[:100]
    assert flood.rstrip().endswith(b"TAIL-MARK")
    assert b"bytes of output dropped here" in flood

    # 1: every record bounded, the counts kept; the log is read (no note, no flag).
    lines = (run_dir / ids["calls"] / "binary-calls.jsonl").read_bytes().splitlines()
    assert len(lines) == 3
    for line in lines:
        assert len(line) <= daemon.RECORD_MAX + 256
        record = json.loads(line)
        assert record["argv_count"] == 8
        assert record["stripped_env_count"] == 7
    assert b"CALLS-DONE" in (run_dir / ids["calls"] / "agent.log").read_bytes()
    assert not any("call-log" in r for r in tasks[ids["calls"]]["reasons"])

    # 2: the fork chain was frozen and killed before packing: the pack is the agent's files, scored.
    assert b"CHAIN-RUNNING" in (run_dir / ids["chain"] / "agent.log").read_bytes()
    with tarfile.open(run_dir / ids["chain"] / "submission.tar.gz") as tar:
        assert "chain.txt" in tar.getnames()

    # 6: no setuid, setgid or sticky bit survives packing.
    assert b"SETUID-DONE 0o106755" in (run_dir / ids["setuid"] / "agent.log").read_bytes()
    with tarfile.open(run_dir / ids["setuid"] / "submission.tar.gz") as tar:
        modes = {m.name: m.mode for m in tar.getmembers()}
    assert modes["tool"] == 0o755
    assert modes["shared"] == 0o777
    assert all(not mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX) for mode in modes.values())

    # 4: the call whose worker was killed mid-call has its record, marked interrupted, and the outcome says so.
    assert b"KILLED-WORKERS" in (run_dir / ids["interrupt"] / "agent.log").read_bytes()
    records = [json.loads(line) for line in (run_dir / ids["interrupt"] / "binary-calls.jsonl").read_text()
               .splitlines()]
    interrupted = [r for r in records if r.get("interrupted")]
    assert [r["argv"] for r in interrupted] == [["/workspace/binary"]]
    assert any("never ended" in reason for reason in tasks[ids["interrupt"]]["reasons"])

    assert leaked(docker_client, run_dir) == []


# Makes the call log unreadable for the harness (as an oversized log was): the read limit shrinks to 64 bytes.
SMALL_READ_LIMIT_PLUGIN = textwrap.dedent("""
    from pytest_programbench.sandbox import sandbox
    sandbox.CALL_LOG_READ_LIMIT = 64
    sandbox.TAR_OVERHEAD = 0
""")


@pytest.mark.usefixtures("clean_env")
def test_an_unreadable_call_log_is_a_note_and_a_flag(pytester: pytest.Pytester, testbed: Testbed,
                                                     hostile_tasks: Path, docker_client: Any) -> None:
    """Scored, never an error; the abandoned read closes its archive stream, so the sandbox is removed."""
    pytester.makepyfile(pb_small_read_limit=SMALL_READ_LIMIT_PLUGIN)
    (pytester.path / "hostile" / "hostile.py").write_text(
        "import subprocess\nprint('AGENT-START', flush=True)\n"
        "for _ in range(3):\n    subprocess.run(['/workspace/binary', 'x' * 500], stdin=subprocess.DEVNULL)\n")
    run_dir = pytester.path / "run"
    result = _run(pytester, testbed, hostile_tasks, run_dir, "pbhostile__unreadable", "-p", "pb_small_read_limit")
    result.assert_outcomes(failed=1)
    iid = f"pbhostile__unreadable.{(hostile_tasks.parent / 'suffix.txt').read_text()}"
    reasons = "\n".join(json.loads((run_dir / "summary.json").read_text())["tasks"][iid]["reasons"])
    assert "the proxy's call log could not be read" in reasons
    assert "integrity flags: call-log-unreadable" in reasons
    assert (run_dir / iid / "agent.log").read_text().count("AGENT-START") == 1
    assert leaked(docker_client, run_dir) == []


# ---------------------------------------------------------------------------------------------- in a sandbox
@pytest.fixture(scope="module")
def rpn_box(engine: Any, run_labels: Labels) -> Iterator[Sandbox]:
    require_image(engine, RPN)
    box = open_sandbox(RPN, run_labels, engine)
    try:
        yield box
    finally:
        box.close()


@pytest.fixture(scope="module")
def probe_box(engine: Any, run_labels: Labels, probe_image: str) -> Iterator[Sandbox]:
    box = open_sandbox(probe_image, run_labels, engine)
    try:
        yield box
    finally:
        box.close()


# Scans /proc up to {scans} times (stopping at the first sighting) for processes of the agent's uid other than the
# proxy's; prints the command lines seen. A live chain always has one process: repeated scans cannot miss it.
LIST_AGENT_PROCESSES = """
import json, os
seen = []
for _ in range({scans}):
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            status = open('/proc/%s/status' % name).read()
            cmd = open('/proc/%s/cmdline' % name, 'rb').read()
        except OSError:
            continue
        fields = dict(l.split(':', 1) for l in status.splitlines() if ':' in l)
        if int(fields['Uid'].split()[0]) == {uid} and fields['State'].split()[0] != 'Z' and b'daemon.py' not in cmd:
            seen.append(cmd.decode(errors='replace'))
    if seen:
        break
print(json.dumps(seen))
"""

# Forks a successor every 10 ms and exits: a new pid all the time.
FORK_CHAIN = "import os, time\nwhile True:\n    time.sleep(0.01)\n    if os.fork():\n        os._exit(0)\n"


def test_freeze_then_kill_leaves_no_fork_chain(rpn_box: Sandbox) -> None:
    """Two chains of processes that fork and exit (new pids all the time) are gone after one call, a .pth in the
    agent's user site (any Python of its uid exits at start-up) notwithstanding: only root runs the kill."""
    quoted = shlex.quote(FORK_CHAIN)
    started = rpn_box.exec(f"python3 -c {quoted} & python3 -c {quoted} & echo started", timeout=30)
    assert "started" in started.text
    pth = rpn_box.exec(["python3", "-c", "import site; print(site.getusersitepackages())"], timeout=30).text.strip()
    planted = rpn_box.exec(f"mkdir -p {pth} && echo 'import os; os._exit(0)' > {pth}/zz-exit.pth && python3 -c "
                           "'print(\"not reached\")'; echo planted", timeout=30)
    assert planted.text.strip() == "planted", planted.text

    def sightings(scans: int) -> list[str]:
        script = LIST_AGENT_PROCESSES.format(uid=rpn_box.layout.agent_uid, scans=scans)
        listing = rpn_box.exec(["python3", "-c", script], user="root", workdir="/", timeout=60)
        return list(json.loads(listing.text.strip().splitlines()[-1]))

    assert sightings(1000), "the chains should be running before the kill"
    report = rpn_box.kill_agent_processes()
    assert report["left"] == [], report
    assert sightings(200) == []
    rpn_box.exec(f"rm -f {pth}/zz-exit.pth", timeout=30)
    # The proxy's workers were spared (or replaced): the reference still answers.
    _code, text = agent(rpn_box, "echo '1 2 +' | /workspace/binary")
    assert text.strip() == "3"


def test_proc_mem_audit_resolves_every_argument_and_records_what_it_saw(rpn_box: Sandbox) -> None:
    agent(rpn_box, "cd /workspace/src && ln -sf /proc/self/mem m && /workspace/binary $(seq 300) m </dev/null; "
                   "rm -f m; true")
    record = rpn_box.call_log()[-1]
    assert record["argv_count"] == 302  # (the logged list is cut, the count kept)
    assert record["flags"] == ["proc-mem"]
    assert record["flag_paths"]["m"].startswith("/proc/")
    assert record["flag_paths"]["m"].endswith("/mem")


STRIPPED = ["PERLLIB", "PYTHONUSERBASE", "LUA_INIT", "LUA_INIT_5_4", "LUA_PATH", "LUA_CPATH", "LUA_CPATH_5_3",
            "OPENSSL_CONF", "OPENSSL_ENGINES", "OPENSSL_MODULES", "TMPDIR", "TZDIR"]


def test_new_strip_list_entries_never_reach_the_reference(probe_box: Sandbox) -> None:
    assignments = " ".join(f"{name}=/tmp/x" for name in STRIPPED)
    _code, text = agent(probe_box, f"env {assignments} PYTHONNOUSERSITE= KEEP=1 /workspace/binary env")
    seen = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert seen["KEEP"] == "1"
    assert seen["PYTHONNOUSERSITE"] == "1"  # forced: an embedded Python never reads the agent's user site
    assert set(seen).isdisjoint(STRIPPED), set(seen) & set(STRIPPED)
    assert set(probe_box.call_log()[-1]["stripped_env"]) == set(STRIPPED)


# ---------------------------------------------------------------------------------------------- pure
def test_the_full_strip_list_is_pinned() -> None:
    assert set(daemon.STRIP_ENV_EXACT) == {
        "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE",
        "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR",
        "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "NODE_OPTIONS", "PYTHONPATH", "PYTHONHOME",
        "PYTHONSTARTUP", "PYTHONUSERBASE", "PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB",
        "OPENSSL_CONF", "OPENSSL_ENGINES", "OPENSSL_MODULES",
    }
    assert daemon.STRIP_ENV_PREFIXES == ("LD_", "LUA_INIT", "LUA_PATH", "LUA_CPATH")
    assert daemon.FORCED_ENV == {"PYTHONNOUSERSITE": "1"}
    docs = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    documented = set(re.findall(r"[A-Z_][A-Z0-9_]+", docs))
    assert set(daemon.STRIP_ENV_EXACT) | set(daemon.FORCED_ENV) <= documented


def test_a_record_is_bounded_whatever_the_caller_sends() -> None:
    huge = "\x01" * 120000
    record = {"time": "t", "call": "1.2", "phase": "ended", "argv": ["/workspace/binary", *[huge] * 7],
              "cwd": "/w/" + huge, "flags": [], "stripped_env": ["LD_" + huge + str(i) for i in range(7)],
              "flag_paths": {huge: huge}, "exit": 0}
    line = daemon.bounded_line(record)
    assert len(line) <= daemon.RECORD_MAX
    parsed = json.loads(line)
    assert (parsed["argv_count"], parsed["stripped_env_count"], parsed["exit"]) == (8, 7, 0)
    many = {"time": "t", "argv": ["a"] * 100000}
    parsed = json.loads(daemon.bounded_line(many))
    assert parsed["argv_count"] == 100000
    assert len(parsed["argv"]) <= daemon.LOG_LIST_LIMIT


def test_the_audit_resolves_every_argument(tmp_path: Path) -> None:
    (tmp_path / "m").symlink_to("/proc/self/mem")
    flags, seen = daemon.audit(["b", *map(str, range(300)), "m"], str(tmp_path))
    assert flags == ["proc-mem"]
    assert seen["m"].endswith("/mem")
    assert daemon.audit(["b", "--input=m"], str(tmp_path))[0] == ["proc-mem"]


def test_the_harness_reads_what_the_daemon_may_write() -> None:
    """The read limit covers the log's cap plus one record per worker (each may append after the check)."""
    assert sandbox_module.CALL_LOG_MAX == daemon.LOG_MAX_BYTES
    assert sandbox_module.CALL_RECORD_MAX == daemon.RECORD_MAX
    serve = daemon._parser().parse_args(["serve", "--agent-uid", "1", "--agent-gid", "1"])
    assert serve.max_workers == sandbox_module.PROXY_MAX_WORKERS
    assert sandbox_module.CALL_LOG_READ_LIMIT >= daemon.LOG_MAX_BYTES + 2 * 512 * daemon.RECORD_MAX
    assert sandbox_module.DROPPED_LOG == daemon.DROPPED_LOG


def test_started_lines_without_an_end_are_interrupted_calls() -> None:
    lines = [{"call": "1.1", "phase": "started", "argv": ["b", "a"]},
             {"call": "2.2", "phase": "started", "argv": ["b"]},
             {"call": "2.2", "phase": "ended", "argv": ["b"], "exit": 0},
             {"error": "refused", "call": "3.3", "phase": "ended"}]
    data = b"\n".join(json.dumps(line).encode() for line in lines) + b"\nnot json\n"
    merged = merge_call_records(data)
    assert merged == [{"call": "1.1", "argv": ["b", "a"], "interrupted": True, "exit": None, "signal": None},
                      {"call": "2.2", "argv": ["b"], "exit": 0}, {"error": "refused", "call": "3.3"}]


def test_the_capped_log_keeps_head_and_tail(tmp_path: Path) -> None:
    path = tmp_path / "agent.log"
    with CappedLog(path, limit=1000) as log:
        log.write(b"HEAD" + b"." * 600)
        for _ in range(100):
            log.write(b"-" * 100)
        log.write(b"." * 400 + b"TAIL")
    data = path.read_bytes()
    assert data.startswith(b"HEAD")
    assert data.endswith(b"TAIL")
    assert len(data) <= 1000 + 200
    assert b"10008 bytes of output dropped here" in data  # 11008 written, 1000 kept
    # A later writer of the same file shares what is left of the budget: nothing, here (the drop is said).
    with CappedLog(path, limit=1000) as log:
        log.text("more")
    after = path.read_bytes()
    assert after.startswith(data)
    assert b"more" not in after[len(data):]
    assert b"5 bytes of output dropped here" in after[len(data):]
