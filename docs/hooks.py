"""mkdocs hooks (``hooks:`` in mkdocs.yml): the generated reference tables, and README.md as the site's front page.

A page holds ``<!-- pb:table NAME -->``, a line of its own, where a table of ``pytest_layer/reference_tables.py``
goes (the options, the environment variables), rendered from their declarations at every build; a marker naming no
table, or a table placed on no page, fails the build. ``docs/index.md`` holds ``<!-- pb:readme -->``: README.md, its
links into ``docs/`` made the site's own, so the front page has one home and strict mode checks its links too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

from pytest_programbench.pytest_layer.reference_tables import TABLES

TABLE = re.compile(r"^<!-- pb:table ([\w-]+) -->$", re.MULTILINE)  # a line of its own, never quoted text
README_MARKER = re.compile(r"^<!-- pb:readme -->$", re.MULTILINE)
README = Path(__file__).resolve().parent.parent / "README.md"

_placed: set[str] = set()


def readme_for_site() -> str:
    """README.md with its links into docs/ relative to the site (``docs/options.md#x`` is ``options.md#x``)."""
    return re.sub(r"\]\(docs/", "](", README.read_text())


def expand(markdown: str, where: str) -> str:
    """A page's Markdown with its markers replaced (the tables it names, README)."""

    def table(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise PluginError(f"{where}: no generated table {name!r} (there are {', '.join(sorted(TABLES))})")
        _placed.add(name)
        return TABLES[name]()

    markdown = TABLE.sub(table, markdown)
    return README_MARKER.sub(lambda _: readme_for_site(), markdown)


def on_pre_build(config: Any) -> None:
    _placed.clear()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, page.file.src_uri)


def on_post_build(config: Any) -> None:
    missing = sorted(set(TABLES) - _placed)
    if missing:
        raise PluginError(f"generated tables placed on no page: {', '.join(missing)}")
