#!/usr/bin/env bash
# The main job on the embedded default: the fixture tasks, built locally, evaluated end to end.
# Extra arguments go to pytest (e.g. -n 2, --junitxml out.xml).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e .
bash testbed/setup.sh
# shellcheck source=/dev/null
. testbed/.state/env.sh
export HF_HUB_OFFLINE=1
exec python3 -m pytest -p no:cacheprovider \
    --pb-tasks-dir testbed/tasks --pb-filter 'pbfix__' \
    --pb-blob-dir "$PB_TESTBED_BLOB_DIR" \
    --pb-submissions "$PB_TESTBED_SUBMISSIONS" \
    "$@"
