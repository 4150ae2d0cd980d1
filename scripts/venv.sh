# Sourced by the set-up scripts: the project's own virtual environment, `.venv` at the checkout's root.
# A stock Debian 12 / Ubuntu 24.04 python3 refuses `pip install` into itself (PEP 668), and whatever python3 comes
# first on PATH is nobody's promise: both commands install into and run from this venv. PB_BASE_PYTHON picks the
# interpreter it is created from (default: python3). Usage: . scripts/venv.sh EXTRAS  ->  $PY is the venv's python.
pb_venv() {
    local extras=$1 root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    local base=${PB_BASE_PYTHON:-python3}
    if ! [ -x "$root/.venv/bin/python" ]; then
        if ! "$base" -c 'import venv, ensurepip' 2>/dev/null; then
            # Debian ships venv and ensurepip apart from python3.
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        fi
        "$base" -m venv "$root/.venv"
        echo "venv: created $root/.venv from $($base -c 'import sys; print(sys.executable)')"
    fi
    PY=$root/.venv/bin/python
    "$PY" -m pip install -q --disable-pip-version-check -e "$root$extras"
    echo "venv: $root/.venv ($("$PY" --version)); activate it with: . $root/.venv/bin/activate"
    # Commands started below (pytest, programbench, the test bed's python) resolve to the venv's.
    export PATH="$root/.venv/bin:$PATH" VIRTUAL_ENV="$root/.venv" PB_PYTHON="$PY"
}
