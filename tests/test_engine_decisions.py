"""One place for each decision: the engine fans out n > 1 and ends rows at stop strings, GetLoads
answers from the figures the engine publishes, and one output rule says when output goes to
the handlers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import demo_config
from support import ServerThread, generate, wait_until

from servicer.engine.inbox import Inbox
from servicer.loads import Throughput, load_figures
from servicer.messages import (
    EngineFigures,
    FailureKind,
    GenerationRequest,
    LoadCounts,
    PrefixCacheStats,
    RowEvent,
    RowFailure,
    SamplingSpec,
    StepOutput,
)
from servicer.outbox import output_due
from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc


@pytest.fixture(scope="module")
def worker(demo_dir) -> Iterator[ServerThread]:
    config = dataclasses.replace(demo_config(demo_dir), protocols=("mlx", "vllm"))
    with ServerThread(config) as running:
        yield running


class Spy:
    """Records the calls made to one of the engine handle's methods, then makes them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, target: Any, name: str) -> None:
        self.calls: list[tuple[Any, ...]] = []
        real = getattr(target, name)

        def spy(*args: Any) -> Any:
            self.calls.append(args)
            return real(*args)

        monkeypatch.setattr(target, name, spy)


# ----- n > 1 -----


def _request(ticket: int = 1, samples: tuple[int, ...] = (), seed: int | None = 7):
    return GenerationRequest(
        ticket, "r", [1, 2, 3], 8, SamplingSpec(seed=seed), sample_tickets=samples
    )


def _take(inbox: Inbox):
    return inbox.take(idle=False, quiet_s=0, max_s=0, burst_size=1)


def test_the_inbox_holds_the_other_samples_until_the_engine_releases_them():
    inbox = Inbox()
    inbox.put(_request(1, (5, 6)))
    (first,) = _take(inbox).requests
    assert (first.ticket, first.n, first.sampling.seed) == (1, 1, 7)
    assert inbox.held_samples() == [3, 3]
    assert _take(inbox).requests == []  # nothing more until sample 0's prompt is through
    inbox.release(1)
    others = _take(inbox).requests
    assert [(r.ticket, r.sampling.seed, r.sample_tickets) for r in others] == [
        (5, 8, ()),
        (6, 9, ()),
    ]
    assert inbox.held_samples() == []


def test_aborting_sample_0_ends_its_held_samples_with_it():
    inbox = Inbox()
    inbox.put(_request(1, (5, 6)))
    _take(inbox)
    inbox.abort([1])  # the engine then enqueues and withdraws them: each ends with `abort`
    taken = _take(inbox)
    assert [r.ticket for r in taken.requests] == [5, 6] and taken.aborts == {1, 5, 6}
    assert inbox.held_samples() == []
    inbox.put(_request(2, (7, 8)))
    _take(inbox)
    inbox.abort([8])  # one held sample alone
    taken = _take(inbox)
    assert [r.ticket for r in taken.requests] == [8] and taken.aborts == {8}
    assert [r.ticket for r in inbox.drop_samples(2)] == [7]  # still held, under sample 0


def test_an_n_3_request_is_one_submit_and_the_engine_fans_it_out(worker, monkeypatch, prompts):
    engine = worker.server.servicer._engine
    submits = Spy(monkeypatch, engine, "submit")
    aborts = Spy(monkeypatch, engine, "abort")
    prompt = (prompts[1] * 200)[:600]
    params = {"temperature": 1.0, "seed": 3, "n": 3, "max_tokens": 6, "ignore_eos": True}
    message = vpb.GenerateRequest(
        request_id="n3",
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(**params),
        stream=True,
    )
    with worker.channel() as channel:
        responses = list(vgrpc.VllmEngineStub(channel).Generate(message, timeout=120))
    completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
    assert sorted(completes) == [0, 1, 2]
    assert {c.finish_reason for c in completes.values()} == {"length"}
    assert all(completes[i].cached_tokens >= 512 for i in (1, 2))  # sample 0's prefix
    ((submitted,),) = submits.calls
    assert submitted.n == 3 and len(submitted.sample_tickets) == 2
    assert aborts.calls == []


# ----- stop strings -----


def test_a_stop_string_ends_the_engine_row_with_no_abort(worker, monkeypatch, reference, prompts):
    tokens = reference.greedy(prompts[6], 30)
    full = reference.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = full[len(full) // 3 : len(full) // 3 + 3]
    if not stop.strip() or full.count(stop) != 1:
        pytest.skip("no stop string that occurs once in this continuation")
    aborts = Spy(monkeypatch, worker.server.servicer._engine, "abort")
    ended: list[RowEvent] = []
    servicer = worker.server.servicer
    dispatch = servicer.dispatch

    def watch(out: StepOutput) -> None:
        ended.extend(e for e in out.events if e.finish_reason is not None)
        dispatch(out)

    monkeypatch.setattr(servicer, "dispatch", watch)
    with worker.channel() as channel:
        outcome = generate(
            channel, prompts[6], temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]
        )
    assert outcome.complete.finish_reason == "stop" and outcome.complete.matched_stop == stop
    assert "".join(c.text for c in outcome.chunks) == full[: full.find(stop)]
    # The engine itself ended the row at the token that completed the stop string.
    (event,) = ended
    assert event.finish_reason == "stop" and event.token == outcome.tokens[-1]
    assert event.matched_stop_token_id is None
    assert aborts.calls == []
    assert wait_until(lambda: servicer.figures().load.running == 0, timeout=10)


# ----- GetLoads -----


def test_get_loads_answers_from_the_engines_published_figures():
    load = LoadCounts(
        running=3, waiting=2, waiting_tokens=40, used_tokens=500, generated=9, prompt_tokens=100
    )
    prefix = PrefixCacheStats(ram_tokens=20, disk_tokens=5)
    figures = load_figures(EngineFigures(prefix, load=load), None, Throughput(), 8)
    assert (figures.running, figures.waiting) == (3, 2)
    assert (figures.waiting_tokens, figures.used_tokens) == (40, 500)
    assert figures.cache_hit_rate == 0.25 and figures.utilization == 3 / 8


def test_the_engine_publishes_its_load(worker, prompts):
    with worker.channel() as channel:
        generate(channel, prompts[0], temperature=0, max_tokens=5, ignore_eos=True)
    load = worker.server.servicer.figures().load
    assert load.generated >= 5 and load.prompt_tokens >= len(prompts[0])
    assert (load.running, load.waiting, load.used_tokens) == (0, 0, 0)


# ----- the output rule -----


@pytest.mark.parametrize(
    ("out", "rows_due", "running", "due"),
    [
        (StepOutput(events=[RowEvent(1, 5)]), False, True, False),  # held for a batch
        (StepOutput(events=[RowEvent(1, 5)]), True, True, True),  # a row's tokens are due
        (StepOutput(events=[RowEvent(1, 5, "length")]), False, True, True),  # a finish
        (StepOutput(failures=[RowFailure(1, FailureKind.INTERNAL, "x")]), False, True, True),
        (StepOutput(flushed=[3]), False, True, True),  # answers a flush
        (StepOutput(figures=EngineFigures()), False, False, True),  # nothing runs
        (StepOutput(figures=EngineFigures()), False, True, False),
    ],
)
def test_one_rule_says_when_a_steps_output_goes(out, rows_due, running, due):
    assert output_due(out, rows_due, running) is due
