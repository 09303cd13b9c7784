"""Rendering a whole `make bench` run, with the parts whose modules render their own tables
(speculation, kv_quant, faces); those modules use report's helpers, so report cannot import
them. Also re-renders a saved run:

    python bench/render_run.py results/bench-STAMP.json [--plot out.png] [--results-md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import faces
import kv_quant
import report
import speculation


def sections() -> report.Sections:
    return {
        "speculation": (
            lambda: (
                "### Speculation (our worker with speculation on and off, the raw "
                "BatchGenerator without it: the demo llama, the target bench/fixtures.py "
                "builds with the demo llama drafting, and the real model when ../shared has it; "
                f"{speculation.MAX_TOKENS} new tokens, K = {speculation.K})"
            ),
            lambda run: speculation.render(run["speculation"]),
        ),
        "kv_quant": (
            lambda: "### Quantized KV cache (--kv-bits)",
            lambda run: kv_quant.render(run["kv_quant"]),
        ),
        "faces": (
            lambda: "### vLLM face vs MLX face through smg (`--protocols mlx,vllm` ÷ `mlx`)",
            lambda run: faces.render(run["faces"]),
        ),
    }


def render(run: report.Run) -> str:
    return report.render(run, sections())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Re-render a saved benchmark JSON")
    parser.add_argument("json", type=Path)
    parser.add_argument("--plot", type=Path, help="also draw the PNG here")
    parser.add_argument("--results-md", action="store_true", help="rewrite bench/RESULTS.md")
    args = parser.parse_args(argv)
    run = json.loads(args.json.read_text())
    print(render(run))
    if args.plot:
        report.plot(run, args.plot)
    if args.results_md:
        report.update_results_md(render(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
