"""The layout keeps its promise: MLX stays on the engine side."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT

HANDLER_SIDE = [
    "servicer.handlers",
    "servicer.metadata",
    "servicer.validation",
    "servicer.messages",
    "servicer.text",
    "servicer.metrics",
    "servicer.tokenizer_bundle",
    "servicer.lifecycle",
    "servicer.model_files",
    "servicer.codec",
    "servicer.faults",
    "servicer.server",
    "servicer.cli",
    "servicer.engine_process",
    "servicer.engine_config",
    "servicer.grammar",
    "servicer.media",
    "servicer.engine.prefix.keys",
    "servicer.engine.prefix.index",
    "servicer.engine.prefix.snapshots",
    "servicer.engine.prefix",
    "servicer.engine",
    "servicer.outbox",
    "servicer.ratelimit",
    "servicer.streams",
    "servicer.output",
    "servicer.client",
    "servicer.proto.mlx_engine_pb2_grpc",
]


def test_handler_side_modules_never_import_mlx():
    probe = (
        f"import sys\nfor name in {HANDLER_SIDE!r}:\n    __import__(name)\n"
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
ARGUMENT_PARSERS = {"parse_args"}  # a flag table reads best in one place


def test_classes_and_functions_stay_small():
    import ast

    too_long = []
    for path in sorted((ROOT / "servicer").rglob("*.py")):
        if "proto" in path.relative_to(ROOT / "servicer").parts:
            continue  # generated
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_long.append(f"{path.name}: class {node.name} has {lines} lines")
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and lines > MAX_FUNCTION_LINES and node.name not in ARGUMENT_PARSERS:
                too_long.append(f"{path.name}: {node.name}() has {lines} lines")
    assert too_long == []


def _module_name(path, folder, package: bool) -> str:
    if not package:
        return path.stem
    parts = list(path.relative_to(folder.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(folder, package: bool) -> dict[str, set[str]]:
    """Module -> the modules of `folder` it imports (anywhere in its body, lazily too)."""
    import ast

    # Not what lies in hidden folders: the bench's side venvs (bench/.venv-smg, .venv-genai).
    paths = [
        p
        for p in folder.rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(folder).parts)
    ]
    files = {_module_name(p, folder, package): p for p in paths}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_in_the_package_or_the_bench():
    package = _imports(ROOT / "servicer", package=True)
    assert package["servicer.messages"] >= {"servicer.admission"}  # the graph sees imports
    assert _circles(package) == []
    assert _circles(_imports(ROOT / "bench", package=False)) == []


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_tests_and_bench_never_put_each_other_on_sys_path():
    """The bench's modules reach the tests through pytest's `pythonpath` (pyproject.toml), and
    the bench starts workers with its own code: no file edits sys.path to reach the other."""
    needle = "sys.path." + "insert"  # spelt apart so this file does not match itself
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("tests", "bench")
        for path in sorted((ROOT / folder).glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if needle in line and ('"bench"' in line or '"tests"' in line)
    ]
    assert offenders == []
