"""The batched quantized KV cache: same answers as mlx-lm's single-sequence QuantizedKVCache,
through BatchGenerator's whole life cycle (uneven prefill, joins, leaves, extract, prefix hits)."""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache
from quant_support import quantize_rows

from servicer.demos.text import demo_model_path
from servicer.engine.cache_kinds import make_row_cache
from servicer.engine.quantized_kv import BatchQuantizedKVCache, QuantizedRowCache

GROUP = 32  # the demo models' head_dim
STEPS = 32
# Logprob gap between a batched row and the same prompt run alone (measured: 0 on llama and
# hybrid; ~1e-5 on gemma3, as with mlx-lm's own full-precision batch caches there).
LOGPROB_TOL = 1e-3
TEXTS = (
    "The river",
    "Tell me about the old library",
    "In the morning the baker opens the shutters before the sun is fully up. She sets out",
    "A good soup",
)


@cache
def demo(kind: str) -> tuple[Any, Any]:
    return load(str(demo_model_path(kind)))


def encode(kind: str, text: str) -> list[int]:
    return list(demo(kind)[1].encode(text, add_special_tokens=False))


def solo(model: Any, prompt: list[int], steps: int, bits: int | None) -> tuple[list[int], mx.array]:
    """Greedy tokens and their logprobs from mlx-lm's own single-sequence QuantizedKVCache
    (full precision where `bits` is None)."""
    caches = [
        QuantizedKVCache(group_size=GROUP, bits=bits) if type(c) is KVCache and bits else c
        for c in make_prompt_cache(model)
    ]
    logits = model(mx.array(prompt)[None], cache=caches)[:, -1, :]
    tokens, logprobs = [], []
    for _ in range(steps):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = mx.argmax(lp, axis=-1)
        mx.eval(token, lp)
        tokens.append(token.item())
        logprobs.append(lp[0])
        logits = model(token[:, None], cache=caches)[:, -1, :]
    return tokens, mx.stack(logprobs)


class Run:
    """A BatchGenerator driven step by step, collecting each row's tokens and logprobs."""

    def __init__(self, model: Any, steps: int = STEPS) -> None:
        self.gen = BatchGenerator(model, max_tokens=steps)
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[mx.array]] = {}
        self.finished: dict[int, tuple[list[Any], list[int]]] = {}

    def insert(self, prompts: list[list[int]], caches: list[list[Any]], **kw: Any) -> list[int]:
        uids = self.gen.insert(prompts, caches=caches, **kw)
        for uid in uids:
            self.tokens[uid], self.logprobs[uid] = [], []
        return uids

    def step(self) -> bool:
        responses = self.gen.next_generated()
        mx.eval([r.logprobs for r in responses])
        for r in responses:
            self.tokens[r.uid].append(r.token)
            self.logprobs[r.uid].append(r.logprobs)
            if r.finish_reason is not None:
                self.finished[r.uid] = (r.prompt_cache, r.all_tokens)
        return bool(responses)

    def finish(self) -> None:
        while self.step():
            pass


def assert_matches(run: Run, uid: int, ref: tuple[list[int], mx.array], start: int = 0) -> None:
    tokens, logprobs = run.tokens[uid], run.logprobs[uid]
    assert tokens == ref[0][start : start + len(tokens)]
    gap = mx.abs(mx.stack(logprobs) - ref[1][start : start + len(tokens)]).max().item()
    assert gap < LOGPROB_TOL


