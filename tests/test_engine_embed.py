"""Embeddings from the engine, in a thread and in its own process: the model's pooled final
hidden state, equal to mlx-lm's own forward, answered beside generation without disturbing it;
a bad or failing embed fails alone."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from servicer.demo_model import demo_model_path
from servicer.engine import Engine, EngineConfig
from servicer.engine.embedding import Embedder, inner_module
from servicer.engine.prefix.keys import block_keys
from servicer.engine_process import EngineProcess
from servicer.messages import (
    EmbedRequest,
    EmbedResult,
    EngineFigures,
    GenerationRequest,
    KvBlockEvent,
    RowFailure,
    SamplingSpec,
    StepOutput,
)
from servicer.model_files import ModelSpec, prepare_model_files
from servicer.outbox import Outbox

GREEDY = SamplingSpec(temperature=0.0)
MODES = ["thread", "process"]


class Collected:
    """Everything that reached the handler side through the engine's outbox."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}  # ticket -> cached_tokens of its first event
        self.finished: set[int] = set()
        self.embeddings: dict[int, EmbedResult] = {}
        self.failures: dict[int, RowFailure] = {}
        self.flushed: list[tuple[int, EngineFigures | None]] = []  # with the figures then
        self.kv_events: list[KvBlockEvent] = []
        self.figures: EngineFigures | None = None
        self.embedded_while_running = False  # an embed result came while generation ran
        self._cond = threading.Condition()
        self.outbox = Outbox(self._woken)

    def _woken(self) -> None:
        out = self.outbox.take()
        assert out is not None
        with self._cond:
            self._record(out)
            self._cond.notify_all()

    def _record(self, out: StepOutput) -> None:
        self.figures = out.figures or self.figures
        for event in out.events:
            self.cached.setdefault(event.ticket, event.cached_tokens)
            if event.token is not None:
                self.tokens.setdefault(event.ticket, []).append(event.token)
            if event.finish_reason is not None:
                self.finished.add(event.ticket)
        running = set(self.tokens) - self.finished
        self.embedded_while_running |= bool(out.embeddings and running)
        self.embeddings.update((r.ticket, r) for r in out.embeddings)
        self.failures.update((f.ticket, f) for f in out.failures)
        self.flushed.extend((ticket, self.figures) for ticket in out.flushed)
        self.kv_events.extend(out.kv_events)

    def wait(self, predicate: Callable[[], bool], timeout: float = 120) -> None:
        with self._cond:
            assert self._cond.wait_for(predicate, timeout)

    def wait_finished(self, tickets: set[int], timeout: float = 120) -> None:
        self.wait(lambda: tickets <= self.finished, timeout)


def start_engine(mode: str, model_dir: Any, config: EngineConfig) -> tuple[Any, Collected]:
    collected = Collected()
    cls = Engine if mode == "thread" else EngineProcess
    engine = cls(config, collected.outbox)
    engine.start(prepare_model_files(ModelSpec(str(model_dir))).info)
    engine.wait_ready(180)
    return engine, collected


def greedy_request(
    ticket: int, prompt: list[int], max_tokens: int, block: int = 0
) -> GenerationRequest:
    """With `block`, named by its blocks as the handlers name them (for prefix reuse)."""
    return GenerationRequest(
        ticket=ticket,
        request_id=f"engine-test-{ticket}",
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=GREEDY,
        block_keys=block_keys(prompt, block) if block else (),
    )


def direct_embedding(model: Any, prompt: list[int], pooling: str) -> np.ndarray:
    """mlx-lm's own forward of the prompt alone, pooled and L2-normalised."""
    hidden = model.model(mx.array([prompt]))[0].astype(mx.float32)
    pooled = hidden.mean(axis=0) if pooling == "mean" else hidden[-1]
    vector = np.array(pooled.tolist())
    return vector / np.linalg.norm(vector)


@pytest.fixture(scope="module", params=MODES)
def running(request, demo_dir) -> Iterator[tuple[Any, Collected]]:
    engine, collected = start_engine(request.param, demo_dir, EngineConfig(prompt_cache_size=0))
    yield engine, collected
    engine.shutdown(30)


