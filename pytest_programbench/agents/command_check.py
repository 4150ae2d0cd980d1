"""Is the ``--pb-agent`` command there where it will run? Asked once, in the first task's sandbox, before the agent.

A command that does not exist is the user's input, not the agent's doing: without the check every sandbox started,
every agent exited 127 and every empty submission was evaluated and scored 0 before the run stopped. With it the
first task is an error naming the command (never a score) and the session stops at once, nothing evaluated.
The ``--pb-preflight`` check asks the same question of one sample sandbox.
"""

from __future__ import annotations

import re
import shlex

from pytest_programbench.results.verdict import InfrastructureError

COMMAND_CHECK_TIMEOUT = 120.0
AGENT_COMMAND_MISSING = "agent_command_missing"  # the item's user property: the stop reads it (stopping.py)
NOT_FOUND, NOT_EXECUTABLE = 127, 126  # what ``sh -c`` exits with for such a command
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.DOTALL)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./+@%:,-]+")  # no expansion, quoting or syntax left in it


class AgentCommandMissing(InfrastructureError):
    """The agent command is not found (or not executable) where it runs: an error, and the session stops."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


def command_word(command: str) -> str | None:
    """The program a shell command runs first (leading ``NAME=value`` assignments skipped); None if unparsable."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    return next((w for w in words if not _ASSIGNMENT.fullmatch(w)), None)


def checkable_word(command: str) -> str | None:
    """``command_word`` when it can be told without running the shell: None for a first word the shell works out
    (a variable, a substitution, a glob, a subshell or group) or looks up elsewhere (a leading ``PATH=``)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        for token in lexer:
            name, assigns, _ = token.partition("=")
            if assigns and _NAME.fullmatch(name):
                if name == "PATH":
                    return None
                continue
            return token if _PLAIN_WORD.fullmatch(token) else None
    except ValueError:  # unbalanced quotes: the shell's own message, in agent.log
        return None
    return None


def command_probe(word: str) -> str:
    """A ``sh`` script: prints where ``word`` is and exits 0, else says why and exits 127 (not found) or 126 (not
    executable), as running it would. dash's ``command -v`` prints any path given, so a path is tested itself."""
    quoted = shlex.quote(word)
    return (f"case {quoted} in */*) "
            f"if [ ! -e {quoted} ]; then echo 'no such file'; exit {NOT_FOUND}; fi; "
            f"if [ -d {quoted} ] || [ ! -x {quoted} ]; then echo 'not an executable file'; exit {NOT_EXECUTABLE}; "
            f"fi; echo {quoted} ;; "
            f"*) command -v {quoted} || {{ echo \"PATH=$PATH\"; exit {NOT_FOUND}; }} ;; esac")


def missing_message(command: str, word: str, code: int, where: str, detail: str, *, setup: bool) -> str:
    """The error's first line names the command and what to do; nothing was run or evaluated."""
    what = "is not executable" if code == NOT_EXECUTABLE else "is not found"
    after = ", after --pb-agent-setup" if setup else ""
    fix = ("install it on the host or give its full path" if where == "on the host" else
           "install it with --pb-agent-setup, mount it with --pb-agent-mount, or give its full path")
    return (f"--pb-agent {command!r}: {word!r} {what} {where} (checked before the agent's first run, as the agent "
            f"user{after}: {detail.strip()[-300:] or 'no output'}); {fix}. Nothing was evaluated")
