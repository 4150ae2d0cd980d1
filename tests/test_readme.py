"""README and the docs site against the code: the two set-up commands are the ones CI runs, the selection examples
run as written, the options table names every option, the agent's environment table names every variable the runner
sets, the site builds strictly (and a broken link or anchor fails it), and every command the docs show is run by a
test or says why not. The pages are read through tests/docs_text.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from pytest_programbench.agents.agent import AgentRunner, AgentSpec
from pytest_programbench.core.settings import Settings
from pytest_programbench.pytest_layer.options import OPTIONS
from pytest_programbench.pytest_layer.reference_tables import TABLES, anchor, option_row
from pytest_programbench.relay.relay import relay_env
from pytest_programbench.tasks.catalogue import load_packaged
from tests.conftest import REPO
from tests.docs_text import DOCS, NOT_RUN, SHOWN, bash_blocks, fenced, pages, section

pytestmark = pytest.mark.users_defaults  # the docs' commands, as written

# Set only by the host-loop runner (AgentRunner._on_host), which needs a live sandbox.
HOST_ONLY = ("PB_CONTAINER_ID", "PB_SANDBOX_EXEC", "PB_AGENT_UID", "PB_AGENT_WINDOW")
SET_UP = ["bash scripts/main-job.sh", "bash scripts/test-suite.sh"]


@pytest.mark.parametrize("page", ["README.md", "getting-started.md"])
def test_a_fresh_machine_needs_the_two_commands_ci_runs(page: str) -> None:
    commands = fenced(section(page, "Set-up on a fresh machine"))
    assert commands == SET_UP
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert all(command in ci for command in commands), "CI runs the set-up commands as written"
    installing = section("getting-started.md", "Install")
    assert "```" not in installing, "installing is said in prose: the set-up commands do it"


def test_the_selection_examples_run_as_written(tmp_path: Path) -> None:
    commands = fenced(section("running.md", "Selecting tasks"))
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
    assert "# the 46 Go tasks" in section("running.md", "Selecting tasks")
    assert go == 46
    assert counts[commands[0]] == go
    assert 0 < counts[commands[1]] < go
    assert counts[commands[2]] == 3


def test_the_options_table_names_every_option() -> None:
    """The site's options table, generated from OPTIONS, has a row for each (its usage, ini key, default, help) and
    names no option that is not declared; an option whose default is computed from the machine says it in words."""
    assert "<!-- pb:table options -->" in (DOCS / "options.md").read_text()
    table = section("options.md", "Options", subsections=True)
    assert [o.flag for o in OPTIONS if option_row(o) not in table] == []
    assert [o.flag for o in OPTIONS if f'<a id="{anchor(o.flag)}"></a>' not in table] == []
    named = set(re.findall(r"(?<![\w-])--pb-[a-z-]+[a-z]", table))  # not inside an anchor (#under-gvisor---pb-...)
    assert named <= {o.flag for o in OPTIONS}, named - {o.flag for o in OPTIONS}
    computed = {f.name for f in fields(Settings) if f.default_factory is not MISSING}
    assert [o.flag for o in OPTIONS if computed & set(o.settings_fields) and not o.default_text] == []


def test_the_environment_table_names_every_variable_the_agent_gets(tmp_path: Path) -> None:
    task = load_packaged()[0]
    runner = AgentRunner(AgentSpec("command", command="true"), task, Settings(agent="true"),
                         log_path=tmp_path / "agent.log")
    in_sandbox = runner.environment(None)  # type: ignore[arg-type] # the sandbox is not read for the variables
    names = {*in_sandbox, *relay_env("http://127.0.0.1:1", "/v1", injects_key=True), *HOST_ONLY}
    table = "\n".join(line for line in section("agents.md", "The agent's environment").splitlines()
                      if line.startswith("|"))
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
    """The docs' table of environment variables lists exactly the harness's own declared ones, each with its default
    (``core/environment.py`` is the one table the code reads; the site's table is generated from it)."""
    from pytest_programbench.core.environment import OURS

    assert "<!-- pb:table environment -->" in (DOCS / "options.md").read_text()
    rows = {}
    for line in section("options.md", "Settings by environment variable").splitlines():
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


def _build(config_dir: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=config_dir, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_docs_site_builds_strictly_and_a_broken_link_or_anchor_fails_it(tmp_path: Path) -> None:
    """The site as CI builds it (scripts/test-suite.sh), offline: every generated table placed, every page in the
    nav; then the same files with one broken link, and with one broken anchor: the strict build refuses each."""
    built = _build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    options = (tmp_path / "site" / "options" / "index.html").read_text()
    assert all(f'id="{anchor(o.flag)}"' in options for o in OPTIONS)
    front = (tmp_path / "site" / "index.html").read_text()  # README, its links into docs/ made the site's
    assert "Your first real evaluation" in front
    assert 'href="getting-started/"' in front
    for what, page, old, new, said in (
            ("link", "attempts.md", "](evaluation.md)", "](evaluations.md)", "a link 'evaluations.md'"),
            ("anchor", "README.md", "docs/agents.md#cli-agents-codex-claude-code-opencode", "docs/agents.md#cli-agent",
             "does not contain an anchor '#cli-agent'")):
        copy = tmp_path / what
        shutil.copytree(DOCS, copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO / "mkdocs.yml", copy)
        shutil.copy(REPO / "README.md", copy)
        target = copy / "docs" / page if page != "README.md" else copy / page
        text = target.read_text()
        assert old in text
        target.write_text(text.replace(old, new, 1))
        broken = _build(copy, copy / "site")
        assert broken.returncode != 0, (what, broken.stdout + broken.stderr)
        assert said in broken.stderr, broken.stderr


def test_a_marker_naming_no_table_fails_the_build() -> None:
    from tests.docs_text import hooks

    with pytest.raises(Exception, match="no generated table 'optoins'"):
        hooks().expand("<!-- pb:table optoins -->", "options.md")
    assert set(TABLES) == {"options", "environment"}


def test_every_command_the_docs_show_is_run_by_a_test_or_says_why_not() -> None:
    """Each fenced bash block of README and the site stands under a heading SHOWN names: a test module that reads
    that section (by page and heading) to run its commands as written, or the reason none can."""
    shown = {(name, heading) for name in pages() for heading, _ in bash_blocks(name)}
    assert sorted(shown - set(SHOWN)) == [], "a block no test runs: add it to tests/docs_text.py's SHOWN"
    assert sorted(set(SHOWN) - shown) == [], "SHOWN names a block the docs no longer show"
    for (name, heading), runner in SHOWN.items():
        if runner.startswith(NOT_RUN):
            continue
        source = (REPO / runner).read_text()
        assert repr(name) in source or f'"{name}"' in source, (runner, name)
        assert heading in source, (runner, heading)
