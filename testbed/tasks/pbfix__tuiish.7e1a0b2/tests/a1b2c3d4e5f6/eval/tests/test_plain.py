"""tuiish without a terminal: plain text."""

import subprocess

EXE = "./executable"


def run(*args):
    return subprocess.run([EXE, *args], stdin=subprocess.DEVNULL, capture_output=True, timeout=10)


def test_plain_menu_when_piped():
    r = run()
    assert r.returncode == 0
    assert r.stdout == b"== tuiish ==\n  alpha\n  beta\n  gamma\n"


def test_plain_custom_title():
    r = run("Groceries")
    assert r.returncode == 0
    assert r.stdout.splitlines()[0] == b"== Groceries =="


def test_plain_has_no_escape_sequences():
    r = run("x")
    assert r.stdout.strip()
    assert b"\x1b" not in r.stdout


def test_plain_title_boom():
    # "boom" is the trigger of the bad `killer` variant (SIGKILLs the xdist worker).
    r = run("boom")
    assert r.returncode == 0
    assert r.stdout.startswith(b"== boom ==\n")


def test_plain_exit_status():
    # Ignored in tests.json (dummy_pass): exiting 0 is all it checks.
    assert run().returncode == 0
