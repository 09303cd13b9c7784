"""An idle engine waits for a burst only as large as the one its clients are expected to send:
the requests that ended with the step that emptied it (a prefill batch before anything ran),
so a lone request after a lone one is admitted at once.

The quiet window here is a minute, so a wait for a burst that never comes would show as a
request that does not finish; no timing is measured."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from servicer.engine import Engine, EngineConfig
from servicer.messages import GenerationRequest, SamplingSpec
from servicer.model_files import ModelSpec, prepare_model_files
from servicer.outbox import Outbox

QUIET_S = 60.0
FINISH_TIMEOUT_S = 30.0  # half the quiet window


class Tokens:
    """What reached the handler side: each ticket's tokens and whether it finished, and
    which tickets had their first token before `marker` was set."""

    def __init__(self) -> None:
        self.outbox = Outbox(self._woken)
        self.marker = threading.Event()
        self.before_marker: set[int] = set()
        self._counts: dict[int, int] = {}
        self._finished: set[int] = set()
        self._cond = threading.Condition()

    def _woken(self) -> None:
        out = self.outbox.take()
        if out is None:
            return
        with self._cond:
            for event in out.events:
                if event.token is not None:
                    if event.ticket not in self._counts and not self.marker.is_set():
                        self.before_marker.add(event.ticket)
                    self._counts[event.ticket] = self._counts.get(event.ticket, 0) + 1
                if event.finish_reason is not None:
                    self._finished.add(event.ticket)
            self._cond.notify_all()

    def wait(self, predicate, timeout: float = FINISH_TIMEOUT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def finished(self, *tickets: int) -> bool:
        return self.wait(lambda: set(tickets) <= self._finished)

    def decoding(self, *tickets: int) -> bool:
        return self.wait(lambda: all(self._counts.get(t, 0) >= 2 for t in tickets))


FIRST_WAVE = 3  # the prefill batch: what a fresh engine waits for


@pytest.fixture
def engine(demo_dir) -> Iterator[tuple[Engine, Tokens]]:
    tokens = Tokens()
    config = EngineConfig(
        prompt_cache_size=0,
        prefill_batch_size=FIRST_WAVE,
        coalesce_quiet_s=QUIET_S,
        coalesce_max_s=2 * QUIET_S,
    )
    engine = Engine(config, tokens.outbox)
    engine.start(prepare_model_files(ModelSpec(str(demo_dir))).info)
    engine.wait_ready(120)
    yield engine, tokens
    engine.shutdown(30)


def _request(ticket: int, prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        ticket=ticket,
        request_id=f"idle-{ticket}",
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=SamplingSpec(temperature=0.0),
    )


def test_an_idle_engine_waits_for_as_many_as_ended_together_and_no_more(engine, prompts):
    running, tokens = engine
    for ticket in (1, 2, 3):  # a first wave, as large as the prefill batch
        running.submit(_request(ticket, prompts[ticket - 1], 1000))
    assert tokens.decoding(1, 2, 3)
    running.abort([1])
    assert tokens.finished(1)
    running.abort([2, 3])  # two end with the step that empties the batch
    assert tokens.finished(2, 3)

    def second() -> None:
        tokens.marker.set()
        running.submit(_request(5, prompts[1], 8))

    running.submit(_request(4, prompts[0], 4))
    threading.Timer(0.3, second).start()
    assert tokens.finished(4, 5)  # the second admitted both: no third was waited for
    assert 4 not in tokens.before_marker  # the first waited for the second

    # The longer of the two ended alone: the next request is admitted on its own at once.
    running.submit(_request(6, prompts[2], 4))
    assert tokens.finished(6)
