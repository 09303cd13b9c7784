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
