"""The README and docs/ tell the truth: the README a landing page short enough to read, every
link and anchor in place, every worker command line accepted by the worker, every flag table
true to the parser (the flags exist, the defaults are its own) and every flag documented; the
Layout real; `make families` able to find its place; bench/README.md says how to run things,
not what changed.

Fast: no model is loaded, no server started. The worker's flags are checked against
`servicer.cli.parse_args`, the parser `mlx-grpc-worker` and `python -m servicer` use.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import ROOT

from servicer.cli import parse_args

README = ROOT / "README.md"
DOCS = ROOT / "docs"
LAYOUT = DOCS / "layout.md"
BENCH_README = ROOT / "bench" / "README.md"
MAKEFILE = ROOT / "Makefile"
MAX_LINES = 350  # a landing page: each topic has its page in docs/

# Where a worker command line starts, in a code block or an inline code span: the program
# (`mlx-grpc-worker` or `.venv/bin/mlx-grpc-worker`, not a path such as `~/.cache/mlx-grpc-worker`;
# `python -m servicer`, not `servicer.client`), or `make serve ARGS=`.
WORKER = re.compile(r"(?:^|\s|bin/)(?:mlx-grpc-worker|python3? -m servicer)(?=\s|$)(?P<rest>.*)")
MAKE_SERVE = re.compile(r"\bmake serve ARGS=(?P<quoted>\"[^\"]*\"|'[^']*')")
# Shell words that end the worker's arguments.
SHELL_ENDS = {"&", "&&", "||", "|", ";", ">", ">>", "2>&1"}
# Placeholders the docs write in capitals, and a value the parser accepts for each.
PLACEHOLDERS = {"PORT": "50051", "N": "4", "S": "30", "MS": "50", "SIZE": "8G", "X": "4"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# A markdown link's target (not an image's), and the code whose text is no link.
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCED = re.compile(r"^ *```[^\n]*\n.*?^ *```", flags=re.MULTILINE | re.DOTALL)
SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>[KMGT])")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _text(path: Path = README) -> str:
    return path.read_text(encoding="utf-8")


def _pages() -> list[Path]:
    """The README and every page under docs/."""
    pages = [README, *sorted(DOCS.glob("*.md"))]
    assert len(pages) > 10, "docs/ holds a page per topic"
    return pages


def _sections(text: str) -> dict[str, str]:
    """Each `## ` section's body by its heading (without the hashes)."""
    found: dict[str, str] = {}
    parts = re.split(r"^## +(.+)$", text, flags=re.MULTILINE)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        found[heading.strip()] = body
    return found


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^ *```[^\n]*\n(.*?)^ *```", text, flags=re.MULTILINE | re.DOTALL)


def _layout_paths() -> list[str]:
    """docs/layout.md's one code block: one entry a line, the path first (from the repository
    root, a folder ending in `/`), then at least two spaces and what it is for."""
    blocks = _code_blocks(_text(LAYOUT))
    assert len(blocks) == 1, "docs/layout.md holds exactly one code block"
    paths = []
    for line in blocks[0].splitlines():
        if not line.strip():
            continue
        assert not line[0].isspace(), f"a Layout line starts with its path: {line!r}"
        path, _, purpose = line.partition("  ")
        assert purpose.strip(), f"a Layout line says what its path is for: {line!r}"
        paths.append(path.strip())
    return paths


def _worker_argv(rest: str) -> list[str]:
    """The worker's arguments from what follows the program on a command line."""
    words = shlex.split(rest, comments=True)
    argv = []
    for word in words:
        if word in SHELL_ENDS or word.startswith((">", "2>")):
            break
        if word != "...":  # `make serve ARGS="..."`: any flags
            argv.append(PLACEHOLDERS.get(word, word))
    return argv


