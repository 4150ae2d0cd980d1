"""Each attempt's trajectory in Harbor's ATIF (results/atif.py), validated against the format's published schema:
Harbor's own pydantic models (``harbor.models.trajectories``, from the ``harbor`` wheel on PyPI, fetched once per
machine and read in place: Harbor needs Python 3.12, its trajectory models do not), through a real session where the
real claude-code probes the reference, copies the solution in and says done through the relay.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from pytest_programbench.agents import agent_presets
from pytest_programbench.core.cache import cache_dir
from tests.conftest import TESTBED, Testbed
from tests.scripted_models import ScriptedModels, Step

pytestmark = pytest.mark.usefixtures("clean_env")

RPN = "pbfix__rpn.0b5e55e"
HARBOR = "harbor==0.26.0"
STEPS = (
    Step("Probing the reference.", '/workspace/binary 1 2 +; echo "binary exited $?"', 1200, 40, 500),
    Step("Copying the solution.", f"cp -r /pb-testbed/solutions/{RPN}/. /workspace/src/", 1500, 60, 1100),
    Step("Done: the solution is in /workspace/src.", None, 1700, 25, 1400),
)
VALIDATE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from harbor.models.trajectories import Trajectory
Trajectory.model_validate(json.load(open(sys.argv[2])))
print("valid")
"""


@pytest.fixture(scope="module")
def harbor_models() -> Path:
    """Harbor's ATIF models, unpacked from its published wheel (downloaded once per machine, behind a lock)."""
    root = cache_dir("harbor", None)
    models = root / HARBOR.replace("==", "-")
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "fetch.lock"), timeout=600):
        if not (models / "harbor" / "models" / "trajectories" / "trajectory.py").is_file():
            wheels = root / "wheels"
            subprocess.run([sys.executable, "-m", "pip", "download", HARBOR, "--no-deps", "--python-version", "3.12",
                            "--only-binary=:all:", "-d", str(wheels)], check=True, capture_output=True, timeout=600)
            wheel = next(wheels.glob("harbor-*.whl"))
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name.startswith("harbor/models/trajectories/"):
                        archive.extract(name, models)
            for package in ("harbor", "harbor/models"):  # not Harbor's own: it imports all of Harbor (3.12 only)
                (models / package / "__init__.py").write_text("")
    return models


def validate(models: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", VALIDATE, str(models), str(path)], capture_output=True, text=True,
                          timeout=120)


def test_the_atif_trajectory_validates_against_harbors_schema(pytester: pytest.Pytester, testbed: Testbed,
                                                               harbor_models: Path) -> None:
    parsed = agent_presets.parse("claude-code")
    assert parsed is not None
    agent_presets.ensure_installed(*parsed)
    run_dir = pytester.path / "run"
    with ScriptedModels(STEPS) as server:
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "--pb-tasks-dir", str(testbed.tasks_dir), "--pb-blob-dir",
            str(testbed.blob_dir), "--pb-filter", RPN, "--pb-pull", "never", "--pb-cpus", "2",
            "--pb-agent", "claude-code", "--pb-model", "scripted-model", "--pb-model-endpoint", server.base_url,
            "--pb-agent-mount", f"{TESTBED}:/pb-testbed", "--pb-agent-timeout", "600", "--pb-output", str(run_dir),
            timeout=900)
    result.assert_outcomes(passed=1)
    path = run_dir / RPN / "trajectory.atif.json"
    checked = validate(harbor_models, path)
    assert checked.stdout.strip() == "valid", checked.stderr[-3000:]
    doc: dict[str, Any] = json.loads(path.read_text())
    assert doc["schema_version"] == "ATIF-v1.7"
    assert (doc["agent"]["name"], doc["agent"]["version"]) == ("claude-code", parsed[1])
    steps = doc["steps"]
    assert [s["step_id"] for s in steps] == list(range(1, len(steps) + 1))
    assert steps[0]["source"] == "user"
    assert "rpn" in steps[0]["message"].lower()  # the task's prompt
    calls = [c for s in steps if s["source"] == "agent" for c in s.get("tool_calls") or []]
    commands = [json.dumps(c["arguments"]) for c in calls]
    assert any("/workspace/binary 1 2 +" in c for c in commands), commands
    assert any(f"/pb-testbed/solutions/{RPN}" in c for c in commands), commands
    outputs = [r["content"] for s in steps for r in (s.get("observation") or {}).get("results") or []]
    assert any("binary exited 0" in (o or "") for o in outputs), outputs
    binary = [s for s in steps if s["source"] == "system" and "/workspace/binary called" in s["message"]]
    assert binary, [s["message"][:80] for s in steps]
    assert binary[0]["extra"]["binary_call"]["argv"] == ["/workspace/binary", "1", "2", "+"]
    assert doc["final_metrics"]["total_completion_tokens"] == server.sent.output_tokens
    assert json.loads((run_dir / RPN / "pb-meta.json").read_text())["atif"] == "trajectory.atif.json"
    # The schema is strict: a step the format does not know is refused (the check is not a formality).
    broken = pytester.path / "broken.json"
    broken.write_text(json.dumps({**doc, "steps": [{**steps[0], "source": "tool"}, *steps[1:]]}))
    assert validate(harbor_models, broken).returncode != 0
