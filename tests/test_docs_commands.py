"""Every `sp-harness ...` command the README and docs/ show parses: a renamed flag or a removed
subcommand fails here instead of in a newcomer's terminal. (Parsing only: running them all is
the main job's and the other tests' business.)"""

import pathlib
import re
import shlex

import pytest

from sp_harness.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a command inside a fenced block or inline code span, up to a comment, a pipe or the span's end
COMMAND = re.compile(r"(?:^|`|&& )(?:\.venv/bin/)?(sp-harness (?:[^`#|&\n]|&(?!&))+)")


def _lines(page: pathlib.Path) -> list[str]:
    """Fenced blocks line by line; prose with its inline code spans joined across line breaks."""
    out, fenced = [], False
    for part in re.split(r"(^```.*$)", page.read_text(), flags=re.M):
        if part.startswith("```"):
            fenced = not fenced
        elif fenced:
            out.extend(part.splitlines())
        else:
            out.extend(re.sub(r"`[^`]*`", lambda m: m.group(0).replace("\n", " "), part).splitlines())
    return out


def _commands():
    found = []
    for page in PAGES:
        for line in _lines(page):
            for match in COMMAND.finditer(line):
                text = " ".join(match.group(1).split()).rstrip(".,;:)")
                words = text.split()
                if "..." in text or "[" in text or len(words) < 3 or any(w.isupper() for w in words):
                    continue  # a pattern or a mention of a subcommand, not a command
                found.append(pytest.param(text, id=f"{page.name}:{text[:60]}"))
    return found


COMMANDS = _commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("command", COMMANDS)
def test_a_shown_command_parses(command):
    argv = shlex.split(command)[1:]
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise AssertionError(f"`{command}` does not parse (exit {exc.code})") from None
