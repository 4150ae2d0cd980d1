"""The proxy is faithful: a call through /workspace/binary gives what direct execution gives.

For each fixture reference (and the probe), the same runner, as the agent user, with the same argv (argv[0]
included), cwd, environment and stdin, runs a copy of the reference directly and then through the proxy; stdout,
stderr and the exit status (negative: death by that signal) must be equal. The TUI fixture is compared on the
screen tmux shows, both ways. Needs Docker and the test bed (fails, never skips, without them).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_programbench.engine.docker_engine import Labels
from pytest_programbench.sandbox.sandbox import Sandbox
from tests.proxy_support import (
    CATLIKE,
    DIRECT,
    RPN,
    TUIISH,
    agent,
    expose_direct_copy,
    open_sandbox,
    require_image,
    run_both,
)

pytestmark = pytest.mark.docker

BINARY_BLOB = bytes(range(256)) * 4096  # 1 MiB with every byte value, NULs included


def _box(engine: Any, labels: Labels, image: str) -> Iterator[Sandbox]:
    require_image(engine, image)
    box = open_sandbox(image, labels, engine)
    try:
        expose_direct_copy(box)
        yield box
    finally:
        box.close()


@pytest.fixture(scope="module")
def catlike_box(engine: Any, run_labels: Labels) -> Iterator[Sandbox]:
    yield from _box(engine, run_labels, CATLIKE)


@pytest.fixture(scope="module")
def rpn_box(engine: Any, run_labels: Labels) -> Iterator[Sandbox]:
    yield from _box(engine, run_labels, RPN)


@pytest.fixture(scope="module")
def tuiish_box(engine: Any, run_labels: Labels) -> Iterator[Sandbox]:
    yield from _box(engine, run_labels, TUIISH)


@pytest.fixture(scope="module")
def probe_box(engine: Any, run_labels: Labels, probe_image: str) -> Iterator[Sandbox]:
    yield from _box(engine, run_labels, probe_image)


def _assert_same(box: Sandbox, cases: list[dict[str, Any]]) -> None:
    results = run_both(box, cases)
    for case, (direct, proxied) in zip(cases, results, strict=True):
        assert proxied == direct, f"case {case['argv']}: direct {direct!r} != proxied {proxied!r}"


CATLIKE_CASES: list[dict[str, Any]] = [
    {"argv": ["./catlike"]},
    {"argv": ["./catlike"], "stdin": b"hello\nworld\n"},
    {"argv": ["./catlike", "-"], "stdin": BINARY_BLOB},
    {"argv": ["catlike", "/workspace/docs/README.md"]},
    {"argv": ["./catlike", "-n", "/workspace/docs/README.md", "-", "/workspace/docs/catlike.1.txt"],
     "stdin": b"middle\n"},
    {"argv": ["./catlike", "/nonexistent"]},
    {"argv": ["./catlike", "/workspace/docs/README.md", "/nonexistent"]},
    {"argv": ["./catlike", "--bogus"]},
    {"argv": ["./catlike", "/workspace/docs"]},
    {"argv": ["./catlike", "README.md"], "cwd": "/workspace/docs"},
    {"argv": ["/a/very/odd argv0", "-n"], "stdin": b"x\n"},
    {"argv": ["./catlike", "-"], "stdin": b"", "env": {}},
]


def test_catlike_matches_direct_execution(catlike_box: Sandbox) -> None:
    _assert_same(catlike_box, CATLIKE_CASES)


RPN_CASES: list[dict[str, Any]] = [
    {"argv": ["./rpn", "1", "2", "+"]},
    {"argv": ["./rpn", "2", "3", "4", "*", "+", "neg"]},
    {"argv": ["./rpn", "1", "+"]},
    {"argv": ["./rpn", "1", "0", "/"]},
    {"argv": ["./rpn"], "stdin": b"1 2 +\n3 dup *\nbad\n4 2 /\n"},
    {"argv": ["./rpn"], "stdin": b"1 0 /\n2 2 +\n"},
    {"argv": ["./rpn"], "stdin": b""},
    {"argv": ["./rpn", "--", "-1", "2", "+"]},
]


def test_rpn_matches_direct_execution(rpn_box: Sandbox) -> None:
    _assert_same(rpn_box, RPN_CASES)


def test_tuiish_without_terminal_matches_direct_execution(tuiish_box: Sandbox) -> None:
    _assert_same(tuiish_box, [{"argv": ["./tuiish"]}, {"argv": ["./tuiish", "My Title"]},
                              {"argv": ["./tuiish"], "stdin": b"jjq"}])


PROBE_CASES: list[dict[str, Any]] = [
    {"argv": ["./probe", "argv", "", "two words", "é", "--x=1", "*"]},
    {"argv": ["probe", "env"], "env": {"A": "1", "B": "with=equals", "PATH": "/usr/bin:/bin", "EMPTY": ""}},
    {"argv": ["./probe", "ids"]},
    {"argv": ["./probe", "ids"], "umask": 0o077, "core": 0},
    {"argv": ["./probe", "ids"], "ignore": [2, 3, 1]},  # a background job of a non-interactive shell, nohup
    {"argv": ["./probe", "exit", "0"]},
    {"argv": ["./probe", "exit", "3"]},
    {"argv": ["./probe", "exit", "255"]},
    {"argv": ["./probe", "signal", "15"]},
    {"argv": ["./probe", "signal", "9"]},
    {"argv": ["./probe", "signal", "6"]},
    {"argv": ["./probe", "signal", "2"]},
    {"argv": ["./probe", "signal", "10"]},
    {"argv": ["./probe", "segv"]},
    {"argv": ["./probe", "cat"], "stdin": BINARY_BLOB},
    {"argv": ["./probe", "big", "3000000"]},
    {"argv": ["./probe", "fds"]},
    {"argv": ["./probe", "touch", "created.txt"]},
    {"argv": ["./probe", "nonsense"]},
    {"argv": ["./probe"]},
]


def test_probe_matches_direct_execution(probe_box: Sandbox) -> None:
    _assert_same(probe_box, PROBE_CASES)


# (resource number, soft, hard); -1 is unlimited. The proxy takes its fast path for limits its worker can adopt
# for a moment and the general (fork) path for the others: both must be faithful.
LIMIT_CASES: list[tuple[list[tuple[int, int, int]], str]] = [
    ([(4, -1, -1)], "fast"),  # ulimit -c unlimited
    ([(7, 1024, 1024)], "fast"),  # ulimit -n 1024 (hard lowered: that worker retires)
    ([(7, 1024, 1024)], "fast"),
    ([(7, 10, 10)], "general"),  # too few descriptors for the worker itself
    ([(0, 1000, -1)], "general"),  # CPU seconds: never adopted by the worker
    ([(3, 65536, -1)], "general"),  # a 64 KiB stack
]


def test_rlimits_match_direct_execution(probe_box: Sandbox) -> None:
    cases: list[dict[str, Any]] = [{"argv": ["./probe", "ids"], "limits": limits} for limits, _ in LIMIT_CASES]
    _assert_same(probe_box, cases)
    paths = [r["path"] for r in probe_box.call_log() if r.get("argv") == ["./probe", "ids"]][-len(cases):]
    assert paths == [path for _, path in LIMIT_CASES]


def test_signals_are_forwarded_and_death_reproduced(probe_box: Sandbox) -> None:
    """SIGINT/SIGHUP/SIGUSR1/SIGWINCH reach the reference; SIGTERM makes it exit 42, as directly."""
    outcomes = {}
    for exe in (DIRECT, "/workspace/binary"):
        script = (
            "import subprocess, signal, time, sys\n"
            f"p = subprocess.Popen(['./probe', 'waitsig'], executable={exe!r}, stdout=subprocess.PIPE)\n"
            "assert p.stdout.readline() == b'ready\\n'\n"
            "lines = []\n"
            "for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGWINCH, signal.SIGTERM):\n"
            "    p.send_signal(sig)\n"
            "    lines.append(p.stdout.readline().decode().strip())\n"
            "print(lines, p.wait(10))\n"
        )
        code, text = agent(probe_box, f"python3 -c {_q(script)}")
        assert code == 0, text
        outcomes[exe] = text.strip()
    assert outcomes[DIRECT] == "['got INT', 'got HUP', 'got USR1', 'got WINCH', 'got TERM'] 42"
    assert outcomes["/workspace/binary"] == outcomes[DIRECT]


def test_client_dies_by_the_same_signal_without_core(probe_box: Sandbox) -> None:
    _code, text = agent(probe_box, "mkdir -p /tmp/crash && cd /tmp/crash && ulimit -c unlimited; "
                                  "/workspace/binary segv; echo rc=$?; /workspace/binary signal 15; echo rc=$?; "
                                  "echo files: $(ls)")
    assert "rc=139" in text, text  # 128 + SIGSEGV
    assert "rc=143" in text, text  # 128 + SIGTERM
    assert "core dumped" not in text
    assert text.strip().splitlines()[-1] == "files:"  # no core file either


def test_killing_the_client_kills_the_reference(probe_box: Sandbox) -> None:
    # Waits on conditions (the reference's pid written, then its /proc entry gone), each bounded by 30 s, well
    # under the probe's own 120 s; /proc, not kill -0: the reference runs as another uid, so kill -0 says EPERM.
    script = ("/workspace/binary sleep 120 > /tmp/sleep.out & client=$!; "
              "for i in $(seq 300); do pid=$(sed -n 's/pid=//p' /tmp/sleep.out); [ -n \"$pid\" ] && break; "
              "sleep 0.1; done; [ -n \"$pid\" ] || { echo NOPID; exit 1; }; "
              "[ -d /proc/$pid ] && echo STARTED $pid; kill -9 $client; "
              "for i in $(seq 300); do [ -d /proc/$pid ] || break; sleep 0.1; done; "
              "if [ -d /proc/$pid ]; then echo ALIVE $pid; else echo GONE $pid; fi")
    _code, text = agent(probe_box, script, timeout=120)
    assert "STARTED" in text, text  # the reference was running when its client died
    assert "GONE" in text, text


def test_concurrent_calls(probe_box: Sandbox) -> None:
    script = ("for i in $(seq 24); do (/workspace/binary argv $i > /tmp/c.$i; echo $? >> /tmp/c.$i) & done; wait; "
              "for i in $(seq 24); do cat /tmp/c.$i | tr '\\n' ' '; echo; done")
    _code, text = agent(probe_box, script)
    lines = text.strip().splitlines()
    assert len(lines) == 24
    for index, line in enumerate(lines, 1):
        assert line.strip() == f"[/workspace/binary] [argv] [{index}] 0", line


def test_streams_are_not_buffered(probe_box: Sandbox) -> None:
    """A slow pipe: each line comes out before the next goes in (another proxy buffers stdin until EOF)."""
    script = (
        "import subprocess, time\n"
        "p = subprocess.Popen(['/workspace/binary', 'cat'], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
        "for i in range(5):\n"
        "    p.stdin.write(b'line %d\\n' % i); p.stdin.flush()\n"
        "    assert p.stdout.readline() == b'line %d\\n' % i\n"
        "p.stdin.close(); print('streamed', p.wait(5))\n"
    )
    code, text = agent(probe_box, f"timeout 30 python3 -c {_q(script)}")
    assert code == 0, text
    assert "streamed 0" in text, text


def _q(text: str) -> str:
    import shlex

    return shlex.quote(text)


# ---------------------------------------------------------------------------------------------- terminal
def _tmux(box: Sandbox, script: str) -> str:
    code, text = agent(box, script, timeout=120)
    assert code == 0, text
    return text


def _screen(box: Sandbox, session: str) -> str:
    return _tmux(box, f"tmux -S /tmp/tmux.sock capture-pane -p -t {session}")


def _run_in_tmux(box: Sandbox, session: str, command: str) -> None:
    _tmux(box, f"cd /workspace/src && tmux -S /tmp/tmux.sock new-session -d -s {session} -x 70 -y 20 "
               f"{_q(command + '; echo EXIT=$?; stty -a | head -1; sleep 600')}")


def _wait_for(box: Sandbox, session: str, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = _screen(box, session)
        if text in screen:
            return screen
        time.sleep(0.3)
    raise AssertionError(f"{text!r} never appeared in tmux session {session}:\n{screen}")


def test_tui_under_tmux_shows_the_same_screen(tuiish_box: Sandbox) -> None:
    screens: dict[str, list[str]] = {}
    for session, exe in (("direct", DIRECT), ("proxied", "/workspace/binary")):
        _run_in_tmux(tuiish_box, session, f"{exe} Hello")
        shots = [_wait_for(tuiish_box, session, "q: quit")]
        _tmux(tuiish_box, f"tmux -S /tmp/tmux.sock send-keys -t {session} j")
        shots.append(_wait_for(tuiish_box, session, "> beta"))
        _tmux(tuiish_box, f"tmux -S /tmp/tmux.sock send-keys -t {session} q")
        shots.append(_wait_for(tuiish_box, session, "EXIT="))
        screens[session] = shots
    assert "size: 70x20" in screens["direct"][0]
    assert screens["proxied"] == screens["direct"]  # same frames, same exit, terminal modes restored
    _tmux(tuiish_box, "tmux -S /tmp/tmux.sock kill-server")


def test_reference_gets_a_controlling_terminal(probe_box: Sandbox) -> None:
    """/dev/tty opens, the reference is in the terminal's foreground, the size is the pane's: like directly."""
    shots = {}
    for session, exe in (("ttyd", DIRECT), ("ttyp", "/workspace/binary")):
        _run_in_tmux(probe_box, session, f"{exe} tty")
        shots[session] = _wait_for(probe_box, session, "EXIT=")
    assert "devtty=ok" in shots["ttyd"]
    assert "size=70x20" in shots["ttyd"]
    assert shots["ttyp"] == shots["ttyd"]
    _tmux(probe_box, "tmux -S /tmp/tmux.sock kill-server")


def test_ctrl_c_in_a_terminal_reaches_the_reference(probe_box: Sandbox) -> None:
    shots = {}
    for session, exe in (("intd", DIRECT), ("intp", "/workspace/binary")):
        _run_in_tmux(probe_box, session, f"{exe} waitsig")
        _wait_for(probe_box, session, "ready")
        _tmux(probe_box, f"tmux -S /tmp/tmux.sock send-keys -t {session} C-c")
        _wait_for(probe_box, session, "got INT")
        _tmux(probe_box, f"tmux -S /tmp/tmux.sock send-keys -t {session} C-\\\\")
        _wait_for(probe_box, session, "got QUIT")
        _tmux(probe_box, f"tmux -S /tmp/tmux.sock resize-window -t {session} -x 60 -y 15")
        _wait_for(probe_box, session, "got WINCH")
        _tmux(probe_box, f"tmux -S /tmp/tmux.sock kill-session -t {session}")
        shots[session] = True
    assert shots == {"intd": True, "intp": True}
