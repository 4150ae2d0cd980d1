#!/bin/bash
# Hidden test runner, modelled on the official ones. The official evaluator rewrites
# --timeout-method=thread to signal before running it.
set -e
cd "$(dirname "$0")/.."
python3 -m pytest eval/tests/ -n auto --timeout=10 --timeout-method=thread \
    --junitxml=eval/results.xml -p no:cacheprovider -q -rA || true
