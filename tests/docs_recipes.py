"""The runnable recipes of the user's guide, read from the markdown as written.

A recipe is a fenced code block of a shell (``bash``, ``sh``) or ``python``. Each
runs as written unless an HTML comment on the line just before its fence says
otherwise (invisible on the rendered page)::

    <!-- recipe: skip "needs a GPU" -->
    <!-- recipe: background ready "listening on" -->
    <!-- recipe: background stop TERM ready "listening on" -->
    <!-- recipe: save agent.py run "python agent.py" expect "recorded as seq" -->
    <!-- recipe: expect '"num_held_back": 1' match 'label-try\\W+42\\W+42' -->

The comment is a list of ``keyword [argument]`` pairs, quoted as a shell quotes:
``skip REASON`` (not run; the walk lists it by page, line and reason), ``before COMMAND``
(run first, in the same shell: the state the prose assumes, e.g. a store to work on,
shown in the comment so the setup is as visible as the recipe), ``save FILE``
(the block's text is written to FILE), ``run COMMAND`` (run this instead of the
block, e.g. the ``python agent.py`` the prose asks for after ``save``, or the
command of a block whose first line installs the package the test already runs
from), ``background`` (started and left running until the page's walk ends, then
stopped as a terminal's Ctrl-C does, SIGINT (it must exit 0, or 130 as the CLI does on
Ctrl-C), or with ``stop TERM`` by SIGTERM (it must exit 0)), ``ready TEXT`` (with ``background``: wait for TEXT in its output),
``expect TEXT`` (the output holds TEXT), ``match REGEX`` (the
output matches). Untyped blocks (synopses, output) and other languages (``sql``,
``yaml``) are not recipes.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

RUNNABLE = {"bash", "sh", "shell", "python"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[A-Za-z0-9_+-]*)[ \t]*$")
_MARK = re.compile(r"^[ \t]*<!-- recipe: (?P<spec>.*?) -->[ \t]*$")
_KEYWORDS_WITH_ARG = {"skip", "before", "save", "run", "ready", "stop", "expect", "match"}
_FLAGS = {"background"}


@dataclass
class Recipe:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None = None
    before: str | None = None
    save: str | None = None
    run: str | None = None
    background: bool = False
    ready: str | None = None
    stop: str = "INT"
    expect: list[str] = field(default_factory=list)
    match: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_mark(spec: str, where: str) -> dict:
    """The directives of one ``<!-- recipe: ... -->`` comment; an unknown keyword is an error."""
    words = shlex.split(spec)
    out: dict = {"expect": [], "match": []}
    i = 0
    while i < len(words):
        word = words[i]
        if word in _FLAGS:
            out[word] = True
            i += 1
        elif word in _KEYWORDS_WITH_ARG:
            if i + 1 >= len(words):
                raise ValueError(f"{where}: recipe keyword {word!r} needs an argument")
            if word in ("expect", "match"):
                out[word].append(words[i + 1])
            else:
                out[word] = words[i + 1]
            i += 2
        else:
            raise ValueError(f"{where}: unknown recipe keyword {word!r} in {spec!r}")
    return out


def recipes(path: Path, root: Path) -> list[Recipe]:
    """Every runnable block of the page at ``path``, in order, with its directives."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(root))
    found: list[Recipe] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group("lang")
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = textwrap.dedent("\n".join(lines[start + 1:j]))
        mark = _MARK.match(lines[start - 1]) if start > 0 else None
        i = j + 1
        if lang not in RUNNABLE:
            if mark:
                raise ValueError(f"{page}:{start + 1}: a recipe comment above a {lang or 'plain'} block")
            continue
        directives = parse_mark(mark.group("spec"), f"{page}:{start}") if mark else {"expect": [], "match": []}
        found.append(Recipe(page, start + 1, lang, body + "\n", **directives))
    return found


def shell_script(text: str) -> str:
    """A shell block as one script that stops at the first failing command."""
    return "set -e -o pipefail\n" + text.rstrip("\n") + "\n"
