#!/usr/bin/env bash
# The project's test suite on a fresh machine: install, start Docker + build the test bed, run pytest.
# Three streams at once, each scheduled as the plugin schedules tasks (longest first):
#  - the tests with engines of their own (chaos, load, several engines, a registry): one process, one module at a
#    time under their own lock, sharing one private dockerd (tests/conftest.py's private_engine) where a module needs
#    one engine of its own;
#  - the clock-bound modules (model outages, agent clocks, CLI agents, mini-swe-agent's clocks): they wait on clocks
#    rather than compute, so they wait beside the rest instead of holding one of its workers;
#  - the rest -n 3 on the shared engine, a module per worker (--dist loadfile: a module's costly shared runs are made
#    once, not once per worker), modules longest first from tests/durations.json (tests/conftest.py orders the
#    collection; --no-loadscope-reorder keeps that order; `python -m tests.durations .ci/out/junit*.xml` refreshes it).
# They do not interfere: what the first stream restarts, kills or counts is its own engine's (on the shared engine it
# only checks its own runs, by run id), and most of every stream's time is spent waiting on containers or clocks.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
pb_venv '[dev,mini,ssh]'
# The house's rules first, in seconds: lint and the import contract (layers, no circles; pyproject.toml). The types
# (mypy, strict: about a minute on a fresh clone) are checked beside the set-up and the tests, and fail the suite at
# its end.
"$PY" -m ruff check .
.venv/bin/lint-imports
mkdir -p .ci/out
"$PY" -m mypy > .ci/out/mypy.log 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true' EXIT  # by its pid, should this script end first
# The docs site (mkdocs.yml), built strictly and offline: a broken link or anchor, a page outside the nav, or a
# generated table (docs/hooks.py) placed on no page fails the suite here.
docs_site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet --site-dir "$docs_site"
rm -rf "$docs_site"
bash testbed/setup.sh
# Debian's Chromium renders report.html for tests/test_report.py (headless, offline); installed only when missing.
if ! command -v chromium >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
# Debian's tmux: a real terminal for tests/test_progress.py's live view (capture-pane mid-run and at the end).
if ! command -v tmux >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null
fi
# Debian's openssh-server: an engine reached over ssh:// on 127.0.0.1 for tests/test_engines.py.
if ! [ -x /usr/sbin/sshd ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null
fi
# Debian's docker-registry serves a test-bed image on 127.0.0.1 for tests/test_registry.py (the pull path).
if ! command -v docker-registry >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry >/dev/null
fi
# The CLI agents of tests/test_cli_agents.py come from the npm registry, installed once per machine into the plugin's
# cache (~/.cache/pytest-programbench/agents, kept between runs): npm is needed only for the first install.
if ! command -v npm >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
fi
"$PY" -c 'from pytest_programbench.agents import agent_presets as p
for name in p.PRESETS: print(p.describe(p.ensure_installed(*p.parse(name))))'
# No network during tests: the hidden test archives come from the local blob dir.
export HF_HUB_OFFLINE=1
# pytest rewrites the asserts of every plugin module it loads (xdist's, pytest-timeout's, anyio's...) and of the
# suite's modules, and caches each rewrite beside its source only where bytecode may be written. Where
# PYTHONDONTWRITEBYTECODE is set, as on this project's CI machine, every pytest process of the suite (hundreds, with
# the sessions the tests start) rewrote them all anew. One collection with writing allowed leaves the caches, which
# every later process reads whatever the setting (tests/test_invocation.py: 27.6 core-s cold, 20.0 with them).
env -u PYTHONDONTWRITEBYTECODE "$PY" -m pytest tests --co -q -n 1 -p no:cacheprovider > .ci/out/rewrite-cache.log 2>&1 \
    || { cat .ci/out/rewrite-cache.log; echo "test suite: collecting the suite failed"; exit 1; }
# The shared engine's account before the suite: what it leaves is checked against it at the end.
"$PY" -m tests.engine_leftovers snapshot .ci/out/leftovers.json
serial=(tests/test_chaos_engine.py tests/test_chaos.py tests/test_load.py tests/test_engines.py tests/test_registry.py)
clocked=(tests/test_model_outage.py tests/test_agent_clock.py tests/test_cli_agents.py tests/test_mini_swe_agent.py)
status=0
started=$SECONDS
# --durations: where the suite's time goes, kept in every run's output (the CI budget is 25 minutes).
# The background streams' output goes to files, shown whole when they end (never interleaved with the rest's).
"$PY" -m pytest "${serial[@]}" -p no:cacheprovider --durations=15 --junitxml=.ci/out/junit-serial.xml "$@" \
    > .ci/out/own-engines.log 2>&1 &
own_engines=$!
"$PY" -m pytest "${clocked[@]}" -p no:cacheprovider --durations=15 --junitxml=.ci/out/junit-clocked.xml "$@" \
    > .ci/out/clocked.log 2>&1 &
clocked_pid=$!
trap 'kill "$own_engines" "$clocked_pid" "$mypy_pid" 2>/dev/null || true' EXIT  # by their pids, likewise
"$PY" -m pytest tests -n 3 --dist loadfile --no-loadscope-reorder -p no:cacheprovider --durations=50 \
    "${serial[@]/#/--ignore=}" "${clocked[@]/#/--ignore=}" --junitxml=.ci/out/junit.xml "$@" || status=$?
echo "test suite: shared-engine tests done at $((SECONDS - started)) s"
clocked_status=0
wait "$clocked_pid" || clocked_status=$?
echo "== clock-bound tests (${clocked[*]}): exit status $clocked_status, done at $((SECONDS - started)) s"
cat .ci/out/clocked.log
own_status=0
wait "$own_engines" || own_status=$?
echo "== tests with engines of their own (${serial[*]}): exit status $own_status"
cat .ci/out/own-engines.log
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
echo "== types (mypy, strict): exit status $mypy_status"
cat .ci/out/mypy.log
# No container, grader volume or containerd shim of the suite's left on the shared engine (tests/engine_leftovers.py).
leftovers_status=0
"$PY" -m tests.engine_leftovers check .ci/out/leftovers.json || leftovers_status=$?
echo "test suite: done at $((SECONDS - started)) s"
[ "$leftovers_status" = 0 ] || status=$leftovers_status
[ "$mypy_status" = 0 ] || status=$mypy_status
[ "$clocked_status" = 0 ] || status=$clocked_status
[ "$own_status" = 0 ] || status=$own_status
exit "$status"
