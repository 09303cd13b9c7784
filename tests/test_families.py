"""A representative slice of the family matrix (bench/families.py): one architecture per cache
kind and per distinct attention / MoE / recurrent mechanism, served by the real worker (engine
in its own process) with three prompts at once, then a second wave that hits the prefix store;
every output must equal mlx-lm's own greedy generation token for token.

The runner is invoked as a subprocess and its JSON read back. Models are built once into the
demo cache (about 10-20 s each the first time). Architectures known to fail are strict xfails
with the reason, so a fix shows up as an unexpected pass. `make test` runs FAST (dense, sliding
window, hybrid, a padding reader: one runner call); the others are slow (`make test-slow`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import SLOW

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "bench" / "families.py"

# model_type -> what it stands for in the matrix
SUBSET = {
    "llama": "dense attention, KVCache",
    "gemma3_text": "sliding window + global (RotatingKVCache + KVCache)",
    "qwen3_next": "hybrid: gated delta net (ArraysCache) + attention",
    "mamba2": "pure recurrent (ArraysCache only)",
    "mamba": "recurrent layers that read left padding (prefilled one prompt at a time)",
    "nemotron_h": "Mamba-2 + attention without positions (prefilled one prompt at a time)",
    "qwen3_moe": "mixture of experts (SwitchGLU)",
    "deepseek_v3": "multi-head latent attention (MLA) + MoE",
    "gpt_oss": "attention sinks + sliding window + MoE",
    "llama4": "chunked attention (ChunkedKVCache)",
}
# What make test runs; the rest of SUBSET runs in make test-slow.
FAST = ("llama", "gemma3_text", "qwen3_next", "mamba")
# model_type -> reason; strict xfails (fill from `make families`: status and first difference).
KNOWN_FAILURES: dict[str, str] = {}
# model_type -> the words of the refusal at start (served wrong never; refused with a reason)
REFUSED: dict[str, str] = {}
CELLS = ("defaults", "prefix")


# Layers that read padding, with the prefill budget off: the plan alone keeps them to one
# prompt at a time (the runner once admitted a prefill batch of them by its own caps).
BUDGET_OFF = ("mamba", "nemotron_h")


def _run_matrix(out: Path, archs: Any, cells: Any) -> dict[str, Any]:
    command = [sys.executable, str(RUNNER), "--only", ",".join(archs)]
    command += ["--cells", ",".join(cells), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["results"]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """An architecture's results: FAST in one runner call, the rest of SUBSET in another, each
    on the first test that needs it (so make test runs only FAST's)."""
    runs: dict[bool, dict[str, Any]] = {}

    def result(arch: str) -> dict[str, Any]:
        fast = arch in FAST
        if fast not in runs:
            archs = [name for name in SUBSET if (name in FAST) == fast]
            out = tmp_path_factory.mktemp("families") / "families.json"
            runs[fast] = _run_matrix(out, archs, CELLS)
        return runs[fast][arch]

    return result


@pytest.mark.parametrize("arch", BUDGET_OFF)
def test_padding_readers_are_exact_with_the_prefill_budget_off(tmp_path: Path, arch: str) -> None:
    cell = _run_matrix(tmp_path / "stall0.json", [arch], ["stall0"])[arch]["cells"]["stall0"]
    assert cell["status"] == "exact", f"{arch} --max-prefill-stall-ms 0: {cell}"


def _marks(arch: str) -> list[pytest.MarkDecorator]:
    marks = [] if arch in FAST else [SLOW]
    if arch in KNOWN_FAILURES:
        marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[arch], strict=True))
    return marks


@pytest.mark.parametrize("arch", [pytest.param(name, marks=_marks(name)) for name in SUBSET])
def test_the_worker_matches_mlx_lm(matrix: Callable[[str], dict[str, Any]], arch: str) -> None:
    cells = matrix(arch)["cells"]
    for cell in CELLS:
        entry = cells[cell]
        if arch in REFUSED:
            assert entry["status"] == "refused" and REFUSED[arch] in entry["detail"], entry
            continue
        assert entry["status"] == "exact", f"{arch} ({SUBSET[arch]}) {cell}: {entry}"