def _command_lines(text: str) -> list[tuple[str, list[str]]]:
    """Every worker command line in `text`, with its arguments: code blocks (lines joined
    where they end in a backslash) and inline code spans."""
    candidates = []
    for block in _code_blocks(text):
        candidates.extend(block.replace("\\\n", " ").splitlines())
    prose = FENCED.sub("", text)
    candidates.extend(re.findall(r"`([^`\n]+)`", prose.replace("\n", " ")))
    found = []
    for line in candidates:
        for match in MAKE_SERVE.finditer(line):
            found.append((line.strip(), _worker_argv(match.group("quoted")[1:-1])))
        match = WORKER.search(line)
        if match and "make serve" not in line:
            found.append((line.strip(), _worker_argv(match.group("rest"))))
    return found


def _all_command_lines() -> list[tuple[Path, str, list[str]]]:
    return [(page, line, argv) for page in _pages() for line, argv in _command_lines(_text(page))]


def _parser() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The worker's parser as `parse_args` builds it, and what it makes of no flags (the
    defaults the worker runs with: `--speculate` is `ngram` there, not the parser's None)."""
    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def keep(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        seen.append(self)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", keep)
        defaults = parse_args([])
    assert len(seen) == 1, "parse_args builds one parser"
    return seen[0], defaults


def _actions() -> dict[str, argparse.Action]:
    """Every documented-to-be option string of the parser -> its action (not --help, nor one
    whose help is suppressed)."""
    parser, _ = _parser()
    return {
        option: action
        for action in parser._actions
        if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
        if option.startswith("--")
    }


# ----- markdown tables of flags -----


@dataclass(frozen=True)
class FlagRow:
    page: Path
    line: str
    flags: tuple[str, ...]  # the flags its first cell names
    default: str | None  # its default cell's text (None: the table has no default column)


def _cells(line: str) -> list[str]:
    """A table row's cells (`\\|` inside a cell is a literal bar)."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", inner)]


def _tables(text: str) -> list[list[str]]:
    """Every table in `text` (outside code blocks), as its lines."""
    tables: list[list[str]] = []
    current: list[str] = []
    for line in [*FENCED.sub("", text).splitlines(), ""]:
        if line.lstrip().startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def _flag_rows(page: Path) -> list[FlagRow]:
    """The rows of `page`'s flag tables: tables whose rows start with a flag in their first
    column (`--model PATH`); a column headed "default" is each flag's default."""
    rows = []
    for table in _tables(_text(page)):
        if len(table) < 3:
            continue
        header = [cell.lower() for cell in _cells(table[0])]
        body = [line for line in table[2:] if _cells(line)[0].startswith("`--")]
        if not body:
            continue
        column = header.index("default") if "default" in header else None
        for line in body:
            cells = _cells(line)
            default = cells[column] if column is not None else None
            rows.append(FlagRow(page, line, tuple(FLAG.findall(cells[0])), default))
    return rows


def _all_flag_rows() -> list[FlagRow]:
    return [row for page in _pages() for row in _flag_rows(page)]


def _value(action: argparse.Action, text: str) -> Any:
    """A default as the docs write it, read as the parser reads a value: by the flag's type;
    a size (`16M`) where the type takes plain numbers."""
    convert = action.type or str
    try:
        return convert(text)
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        size = SIZE.fullmatch(text)
        if size is None:
            raise
        return int(float(size.group("number")) * UNITS[size.group("unit")])


def _default_matches(action: argparse.Action, option: str, value: Any, documented: str) -> bool:
    """Whether `documented` (a table's default cell) says `value`, the worker's default for
    `action`. A default the worker works out at start (the parser's None) is described in
    words (not as a number: that would be a value the parser lacks) and not checked further;
    on / off and none name booleans and unset values."""
    text = documented.replace("`", "").strip()
    assert text, "a default cell is never empty"
    if value is None:
        return SIZE.fullmatch(text) is None and not re.fullmatch(r"[\d.]+", text)
    negated = option.startswith("--no-") and option in action.option_strings[1:]
    if text in ("on", "off"):
        meant = text == "on"
        if isinstance(value, bool):
            return (not value if negated else value) is meant
        return not meant and value in ((), [])
    if text == "none":
        return value in ((), [], False)
    try:
        return _value(action, text) == value
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return False


# ----- the tests -----


def test_readme_is_short_enough_to_read():
    lines = _text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; the landing page keeps to {MAX_LINES}"


def test_every_layout_path_exists():
    paths = _layout_paths()
    assert len(paths) > 20
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/layout.md names paths that do not exist: {missing}"
    folders = [p for p in paths if p.endswith("/")]
    not_folders = [p for p in folders if not (ROOT / p).is_dir()]
    assert not not_folders, f"Layout entries ending in / that are not folders: {not_folders}"
    listed = set(paths)
    for module in ("faces.py", "vllm_face.py", "kv_events.py", "loads.py"):
        assert f"servicer/{module}" in listed
    assert "servicer/engine/embedding.py" in listed
    assert "proto/vllm_engine.proto" in listed


def test_the_layout_names_every_module():
    listed = set(_layout_paths())
    modules = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "servicer").rglob("*.py")
        if "proto" not in path.relative_to(ROOT / "servicer").parts
    )
    unnamed = [m for m in modules if m not in listed]
    assert not unnamed, f"docs/layout.md does not name: {unnamed}"


