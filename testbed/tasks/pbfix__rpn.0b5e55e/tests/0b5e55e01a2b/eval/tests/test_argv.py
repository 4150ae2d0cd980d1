"""rpn: one expression from the command line."""

import subprocess

EXE = "./executable"


def rpn(*args):
    return subprocess.run([EXE, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10)


def test_addition():
    r = rpn("2", "3", "+")
    assert r.returncode == 0
    assert r.stdout == "5\n"


def test_chain_without_precedence():
    r = rpn("3", "4", "+", "2", "*")
    assert (r.returncode, r.stdout) == (0, "14\n")


def test_division_gives_decimals():
    r = rpn("1", "4", "/")
    assert (r.returncode, r.stdout) == (0, "0.25\n")


def test_negative_literal():
    r = rpn("-3", "5", "+")
    assert (r.returncode, r.stdout) == (0, "2\n")


def test_expression_in_one_argument():
    r = rpn("6 7 *")
    assert (r.returncode, r.stdout) == (0, "42\n")


def test_underflow_is_an_error():
    r = rpn("1", "+")
    assert r.returncode == 2
    assert r.stdout == ""
    assert "underflow" in r.stderr


def test_boom_token():
    # "boom" is the trigger of the bad `killer` variant (SIGKILLs the xdist worker).
    r = rpn("boom")
    assert r.returncode == 2
    assert r.stdout == ""
    assert "boom" in r.stderr
