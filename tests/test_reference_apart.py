"""The layout advantage (upstream ProgramBench #60): under the official contract the reference is
``/workspace/executable`` and ``compile.sh`` builds ``./executable`` in the same directory, so an agent that runs its
own ``compile.sh`` overwrites the reference and goes on comparing its program with itself. Our sandbox serves the
reference at ``/workspace/binary``, apart from the agent's build in ``/workspace/src``: a real session whose agent
builds a fake ``./executable`` with its ``compile.sh`` (and tries to write over ``/workspace/binary`` too) still gets
the reference's answers afterwards.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import Testbed

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
# compile.sh writes ./executable (a fake rpn that answers 42 to everything); the agent builds, runs its build, then
# asks the reference, and tries to replace it.
AGENT = (
    "printf '#!/bin/sh\\nprintf \"#!/bin/sh\\\\necho 42\\\\n\" > ./executable && chmod +x ./executable\\n' > compile.sh"
    " && sh compile.sh && echo \"built: $(./executable 1 2 +)\""
    " && echo \"reference: $(/workspace/binary 1 2 +)\""
    " && { cp ./executable /workspace/binary 2>/dev/null && echo 'binary replaced' || echo 'binary not writable'; }"
    " && echo \"reference after: $(/workspace/binary 3 4 + 2 '*')\""
    " && ls /workspace/executable 2>&1 | sed 's/^/official path: /'")


def test_the_reference_survives_a_compile_sh_that_writes_executable(pytester: pytest.Pytester,
                                                                    testbed: Testbed) -> None:
    run_dir = pytester.path / "run"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir", str(testbed.blob_dir),
        "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2", "--pb-agent", AGENT, "--pb-agent-timeout", "120",
        "--pb-output", str(run_dir), timeout=600)
    log = (run_dir / RPN / "agent.log").read_text(errors="replace")
    result.assert_outcomes(failed=1)  # the fake program is scored as what it is
    lines = log.splitlines()
    assert "built: 42" in lines, log[-2000:]  # the agent's own build ran from ./executable
    assert "reference: 3" in lines, log[-2000:]  # ... and the reference still answers as the reference
    assert "binary not writable" in lines, log[-2000:]
    assert "reference after: 14" in lines, log[-2000:]
    # Nothing of the reference sits at the official path for the agent to overwrite or compare against.
    assert any(line.startswith("official path: ") and "No such file" in line for line in lines), log[-2000:]
    calls = [json.loads(line) for line in (run_dir / RPN / "binary-calls.jsonl").read_text().splitlines()]
    assert len(calls) >= 2, calls
