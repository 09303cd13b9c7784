"""How finely the engine splits one image's encoder pass (servicer/engine/encoding.py).

    python bench/encode_stages.py                                # the gemma3 and qwen3_vl shapes
    python bench/encode_stages.py --model demo:qwen3_vl --model shape --image-px 640x480

The engine evaluates a vision tower's pass a piece at a time, so a step's encode stays within
what its budget leaves. A piece is one module call of the tower (a layer's norms, projections,
attention, MLP), not a whole layer: one SigLIP layer at 224 px takes ~130 ms on the 2-core CPU,
more than the 50 ms budget. Per model, one image through the engine's own encoder:

- the whole pass evaluated at once (the single graph), and staged a piece at a time (the sum);
- the tower's layers, the pieces, the longest layer (the sum of its pieces) and the longest
  piece: a step's encode overshoots its budget by at most the longest piece (before: a layer);
- that the staged features equal the single pass's, bit for bit.

`shape` and `shape-FAMILY` are bench/vlm_shape.py's random models of real shape (built on first
use); `demo:FAMILY` a registry family's tiny demo. Runs with OpenBLAS preloaded when it is
installed (it re-executes itself so). Prints a table, writes
bench/results/encode-stages-STAMP.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import numpy as np
import report
from PIL import Image
from workers import BENCH, blas_env, log


def _model_dir(name: str) -> Path:
    if name.startswith("demo:"):
        from servicer.demos.vision import demo_vlm_path

        return demo_vlm_path(family=name.partition(":")[2])
    if name == "shape" or name.startswith("shape-"):
        from vlm_shape import vlm_shape_path

        return vlm_shape_path(224, 0, family=name.partition("-")[2] or "gemma3", image_tokens=256)
    return Path(name).expanduser().resolve()


def _layer_class(tower: Any) -> str:
    """The class of the tower's list of modules holding the most weights (its layers)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    def weights(modules: list[Any]) -> int:
        return sum(v.size for m in modules for _, v in tree_flatten(m.parameters()))

    lists = [
        v
        for _, m in tower.named_modules()
        for v in m.values()
        if isinstance(v, list) and v and all(isinstance(x, nn.Module) for x in v)
    ]
    return type(max(lists, key=weights)[0]).__name__ if lists else ""


def measure(name: str, size: tuple[int, int], repeats: int) -> dict[str, Any]:
    import mlx.core as mx
    from transformers import AutoTokenizer

    from servicer.engine.encoding import StagedEncode
    from servicer.engine.model import load_model
    from servicer.engine.vision import VisionEncoder
    from servicer.images import ImagePreparer
    from servicer.media import MediaPolicy
    from servicer.messages import ImageInput
    from servicer.vision_families import vision_spec

    model_dir = _model_dir(name)
    config = json.loads((model_dir / "config.json").read_text())
    spec = vision_spec(config, AutoTokenizer.from_pretrained(str(model_dir)))
    if spec is None:
        raise SystemExit(f"{name}: not a served vision family")
    preparer = ImagePreparer(model_dir, spec, MediaPolicy())
    pixels = np.random.default_rng(7).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    processed = preparer._process(0, Image.open(io.BytesIO(buffer.getvalue())))
    preparer.close()
    loaded = load_model(model_dir, None)
    encoder = VisionEncoder.load(model_dir, loaded.model, 1 << 20)
    image = ImageInput(5, processed.tokens, processed.key, processed.pixel_values, processed.extra)
    run = list(processed.run) or [encoder.image_token_id] * processed.tokens
    layer_class = _layer_class(encoder.tower)

    singles, best = [], None
    for _ in range(repeats + 1):  # the first warms up
        features = encoder.lazy_features(image, run)
        began = time.perf_counter()
        mx.eval(features)
        singles.append(time.perf_counter() - began)
        staged = StagedEncode(encoder, image, run)
        pieces = []
        while not staged.done:
            kind = staged._stages[staged._next].kind
            began = time.perf_counter()
            staged.advance(0.0)  # one piece
            pieces.append((kind, time.perf_counter() - began))
        exact = bool(np.array_equal(np.array(staged.features), np.array(features)))
        if best is None or sum(t for _, t in pieces) < sum(t for _, t in best[0]):
            best = (pieces, exact)
    assert best is not None
    pieces, exact = best
    layers, current = [], 0.0
    for kind, seconds in pieces:
        current += seconds
        if kind[0] == layer_class:  # a layer's own output comes after its pieces
            layers.append(current)
            current = 0.0
    longest_kind, longest = max(pieces, key=lambda p: p[1])
    return {
        "model": name,
        "path": str(model_dir),
        "image_px": list(size),
        "image_tokens": processed.tokens,
        "patches": int(np.prod(processed.pixel_values.shape[:-1]))
        if processed.pixel_values is not None
        else None,
        "single_ms": min(singles[1:]) * 1000,
        "staged_ms": sum(t for _, t in pieces) * 1000,
        "layers": len(layers),
        "pieces": len(pieces),
        "longest_layer_ms": max(layers, default=0.0) * 1000,
        "longest_piece_ms": longest * 1000,
        "longest_piece": f"{longest_kind[0]} {list(longest_kind[1:])}",
        "exact": exact,
    }


def render(results: dict[str, Any]) -> str:
    headers = [
        "model",
        "image tokens",
        "whole pass ms",
        "staged ms",
        "layers",
        "pieces",
        "longest layer ms",
        "longest piece ms",
        "longest piece",
        "staged = single",
    ]
    rows = [
        [
            r["model"],
            r["image_tokens"],
            report._fmt(r["single_ms"], 0),
            report._fmt(r["staged_ms"], 0),
            r["layers"],
            r["pieces"],
            report._fmt(r["longest_layer_ms"], 0),
            report._fmt(r["longest_piece_ms"], 0),
            r["longest_piece"],
            "yes" if r["exact"] else "NO",
        ]
        for r in results["models"]
    ]
    return report.markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    if blas := blas_env():  # measured in this process: OpenBLAS preloaded, as every bench's
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **blas})
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", action="append", help="shape, shape-FAMILY, demo:FAMILY, DIR")
    parser.add_argument("--image-px", default="320x240", help="WIDTHxHEIGHT of the image")
    parser.add_argument("--repeats", type=int, default=2, help="measured passes (the best)")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    width, _, height = args.image_px.partition("x")
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": report.machine_info(),
        "models": [],
    }
    for name in args.model or ["shape", "shape-qwen3_vl"]:
        log(f"{name}: measuring")
        results["models"].append(measure(name, (int(width), int(height)), args.repeats))
    print(render(results))
    print(f"Machine: {report.machine_line(results)}")
    report.save_json(args.out, "encode-stages", results)
    return 0 if all(r["exact"] for r in results["models"]) else 1


if __name__ == "__main__":
    sys.exit(main())
