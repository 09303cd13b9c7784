"""Architectures whose mlx-lm code breaks in a batch (servicer/engine/arch_fixes.py): a batch of
prompts of different lengths, prefilled together and decoded a step, gives each row the logits
it gets alone. Without the fixes gemma2 (grouped heads) applies one row's mask to another
(or raises, by batch size), gpt_bigcode (learned positions) raises on per-row offsets, and afm7's
KV-reuse layers place a padded row's queries at the wrong position."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

from servicer.engine.arch_fixes import fix_for_batching

CONFIGS = Path(__file__).resolve().parent.parent / "bench" / "families" / "configs"
PROMPTS = ([5, 17, 42, 99, 3], [7, 8, 9, 10, 11, 12, 13, 200, 201])


def build(arch: str):
    config = json.loads((CONFIGS / f"{arch}.json").read_text())
    config.pop("families", None)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def alone(model, prompt: list[int], follow: int) -> tuple[mx.array, mx.array]:
    cache = make_prompt_cache(model)
    first = model(mx.array([prompt]), cache=cache)[0, -1]
    second = model(mx.array([[follow]]), cache=cache)[0, -1]
    return first, second


def together(model, follow: list[int]) -> tuple[mx.array, mx.array]:
    width = max(len(p) for p in PROMPTS)
    padding = [width - len(p) for p in PROMPTS]
    cache = [BatchKVCache(padding) for _ in make_prompt_cache(model)]
    inputs = mx.array([[0] * pad + p for pad, p in zip(padding, PROMPTS, strict=True)])
    first = model(inputs, cache=cache)[:, -1]
    second = model(mx.array([[t] for t in follow]), cache=cache)[:, -1]
    return first, second


def rows_match(model) -> bool:
    try:
        first, second = together(model, [1, 2])
        mx.eval(first, second)
    except (ValueError, TypeError):
        return False
    for row, prompt in enumerate(PROMPTS):
        want_first, want_second = alone(model, prompt, [1, 2][row])
        if not mx.allclose(first[row], want_first, atol=1e-4).item():
            return False
        if not mx.allclose(second[row], want_second, atol=1e-4).item():
            return False
    return True


@pytest.mark.parametrize("arch", ["afm7", "gemma2", "gpt_bigcode"])
def test_a_batch_gives_each_row_its_own_logits(arch: str) -> None:
    model = build(arch)
    assert not rows_match(model), "mlx-lm batches this architecture right now: drop its fix"
    fix_for_batching(model)
    fix_for_batching(model)  # a second call changes nothing
    assert rows_match(model)