@pytest.mark.parametrize(
    ("kind", "bits"), [("llama", 8), ("llama", 4), ("hybrid", 8), ("gemma3", 4)]
)
def test_batch_agrees_with_each_row_alone(kind: str, bits: int) -> None:
    model, _ = demo(kind)
    prompts = [encode(kind, t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # uneven: right padding, then roll
    run = Run(model)
    uids = run.insert(prompts, [make_row_cache(model, bits, GROUP) for _ in prompts])
    run.step()
    kinds = {type(c).__name__ for c in run.gen._generation_batch.prompt_cache}
    assert "BatchQuantizedKVCache" in kinds
    run.finish()
    for uid, prompt in zip(uids, prompts, strict=True):
        assert len(set(run.tokens[uid])) >= 8  # varied, so equality says something
        assert_matches(run, uid, solo(model, prompt, STEPS, bits))
    # Quantizing really happened: full precision gives other logprobs.
    full = solo(model, prompts[-1], STEPS, None)[1]
    assert mx.abs(mx.stack(run.logprobs[uids[-1]]) - full).max().item() > LOGPROB_TOL


def test_layer_kinds_stay_as_the_model_makes_them() -> None:
    kinds = {
        kind: [type(c).__name__ for c in make_row_cache(demo(kind)[0], 8, GROUP)]
        for kind in ("llama", "hybrid", "gemma3")
    }
    assert kinds == {
        "llama": ["QuantizedRowCache"] * 2,
        "hybrid": ["ArraysCache", "QuantizedRowCache"],
        "gemma3": ["RotatingKVCache", "QuantizedRowCache"],
    }
    merged = [c.merge([c]) for c in make_row_cache(demo("hybrid")[0], 8, GROUP)]
    assert [type(c).__name__ for c in merged] == ["ArraysCache", "BatchQuantizedKVCache"]


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_rows_join_and_leave_mid_generation(kind: str) -> None:
    model, _ = demo(kind)
    prompts = [encode(kind, t) for t in TEXTS]
    run = Run(model)
    uids = run.insert(prompts[:2], [make_row_cache(model, 8, GROUP) for _ in range(2)])
    for _ in range(5):
        run.step()
    uids += run.insert(prompts[2:3], [make_row_cache(model, 8, GROUP)])  # joins: extend
    for _ in range(5):
        run.step()
    run.gen.remove([uids[0]])  # leaves: filter
    for _ in range(3):
        run.step()
    uids += run.insert(prompts[3:], [make_row_cache(model, 8, GROUP)])  # joins the rest
    run.finish()
    assert len(run.tokens[uids[0]]) < STEPS
    assert all(len(run.tokens[uid]) == STEPS for uid in uids[1:])
    for uid, prompt in zip(uids, prompts, strict=True):
        assert_matches(run, uid, solo(model, prompt, STEPS, 8))


def test_resume_from_an_extracted_cache() -> None:
    model, _ = demo("llama")
    prompts = [encode("llama", t) for t in TEXTS[:3]]
    run = Run(model)
    uids = run.insert(prompts, [make_row_cache(model, 8, GROUP) for _ in prompts])
    for _ in range(10):
        run.step()
    (caches, tokens) = run.gen.remove([uids[1]], return_prompt_caches=True)[uids[1]]
    assert all(isinstance(c, QuantizedRowCache) for c in caches)
    done = len(run.tokens[uids[1]])
    # The extracted cache already holds the last emitted token: drop it and feed it again.
    assert {c.trim(1) for c in caches} == {1}
    stored = [QuantizedRowCache.from_state(c.state) for c in caches]  # as a store keeps it
    resumed = run.insert(
        [tokens[-1:]], [stored], all_tokens=[tokens[:-1]], max_tokens=[STEPS - done]
    )[0]
    run.finish()
    assert done + len(run.tokens[resumed]) == STEPS
    ref = solo(model, prompts[1], STEPS, 8)
    assert_matches(run, uids[1], ref)
    assert_matches(run, resumed, ref, start=done)
    for uid in (uids[0], uids[2]):
        assert len(run.tokens[uid]) == STEPS


def test_prefix_hits_give_the_cold_output() -> None:
    model, _ = demo("llama")
    prompt = encode("llama", TEXTS[2])
    cut = len(prompt) // 2
    cold = Run(model)
    cold_uid = cold.insert([prompt], [make_row_cache(model, 8, GROUP)])[0]
    cold.finish()
    # A quantized prefix: a finished request's cache, kept as a store keeps it (state).
    first = Run(model, steps=1)
    done = first.insert([prompt[:cut]], [make_row_cache(model, 8, GROUP)])[0]
    first.finish()
    caches, tokens = first.finished[done]
    assert tokens == prompt[:cut] + first.tokens[done]
    assert {c.trim(1) for c in caches} == {1}  # holds the emitted token too
    stored = [QuantizedRowCache.from_state(c.state) for c in caches]
    assert all(c.offset == cut and c.keys[0].shape[2] == cut for c in stored)
    # A full-precision prefix, quantized on the way in.
    full = make_prompt_cache(model)
    model(mx.array(prompt[: cut + 3])[None], cache=full)
    hit = Run(model)
    uids = hit.insert(
        [prompt[cut:], prompt[cut + 3 :], prompt],
        [stored, quantize_rows(full, 8, GROUP), make_row_cache(model, 8, GROUP)],
        all_tokens=[prompt[:cut], prompt[: cut + 3], []],
    )
    hit.finish()
    for uid in uids:
        assert hit.tokens[uid] == cold.tokens[cold_uid]
    assert_matches(hit, uids[0], solo(model, prompt, STEPS, 8))


# ---------------------------------------------------------------- against BatchKVCache, no model


def _kv(rng_key: int, rows: int, n: int) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(rng_key))
    return mx.random.normal((rows, 2, n, 64), key=k1), mx.random.normal((rows, 2, n, 64), key=k2)


def _roundtrip(x: mx.array, bits: int) -> mx.array:
    return mx.dequantize(*mx.quantize(x, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits)


def _check(ours: BatchQuantizedKVCache, ref: BatchKVCache, bits: int) -> None:
    assert ours.size() == ref.size()
    assert ours.offset.tolist() == ref.offset.tolist()
    assert ours.left_padding.tolist() == ref.left_padding.tolist()
    assert mx.array_equal(ours.make_mask(3), ref.make_mask(3)).item()
    keys, values = ours.keys_and_values()
    deq = [mx.dequantize(*q, group_size=GROUP, bits=bits) for q in (keys, values)]
    for a, b in zip(deq, ref.keys_and_values(), strict=True):
        assert mx.array_equal(a, b).item()


def _pair(bits: int, lengths: list[int], seed: int) -> tuple[BatchQuantizedKVCache, BatchKVCache]:
    """Caches built by merge from rows of these lengths: quantized, full precision, empty."""
    ours, refs = [], []
    for i, n in enumerate(lengths):
        full, ref = KVCache(), KVCache()
        if n:
            k, v = _kv(seed + i, 1, n)
            full.update_and_fetch(k, v)
            ref.update_and_fetch(_roundtrip(k, bits), _roundtrip(v, bits))
        ours.append(quantize_rows([full], bits, GROUP)[0] if i % 2 == 0 else full)
        refs.append(ref)
    if not isinstance(ours[0], QuantizedRowCache):
        ours[0] = QuantizedRowCache(group_size=GROUP, bits=bits)
    return ours[0].merge(ours), BatchKVCache.merge(refs)


def _write(ours: Any, ref: Any, bits: int, rows: int, n: int, seed: int) -> None:
    k, v = _kv(seed, rows, n)
    ours.update_and_fetch(k, v)
    ref.update_and_fetch(_roundtrip(k, bits), _roundtrip(v, bits))


@pytest.mark.parametrize("bits", [8, 4])
def test_every_operation_matches_batch_kv_cache(bits: int) -> None:
    ours, ref = _pair(bits, [5, 0, 9], seed=0)
    _check(ours, ref, bits)
    for c in (ours, ref):  # an uneven prefill: right padding rolled into left padding
        c.prepare(lengths=[4, 2, 1], right_padding=[0, 2, 3])
    _write(ours, ref, bits, 3, 4, seed=10)
    for c in (ours, ref):
        c.finalize()
    _check(ours, ref, bits)
    for step in range(300):  # past the first 256-token step: the buffer grows
        _write(ours, ref, bits, 3, 1, seed=100 + step)
    _check(ours, ref, bits)
    assert ours.keys[0].shape[2] == ref.keys.shape[2]
    ours.filter([2, 0]), ref.filter([2, 0])
    _check(ours, ref, bits)
    other, other_ref = _pair(bits, [3, 7], seed=20)
    ours.extend(other), ref.extend(other_ref)
    _check(ours, ref, bits)
    assert ours.trim(4) == ref.trim(4) == 4
    _check(ours, ref, bits)
    row, row_ref = ours.extract(1), ref.extract(1)
    assert row.offset == row_ref.offset
    keys = mx.dequantize(*row.keys, group_size=GROUP, bits=bits)
    assert mx.array_equal(keys, row_ref.keys).item()


def test_extend_with_empty_and_from_empty() -> None:
    empty = BatchQuantizedKVCache(8, GROUP, [0, 0])
    ours, ref = _pair(8, [4, 6], seed=30)
    empty.extend(ours)
    ref_empty = BatchKVCache([0, 0])
    ref_empty.extend(ref)
    _check(empty, ref_empty, 8)
    state = BatchQuantizedKVCache.from_state(empty.state)
    _check(state, ref_empty, 8)
    assert state.bits == 8 and state.group_size == GROUP


def test_merge_refuses_mixed_quantization() -> None:
    rows = [
        QuantizedRowCache(group_size=GROUP, bits=8),
        QuantizedRowCache(group_size=GROUP, bits=4),
    ]
    with pytest.raises(ValueError, match="4-bit"):
        rows[0].merge(rows)
    with pytest.raises(ValueError, match="bits"):
        BatchQuantizedKVCache.merge([KVCache()])
    assert QuantizedRowCache().nbytes == 0  # mlx-lm's own raises on an empty cache
    # Settings MLX cannot quantize with (whether a group divides the heads: test_kv_group).
    with pytest.raises(ValueError, match="KV bits must be one of"):
        make_row_cache(demo("llama")[0], 7, GROUP)
    with pytest.raises(ValueError, match="KV group size must be one of"):
        make_row_cache(demo("llama")[0], 8, 48)


# ---------------------------------------------------------------- memory on a real-shaped model


def _real_shaped_llama() -> Any:
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=1,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-5,
        vocab_size=64,
    )
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    return model


@pytest.mark.parametrize(("bits", "limit"), [(8, 0.55), (4, 0.31)])
def test_bytes_per_token(bits: int, limit: float) -> None:
    model = _real_shaped_llama()
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7], [0, 0, 3, 4, 5, 6, 7]])
    quantized = [BatchQuantizedKVCache(bits, 64, [0, 2])]
    full = [BatchKVCache([0, 2])]
    for caches in (quantized, full):
        model(tokens, cache=caches)
        mx.eval([c.state for c in caches])
    assert quantized[0].size() == full[0].size() == 7
    assert full[0].keys.dtype == mx.float16
    ratio = quantized[0].nbytes / full[0].nbytes  # same buffer length on both sides
    assert ratio <= limit
    row = quantized[0].extract(0)
    assert row.nbytes / (full[0].extract(0).nbytes) <= limit
