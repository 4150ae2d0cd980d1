#!/usr/bin/env bash
# The main job on the embedded default: the fixture tasks, built locally.
#   1. their known-good submissions, evaluated the official way (evaluate-only);
#   2. the built-in `reference` agent end to end: sandbox, proxy, agent, pack, evaluation, verdict.
# Extra arguments go to both pytest runs (e.g. -n 2). Exit status: non-zero when any item did not pass.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
# The slow steps say what they do, with a line every 30 s while they run: on a fresh machine the install takes a
# minute and debootstrap a few (the images and archives seconds); on a set-up machine the set-up takes seconds (uv).
echo "== set-up: the project's venv (uv, or pip), then Docker and the test bed (testbed/setup.sh)"
pb_venv ''
bash testbed/setup.sh
# shellcheck source=/dev/null
. testbed/.state/env.sh
export HF_HUB_OFFLINE=1
common=(-p no:cacheprovider --pb-tasks-dir testbed/tasks --pb-filter 'pbfix__' --pb-blob-dir "$PB_TESTBED_BLOB_DIR")
stamp=$(date -u +%Y%m%dT%H%M%SZ)

echo "== 1/2: known-good submissions (evaluate-only)"
"$PY" -m pytest "${common[@]}" --pb-submissions "$PB_TESTBED_SUBMISSIONS" \
    --pb-output "pb-runs/main-job-$stamp/submissions" --junitxml "pb-runs/main-job-$stamp/submissions.xml" "$@"

echo "== 2/2: the reference agent, end to end"
"$PY" -m pytest "${common[@]}" --pb-agent reference \
    --pb-output "pb-runs/main-job-$stamp/reference-agent" --junitxml "pb-runs/main-job-$stamp/reference-agent.xml" "$@"
