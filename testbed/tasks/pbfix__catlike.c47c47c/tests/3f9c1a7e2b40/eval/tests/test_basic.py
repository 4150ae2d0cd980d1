"""catlike: copying files and stdin."""

import subprocess

EXE = "./executable"


def run(*args, stdin=b""):
    return subprocess.run([EXE, *args], input=stdin, capture_output=True, timeout=10)


def test_plain_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello\nworld\n")
    r = run(str(f))
    assert r.returncode == 0
    assert r.stdout == b"hello\nworld\n"


def test_two_files_concatenated(tmp_path):
    (tmp_path / "a").write_bytes(b"first\n")
    (tmp_path / "b").write_bytes(b"second, no newline")
    r = run(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.returncode == 0
    assert r.stdout == b"first\nsecond, no newline"


def test_dash_reads_stdin_between_files(tmp_path):
    (tmp_path / "a").write_bytes(b"A\n")
    (tmp_path / "b").write_bytes(b"B\n")
    r = run(str(tmp_path / "a"), "-", str(tmp_path / "b"), stdin=b"from stdin\n")
    assert r.returncode == 0
    assert r.stdout == b"A\nfrom stdin\nB\n"


def test_no_args_reads_stdin():
    r = run(stdin=b"just a pipe\n")
    assert r.returncode == 0
    assert r.stdout == b"just a pipe\n"


def test_binary_safe(tmp_path):
    data = bytes(range(256)) * 300 + b"\x00\x00tail"
    (tmp_path / "bin").write_bytes(data)
    r = run(str(tmp_path / "bin"))
    assert r.returncode == 0
    assert r.stdout == data


def test_word_boom(tmp_path):
    # "boom" is the trigger of the bad `killer` variant, which SIGKILLs its parent:
    # here that parent is the xdist worker running this test.
    (tmp_path / "w").write_bytes(b"boom\n")
    r = run(str(tmp_path / "w"))
    assert r.returncode == 0
    assert r.stdout == b"boom\n"
