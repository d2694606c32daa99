"""The docs point at things that exist: every relative link of README.md and docs/*.md at a
file (and, with a ``#fragment``, at a heading of it), every ``trajstore ...`` command they
show at a command of the real CLI parser with options it has, every extra they name at
one of pyproject.toml's, spelled one way (``pip install -e '.[EXTRA]'``); README's extras
table is checked against pyproject.toml by tests/test_cli_first_hour.py."""

from __future__ import annotations

import functools
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from trajstore.cli import _parser

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}
EXTRAS = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _prose_lines(path: Path):
    """(line number, line) outside fenced blocks."""
    fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield n, line


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings (a repeated heading gets -1, -2, ...)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path):
        m = re.match(r"^#{1,6} +(.*?) *$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            k = seen.get(slug, 0)
            seen[slug] = k + 1
            out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def broken_links(path: Path) -> list[str]:
    bad = []
    for n, line in _prose_lines(path):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, frag = target.partition("#")
            dest = (path.parent / file) if file else path
            if not dest.exists():
                bad.append(f"{path.relative_to(REPO)}:{n}: {target}: no such file")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                bad.append(f"{path.relative_to(REPO)}:{n}: {target}: no such heading in {file or 'the page'}")
    return bad


def test_every_link_finds_its_file_and_heading():
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_the_map_names_every_page_in_guide_or_internals():
    """docs/README.md is the map: each page of docs/ is linked from its Guide or its Internals part."""
    text = (REPO / "docs" / "README.md").read_text()
    guide, internals = text.split("\n## Guide\n")[1].split("\n## Internals\n")
    linked = set(re.findall(r"\]\(([a-z0-9-]+\.md)\)", guide)) | set(re.findall(r"\]\(([a-z0-9-]+\.md)\)", internals))
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert pages <= linked, sorted(pages - linked)


def commands(path: Path):
    """(line, command) for every ``trajstore ...`` a page shows: in shell blocks (continued
    lines joined) and in inline code, each segment of ``&&``, ``;``, ``|`` on its own."""
    fence, pending = None, ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^\s*```(\S*)\s*$", line)
        if m:
            fence = None if fence is not None else m.group(1)
            continue
        if fence is not None:
            if fence not in SHELL:
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            texts, pending = [pending + line], ""
        else:
            texts = re.findall(r"`([^`]+)`", line)
        for text in texts:
            if text.strip().startswith("#"):
                continue
            for seg in re.split(r"&&|;|\|\|?|\$\(", text):
                seg = re.sub(r"^\s*(?:\$ |[A-Z_]+=\S* |time |exec |nohup )*", "", seg).strip()
                first, _, rest = seg.partition(" ")
                if first == "trajstore" or first.endswith("/trajstore"):
                    yield n, ("trajstore " + rest).strip()


@functools.lru_cache(maxsize=1)
def _cli():
    return _parser()


def _subparsers(p) -> dict:
    return next((a.choices for a in p._actions if a.__class__.__name__ == "_SubParsersAction"), {})


def _options(p) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def command_errors(command: str) -> list[str]:
    """What is wrong with ``command`` (a doc's ``trajstore ...``) against the CLI's parser:
    an unknown command, or an option its command (or sub-action) does not have. Upper-case
    words are placeholders (``COMMAND``, ``URL``); a synopsis's ``[--x]`` and ``--a/--b``
    are read as options."""
    command = re.split(r"\s(?:#|>|2>)", command + " ")[0]
    try:
        words = shlex.split(command)[1:]
    except ValueError:
        words = command.split()[1:]
    top = _cli()
    glob, subs = _options(top), _subparsers(top)
    i = 0
    while i < len(words) and words[i].startswith("-"):
        i += 2 if words[i] in ("--store", "--payload") else 1
    if i >= len(words):
        return [f"trajstore has no {f}" for w in words for f in re.findall(r"(--[a-z][a-z0-9-]*)", w)
                if f not in glob]
    name = words[i]
    if name not in subs:
        return [] if name.isupper() else [f"no command {name!r}"]
    parser = subs[name]
    known = _options(parser) | glob
    actions = _subparsers(parser)
    rest = words[i + 1:]
    positional = [w for w in rest if not w.startswith(("-", "["))]
    if actions and positional and positional[0] in actions:
        known |= _options(actions[positional[0]])
    else:
        for a in actions.values():
            known |= _options(a)
    return [f"trajstore {name} has no {f}" for w in rest
            for f in re.findall(r"(?:^|[\[/|])(--[a-z][a-z0-9-]*)", w) if f not in known]


def test_the_command_check_catches_what_it_should():
    assert command_errors("trajstore --store URL compact") == ["no command 'compact'"]
    assert command_errors("trajstore gc [--compact] [--grace-s S]") == []
    assert command_errors("trajstore gc --compactt") == ["trajstore gc has no --compactt"]
    assert command_errors("trajstore materialize --follow --poll-s 1") == []
    assert command_errors("trajstore worker --tensorboard/--mlflow/--wandb-projekt") == [
        "trajstore worker has no --wandb-projekt"]
    assert command_errors("trajstore payload move LOC --delete-old") == []
    assert command_errors("trajstore payload show --delete-old") == ["trajstore payload has no --delete-old"]
    assert list(commands(REPO / "docs" / "first-hour.md"))


def test_every_command_the_docs_show_exists_with_its_options():
    bad = [f"{page.relative_to(REPO)}:{n}: {err}   [{cmd}]"
           for page in PAGES for n, cmd in commands(page) for err in command_errors(cmd)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_extras_are_spelled_one_way(page):
    """``pip install -e '.[EXTRA]'`` (or ``pip install '.[EXTRA]'``): quoted, from the checkout
    (the package installs from this repository), naming extras that exist."""
    text = page.read_text()
    bad = [m.group(0) for m in re.finditer(r"pip install[^\n`]*?\S*\[[^\]\n]*\]\S*", text)
           if not re.search(r"pip install (?:-q )?(?:-e )?'\.\[[A-Za-z0-9,. ]+\]'", m.group(0))]
    assert not bad, bad
    bad += [m.group(0) for m in re.finditer(r"trajstore\[[a-z,]*\]", text)]
    assert not bad, f"{page.name}: name an extra as `x` or pip install -e '.[x]', not {bad}"
    for m in re.finditer(r"pip install (?:-q )?(?:-e )?'\.\[([A-Za-z0-9,. ]+)\]'", text):
        names = [x.strip() for x in m.group(1).split(",") if x.strip() and x.strip() not in ("EXTRA", "...")]
        assert set(names) <= EXTRAS, (page.name, m.group(0))