def test_every_worker_command_line_parses():
    commands = _all_command_lines()
    # The quick start, the router, the faces, the features, a fleet, mx.distributed.
    assert len(commands) >= 10, commands
    assert {page for page, _, _ in commands} > {README}, "docs/ pages have command lines too"
    for page, line, argv in commands:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                parse_args(argv)
        except SystemExit as exc:
            if exc.code == 0 and "--help" in argv:
                continue
            where = page.relative_to(ROOT)
            pytest.fail(f"the worker refuses a command line of {where} ({exc}): {line!r} -> {argv}")


def test_the_command_line_helpers_find_what_they_should():
    assert _worker_argv("--model PATH --port PORT & # a comment") == [
        "--model",
        "PATH",
        "--port",
        "50051",
    ]
    lines = dict(_command_lines(_text()))
    assert not any("servicer.client" in line for line in lines)
    assert any("--protocols mlx,vllm" in line for line in lines)
    assert any(line.startswith("make serve ARGS=") for line in lines)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation gone, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    slugs: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCED.sub("", _text(path)), re.MULTILINE):
        slug = base = _slug(heading)
        n = 0
        while slug in slugs:
            n += 1
            slug = f"{base}-{n}"
        slugs.add(slug)
    return slugs


def test_the_helpers_read_links_and_headings():
    assert _slug("How a request flows") == "how-a-request-flows"
    assert _slug("Two faces: `--protocols mlx,vllm`") == "two-faces---protocols-mlxvllm"
    assert _slug("Fused prefill (`--fuse-prefill`, off by default)") == (
        "fused-prefill---fuse-prefill-off-by-default"
    )
    text = "[a](docs/x.md#y) ![img](p.png) `[not](a.md)`\n```\n[no](b.md)\n```\n"
    assert LINK.findall(FENCED.sub("", text)) == ["docs/x.md#y", "a.md"]


