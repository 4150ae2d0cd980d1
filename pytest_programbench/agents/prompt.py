"""The agent's prompt: the task's docs and the official ProgramBench rules, adapted to our sandbox layout.

Rendered with Jinja2 from ``templates/prompt.md.j2`` or ``--pb-prompt-template FILE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from pytest_programbench.sandbox.layout import BINARY_PATH, DOCS_DIR, SRC_DIR
from pytest_programbench.tasks.catalogue import Task

DEFAULT_TEMPLATE = Path(__file__).with_name("templates") / "prompt.md.j2"
README_CAP = 40_000


@dataclass(frozen=True)
class PromptContext:
    task: Task
    doc_files: tuple[str, ...] = ()
    readme: str = ""
    model_relay: bool = False
    extra: dict[str, str] = field(default_factory=dict)


class PromptTemplateError(Exception):
    """The template cannot be read or rendered: a usage problem, named with the file."""


def render_prompt(context: PromptContext, template: Path | None = None) -> str:
    path = template or DEFAULT_TEMPLATE
    try:
        source = path.read_text()
    except OSError as exc:
        raise PromptTemplateError(f"--pb-prompt-template: cannot read {path} ({exc})") from exc
    readme = context.readme
    if len(readme) > README_CAP:
        readme = readme[:README_CAP] + f"\n\n[... README truncated at {README_CAP} characters; see the docs ...]"
    try:
        # A Markdown prompt for an agent, not HTML: escaping would corrupt it.
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                 autoescape=False)  # noqa: S701
        return env.from_string(source).render(
            task=context.task, language=context.task.language, doc_files=context.doc_files, readme=readme,
            binary=BINARY_PATH, docs=DOCS_DIR, src=SRC_DIR, model_relay=context.model_relay, **context.extra,
        )
    except jinja2.TemplateError as exc:
        raise PromptTemplateError(f"prompt template {path}: {exc}") from exc
