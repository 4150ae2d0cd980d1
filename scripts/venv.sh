# Sourced by the set-up scripts: the project's own virtual environment, `.venv` at the checkout's root.
# A stock Debian 12 / Ubuntu 24.04 python3 refuses `pip install` into itself (PEP 668), and whatever python3 comes
# first on PATH is nobody's promise: both commands install into and run from this venv. PB_BASE_PYTHON picks the
# interpreter it is created from (default: python3). Usage: . scripts/venv.sh EXTRAS  ->  $PY is the venv's python.

# Lines as testbed/setup.sh's "[setup Ns]": the seconds since the script started.
_pb_log() { printf '[venv %4ds] %s\n' "$SECONDS" "$*"; }

# Runs "$@" with its output in the file $1, saying every 30 s that it still runs and what it printed last: pip is
# silent for minutes otherwise, and a silent step looks hung.
_pb_heartbeat() {
    local log=$1 pid waited=0
    shift
    "$@" >"$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        waited=$((waited + 1))
        if [ $((waited % 30)) -eq 0 ]; then
            _pb_log "  still running after ${waited} s; last: $(tail -n 1 "$log" 2>/dev/null | cut -c1-90)"
        fi
    done
    wait "$pid"
}

# uv installs what pip would (the same resolution: it is given the constraint file and index pip is configured with,
# and trusts the system's certificates, as Debian's pip does) in seconds where pip takes minutes; uv itself comes from
# pip. It byte-compiles what it installs, as pip does (uv does not by default): see pb_venv.
_pb_pip_setting() {  # the value pip's configuration (listed in $1: its files and PIP_* variables) gives KEY $2, if any
    printf '%s\n' "$1" | sed -n "s/^\(global\|:env:\)\.$2='\(.*\)'\$/\2/p" | tail -n 1
}

_pb_uv_install() {
    local py=$1 spec=$2 args=(--native-tls --compile-bytecode) config value
    "$py" -m pip install --disable-pip-version-check --progress-bar off --quiet uv || return 1
    config=$("$py" -m pip config list 2>/dev/null || true)
    value=$(_pb_pip_setting "$config" constraint) && [ -n "$value" ] && args+=(--constraint "$value")
    value=$(_pb_pip_setting "$config" index-url) && [ -n "$value" ] && args+=(--index-url "$value")
    "$py" -m uv pip install --python "$py" "${args[@]}" -e "$spec"
}

pb_venv() {
    local extras=$1 root log
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    local base=${PB_BASE_PYTHON:-python3}
    if ! [ -x "$root/.venv/bin/python" ]; then
        if ! "$base" -c 'import venv, ensurepip' 2>/dev/null; then
            # Debian ships venv and ensurepip apart from python3.
            _pb_log "installing python3-venv via apt (under a minute)"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        fi
        "$base" -m venv "$root/.venv"
        echo "venv: created $root/.venv from $($base -c 'import sys; print(sys.executable)')"
    fi
    PY=$root/.venv/bin/python
    log=$root/.venv/pb-pip-install.log
    _pb_log "install -e .$extras into $root/.venv with uv (pip where uv fails): about a minute the first time" \
        "(downloads from PyPI), seconds after (log: $log)"
    if _pb_heartbeat "$log" _pb_uv_install "$PY" "$root$extras"; then
        _pb_log "install done (uv)"
    else
        _pb_log "uv failed ($(tail -n 1 "$log" | cut -c1-120)); installing with pip: a few minutes the first time"
        _pb_heartbeat "$log" "$PY" -m pip install --disable-pip-version-check --progress-bar off -e "$root$extras" \
            || { tail -n 30 "$log" >&2; _pb_log "pip install failed (full log: $log)"; return 1; }
        _pb_log "install done (pip)"
    fi
    # The checkout's own modules byte-compiled too (an editable install leaves them as sources). Where
    # PYTHONDONTWRITEBYTECODE is set, as on this project's CI machine, no interpreter writes a .pyc: without these,
    # every one compiled every module it imported from source, 0.6 s more for each pytest start, and the suite starts
    # hundreds. A stale .pyc (a source edited since) is ignored, never used.
    "$PY" -m compileall -q -j 0 "$root/pytest_programbench" "$root/tests" >/dev/null \
        || { _pb_log "byte-compiling the checkout failed"; return 1; }
    echo "venv: $root/.venv ($("$PY" --version)); activate it with: . $root/.venv/bin/activate"
    # Commands started below (pytest, programbench, the test bed's python) resolve to the venv's.
    export PATH="$root/.venv/bin:$PATH" VIRTUAL_ENV="$root/.venv" PB_PYTHON="$PY"
}
