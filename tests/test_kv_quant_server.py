"""The quantized KV cache through the real server, on every demo kind: rows join and leave,
prefix hits from RAM and from disk (after a restart) give what a quantized cold run gives,
aborts end cleanly, and the cache, the blocks and the admission guard count quantized bytes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import mlx.core as mx
import pytest
from conftest import DRAFT_EVERY_STEP, Reference, demo_config
from mlx_lm.generate import generate_step
from support import BackgroundGenerate, ServerThread, generate, wait_until
from test_prefix_store import text_tokens

from servicer.demos.text import available_kinds, demo_model_path
from servicer.engine.cache_kinds import make_row_cache
from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

BITS, GROUP = 8, 32  # the demo models' head_dim is 32
N = 12


class QuantizedReference:
    """Greedy tokens of one sequence through mlx-lm with the same quantized caches."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(self, prompt: list[int], max_tokens: int = N) -> list[int]:
        key = (*prompt, max_tokens)
        if key not in self._cache:
            model = self.reference.model
            steps = generate_step(
                mx.array(prompt),
                model,
                max_tokens=max_tokens,
                prompt_cache=make_row_cache(model, BITS, GROUP),
            )
            self._cache[key] = [int(token) for token, _ in steps]
        return self._cache[key]


def quantized_config(model_dir, directory, **engine):
    config = demo_config(
        model_dir,
        kv_bits=BITS,
        kv_group_size=GROUP,
        prompt_cache_block=64,
        prompt_cache_snapshot_interval=128,
        prompt_cache_dir=str(directory),
        **engine,
    )
    return replace(config, engine_mode="thread")


@pytest.fixture(scope="module", params=available_kinds())
def kind(request) -> Iterator[tuple[str, Reference, QuantizedReference]]:
    reference = Reference(demo_model_path(request.param))
    yield request.param, reference, QuantizedReference(reference)


def _run(running: ServerThread, prompt: list[int], max_tokens: int = N):
    with running.channel() as chan:
        outcome = generate(chan, prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert outcome.error is None, outcome.error
    return outcome


def test_rows_joining_and_leaving_give_what_each_alone_gives(kind, tmp_path):
    name, reference, quantized = kind
    prompts = [text_tokens(reference, 150 + 40 * i, salt=80 + i) for i in range(4)]
    config = quantized_config(demo_model_path(name), tmp_path)
    with ServerThread(config) as running, running.channel() as chan:
        first = [
            BackgroundGenerate(chan, p, temperature=0, max_tokens=3 * N, ignore_eos=True)
            for p in prompts[:2]
        ]
        assert all(call.started.wait(60) for call in first)
        later = [
            BackgroundGenerate(chan, p, temperature=0, max_tokens=N, ignore_eos=True)
            for p in prompts[2:]
        ]
        for call in first + later:
            call.join(120)
    lengths = [3 * N, 3 * N, N, N]
    for call, prompt, length in zip(first + later, prompts, lengths, strict=True):
        assert call.outcome.error is None
        assert call.outcome.tokens == quantized.greedy(prompt, length), name


def test_prefix_hits_from_ram_and_from_disk_equal_a_quantized_cold_run(kind, tmp_path):
    name, reference, quantized = kind
    system = text_tokens(reference, 400, salt=90)
    turns = [system + text_tokens(reference, 20, salt=91 + i) for i in range(3)]
    config = quantized_config(demo_model_path(name), tmp_path)
    with ServerThread(config) as running:
        cold = _run(running, turns[0])
        warm = _run(running, turns[1])
        stats = running.server.prefix_stats()
    assert cold.tokens == quantized.greedy(turns[0]) and cold.complete.cached_tokens == 0
    assert warm.tokens == quantized.greedy(turns[1]) and warm.complete.cached_tokens >= 256
    assert stats.ram_hits >= 1
    with ServerThread(config) as restarted:  # the same directory: blocks come from disk
        again = _run(restarted, turns[2])
        stats = restarted.server.prefix_stats()
    assert again.tokens == quantized.greedy(turns[2]) and again.complete.cached_tokens >= 256
    assert stats.disk_hits >= 1, name


def test_an_abort_ends_a_quantized_row_and_the_others_go_on(kind, tmp_path):
    name, reference, quantized = kind
    prompt = text_tokens(reference, 200, salt=95)
    with ServerThread(quantized_config(demo_model_path(name), tmp_path)) as running:
        with running.channel() as chan:
            long = BackgroundGenerate(
                chan, prompt, request_id=f"q-abort-{name}", temperature=0, max_tokens=3000
            )
            assert long.started.wait(60)
            other = threading.Thread(target=lambda: _run(running, prompt))
            other.start()
            pb_grpc.MlxEngineStub(chan).Abort(
                pb.AbortRequest(request_ids=[f"q-abort-{name}"]), timeout=10
            )
            long.join(60)
            other.join(60)
        assert wait_until(lambda: running.server.load().running == 0)
        after = _run(running, prompt)
    assert long.outcome.complete.finish_reason == "abort"
    assert after.tokens == quantized.greedy(prompt)


def test_the_cache_blocks_and_admission_count_quantized_bytes(tmp_path):
    model_dir = demo_model_path("llama")
    reference = Reference(model_dir)
    prompt = text_tokens(reference, 512, salt=97)
    sizes = {}
    for bits in (None, 8, 4):
        config = demo_config(model_dir, kv_bits=bits, kv_group_size=GROUP)
        with ServerThread(config) as running:
            _run(running, prompt)
            per_token = running.server.engine.capabilities.admission.memory.per_token
            sizes[bits] = (sum(b for b, _ in per_token), running.server.prefix_stats().bytes)
    full_token, full_blocks = sizes[None]
    # float32 in groups of 32: (32 + 8) / 128 bytes at 8 bits, (16 + 8) / 128 at 4
    assert sizes[8][0] == pytest.approx(full_token * 40 / 128)
    assert sizes[4][0] == pytest.approx(full_token * 24 / 128)
    assert sizes[8][1] <= 0.35 * full_blocks and sizes[4][1] <= 0.22 * full_blocks


def test_speculation_over_a_quantized_cache_gives_what_the_quantized_cache_alone_gives(tmp_path):
    from spec_support import passages, repeat_prompt

    reference = Reference(demo_model_path("llama"))
    quantized = QuantizedReference(reference)
    prompts = [repeat_prompt(reference.tokenizer, p, 100) for p in passages()[:3]]
    config = quantized_config(
        demo_model_path("llama"), tmp_path, speculate="ngram", speculation=DRAFT_EVERY_STEP
    )
    with ServerThread(config) as running:
        outcomes = [_run(running, p, 3 * N) for p in prompts]
        figures = running.server.servicer.figures().speculation
    assert [o.tokens for o in outcomes] == [quantized.greedy(p, 3 * N) for p in prompts]
    assert figures is not None and figures.accepted > 0
