"""coin: the gold ledger's fixture. On the reference itself one test always passes, one never does (it expects a
version the reference does not print: impossible), and one passes on every other gold run (flaky, made
deterministic: it reads the run's number from the gold submission's .pb-gold-run, so the test cannot flake)."""

import subprocess
from pathlib import Path

EXE = "./executable"


def coin(*args):
    return subprocess.run([EXE, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10)


def test_joins_words():
    assert coin("a", "b").stdout == "a b\n"


def test_version_two():
    assert coin("--version").stdout == "coin 2.0\n", "the reference says 1.0"


def test_every_other_run():
    marker = Path(".pb-gold-run")
    run = int(marker.read_text()) if marker.is_file() else 0
    assert run % 2 == 0, f"gold run {run} is odd"
