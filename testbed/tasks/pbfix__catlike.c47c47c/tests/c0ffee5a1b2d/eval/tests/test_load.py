"""catlike: larger inputs. The whole branch is ignored in tests.json (timing-dependent)."""

import subprocess
import time

EXE = "./executable"


def test_large_file(tmp_path):
    data = b"0123456789abcdef\n" * 500_000
    (tmp_path / "big").write_bytes(data)
    r = subprocess.run([EXE, str(tmp_path / "big")], capture_output=True, timeout=10)
    assert r.stdout == data


def test_many_files(tmp_path):
    names = []
    for i in range(200):
        (tmp_path / f"f{i}").write_bytes(b"%d\n" % i)
        names.append(str(tmp_path / f"f{i}"))
    r = subprocess.run([EXE, *names], capture_output=True, timeout=10)
    assert r.stdout == b"".join(b"%d\n" % i for i in range(200))


def test_fast_enough(tmp_path):
    data = b"x" * (64 << 20)
    (tmp_path / "huge").write_bytes(data)
    t0 = time.monotonic()
    subprocess.run([EXE, str(tmp_path / "huge")], stdout=subprocess.DEVNULL, timeout=10)
    assert time.monotonic() - t0 < 0.05
