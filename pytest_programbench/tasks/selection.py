"""Which tasks a session runs: language, difficulty, then the official filter/slice/shuffle semantics."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from pytest_programbench.tasks.catalogue import DIFFICULTIES, LANGUAGE_ALIASES, Catalogue, Task


@dataclass(frozen=True)
class Selection:
    tasks: tuple[Task, ...]
    why_empty: str = ""


def _canonical_languages(values: Sequence[str], catalogue: Catalogue) -> set[str]:
    known = set(catalogue.languages)
    chosen: set[str] = set()
    for value in values:
        lowered = value.strip().lower()
        canonical = LANGUAGE_ALIASES.get(lowered, lowered)
        if canonical not in known:
            aliases = ", ".join(sorted(a for a, c in LANGUAGE_ALIASES.items() if a != c))
            raise pytest.UsageError(
                f"--pb-language: unknown language {value!r}; choose from {', '.join(sorted(known))} "
                f"(aliases: {aliases})"
            )
        chosen.add(canonical)
    return chosen


def _difficulties(values: Sequence[str]) -> set[str]:
    chosen = {v.strip().lower() for v in values}
    unknown = sorted(chosen - set(DIFFICULTIES))
    if unknown:
        raise pytest.UsageError(
            f"--pb-difficulty: unknown difficulty {unknown[0]!r}; choose from {', '.join(DIFFICULTIES)}"
        )
    return chosen


def _parse_slice(spec: str) -> slice:
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        values = [int(p) if p.strip() else None for p in parts]
    except ValueError:
        raise pytest.UsageError(f"--pb-slice: {spec!r} is not a slice; write A:B or A:B:STEP, e.g. 0:10") from None
    if len(values) == 3 and values[2] == 0:
        raise pytest.UsageError(f"--pb-slice: {spec!r} has a step of 0")
    return slice(*values)


def _filter_pattern(spec: str) -> re.Pattern[str]:
    try:
        return re.compile(spec)
    except re.error as exc:
        raise pytest.UsageError(f"--pb-filter: {spec!r} is not a valid regex ({exc})") from None


def _with_attributes(catalogue: Catalogue, langs: set[str], levels: set[str]) -> list[Task]:
    """The catalogue's tasks in one of ``langs`` and of one of ``levels`` (empty: any)."""
    return [t for t in catalogue if (not langs or t.language in langs) and (not levels or t.difficulty in levels)]


def select(
    catalogue: Catalogue,
    *,
    languages: Sequence[str] = (),
    difficulties: Sequence[str] = (),
    filter_spec: str = "",
    slice_spec: str = "",
    shuffle_seed: int | None = None,
) -> Selection:
    """Language and difficulty first, then programbench's ``filter_instances`` order: shuffle, filter, slice.

    The official function hard-codes seed 42 and re-seeds the global RNG; we keep its algorithm (sort by id, then
    ``random.shuffle``) on a private ``Random(seed)`` so the order for seed 42 is the official one.
    """
    langs = _canonical_languages(languages, catalogue) if languages else set()
    levels = _difficulties(difficulties) if difficulties else set()
    pattern = _filter_pattern(filter_spec) if filter_spec else None
    cut = _parse_slice(slice_spec) if slice_spec else None

    tasks = _with_attributes(catalogue, langs, levels)
    after_attributes = len(tasks)
    if shuffle_seed is not None:
        tasks = sorted(tasks, key=lambda t: t.instance_id)
        random.Random(shuffle_seed).shuffle(tasks)  # noqa: S311 - reproducible order, not security
    if pattern is not None:
        tasks = [t for t in tasks if pattern.match(t.instance_id)]
    after_filter = len(tasks)
    if cut is not None:
        tasks = tasks[cut]
    if tasks:
        return Selection(tuple(tasks))
    if not len(catalogue):
        return Selection((), "the catalogue is empty")
    if after_attributes == 0:
        return Selection((), f"no task has language in {sorted(langs) or 'any'} and difficulty in "
                             f"{sorted(levels) or 'any'} (catalogue: {len(catalogue)} tasks)")
    if after_filter == 0:
        return Selection((), f"--pb-filter {filter_spec!r} matched none of {after_attributes} tasks (re.match on the "
                             f"task id)")
    return Selection((), f"--pb-slice {slice_spec!r} left nothing of {after_filter} tasks")
