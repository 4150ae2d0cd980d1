"""tuiish on a pseudo-terminal: framed screen sized from the window size, keys, exit."""

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time

EXE = "./executable"


def set_size(fd, cols, rows):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def spawn(cols, rows, *args):
    master, slave = pty.openpty()
    set_size(slave, cols, rows)
    p = subprocess.Popen([EXE, *args], stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    return p, master


def read_until(master, done, deadline=None):
    """Read the terminal until done(bytes) holds, EOF, or the optional deadline."""
    buf = b""
    while not done(buf):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([master], [], [], left)[0]:
                break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the program exited and the terminal is gone
            break
        if not chunk:
            break
        buf += chunk
    return buf


def render(data, cols, rows):
    """A tiny terminal: cursor moves, clears, printable text; other sequences are dropped."""
    grid = [[" "] * cols for _ in range(rows)]
    y = x = 0
    for m in re.finditer(rb"\x1b\[([?0-9;]*)([A-Za-z])|\x1b.|(.)", data, re.S):
        params, final, ch = m.group(1), m.group(2), m.group(3)
        if final == b"H":
            nums = [int(n) if n else 1 for n in params.split(b";")] if params else [1, 1]
            y, x = min(nums[0], rows) - 1, min(nums[1] if len(nums) > 1 else 1, cols) - 1
        elif final == b"J" and params == b"2":
            grid = [[" "] * cols for _ in range(rows)]
        elif ch == b"\r":
            x = 0
        elif ch == b"\n":
            y = min(y + 1, rows - 1)
        elif ch is not None and ch >= b" ":
            if x < cols:
                grid[y][x] = ch.decode("latin-1")
            x += 1
    return ["".join(r) for r in grid]


def quit_and_wait(p, master):
    os.write(master, b"q")
    rest = read_until(master, lambda b: False, deadline=time.monotonic() + 10)
    assert p.wait(timeout=10) == 0
    return rest


def test_draws_frame_and_quits():
    # No deadline on purpose: a program that never draws keeps this read waiting until
    # run.sh's --timeout fires (the hang fixture).
    p, master = spawn(60, 15)
    try:
        out = read_until(master, lambda b: b"q: quit" in b)
        assert b"q: quit" in out
        quit_and_wait(p, master)
    finally:
        p.kill()
        os.close(master)


def test_frame_follows_window_size():
    cols, rows = 72, 18
    bottom = "+" + "-" * (cols - 2) + "+"
    p, master = spawn(cols, rows, "Sized")
    try:
        # Wait for the whole frame: a program may flush it row by row.
        out = read_until(master, lambda b: render(b, cols, rows)[-1] == bottom, deadline=time.monotonic() + 5)
        screen = render(out, cols, rows)
        assert screen[0][0] == "+" and screen[0][-1] == "+"
        assert "Sized" in screen[0]
        assert screen[-1] == bottom
        for line in screen[1:-1]:
            assert line[0] == "|" and line[-1] == "|", line
        assert "size: 72x18" in "".join(screen)
        quit_and_wait(p, master)
    finally:
        p.kill()
        os.close(master)


def test_j_moves_selection():
    cols, rows = 40, 12
    p, master = spawn(cols, rows)
    try:
        out = read_until(master, lambda b: b"q: quit" in b, deadline=time.monotonic() + 5)
        assert any("> alpha" in line for line in render(out, cols, rows))
        os.write(master, b"j")
        deadline = time.monotonic() + 5
        out += read_until(master, lambda b: any("> beta" in line for line in render(out + b, cols, rows)), deadline)
        screen = render(out, cols, rows)
        assert any("> beta" in line for line in screen)
        assert not any("> alpha" in line for line in screen)
        quit_and_wait(p, master)
    finally:
        p.kill()
        os.close(master)


def test_q_restores_terminal():
    p, master = spawn(50, 10)
    try:
        out = read_until(master, lambda b: b"q: quit" in b, deadline=time.monotonic() + 5)
        assert b"\x1b[?1049h" in out
        rest = quit_and_wait(p, master)
        assert b"\x1b[?1049l" in rest
    finally:
        p.kill()
        os.close(master)


def test_redraws_after_resize():
    # Ignored in tests.json (gold_fail): the reference never handles SIGWINCH.
    p, master = spawn(50, 10)
    try:
        read_until(master, lambda b: b"q: quit" in b, deadline=time.monotonic() + 5)
        set_size(master, 64, 14)
        p.send_signal(signal.SIGWINCH)
        out = read_until(master, lambda b: b"size: 64x14" in b, deadline=time.monotonic() + 3)
        assert b"size: 64x14" in out
        quit_and_wait(p, master)
    finally:
        p.kill()
        os.close(master)
