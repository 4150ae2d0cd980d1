"""rpn: stack words and leftovers."""

import subprocess

EXE = "./executable"


def rpn(*args):
    return subprocess.run([EXE, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10)


def test_neg():
    assert rpn("5", "neg").stdout == "-5\n"


def test_dup():
    r = rpn("3", "dup", "*")
    assert (r.returncode, r.stdout) == (0, "9\n")


def test_values_left_over_is_an_error():
    r = rpn("1", "2")
    assert r.returncode == 2
    assert r.stdout == ""


def test_unknown_token_names_it():
    r = rpn("2", "x2", "+")
    assert r.returncode == 2
    assert "x2" in r.stderr
