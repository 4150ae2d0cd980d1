"""README against the code: the two set-up commands are the ones CI runs, the selection examples run as written,
the options table names every option, the agent's environment table names every variable the runner sets.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_programbench.agents.agent import AgentRunner, AgentSpec
from pytest_programbench.core.settings import Settings
from pytest_programbench.pytest_layer.options import OPTIONS
from pytest_programbench.relay.relay import relay_env
from pytest_programbench.tasks.catalogue import load_packaged
from tests.conftest import REPO

pytestmark = pytest.mark.users_defaults  # README's commands, as written

README = (REPO / "README.md").read_text()
# Set only by the host-loop runner (AgentRunner._on_host), which needs a live sandbox.
HOST_ONLY = ("PB_CONTAINER_ID", "PB_SANDBOX_EXEC", "PB_AGENT_UID", "PB_AGENT_WINDOW")


def section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else len(README)]


def fenced(text: str) -> list[str]:
    """The commands of the fenced bash blocks (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("  #")[0].strip()
            if command:
                commands.append(command)
    return commands


def test_a_fresh_machine_needs_the_two_commands_ci_runs() -> None:
    commands = fenced(section("Set-up on a fresh machine"))
    assert commands == ["bash scripts/main-job.sh", "bash scripts/test-suite.sh"]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert all(command in ci for command in commands), "CI runs README's set-up commands as written"
    assert "```" not in section("Install"), "installing is said in prose: the set-up commands do it"


def test_the_selection_examples_run_as_written(tmp_path: Path) -> None:
    commands = fenced(section("Selecting tasks"))
    assert len(commands) == 3, commands
    counts = {}
    for command in commands:
        words = shlex.split(command)
        assert words[0] == "pytest", command
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *words[1:]], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        found = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", done.stdout)
        assert found, (command, done.stdout[-2000:])
        counts[command] = int(found.group(1))
    go = sum(t.language == "go" for t in load_packaged())
    assert "# the 46 Go tasks" in section("Selecting tasks")
    assert go == 46
    assert counts[commands[0]] == go
    assert 0 < counts[commands[1]] < go
    assert counts[commands[2]] == 3


def test_the_options_table_names_every_option() -> None:
    table = section("Options")
    assert [o.flag for o in OPTIONS if o.flag not in table] == []
    named = set(re.findall(r"--pb-[a-z-]+[a-z]", table))
    assert named <= {o.flag for o in OPTIONS}, named - {o.flag for o in OPTIONS}


def test_the_environment_table_names_every_variable_the_agent_gets(tmp_path: Path) -> None:
    task = load_packaged()[0]
    runner = AgentRunner(AgentSpec("command", command="true"), task, Settings(agent="true"),
                         log_path=tmp_path / "agent.log")
    in_sandbox = runner.environment(None)  # type: ignore[arg-type] # the sandbox is not read for the variables
    names = {*in_sandbox, *relay_env("http://127.0.0.1:1", "/v1", injects_key=True), *HOST_ONLY}
    table = "\n".join(line for line in section("The agent's environment").splitlines() if line.startswith("|"))
    documented = set(re.findall(r"`([A-Z][A-Z_]+|[a-z]+_[a-z_]+)`", table))  # no_proxy too
    assert sorted(names - documented) == []
    # Every documented name is one a runner sets (the host's DOCKER_HOST and the presets' examples aside).
    source = "".join((REPO / "pytest_programbench" / p).read_text()
                     for p in ("agents/agent.py", "relay/relay.py", "sandbox/sandbox.py", "agents/agent_presets.py"))
    assert sorted(n for n in documented if f'"{n}"' not in source) == []


@pytest.mark.parametrize("name", HOST_ONLY)
def test_the_host_only_names_are_the_runners(name: str) -> None:
    source = (REPO / "pytest_programbench" / "agents" / "agent.py").read_text()
    assert f'"{name}":' in source.split("def _on_host", 1)[1]


def test_the_environment_table_is_the_declared_one() -> None:
    """README's table of environment variables lists exactly the harness's own declared ones, each with its default
    (``core/environment.py`` is the one table the code reads)."""
    from pytest_programbench.core.environment import OURS

    section = README.split("## Settings by environment variable", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1].strip("`")
    assert rows == {v.name: v.default for v in OURS}


def test_no_module_reads_an_undeclared_environment_variable() -> None:
    """Every variable the package reads goes through the declared table: no ``os.environ.get("NAME")`` and no
    ``environ["NAME"]`` with a literal name outside ``core/environment.py`` (the proxy daemon and client, shipped
    into containers alone, read their own)."""
    package = Path(__file__).parent.parent / "pytest_programbench"
    pattern = re.compile(r"""(?:environ|getenv)(?:\.get)?[\[(]\s*["'][A-Z_]+["']""")
    readers = [f"{path.relative_to(package)}:{n}" for path in package.rglob("*.py")
               if path.parent.name != "proxy" and path.name != "environment.py"
               for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert readers == []
