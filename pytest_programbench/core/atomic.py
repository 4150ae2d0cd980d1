"""Files written whole or not at all: a temporary file next to the target, renamed over it. An interrupted run never
leaves a half-written file that a resume or ``programbench info`` would trust; files take the umask like any other."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


def _new_temp(directory: Path, name: str) -> tuple[int, str]:
    """A fresh temporary file next to ``name``, created with mode 0666 so the umask applies as to any other file
    (``mkstemp`` makes 0600: the official's outputs are 0644 under the usual umask)."""
    while True:
        tmp = str(directory / f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp(path.parent, path.name)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.resolve() == target.resolve():
        return
    fd, tmp = _new_temp(target.parent, target.name)
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as src:
            shutil.copyfileobj(src, out)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