def test_embeddings_beside_generation_equal_mlx_lm_and_leave_it_alone(running, prompts, reference):
    engine, collected = running
    assert engine.capabilities.embedding_size == 128
    base = 1000 if isinstance(engine, Engine) else 2000
    generating = {base + 1: prompts[0], base + 2: prompts[1]}
    for ticket, prompt in generating.items():
        engine.submit(greedy_request(ticket, prompt, 300))
    collected.wait(lambda: all(collected.tokens.get(t) for t in generating))
    long = prompts[2] + prompts[3] + prompts[4]
    texts = [prompts[5][:3], prompts[6], long]
    assert len({len(t) for t in texts}) == 3
    embeds = {
        base + 10 + i: (prompt, pooling)
        for i, (prompt, pooling) in enumerate(
            [(t, "last") for t in texts] + [(t, "mean") for t in texts]
        )
    }
    for ticket, (prompt, pooling) in embeds.items():
        engine.embed(EmbedRequest(ticket, prompt, pooling))
    collected.wait(lambda: set(embeds) <= set(collected.embeddings))
    assert collected.embedded_while_running
    for ticket, (prompt, pooling) in embeds.items():
        result = collected.embeddings[ticket]
        assert result.error is None
        assert len(result.embedding) == 128
        expected = direct_embedding(reference.model, prompt, pooling)
        assert np.abs(np.array(result.embedding) - expected).max() < 1e-4, (len(prompt), pooling)
        assert abs(np.linalg.norm(result.embedding) - 1.0) < 1e-5
    collected.wait_finished(set(generating))
    for ticket, prompt in generating.items():
        assert collected.tokens[ticket] == reference.greedy(prompt, 300)


def test_a_bad_embed_fails_alone(running, prompts, reference):
    engine, collected = running
    base = 3000 if isinstance(engine, Engine) else 4000
    engine.embed(EmbedRequest(base + 1, [], "last"))
    engine.embed(EmbedRequest(base + 2, prompts[0], "max"))
    engine.embed(EmbedRequest(base + 3, prompts[0], "mean"))
    collected.wait(lambda: {base + 1, base + 2, base + 3} <= set(collected.embeddings))
    assert "empty" in collected.embeddings[base + 1].error
    assert "pooling" in collected.embeddings[base + 2].error
    assert collected.embeddings[base + 1].embedding == []
    good = collected.embeddings[base + 3]
    expected = direct_embedding(reference.model, prompts[0], "mean")
    assert good.error is None and np.abs(np.array(good.embedding) - expected).max() < 1e-4


def test_a_failing_forward_fails_only_its_own_request(reference, prompts):
    inner, size, _ = inner_module(reference.model)
    assert inner is not None and size == 128
    poison = prompts[1][0]

    def flaky(ids: mx.array, cache: Any = None) -> mx.array:
        if poison in ids[:, 0].tolist():
            raise RuntimeError("injected")
        return inner(ids, cache=cache)

    embedder = Embedder(flaky, size, "")
    results = embedder.run(
        [EmbedRequest(1, prompts[0]), EmbedRequest(2, prompts[1]), EmbedRequest(3, prompts[2])]
    )
    assert [r.ticket for r in results] == [1, 2, 3]
    assert results[1].error is not None and "injected" in results[1].error
    for result, prompt in ((results[0], prompts[0]), (results[2], prompts[2])):
        expected = direct_embedding(reference.model, prompt, "last")
        assert result.error is None and np.abs(np.array(result.embedding) - expected).max() < 1e-4


@pytest.mark.parametrize("kind", ["llama", "hybrid", "gemma3"])
def test_every_demo_family_embeds_like_mlx_lm_whole_or_in_chunks(kind, prompts):
    from mlx_lm import load

    model, _ = load(str(demo_model_path(kind)))
    # Chunks of 4 tokens: the longer prompts go through with a cache of their own.
    embedder = Embedder.of(model, distributed=False, chunk=4)
    assert embedder.size == 128
    long = prompts[2] + prompts[3] + prompts[4]
    assert len(long) > 5 * 4
    cases = [
        (prompts[0][:2], "last"),
        (prompts[1], "mean"),
        (long, "last"),
        (long[:-5], "mean"),
    ]
    results = embedder.run([EmbedRequest(i, p, pool) for i, (p, pool) in enumerate(cases)])
    for result, (prompt, pooling) in zip(results, cases, strict=True):
        expected = direct_embedding(model, prompt, pooling)
        assert result.error is None and np.abs(np.array(result.embedding) - expected).max() < 1e-4


def test_a_model_that_cannot_embed_says_why():
    class NoInner:
        pass

    embedder = Embedder.of(NoInner(), distributed=False)  # type: ignore[arg-type]
    assert embedder.size == 0
    (result,) = embedder.run([EmbedRequest(7, [1, 2, 3])])
    assert result.embedding == [] and result.error.startswith("this model cannot embed: ")
    distributed = Embedder.of(NoInner(), distributed=True)  # type: ignore[arg-type]
    assert (
        distributed.size == 0
        and "--distributed" in distributed.run([EmbedRequest(8, [1])])[0].error
    )


def test_an_embed_while_the_engine_stops_gets_an_error(demo_dir, prompts):
    engine, collected = start_engine("thread", demo_dir, EngineConfig(prompt_cache_size=0))
    # Both land in one take: the engine is stopping when it sees the embed.
    with engine._inbox._cond:
        engine.embed(EmbedRequest(1, prompts[0]))
        engine._inbox.stop()
    engine.join(30)
    collected.wait(lambda: 1 in collected.embeddings)
    assert collected.embeddings[1].error == "the engine is stopping"
