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


def build(arch: str, **text_config):
    config = json.loads((CONFIGS / f"{arch}.json").read_text())
    config.pop("families", None)
    config.get("text_config", {}).update(text_config)
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


def test_llama4_chunked_attention_batches_exactly() -> None:
    """llama4's chunked layers (mlx-lm's ChunkedKVCache, no batched form) keep the whole
    history in a batch, masked to each row's own chunk: every row's logits, through a prefill
    that crosses chunk boundaries and decode steps that cross more, equal mlx-lm's alone."""
    model = build("llama4", floor_scale=4)  # chunks of 8; query temperature moves every 4
    prompts = ([5, 17, 42, 99, 3], [7, 8, 9, 10, 11, 12, 13, 200, 201, 4, 6, 90, 91])
    follow = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
    want = []
    for prompt, tokens in zip(prompts, follow, strict=True):
        cache = make_prompt_cache(model)  # mlx-lm's own: ChunkedKVCache and KVCache
        rows = [model(mx.array([prompt]), cache=cache)[0, -1]]
        rows += [model(mx.array([[t]]), cache=cache)[0, -1] for t in tokens]
        want.append(rows)
    width = max(len(p) for p in prompts)
    padding = [width - len(p) for p in prompts]
    with pytest.raises(ValueError, match="batching"):
        from mlx_lm.generate import _merge_caches

        _merge_caches([make_prompt_cache(model) for _ in prompts])
    fix_for_batching(model)
    cache = [BatchKVCache(padding) for _ in make_prompt_cache(model)]
    inputs = mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)])
    got = [model(inputs, cache=cache)[:, -1]]
    for step in range(len(follow[0])):
        got.append(model(mx.array([[f[step]] for f in follow]), cache=cache)[:, -1])
    for row in range(len(prompts)):
        for step, logits in enumerate(got):
            assert mx.allclose(logits[row], want[row][step], atol=1e-4).item(), (row, step)
    # One sequence through the fixed model (plain KV caches) gives mlx-lm's logits too.
    cache = make_prompt_cache(model)
    alone = [model(mx.array([prompts[1]]), cache=cache)[0, -1]]
    alone += [model(mx.array([[t]]), cache=cache)[0, -1] for t in follow[1]]
    for step, logits in enumerate(alone):
        assert mx.allclose(logits, want[1][step], atol=1e-4).item(), step


def test_phi3small_is_refused_with_the_reason() -> None:
    """mlx-lm's phi3small lets a prompt's tokens see later tokens of their block (its boolean
    mask is added as numbers): wrong alone, so no batching fix helps; the worker refuses it."""
    from servicer.engine.arch_fixes import UnservableModel

    model = build("phi3small")
    prompt = list(range(5, 40))
    full = model(mx.array([prompt]))[0, 3]
    cut = model(mx.array([prompt[:4]]))[0, 3]  # position 3 without the tokens after it
    assert not mx.allclose(full, cut, atol=1e-3).item(), "mlx-lm's phi3small is causal now"
    with pytest.raises(UnservableModel, match="block-sparse"):
        fix_for_batching(model)
