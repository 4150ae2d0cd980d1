"""When ``-k``/``-m`` leave none of the selected tasks: why, and which tasks outside the selection would match.

``-k`` and ``-m`` choose among the collected items, and the items are only the tasks the ``--pb-*`` selection options
chose. In the checkout, whose ``conftest.py`` narrows an unselected session to the test bed's tasks, ``pytest -k
pandoc`` deselected all three and said nothing else. Here the expressions are evaluated over every task of the
catalogue as pytest evaluates them on an item (``-k``: a substring, in any case, of a node name or marker; ``-m``: a
marker name), from the names an item would have, without collecting anything.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import pytest
from _pytest.mark.expression import Expression

from pytest_programbench.core import environment
from pytest_programbench.core.task_key import SUITE_NAME
from pytest_programbench.pytest_layer import options
from pytest_programbench.pytest_layer.invocation import named_tasks
from pytest_programbench.pytest_layer.items import task_keys
from pytest_programbench.pytest_layer.markers import SUITE, difficulty_marker, language_marker
from pytest_programbench.tasks.catalogue import Task

NARROWING = ("pb_language", "pb_difficulty", "pb_filter", "pb_slice")  # the options that leave tasks out
LISTED = 10  # matching tasks named in the hint; the rest counted
BY_NAME = 3  # up to this many matches: the hint gives the node ids to run them by


def _keyword_matcher(names: Collection[str]) -> Callable[..., bool]:
    lowered = [name.lower() for name in names]

    def match(subname: str, /, **kwargs: str | int | bool | None) -> bool:
        return not kwargs and any(subname.lower() in name for name in lowered)

    return match


def _mark_matcher(marks: Collection[str]) -> Callable[..., bool]:
    def match(name: str, /, **kwargs: str | int | bool | None) -> bool:
        return not kwargs and name in marks  # our markers carry no arguments

    return match


@dataclass(frozen=True)
class Expressions:
    """The session's ``-k`` and ``-m``, compiled as pytest compiles them."""

    keyword: Expression | None
    mark: Expression | None
    text: str  # as the user gave them: "-k 'pandoc'", "-m 'lang_go'", or both

    @classmethod
    def of(cls, config: pytest.Config) -> Expressions | None:
        """``None`` without either, or when one does not parse (pytest says so itself)."""
        keyword = (config.option.keyword or "").strip()
        mark = (config.option.markexpr or "").strip()
        if not keyword and not mark:
            return None
        try:
            compiled = (Expression.compile(keyword) if keyword else None, Expression.compile(mark) if mark else None)
        except SyntaxError:
            return None
        text = " ".join(f"{flag} {shlex.quote(value)}" for flag, value in (("-k", keyword), ("-m", mark)) if value)
        return cls(*compiled, text)

    def accepts(self, task: Task, *, attempts: int, gold: int) -> bool:
        """Whether any item of ``task`` would be kept: its names are the suite's, its own and its markers'."""
        marks = (SUITE, language_marker(task.language), difficulty_marker(task.difficulty))
        if self.mark is not None and not self.mark.evaluate(_mark_matcher(marks)):
            return False
        if self.keyword is None:
            return True
        keyword = self.keyword
        return any(keyword.evaluate(_keyword_matcher((SUITE_NAME, key.name, *marks)))
                   for key in task_keys(task, attempts=attempts, gold=gold))


def _given_as(config: pytest.Config, opt: options.Option) -> str:
    """Where a selection option's value came from: the command line, the ini file, or neither (a conftest.py)."""
    if config.getoption(opt.dest, None) is None:
        return "in the ini file"
    words = [*config.invocation_params.args, *shlex.split(environment.PYTEST_ADDOPTS.raw()),
             *config.getini("addopts")]
    if any(word == opt.flag or word.startswith(opt.flag + "=") for word in words):
        return ""
    return "set by a conftest.py, not on the command line"


def narrowing(config: pytest.Config) -> tuple[list[str], bool]:
    """The options and node ids that narrowed the selection, each with where it came from; and whether every one
    came from a conftest.py (the user typed none of them)."""
    said: list[str] = []
    typed = False
    for dest in NARROWING:
        opt = options.BY_DEST[dest]
        value = options.raw_value(config, opt)
        if value in (None, "", []):
            continue
        shown = value if isinstance(value, str) else ",".join(map(str, value))
        where = _given_as(config, opt)
        typed = typed or where != "set by a conftest.py, not on the command line"
        said.append(f"{opt.flag} {shlex.quote(shown)}" + (f" ({where})" if where else ""))
    named = named_tasks(config)
    if named:
        said.append("the tasks named as node ids")
        typed = True
    return said, bool(said) and not typed


def hint_lines(config: pytest.Config, catalogue: Sequence[Task], selected: Sequence[Task], *, attempts: int,
               gold: int) -> list[str]:
    """Lines for the end of a session whose ``-k``/``-m`` kept none of the ``selected`` tasks; ``[]`` otherwise."""
    expressions = Expressions.of(config)
    if expressions is None or not selected:
        return []
    if any(expressions.accepts(t, attempts=attempts, gold=gold) for t in selected):
        return []
    chosen = {t.instance_id for t in selected}
    outside = [t for t in catalogue
               if t.instance_id not in chosen and expressions.accepts(t, attempts=attempts, gold=gold)]
    said, by_conftest = narrowing(config)
    lines = [f"programbench: {expressions.text} matched none of the {len(selected)} selected tasks: -k and -m "
             "only choose among the selected ones"]
    if said:
        lines.append(f"  the selection: {'; '.join(said)}")
    if not outside:
        lines.append(f"  no task outside it matches either ({len(catalogue)} tasks in the catalogue)")
        return lines
    more = f" (+{len(outside) - LISTED} more)" if len(outside) > LISTED else ""
    lines.append(f"  outside it, {expressions.text} matches {len(outside)} task(s): "
                 + ", ".join(t.instance_id for t in outside[:LISTED]) + more)
    if by_conftest:
        if len(outside) <= BY_NAME:
            lines.append("  to run them: pytest " + " ".join(f"{SUITE_NAME}::{t.instance_id}" for t in outside))
        lines.append(f"  {'or ' if len(outside) <= BY_NAME else 'to run them, '}give a selection option of your "
                     f"own: --pb-filter '.*' selects every task, {expressions.text} then narrows them")
    elif said:  # tasks named as node ids are looked up within the options' selection: the options must change
        lines.append(f"  to run them, widen or drop {', '.join(s.split(' (')[0] for s in said)}")
    return lines
