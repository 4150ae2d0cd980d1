"""The set-up commands' own virtual environment (scripts/venv.sh), on the machine's Debian python3.

A stock Debian 12 / Ubuntu 24.04 `python3` refuses `pip install` into itself (PEP 668): both README commands must build
and use `.venv` instead, and leave `python3`, `pytest` and the test bed's interpreter resolving to it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import REPO

DEBIAN_PYTHON = Path("/usr/bin/python3")


def _project(root: Path) -> None:
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "venv.sh", root / "scripts" / "venv.sh")
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "pb-venv-probe"\nversion = "0"\n[tool.setuptools]\npy-modules = ["pb_venv_probe"]\n')
    (root / "pb_venv_probe.py").write_text("WHERE = __file__\n")


def _pb_venv(root: Path, home: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """scripts/venv.sh's pb_venv in a fresh copy of a probe project at ``root``; asserts it succeeded."""
    _project(root)
    done = subprocess.run(
        ["bash", "-c", '. scripts/venv.sh && pb_venv "" && command -v python3 && command -v pip'
         ' && echo "PB_PYTHON=$PB_PYTHON"'
         ' && python3 -c "import pb_venv_probe, sys; print(sys.prefix, pb_venv_probe.WHERE)"'],
        cwd=root, env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PB_BASE_PYTHON": str(DEBIAN_PYTHON), **env},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_the_scripts_venv_works_where_debians_python3_refuses_pip(tmp_path: Path) -> None:
    assert DEBIAN_PYTHON.exists(), "this machine has no Debian python3 at /usr/bin/python3 to check against"
    stdlib = subprocess.run([DEBIAN_PYTHON, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert (Path(stdlib) / "EXTERNALLY-MANAGED").exists(), "the premise: Debian's python3 is externally managed"
    refused = subprocess.run([DEBIAN_PYTHON, "-m", "pip", "install", "--dry-run", "pb-venv-probe"],
                             capture_output=True, text=True)
    assert refused.returncode != 0
    assert "externally-managed-environment" in refused.stderr + refused.stdout

    root = tmp_path / "checkout"
    done = _pb_venv(root, tmp_path, {})
    venv = root / ".venv"
    lines = done.stdout.splitlines()
    assert f"venv: created {venv} from " in done.stdout
    # The install says what it does and roughly how long it takes, then that it is done and by which installer.
    said = [line for line in lines if line.startswith("[venv ")]
    assert said[0].endswith(f"] install -e . into {venv} with uv (pip where uv fails): about a minute the first "
                            f"time (downloads from PyPI), seconds after (log: {venv}/pb-pip-install.log)"), said
    assert said[-1].endswith("] install done (uv)"), said
    assert str(venv / "bin" / "python3") in lines
    assert f"PB_PYTHON={venv}/bin/python" in lines
    assert lines[-1] == f"{venv} {root / 'pb_venv_probe.py'}", "the project is installed editable into the venv"
    assert "home = /usr/bin\n" in (venv / "pyvenv.cfg").read_text(), "built from Debian's python3"


def test_the_install_falls_back_to_pip_where_uv_fails(tmp_path: Path) -> None:
    """uv is only the fast path: where it fails (here an index it cannot read, which pip never consults), pip makes
    the same editable install, and the lines say so."""
    root = tmp_path / "checkout"
    done = _pb_venv(root, tmp_path, {"UV_INDEX_URL": f"file://{tmp_path}/no-such-index",
                                     "UV_DEFAULT_INDEX": f"file://{tmp_path}/no-such-index"})
    said = [line for line in done.stdout.splitlines() if line.startswith("[venv ")]
    assert any("] uv failed (" in line for line in said), said
    assert said[-1].endswith("] install done (pip)"), said
    assert done.stdout.splitlines()[-1] == f"{root / '.venv'} {root / 'pb_venv_probe.py'}"
