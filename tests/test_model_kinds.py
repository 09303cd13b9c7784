"""Other cache shapes: a hybrid model (KVCache + recurrent ArraysCache layers) and a
sliding-window model (RotatingKVCache layers), batched with per-step admission, staggered
arrivals, cancels and prefix hits; every finished request equals mlx-lm's solo output."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import Reference, demo_config
from support import ServerThread, make_request, server_info, wait_until

from servicer.demos.text import TEST_PROMPTS, demo_model_path
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

N = 20
KINDS = ["hybrid", "gemma3"]


@pytest.fixture(scope="module", params=KINDS)
def kind_setup(request) -> Iterator[tuple[str, Reference, ServerThread]]:
    model_dir = demo_model_path(request.param)
    reference = Reference(model_dir)
    with ServerThread(demo_config(model_dir)) as running:
        yield request.param, reference, running


def _prompts(reference: Reference) -> list[list[int]]:
    """Prompts of many lengths (some past the sliding window), several sharing prefixes."""
    long_text = " ".join(TEST_PROMPTS * 6)
    base = reference.encode(long_text)
    prompts = [reference.encode(text) for text in TEST_PROMPTS]
    prompts += [base[:n] for n in (9, 17, 33, 60, 95, 140)]
    prompts += [base[:n] + reference.encode(" and then") for n in (33, 95)]
    return prompts


def test_the_cache_mixes_the_kinds_we_mean(kind_setup):
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

    kind, reference, _ = kind_setup
    layers = {type(c) for c in make_prompt_cache(reference.model)}
    expected = {"hybrid": {ArraysCache, KVCache}, "gemma3": {RotatingKVCache, KVCache}}[kind]
    assert layers == expected


def test_concurrent_staggered_with_cancels_matches_solo_cold_and_on_hits(kind_setup):
    kind, reference, running = kind_setup
    prompts = _prompts(reference)
    expected = [reference.greedy(p, N) for p in prompts]
    stub = pb_grpc.MlxEngineStub(running.channel())
    rng = random.Random(11)

    def run(job):
        i, prompt, delay, cancel_at = job
        time.sleep(delay)
        request = make_request(prompt, temperature=0, max_tokens=N, ignore_eos=True)
        call = stub.Generate(request, timeout=120)
        tokens, cached = [], None
        try:
            for response in call:
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
                    if cancel_at is not None and len(tokens) >= cancel_at:
                        call.cancel()
                        return i, tokens, None
                else:
                    cached = response.complete.cached_tokens
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.CANCELLED
        return i, tokens, cached

    for round_ in range(2):  # the first round is mostly cold, the second hits the cache
        jobs = [
            (i, p, rng.uniform(0, 0.2), rng.randrange(1, N) if rng.random() < 0.2 else None)
            for i, p in enumerate(prompts)
        ]
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(run, jobs))
        for i, tokens, cached in results:
            assert tokens == expected[i][: len(tokens)], f"{kind} round {round_} prompt {i}"
            if cached is not None:
                assert len(tokens) == N
        if round_ == 1:
            hits = [cached for _, _, cached in results if cached]
            assert len(hits) >= 3, f"{kind}: expected prefix hits on the second round"
    assert wait_until(lambda: server_info(running.channel()).active_requests == 0)
    load = running.server.load()
    assert (load.running, load.waiting) == (0, 0)


def test_a_prefix_hit_gives_exactly_the_cold_output(kind_setup):
    _kind, reference, running = kind_setup
    base = reference.encode(" ".join(TEST_PROMPTS[::-1] * 3))[:120]
    extended = base + reference.encode(" Later that day")
    with running.channel() as chan:
        stub = pb_grpc.MlxEngineStub(chan)
        outputs = {}
        for name, prompt in (("base", base), ("again", base), ("extended", extended)):
            request = make_request(
                prompt, stream=False, temperature=0, max_tokens=N, ignore_eos=True
            )
            (response,) = list(stub.Generate(request, timeout=120))
            outputs[name] = response.complete
    assert list(outputs["base"].output_ids) == reference.greedy(base, N)
    assert list(outputs["again"].output_ids) == reference.greedy(base, N)
    assert list(outputs["extended"].output_ids) == reference.greedy(extended, N)
    assert outputs["again"].cached_tokens == len(base) - 1
    assert outputs["extended"].cached_tokens >= len(base) - 1
