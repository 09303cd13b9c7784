"""Architectures whose mlx-lm code breaks in a batch (servicer/engine/arch_fixes.py): a batch of
prompts of different lengths, prefilled together and decoded a step, gives each row the logits
it gets alone. Without the fixes gemma2 (grouped heads) applies one row's mask to another
(or raises, by batch size), gpt_bigcode (learned positions) raises on per-row offsets, afm7's
KV-reuse layers place a padded row's queries at the wrong position, minimax_m3_vl's indexer
cuts a padded row's key blocks at other boundaries, nemotron-nas's linear layers leave empty
caches that a batch cannot give back, plamo3's sliding-window cache holds one token less
than its mask lets a token see, and phi3small's block-sparse layers are not causal inside a
block (alone too) and cut blocks at cache slots."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import _get_classes
from support import SLOW

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


def _finite_match(got: mx.array, want: mx.array) -> bool:
    """Equal logits, where phi3small's placeholder tokens are -inf in both."""
    finite = mx.isfinite(want)
    same = mx.allclose(mx.where(finite, got, 0), mx.where(finite, want, 0), atol=1e-4)
    return bool(same.item() and mx.array_equal(mx.isfinite(got), finite).item())


@SLOW  # ~25 s on a CPU; the rule itself is checked key by key below in make test
def test_phi3small_is_causal_and_block_sparse_by_position_in_chunks_and_in_a_batch() -> None:
    """mlx-lm's phi3small lets a prompt's tokens see later tokens of their block (its boolean
    mask is added as numbers), so it is wrong alone too. Fixed (blocks of 32, 2 local blocks,
    a vertical stride of 3: both act past 64 tokens): a token's logits do not change with the
    tokens after it, 37-token chunks (crossing block edges) give the whole prompt's logits, and
    a left-padded batch row gives its logits alone, through decode steps too."""
    model = build("phi3small")
    prompt = [(i * 37) % 5000 + 5 for i in range(150)]
    full = model(mx.array([prompt]))[0, 3]
    cut = model(mx.array([prompt[:4]]))[0, 3]  # position 3 without the tokens after it
    assert not mx.allclose(full, cut, atol=1e-3).item(), "mlx-lm's phi3small is causal now"
    fix_for_batching(model)
    full = model(mx.array([prompt]))[0]
    assert _finite_match(model(mx.array([prompt[:4]]))[0, 3], full[3])
    cache = make_prompt_cache(model)
    chunks = [model(mx.array([prompt[i : i + 37]]), cache=cache)[0] for i in range(0, 150, 37)]
    assert _finite_match(mx.concatenate(chunks), full)

    short, follow = prompt[:90], [[11, 12, 13], [21, 22, 23]]
    want = []
    for tokens, steps in zip((prompt, short), follow, strict=True):
        cache = make_prompt_cache(model)
        rows = [model(mx.array([tokens]), cache=cache)[0, -1]]
        want.append(rows + [model(mx.array([[t]]), cache=cache)[0, -1] for t in steps])
    cache = [BatchKVCache([0, 60]) for _ in make_prompt_cache(model)]
    got = [model(mx.array([prompt, [0] * 60 + short]), cache=cache)[:, -1]]
    got += [model(mx.array([[f[step]] for f in follow]), cache=cache)[:, -1] for step in range(3)]
    for row in range(2):
        for step, logits in enumerate(got):
            assert _finite_match(logits[row], want[row][step]), (row, step)


