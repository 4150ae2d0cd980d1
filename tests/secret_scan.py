"""Where a secret must never show up after a session: any file of the run directory, the JUnit XML, the terminal.

A helper of the suite (imported by tests), not a test module.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest


def _archive_texts(path: Path) -> list[tuple[str, bytes]]:
    """The members of a ``.tar.gz`` (the submission), else the gunzipped bytes of a ``.gz``."""
    data = path.read_bytes()
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            return [(f"{path}!{m.name}", tar.extractfile(m).read())  # type: ignore[union-attr]
                    for m in tar.getmembers() if m.isfile()]
    except tarfile.TarError:
        return [(str(path), gzip.decompress(data))]


def assert_secret_nowhere(secret: str, *, run_dir: Path, junit: Path | None = None,
                          result: pytest.RunResult | None = None) -> None:
    """``secret`` is in no file under ``run_dir`` (archives opened), nor in ``junit``, nor in the session's output."""
    needle = secret.encode()
    scanned = 0
    for path in sorted(run_dir.rglob("*")):
        if not path.is_file():
            continue
        for name, data in _archive_texts(path) if path.name.endswith(".gz") else [(str(path), path.read_bytes())]:
            scanned += 1
            assert needle not in data, f"the secret is in {name}"
    assert scanned, f"nothing to scan under {run_dir}"
    if junit is not None:
        assert needle not in junit.read_bytes(), f"the secret is in the JUnit XML {junit}"
    if result is not None:
        assert secret not in "\n".join(result.outlines), "the secret is in the session's standard output"
        assert secret not in "\n".join(result.errlines), "the secret is in the session's standard error"
