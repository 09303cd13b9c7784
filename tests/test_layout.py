"""The layout keeps its promise: MLX stays on the engine side."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT

HANDLER_SIDE = [
    "servicer.handlers",
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


MAX_CLASS_LINES = 300
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
