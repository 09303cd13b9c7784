"""The prefill budget: while rows decode, a long prompt is prefilled in pieces; idle, in full
chunks; outputs never change; the oldest prompt gets its first token first. Behaviour only:
what the metrics and the engine's load say, never how long anything took."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from conftest import Reference, demo_config
from support import BackgroundGenerate, ServerThread, generate, wait_until

from servicer.demos.text import TEST_PROMPTS, demo_model_path

# A budget so small that every machine splits a long prompt while rows decode.
TINY_BUDGET_MS = 1.0
N = 16


def _long_prompt(reference: Reference, tokens: int, salt: int = 0) -> list[int]:
    text = " ".join(TEST_PROMPTS[(i + salt) % len(TEST_PROMPTS)] for i in range(600))
    ids = reference.encode(text)
    assert len(ids) >= tokens
    return ids[:tokens]


def _prefill_steps(running: ServerThread) -> tuple[float, float, float]:
    """(steps that prefilled, prompt tokens they took, steps that took more than 1024)."""
    registry = running.server.metrics.registry
    name = "mlx_worker_prefill_tokens_per_step"
    count = registry.get_sample_value(f"{name}_count") or 0.0
    total = registry.get_sample_value(f"{name}_sum") or 0.0
    small = registry.get_sample_value(f"{name}_bucket", {"le": "1024.0"}) or 0.0
    return count, total, count - small


def _fused_steps(running: ServerThread) -> float:
    registry = running.server.metrics.registry
    return registry.get_sample_value("mlx_worker_prefill_steps_fused_total") or 0.0


@pytest.fixture(scope="module")
def budgeted(demo_dir) -> Iterator[ServerThread]:
    config = demo_config(
        demo_dir, max_prefill_stall_ms=TINY_BUDGET_MS, prompt_cache_size=0, fuse_prefill=True
    )
    with ServerThread(config) as running:
        yield running


def test_idle_a_long_prompt_gets_full_chunks(budgeted, reference):
    prompt = _long_prompt(reference, 3000)
    before = _prefill_steps(budgeted)
    with budgeted.channel() as chan:
        done = generate(chan, prompt, stream=False, temperature=0, max_tokens=2, ignore_eos=True)
    after = _prefill_steps(budgeted)
    assert done.error is None
    # 2999 tokens go through in chunks (the last one starts decoding): 2048, then 951.
    assert after[0] - before[0] == 2
    assert after[1] - before[1] == 2999
    assert after[2] - before[2] == 1  # one full chunk


def test_while_rows_decode_a_long_prompt_is_split_over_many_steps(budgeted, reference, prompts):
    prompt = _long_prompt(reference, 3000, salt=1)
    with budgeted.channel() as chan:
        stream = BackgroundGenerate(
            chan, prompts[0], temperature=0, max_tokens=3000, ignore_eos=True
        )
        assert stream.started.wait(60)
        before, fused_before = _prefill_steps(budgeted), _fused_steps(budgeted)
        done = generate(chan, prompt, temperature=0, max_tokens=N, ignore_eos=True)
        after, fused_after = _prefill_steps(budgeted), _fused_steps(budgeted)
        assert stream.is_alive()  # it decoded all along
        budgeted.server.servicer.abort_all()
        stream.join(60)
    assert done.tokens == reference.greedy(prompt, N)
    # How many steps the prompt takes follows from what the engine measured its steps to
    # cost; what holds on any machine: all of it went through, never a full chunk in a step
    # (so in three steps at least), and every chunk but the first (taken as the prompt
    # joined) rode in the stream's forward, however many there were.
    steps = after[0] - before[0]
    assert after[1] - before[1] == 2999
    assert after[2] == before[2]  # no step took a full chunk
    assert steps >= 3
    assert fused_after - fused_before >= steps - 1


def test_an_arriving_prompt_finishes_its_prefill_under_steady_decoding(
    budgeted, reference, prompts
):
    arriving = _long_prompt(reference, 1200, salt=2)
    with budgeted.channel() as chan:
        streams = [
            BackgroundGenerate(chan, p, temperature=0, max_tokens=4000, ignore_eos=True)
            for p in prompts[:6]
        ]
        assert all(s.started.wait(60) for s in streams)
        done = generate(chan, arriving, temperature=0, max_tokens=4, ignore_eos=True)
        assert all(s.is_alive() for s in streams)  # they kept decoding meanwhile
        budgeted.server.servicer.abort_all()
        for s in streams:
            s.join(60)
    assert done.tokens == reference.greedy(arriving, 4)
    assert all(s.outcome.complete.finish_reason == "abort" for s in streams)


def test_the_oldest_of_prompts_arriving_together_gets_its_first_token_first(demo_dir, reference):
    """When the first prompt's first token arrives, the later ones are still waiting or in
    prefill: they were not all prefilled together."""
    prompts = [_long_prompt(reference, 1200, salt=s) for s in range(4)]
    waiting_at_first_token: list[int] = []
    with ServerThread(demo_config(demo_dir, prompt_cache_size=0)) as running:
        worker = running.server

        def first(chunk) -> None:
            if not waiting_at_first_token:
                waiting_at_first_token.append(worker.load().waiting)

        with running.channel() as chan:
            callers = []
            for i, prompt in enumerate(prompts):
                on_chunk = first if i == 0 else None
                callers.append(
                    threading.Thread(
                        target=generate,
                        args=(chan, prompt),
                        kwargs={"temperature": 0, "max_tokens": 4, "on_chunk": on_chunk},
                    )
                )
                callers[-1].start()
                assert wait_until(lambda n=i + 1: running.server.servicer.active_requests >= n)
            for caller in callers:
                caller.join(120)
    assert waiting_at_first_token and waiting_at_first_token[0] >= 1


@pytest.mark.parametrize("kind", ["llama", "hybrid", "gemma3"])
def test_greedy_outputs_are_unchanged_by_split_prefill(kind):
    model_dir = demo_model_path(kind)
    reference = Reference(model_dir)
    arriving = [_long_prompt(reference, n, salt=n) for n in (700, 300)]
    # Two prompts arriving together are a queue; a fixed budget keeps them in pieces, and so
    # does a chunk of at most 128 tokens where the budget's floor (three decode steps, which on
    # a loaded machine may fit hundreds of the demo's tokens) would not.
    config = demo_config(
        model_dir,
        max_prefill_stall_ms=TINY_BUDGET_MS,
        max_prefill_stall_widen=1.0,
        prompt_cache_size=0,
        prefill_step_size=128,
    )
    with ServerThread(config) as running, running.channel() as chan:
        short = [reference.encode(text) for text in TEST_PROMPTS[:3]]
        streams = [
            BackgroundGenerate(chan, p, temperature=0, max_tokens=48, ignore_eos=True)
            for p in short
        ]
        assert all(s.started.wait(60) for s in streams)
        late = [
            BackgroundGenerate(chan, p, temperature=0, max_tokens=N, ignore_eos=True)
            for p in arriving
        ]
        for call in streams + late:
            call.join(120)
        steps = _prefill_steps(running)
    assert [s.outcome.tokens for s in streams] == [reference.greedy(p, 48) for p in short]
    assert [c.outcome.tokens for c in late] == [reference.greedy(p, N) for p in arriving]
    assert steps[0] >= 6  # the arriving prompts went through in pieces
