"""The engine's hand-offs: one per step by default, fewer when requests take tokens in batches."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from servicer.engine import Engine, EngineConfig
from servicer.messages import GenerationRequest, SamplingSpec, StepOutput
from servicer.model_files import ModelSpec, prepare_model_files
from servicer.outbox import Outbox

GREEDY = SamplingSpec(temperature=0.0)


class Deliveries:
    """What reached the handler side through the engine's outbox, one StepOutput per wake."""

    def __init__(self) -> None:
        self.outputs: list[StepOutput] = []
        self._finished: set[int] = set()
        self._cond = threading.Condition()
        self.outbox = Outbox(self._woken)

    def _woken(self) -> None:
        out = self.outbox.take()
        assert out is not None
        with self._cond:
            self.outputs.append(out)
            self._finished.update(e.ticket for e in out.events if e.finish_reason is not None)
            self._cond.notify_all()

    def wait_finished(self, tickets: set[int], timeout: float = 60) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: tickets <= self._finished, timeout)

    def tokens_per_delivery(self, ticket: int) -> list[int]:
        counts = [
            sum(1 for e in out.events if e.ticket == ticket and e.token is not None)
            for out in self.outputs
        ]
        return [count for count in counts if count]


@pytest.fixture(scope="module")
def engine(demo_dir) -> Iterator[tuple[Engine, Deliveries]]:
    deliveries = Deliveries()
    engine = Engine(EngineConfig(prompt_cache_size=0), deliveries.outbox)
    engine.start(prepare_model_files(ModelSpec(str(demo_dir))).info)
    engine.wait_ready(120)
    yield engine, deliveries
    engine.shutdown(30)


def _request(ticket: int, prompt: list[int], max_tokens: int, per_handoff: int = 1):
    return GenerationRequest(
        ticket=ticket,
        request_id=f"handoff-{ticket}",
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=GREEDY,
        tokens_per_handoff=per_handoff,
    )


def test_every_step_is_handed_off_by_default(engine, prompts):
    running, deliveries = engine
    running.submit(_request(101, prompts[0], 7))
    deliveries.wait_finished({101})
    assert deliveries.tokens_per_delivery(101) == [1] * 7


def test_tokens_wait_in_the_engine_until_a_batch_is_due(engine, prompts, reference):
    running, deliveries = engine
    running.submit(_request(102, prompts[1], 10, per_handoff=4))
    deliveries.wait_finished({102})
    assert deliveries.tokens_per_delivery(102) == [1, 4, 4, 1]
    tokens = [
        e.token
        for out in deliveries.outputs
        for e in out.events
        if e.ticket == 102 and e.token is not None
    ]
    assert tokens == reference.greedy(prompts[1], 10)[: len(tokens)]
    assert len(tokens) == 10


def test_a_row_due_carries_the_held_tokens_of_the_others(engine, prompts):
    running, deliveries = engine
    # A unary-style row (only its first token and finish matter) beside a per-token stream:
    # the stream's hand-off every step takes the other's tokens along.
    running.submit(_request(103, prompts[2], 12, per_handoff=1 << 30))
    running.submit(_request(104, prompts[3], 12))
    deliveries.wait_finished({103, 104})
    assert sum(deliveries.tokens_per_delivery(103)) == 12
    assert sum(deliveries.tokens_per_delivery(104)) == 12
