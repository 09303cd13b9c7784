"""The README stays a manual that tells the truth: short enough to read, its Layout real, its
command lines accepted by the worker; bench/README.md says how to run things, not what changed.

Fast: no model is loaded, no server started. The worker's flags are checked against
`servicer.cli.parse_args`, the parser `mlx-grpc-worker` and `python -m servicer` use.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest
from support import ROOT

from servicer.cli import parse_args

README = ROOT / "README.md"
BENCH_README = ROOT / "bench" / "README.md"
MAX_LINES = 650  # the Layout names every module of the package; images got a section

# Where a worker command line starts, in a code block or an inline code span: the program
# (`mlx-grpc-worker` or `.venv/bin/mlx-grpc-worker`, not a path such as `~/.cache/mlx-grpc-worker`;
# `python -m servicer`, not `servicer.client`), or `make serve ARGS=`.
WORKER = re.compile(r"(?:^|\s|bin/)(?:mlx-grpc-worker|python3? -m servicer)(?=\s|$)(?P<rest>.*)")
MAKE_SERVE = re.compile(r"\bmake serve ARGS=(?P<quoted>\"[^\"]*\"|'[^']*')")
# Shell words that end the worker's arguments.
SHELL_ENDS = {"&", "&&", "||", "|", ";", ">", ">>", "2>&1"}
# Placeholders the README writes in capitals, and a value the parser accepts for each.
PLACEHOLDERS = {"PORT": "50051", "N": "4", "S": "30", "MS": "50", "SIZE": "8G", "X": "4"}


def _text(path=README) -> str:
    return path.read_text(encoding="utf-8")


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
    """The Layout section's code block: one entry a line, the path first (from the repository
    root, a folder ending in `/`), then at least two spaces and what it is for."""
    body = _sections(_text())["Layout"]
    blocks = _code_blocks(body)
    assert len(blocks) == 1, "the Layout section holds exactly one code block"
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


def _command_lines() -> list[tuple[str, list[str]]]:
    """Every worker command line in README.md, with its arguments: code blocks (lines joined
    where they end in a backslash) and inline code spans."""
    text = _text()
    candidates = []
    for block in _code_blocks(text):
        candidates.extend(block.replace("\\\n", " ").splitlines())
    prose = re.sub(r"^ *```[^\n]*\n.*?^ *```", "", text, flags=re.MULTILINE | re.DOTALL)
    candidates.extend(re.findall(r"`([^`\n]+)`", prose.replace("\n", " ")))
    found = []
    for line in candidates:
        for match in MAKE_SERVE.finditer(line):
            found.append((line.strip(), _worker_argv(match.group("quoted")[1:-1])))
        match = WORKER.search(line)
        if match and "make serve" not in line:
            found.append((line.strip(), _worker_argv(match.group("rest"))))
    return found


def _parser_flags() -> set[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args(["--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))


def test_readme_is_short_enough_to_read():
    lines = _text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; the manual keeps to {MAX_LINES}"


def test_every_layout_path_exists():
    paths = _layout_paths()
    assert len(paths) > 20
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README's Layout names paths that do not exist: {missing}"
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
    assert not unnamed, f"README's Layout does not name: {unnamed}"


def test_every_worker_command_line_parses():
    commands = _command_lines()
    # The quick start, the router, the vLLM face, the features, a fleet, mx.distributed.
    assert len(commands) >= 10, commands
    for line, argv in commands:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                parse_args(argv)
        except SystemExit as exc:
            if exc.code == 0 and "--help" in argv:
                continue
            pytest.fail(f"the worker refuses a README command line ({exc}): {line!r} -> {argv}")


def test_every_flag_in_the_command_line_table_exists():
    flags = _parser_flags()
    body = _sections(_text())["Command line"]
    table = "\n".join(line for line in body.splitlines() if line.startswith("| `--"))
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", body))
    assert table, "the Command line section has a table of flags"
    unknown = sorted(shown - flags)
    assert not unknown, f"README's Command line section names flags the worker lacks: {unknown}"


def test_the_command_line_helpers_find_what_they_should():
    assert _worker_argv("--model PATH --port PORT & # a comment") == [
        "--model",
        "PATH",
        "--port",
        "50051",
    ]
    lines = dict(_command_lines())
    assert not any("servicer.client" in line for line in lines)
    assert any("--protocols mlx,vllm" in line for line in lines)
    assert any(line.startswith("make serve ARGS=") for line in lines)


def test_bench_readme_has_no_changelog():
    headings = re.findall(r"^#+ +(.+)$", _text(BENCH_README), flags=re.MULTILINE)
    history = [h for h in headings if re.search(r"changelog|history|what went|changes", h, re.I)]
    assert not history, f"bench/README.md keeps a changelog section: {history}"
