"""The docs' commands run as written: read from a page's section (tests/docs_text.py), only the outside world they name
substituted, by a test's explicit table, and the test bed put where the benchmark would be.

What is substituted, and nothing else:

- **hosts** (a model API, a remote engine): each test's table maps the text of an outside address to what stands in
  for it on this machine (our scripted model server on loopback, an engine reached over ssh:// or tcp:// on
  127.0.0.1), replaced inside the words it occurs in (``https://api.openai.com/v1`` keeps its ``/v1``). A table entry
  no command uses, or an address left that is not loopback, fails the test: a changed doc command shows.
- **secrets**: ``export NAME=sk-...`` and every ``--pb-model-key-env NAME`` take the test's stand-in key for ``NAME``
  (the user's key, which the session must keep out of every file and output).
- **the benchmark**: the 200 packaged tasks live on Docker Hub (images) and Hugging Face (hidden tests), which no
  test machine reaches. A command's selection is kept as written and given a task to select: a copy of the test
  bed's rpn (tests/task_copies.py) named for the command (``-k pandoc``: a task named ``pandoc``; none: ``rpn``), of
  the language it asks for (``--pb-language go``: a Go task), under a fresh organisation; the session gets the test
  bed added (``--pb-tasks-dir`` holding the copy, ``--pb-blob-dir`` its hidden tests, ``--pb-pull never``: the
  locally built image, never Docker Hub; ``HF_HUB_OFFLINE=1`` from tests/conftest.py) and ``--pb-filter <org>__``, which
  leaves the copy where the packaged tasks were.

The rest of each command (its agent, model name, ``-n``, ``--junitxml``, budgets, engines' slots) runs as written.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import Testbed
from tests.docs_text import fenced, section
from tests.task_copies import task_copies

SOURCE = "pbfix__rpn.0b5e55e"  # the test bed's task every stand-in copies (image, docs, hidden tests, solution)
LOOPBACK = re.compile(r"^(?:https?|tcp|ssh)://(?:[\w.-]+@)?(?:127\.0\.0\.1|localhost)(?::\d+)?(?:[/=]|$)")
ADDRESS = re.compile(r"(?:https?|tcp|ssh)://\S+")


def block(page: str, heading: str) -> list[str]:
    """The commands of the fenced bash blocks of ``page``'s section ``heading`` (its own text, no subsection)."""
    commands = fenced(section(page, heading, subsections=False))
    assert commands, (page, heading)
    return commands


@dataclass
class Substitution:
    """A test's explicit table: outside address -> its stand-in, secret name -> the stand-in key."""

    hosts: Mapping[str, str]
    keys: Mapping[str, str]
    used: set[str] = field(default_factory=set)

    def words(self, command: str) -> list[str]:
        """``command``'s words after ``pytest``, each outside address replaced by its stand-in."""
        words = shlex.split(command)
        assert words[0] == "pytest", command
        out = []
        for written in words[1:]:
            word = written
            for outside, ours in self.hosts.items():
                if outside in word:
                    word = word.replace(outside, ours)
                    self.used.add(outside)
            for address in ADDRESS.findall(word):
                assert LOOPBACK.match(address), f"{command!r}: {address} is outside and the test's table has no " \
                                                "stand-in for it"
            out.append(word)
        assert "--pb-filter" not in out, f"{command!r} selects with --pb-filter: the test bed's filter would replace it"
        return out

    def env(self, commands: list[str]) -> dict[str, str]:
        """The block's environment: its ``export NAME=...`` lines and the keys its commands name, as stand-ins."""
        names = [line.split()[1].split("=", 1)[0] for line in commands if line.startswith("export ")]
        for command in commands:
            words = shlex.split(command)
            names += [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--pb-model-key-env"]
        missing = sorted({n for n in names if n not in self.keys})
        assert missing == [], f"no stand-in key for {missing}"
        return {name: self.keys[name] for name in names}

    def check_all_used(self) -> None:
        assert sorted(set(self.hosts) - self.used) == [], "the table stands in for addresses the docs no longer show"


def option(words: list[str], name: str) -> str | None:
    """The value of ``name`` in ``words`` (``--opt value`` or ``--opt=value``; ``-k value``), else None."""
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


@dataclass(frozen=True)
class StandIn:
    """The test bed in the benchmark's place for one command: the copy's id and the options that add it."""

    task: str
    args: tuple[str, ...]
    root: Path
    tasks: tuple[str, ...]


@contextlib.contextmanager
def stand_in(root: Path, testbed: Testbed, docker_client: Any, words: list[str], tasks: int = 1) -> Iterator[StandIn]:
    """A copy of :data:`SOURCE` named and of the language ``words`` select (see the module's docstring); ``tasks``
    copies (``rpn``, ``rpn2``...) where a command is about spreading several (``StandIn.task``: the first)."""
    keyword = option(words, "-k")
    if keyword is not None:
        assert re.fullmatch(r"[a-z0-9]+", keyword), f"-k {keyword!r}: a plain task name is what the copy can match"
    name = keyword or SOURCE.split("__")[1].split(".", maxsplit=1)[0]
    names = [name, *(f"{name}{n}" for n in range(2, tasks + 1))]
    with task_copies(root, testbed, docker_client, dict.fromkeys(names, SOURCE), prefix="pbdocs") as ids:
        language = option(words, "--pb-language")
        for task in ids.values():
            if language is not None:
                yaml = root / "tasks" / task / "task.yaml"
                text = yaml.read_text()
                assert "\nlanguage: c\n" in text, text
                yaml.write_text(text.replace("\nlanguage: c\n", f"\nlanguage: {language}\n"))
        org = ids[name].split("__")[0]
        yield StandIn(ids[name], ("--pb-tasks-dir", str(root / "tasks"), "--pb-blob-dir", str(root / "blobs"),
                                  "--pb-pull", "never", "--pb-filter", f"{org}__"), root, tuple(ids.values()))


def written_run_dir(cwd: Path, result: Any = None) -> Path:
    """The one run directory a command without ``--pb-output`` wrote: ``pb-runs/<UTC>-<run id>`` under ``cwd``
    (``result``: the session's, whose output tells why there is none)."""
    found = sorted(p for p in (cwd / "pb-runs").glob("*") if p.is_dir())  # beside them: the runs' index.html
    said = "" if result is None else "\n".join([*result.outlines[-30:], *result.errlines[-30:]])
    assert len(found) == 1, f"run directories {found}\n{said}"
    return found[0]
