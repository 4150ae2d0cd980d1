"""The documentation as the tests read it: README.md (the front page) and the docs site's pages under docs/, a page
or one of its sections, with the generated tables in place as the site shows them (docs/hooks.py); and the commands
of their fenced bash blocks. One home for reading the docs: every test that runs a documented command as written,
or holds the docs to a promise, reads them here.

``SHOWN`` names, for every fenced bash block the docs show, the test module that runs its commands as written, or why
none can (tests/test_readme.py::test_every_command_the_docs_show_is_run_by_a_test_or_says_why_not holds both ways).
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from types import ModuleType

from tests.conftest import REPO

DOCS = REPO / "docs"
HEADING = re.compile(r"(#{1,6}) (.*)")


@cache
def hooks() -> ModuleType:
    """docs/hooks.py, the mkdocs hooks that place the generated tables (a file of the site, not a package)."""
    spec = importlib.util.spec_from_file_location("pb_docs_hooks", DOCS / "hooks.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[str]:
    """README.md and every page of the site, by the name ``page`` takes."""
    return ["README.md", *sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")]  # index.md: README


def page(name: str) -> str:
    """A page as the site renders it: ``README.md`` or a page of docs/ (``running.md``), its markers expanded."""
    path = REPO / name if name == "README.md" else DOCS / name
    return hooks().expand(path.read_text(), name)


def headings(text: str) -> list[tuple[int, int, str]]:
    """(line number, level, title) of every heading outside fenced blocks."""
    found, fence = [], False
    for n, line in enumerate(text.split("\n")):
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := HEADING.fullmatch(line)):
            found.append((n, len(m.group(1)), m.group(2)))
    return found


def section(name: str, title: str, *, subsections: bool = True) -> str:
    """The section of page ``name`` whose heading starts with ``title``, from its heading to the next one of its level
    or higher (``subsections=False``: to the next heading of any level)."""
    text = page(name)
    lines = text.split("\n")
    marks = headings(text)
    for i, (n, level, heading) in enumerate(marks):
        if heading.startswith(title):
            end = next((m for m, lv, _ in marks[i + 1:] if not subsections or lv <= level), len(lines))
            return "\n".join(lines[n:end])
    raise LookupError(f"{name} has no section {title!r}: {[h for _, _, h in marks]}")


def fenced(text: str) -> list[str]:
    """The commands of the fenced bash blocks (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("  #")[0].strip()
            if command:
                commands.append(command)
    return commands


def bash_blocks(name: str) -> list[tuple[str, str]]:
    """(the heading it stands under, its text) of every fenced bash block of a page."""
    text = page(name)
    lines = text.split("\n")
    marks = headings(text)
    blocks = []
    for match in re.finditer(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        line = text.count("\n", 0, match.start())
        heading = next((h for n, _, h in reversed(marks) if n < line), lines[0])
        blocks.append((heading, match.group(1)))
    return blocks


NOT_RUN = "not run: "
# Every fenced bash block of the docs, by (page, heading): the module whose tests run its commands as written (the
# outside world they name substituted as tests/doc_commands.py says), or why none can. A block added to the docs
# without a line here fails the suite; a line whose block is gone, too.
SHOWN: dict[tuple[str, str], str] = {
    ("README.md", "pytest-programbench"): "tests/test_mini_swe_agent.py",  # its codex command too
    ("README.md", "Set-up on a fresh machine"): "tests/test_readme.py",  # and .ci/run runs them, as written
    ("README.md", "Your first real evaluation"): "tests/test_mini_swe_agent.py",
    ("getting-started.md", "Set-up on a fresh machine"): "tests/test_readme.py",
    ("running.md", "Selecting tasks"): "tests/test_readme.py",
    ("agents.md", "CLI agents (codex, claude-code, opencode)"): "tests/test_cli_agents.py",
    ("attempts.md", "Attempts, and the reference's own noise"): "tests/test_gold.py",
    ("comparing.md", "Comparing runs, and a leaderboard entry"): "tests/test_compare.py",
    ("comparing.md", "Against a `programbench eval` run or a leaderboard entry"): "tests/test_compare_foreign.py",
    ("scaling.md", "Running on more than one machine"): "tests/test_engine_over_ssh.py",
}