def test_phi3small_keeps_a_key_by_the_block_sparse_rule() -> None:
    """The rule, key by key, against its plain statement: a key at or before the query, in
    one of the query's 2 latest blocks or in a block on the head's stride ((block + head + 1)
    % 3 == 0); positions count from each row's first slot."""
    model = build("phi3small")
    fix_for_batching(model)
    heads = model.args.num_attention_heads

    def rule(query: int, key: int, head: int) -> bool:
        local = query // 32 - key // 32 < 2
        return 0 <= key <= query and (local or (key // 32 + head + 1) % 3 == 0)

    def follows_the_rule(keep: mx.array, first: int, offset: int) -> bool:
        return all(
            keep[head, query, slot].item() == rule(offset + query, slot - first, head)
            for head in range(heads)
            for query in range(0, 40, 7)
            for slot in range(140)
        )

    alone = KVCache()
    alone.offset = 100
    assert follows_the_rule(model.model._block_sparse_mask(alone, 40)[0], 0, 100)
    batch = BatchKVCache([0, 25])
    batch.offset = mx.array([100, 75])
    together = model.model._block_sparse_mask(batch, 40)
    assert follows_the_rule(together[0], 0, 100)
    assert follows_the_rule(together[1], 25, 75)


def batch_caches(model, padding: list[int]) -> list:
    """The batched form of the model's caches, as mlx-lm's merge makes them."""

    def batched(cache):
        if isinstance(cache, CacheList):
            return CacheList(*[batched(c) for c in cache.caches])
        if isinstance(cache, RotatingKVCache):
            return BatchRotatingKVCache(cache.max_size, padding)
        return BatchKVCache(padding)

    return [batched(c) for c in make_prompt_cache(model)]


def decode_batch(model, prompts, follow, chunk: int | None = None) -> list[mx.array]:
    """Each row's last logits after a left-padded batch prefill (in chunks of `chunk`), then
    after each decode step of `follow`."""
    width = max(len(p) for p in prompts)
    padding = [width - len(p) for p in prompts]
    cache = batch_caches(model, padding)
    inputs = mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)])
    chunk = chunk or width
    for start in range(0, width, chunk):
        logits = model(inputs[:, start : start + chunk], cache=cache)
    got = [logits[:, -1]]
    for step in range(len(follow[0])):
        got.append(model(mx.array([[f[step]] for f in follow]), cache=cache)[:, -1])
    return got


def decode_alone(model, prompt, follow) -> list[mx.array]:
    cache = make_prompt_cache(model)
    rows = [model(mx.array([prompt]), cache=cache)[0, -1]]
    rows += [model(mx.array([[t]]), cache=cache)[0, -1] for t in follow]
    return rows


def same_rows(got: list[mx.array], want: list[list[mx.array]]) -> bool:
    return all(
        mx.allclose(logits[row], want[row][step], atol=1e-4).item()
        for row in range(len(want))
        for step, logits in enumerate(got)
    )


def test_minimax_m3_vl_cuts_each_rows_key_blocks_at_its_own_positions() -> None:
    """The sparse layers keep each query's top 4 blocks of 8 keys: past 32 keys a row padded
    by 13 (not a multiple of 8) kept other keys than alone; with the fix every row's logits,
    through the prefill and decode steps that cross block boundaries, equal mlx-lm's alone."""
    model = build("minimax_m3_vl")
    prompts = (list(range(5, 43)), list(range(50, 101)))  # 38 and 51 tokens: padding 13
    follow = [list(range(1, 12)), list(range(100, 111))]
    want = [decode_alone(model, p, f) for p, f in zip(prompts, follow, strict=True)]
    assert not same_rows(decode_batch(model, prompts, follow), want)
    fix_for_batching(model)
    fix_for_batching(model)
    assert same_rows(decode_batch(model, prompts, follow), want)
    alone = decode_alone(model, prompts[1], follow[1])  # one sequence: the original code
    assert all(mx.array_equal(a, b).item() for a, b in zip(alone, want[1], strict=True))