def test_every_relative_link_resolves():
    """Each link from README.md or a docs/ page to a file of the repository names one that
    exists, and an anchor names a heading of the page it points at."""
    broken = []
    for page in _pages():
        for target in LINK.findall(FENCED.sub("", _text(page))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not path.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{where} (no such heading)")
            elif ROOT not in path.parents and path != ROOT:
                broken.append(f"{where} (outside the repository)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_tabled_flag_exists_with_the_parsers_default():
    actions = _actions()
    _, defaults = _parser()
    rows = _all_flag_rows()
    assert len(rows) > len(set(map(id, actions.values()))), "the docs table every flag"
    wrong = []
    for row in rows:
        where = f"{row.page.relative_to(ROOT)}: {row.line}"
        unknown = [flag for flag in row.flags if flag not in actions]
        if unknown:
            wrong.append(f"{where}\n  names flags the worker lacks: {unknown}")
            continue
        named = {id(actions[flag]) for flag in row.flags}
        if len(named) != 1:
            wrong.append(f"{where}\n  names {len(named)} flags: a row is one flag")
            continue
        if row.default is None:
            continue
        option = row.flags[0]
        action = actions[option]
        value = getattr(defaults, action.dest)
        if not _default_matches(action, option, value, row.default):
            wrong.append(f"{where}\n  says the default is {row.default!r}; the worker's: {value!r}")
    assert not wrong, "flag tables that are not the parser's:\n" + "\n".join(wrong)


def test_every_flag_is_documented():
    """A flag added or removed without the docs fails here: each of the parser's flags has a
    row in a flag table of README.md or docs/ (docs/command-line.md tables them all)."""
    actions = _actions()
    rows = _all_flag_rows()
    tabled = {id(actions[flag]) for row in rows for flag in row.flags if flag in actions}
    missing = sorted(
        {action.option_strings[0] for action in actions.values() if id(action) not in tabled}
    )
    assert not missing, f"flags with no row in a flag table of README.md or docs/: {missing}"


def test_the_flag_table_helpers_read_what_they_should():
    actions = _actions()
    _, defaults = _parser()
    assert _cells("| `--kv-bits 8\\|4` | off | x |") == ["`--kv-bits 8|4`", "off", "x"]

    def matches(option: str, text: str) -> bool:
        action = actions[option]
        return _default_matches(action, option, getattr(defaults, action.dest), text)

    assert matches("--port", "`50051`") and not matches("--port", "50052")
    assert matches("--max-image-bytes", "20M") and not matches("--max-image-bytes", "8M")
    assert matches("--max-message-bytes", "64M")  # a plain number of bytes, written as a size
    assert matches("--speculate", "`ngram`")  # what the worker runs, not the parser's None
    assert matches("--group-rows", "on") and not matches("--group-rows", "off")
    assert matches("--no-group-rows", "off")
    assert matches("--protocols", "`mlx`") and not matches("--protocols", "`mlx,vllm`")
    assert matches("--allowed-media-hosts", "none") and matches("--adapter", "none")
    assert matches("--max-kv-memory", "½ memory - weights")  # worked out at start
    assert matches("--kv-bits", "off") and not matches("--kv-bits", "8")


def test_make_families_finds_its_place():
    """`make families` rewrites its summary between two markers of the file the Makefile
    names (bench/families.py, `write_readme`): each there once, in order, and nowhere else."""
    import families

    target = re.search(r"--readme +(\S+)", _text(MAKEFILE))
    assert target, "the Makefile's families target names the file its summary goes to"
    text = _text(ROOT / target.group(1))
    begin, end = text.find(families.README_BEGIN), text.find(families.README_END)
    assert text.count(families.README_BEGIN) == 1 and text.count(families.README_END) == 1
    assert 0 <= begin < end
    for page in _pages():
        if page != ROOT / target.group(1):
            assert families.README_BEGIN not in _text(page), page


def test_the_readme_lists_the_served_vision_families():
    from servicer.vision_families import SERVED_FAMILIES

    text = README.read_text(encoding="utf-8")
    listed = text.split("<!-- vision families:")[1].split("<!-- end of the vision families")[0]
    assert re.findall(r"`([\w-]+)`", listed) == list(SERVED_FAMILIES)  # lfm2-vl: a dash
    assert f"({len(SERVED_FAMILIES)} families)" in listed


def test_bench_readme_has_no_changelog():
    headings = re.findall(r"^#+ +(.+)$", _text(BENCH_README), flags=re.MULTILINE)
    history = [h for h in headings if re.search(r"changelog|history|what went|changes", h, re.I)]
    assert not history, f"bench/README.md keeps a changelog section: {history}"
