"""The command lines README.md documents, read from its code (inline spans and code blocks), so
tests run exactly what a new user would type.

A command is `elastrain ...`, `python -m <module> ...` (or python3) or `python3 hack/<script>.py
...`, up to the end of its code span, a `#` comment or a closing quote; commands inside comments
count too (`# or: elastrain operator ...`). `elastrain <command>` alone mentions the command
("`elastrain describe` too") rather than giving a command line to run.
"""

from __future__ import annotations

import re
import shlex
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"

_SPAN = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(
    r"(?<![\w./-])((?:elastrain|python3? -m [\w.]+|python3? hack/[\w/]+\.py)(?: [^`#\"')\n]*)?)")


def _code(markdown: str) -> list[str]:
    """Every inline code span, and every line of a fenced or indented code block."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            found.append(line)
        else:
            found.extend(_SPAN.findall(line))
    return found


def documented_commands(markdown: str | None = None) -> list[list[str]]:
    """Each documented command line as an argv list, in order of appearance, without repeats."""
    text = README.read_text() if markdown is None else markdown
    commands: list[list[str]] = []
    for code in _code(text):
        for match in _COMMAND.finditer(code):
            argv = shlex.split(match.group(1))
            if len(argv) > 1 and argv not in commands:
                commands.append(argv)
    return commands


def is_mention(argv: list[str]) -> bool:
    return argv[0] == "elastrain" and len(argv) == 2


def executable(argv: list[str]) -> list[str]:
    """The argv as this environment runs it: `python` is this interpreter, `elastrain` the
    console script installed beside it."""
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    if argv[0] == "elastrain":
        return [str(Path(sysconfig.get_path("scripts")) / "elastrain"), *argv[1:]]
    return argv