def test_nemotron_nas_linear_attention_layers_get_no_cache() -> None:
    """A layer whose attention is a linear replacement never writes the KV cache mlx-lm makes
    for it; a batch cannot give such a cache back (mlx-lm's extract reads its keys). With the
    fix only the layers with real attention have caches: a batch's rows, given back and
    continued alone, equal each prompt alone."""
    model = build("nemotron-nas")
    follow = [[1, 2, 3], [4, 5, 6]]
    want = [decode_alone(model, p, f) for p, f in zip(PROMPTS, follow, strict=True)]

    def batch_then_alone() -> list[list[mx.array]]:
        width = max(len(p) for p in PROMPTS)
        padding = [width - len(p) for p in PROMPTS]
        cache = batch_caches(model, padding)
        inputs = mx.array([[0] * pad + p for pad, p in zip(padding, PROMPTS, strict=True)])
        first = model(inputs, cache=cache)[:, -1]
        rows = []
        for row, tokens in enumerate(follow):
            alone = [layer.extract(row) for layer in cache]  # as a finished row leaves
            rows.append([first[row]] + [model(mx.array([[t]]), cache=alone)[0, -1] for t in tokens])
        return rows

    with pytest.raises(TypeError):
        batch_then_alone()
    fix_for_batching(model)
    assert len(make_prompt_cache(model)) == 2  # layers 0 and 3 attend; 1 is a no-op, 2 linear
    for got, expected in zip(batch_then_alone(), want, strict=True):
        for step, logits in enumerate(got):
            assert mx.allclose(logits, expected[step], atol=1e-4).item(), step
    assert same_rows(decode_batch(model, PROMPTS, follow), want)


def test_plamo3_sees_its_whole_window_in_chunks_and_in_decode() -> None:
    """plamo3's mask lets a token see itself and the 16 (window_size) tokens before it, as the
    model without a cache computes it; mlx-lm 0.32's RotatingKVCache(max_size=16) holds one
    token less, so decode steps and the first token of each prefill chunk see 15, and the
    output changes with the chunking. With the fix (17 slots) every chunking, decode, and a
    batch prefilled in chunks give the cacheless logits."""
    model = build("plamo3")
    sequence = list(range(3, 48))

    def through_cache(chunks: list[int]) -> mx.array:
        cache = make_prompt_cache(model)
        cuts = [0]
        for n in chunks:
            cuts.append(cuts[-1] + n)
        cuts += range(cuts[-1] + 1, len(sequence) + 1)  # then one token at a time
        pieces = itertools.pairwise(cuts)
        return mx.concatenate([model(mx.array([sequence[a:b]]), cache=cache)[0] for a, b in pieces])

    want = model(mx.array([sequence]))[0]  # no cache: the window mask alone
    assert not mx.allclose(through_cache([44]), want, atol=1e-4).item()
    assert not mx.allclose(through_cache([17, 3]), want, atol=1e-4).item()
    fix_for_batching(model)
    for chunks in ([44], [20, 24], [7, 7, 7, 7, 7, 7, 2], [17, 3], [30]):
        assert mx.allclose(through_cache(chunks), want, atol=1e-4).item(), chunks

    prompts = (sequence[:30], sequence[5:45])
    follow = [sequence[30:36], [7, 8, 9, 10, 11, 12]]
    expected = []
    for prompt, tokens in zip(prompts, follow, strict=True):
        whole = model(mx.array([prompt + tokens]))[0]
        expected.append([whole[len(prompt) - 1 + i] for i in range(len(tokens) + 1)])
    for chunk in (None, 12, 5):
        got = decode_batch(model, prompts, follow, chunk)
        # The last decode step's logits follow the last fed token, which `whole` lacks.
        assert same_rows(got[:-1], [rows[:-1] for rows in expected]), chunk


def test_deepseek_v41_is_refused_with_the_reason() -> None:
    """deepseek_v41's LayerCache has no batched form (mlx-lm cannot merge it); the worker
    refuses the model at start saying so, rather than failing at its warm-up."""
    from mlx_lm.generate import _merge_caches

    from servicer.engine.arch_fixes import UnservableModel

    model = build("deepseek_v41")
    with pytest.raises(ValueError, match="does not yet support batching"):
        _merge_caches([make_prompt_cache(model) for _ in range(2)])
    with pytest.raises(UnservableModel, match="no batched form"):
        fix_for_batching(model)
