"""The docs site's reference tables, rendered as Markdown from their declarations: every ``--pb-*`` option
(``options.OPTIONS``, with Settings' defaults) and every environment variable of ours (``core.environment.OURS``).

``docs/hooks.py`` puts each where a page holds its marker (``<!-- pb:table NAME -->``) when mkdocs builds the site,
so a declaration added in the code is in the docs with nothing else to write, and none can be left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pytest_programbench.core import environment
from pytest_programbench.core.settings import default
from pytest_programbench.pytest_layer.options import OPTIONS, SECTIONS, Option

SECTION_TITLES = {
    "selection": "Selection", "agent": "Agent", "model": "Model and relay", "sandbox": "Sandbox",
    "evaluation": "Evaluation", "run": "Run",
}

# Words of a help text that read as code in the docs: an option, an environment variable, a snake_case name, a
# file or path name. Everything else is text, with Markdown's and HTML's special characters escaped.
_CODE = re.compile(
    r"--pb-[a-z-]*[a-z]"
    r"|\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b"
    r"|[\w<>\[\]/.-]*[\w>]\.(?:json|jsonl|yaml|html|xml|sh|py|gz|md)\b"
    r"|\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b"
    r"|(?:[\w.-]+/)*[\w.-]*<[^<>\n]{1,24}>(?:[\w./-]*<[^<>\n]{1,24}>)*[\w/.\[\]-]*"
    r"|/workspace[\w/.-]*"
)
_SPECIAL = re.compile(r"([\\|*_<>\[\]`])")


def _text(plain: str) -> str:
    """Help text as Markdown for a table cell: code-like words in backticks, the rest escaped."""
    out: list[str] = []
    for n, part in enumerate(plain.split("`")):
        if n % 2:  # already a code span in the help text
            out.append(_code(part))
            continue
        last = 0
        for match in _CODE.finditer(part):
            out.append(_SPECIAL.sub(r"\\\1", part[last:match.start()]))
            out.append(_code(match.group()))
            last = match.end()
        out.append(_SPECIAL.sub(r"\\\1", part[last:]))
    return "".join(out)


def _code(word: str) -> str:
    """A code span (a table cell's ``|`` escaped); an option links to its row."""
    span = f"`{word.replace('|', chr(92) + '|')}`"
    if re.fullmatch(r"--pb-[a-z-]+", word) and any(o.flag == word for o in OPTIONS):
        return f"[{span}](#{anchor(word)})"
    return span


def anchor(flag: str) -> str:
    """The id of an option's row: ``--pb-agent`` is ``#pb-agent``."""
    return flag.removeprefix("--")


def default_text(option: Option) -> str:
    """The default as the docs say it: the declared wording, else Settings' value (off/on, blank when unset)."""
    if option.default_text:
        return option.default_text
    value = default(option.settings_fields[0])
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value in ("", ()):
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    return f"`{value}`" if isinstance(value, str) else str(value)


def option_row(option: Option) -> str:
    usage = f"{option.flag} {option.metavar}" if option.metavar else option.flag
    name = f'<a id="{anchor(option.flag)}"></a>`{usage.replace("|", chr(92) + "|")}`<br>ini `{option.ini}`'
    meaning = _text(option.help) + (f" {option.docs}" if option.docs else "")
    return f"| {name} | {default_text(option)} | {meaning} |"


def options_markdown() -> str:
    """Every option, by its ``--help`` section, in declaration order within it."""
    parts = []
    for section in SECTIONS:
        rows = [option_row(o) for o in OPTIONS if o.section == section]
        parts.append(f"### {SECTION_TITLES[section]}\n\n| option | default | meaning |\n| --- | --- | --- |\n"
                     + "\n".join(rows) + "\n")
    return "\n".join(parts)


def environment_markdown() -> str:
    """Every environment variable of ours, in declaration order, with its default and meaning."""
    rows = [f"| `{v.name}` | {f'`{v.default}`' if v.default else ''} | {v.meaning} |" for v in environment.OURS]
    return "| variable | default | meaning |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"


TABLES: dict[str, Callable[[], str]] = {"options": options_markdown, "environment": environment_markdown}
