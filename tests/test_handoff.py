"""The hand-off rule, the outbox between the engine thread and the loop, each call's
RequestStream, and the engine's inbox: pure pieces, tested without a server or MLX."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import grpc
import pytest

from servicer.engine.inbox import Inbox
from servicer.messages import (
    EmbedResult,
    EngineFigures,
    FailureKind,
    GenerationRequest,
    KvBlockEvent,
    RowEvent,
    RowFailure,
    StepOutput,
)
from servicer.outbox import Outbox, handoff_due
from servicer.streams import RequestStream, Streams
from servicer.validation import RequestError


def _request(ticket: int = 1, per_handoff: int = 1, request_id: str = "r") -> GenerationRequest:
    return GenerationRequest(ticket, request_id, [1, 2, 3], 8, tokens_per_handoff=per_handoff)


@pytest.mark.parametrize(
    ("started", "pending", "per_handoff", "finished", "due"),
    [
        (False, 0, 4, False, False),  # nothing to hand over
        (False, 1, 4, False, True),  # the first token goes alone
        (True, 1, 4, False, False),
        (True, 3, 4, False, False),
        (True, 4, 4, False, True),  # a full batch
        (True, 2, 4, True, True),  # the finish, whatever the count
        (True, 1, 1, False, True),  # every token when per_handoff is 1
        (True, 5, sys.maxsize, False, False),  # a unary call waits for its finish
    ],
)
def test_handoff_rule(started, pending, per_handoff, finished, due):
    assert (
        handoff_due(started=started, pending=pending, per_handoff=per_handoff, finished=finished)
        is due
    )


ONE_OF_EACH = {
    "events": [RowEvent(1, 10)],
    "failures": [RowFailure(1, FailureKind.INTERNAL, "broken")],
    "fatal": "gone",
    "step_seconds": [0.1],
    "prefill_tokens": [3],
    "over_budget": 1,
    "widened_steps": 1,
    "fused_steps": 1,
    "images_encoded": 1,
    "disk_load_seconds": [0.2],
    "figures": EngineFigures(prefill_budget_s=0.05),
    "embeddings": [EmbedResult(1)],
    "kv_events": [KvBlockEvent("cleared")],
    "flushed": [4],
}


@pytest.mark.parametrize("name", sorted(ONE_OF_EACH))
def test_a_step_output_with_any_field_set_is_handed_over_and_merged(name):
    """`bool` (anything to hand over) and `merge` (fold a later output in) agree on every
    field: an output holding only this one is not dropped, and merging keeps it."""
    assert set(ONE_OF_EACH) == set(StepOutput.__struct_fields__)  # a new field is listed here
    later = StepOutput(**{name: ONE_OF_EACH[name]})
    assert later and not StepOutput()
    out = StepOutput()
    out.merge(later)
    assert out and getattr(out, name) == ONE_OF_EACH[name]


def test_outbox_merges_until_taken_and_wakes_once_per_take():
    wakes = []
    outbox = Outbox(lambda: wakes.append(1))
    outbox.put(StepOutput(events=[RowEvent(1, 10)]), due=False)
    assert wakes == []  # nobody needs it yet
    outbox.put(StepOutput(events=[RowEvent(1, 11)]), due=True)
    outbox.put(StepOutput(events=[RowEvent(2, 20)], step_seconds=[0.1]), due=True)
    assert wakes == [1]  # one wake while the loop has yet to take
    out = outbox.take()
    assert out is not None
    assert [e.token for e in out.events] == [10, 11, 20]
    assert out.step_seconds == [0.1]
    assert outbox.take() is None
    outbox.put(StepOutput(fatal="gone"), due=True)
    assert wakes == [1, 1]


def test_outbox_delivered_waits_until_the_reader_took_everything():
    outbox = Outbox(lambda: None)
    assert outbox.delivered(0.0)
    outbox.put(StepOutput(fatal="gone"), due=True)
    assert not outbox.delivered(0.0)
    taker = threading.Thread(target=outbox.take)
    taker.start()
    assert outbox.delivered(30.0)
    taker.join()


def test_streams_count_requests_waiting_and_decoding():
    async def scenario() -> None:
        streams = Streams()
        streams.open(_request(1, request_id="a"))
        streams.open(_request(2, request_id="b"))
        assert (streams.load().waiting, streams.load().running) == (2, 0)
        streams.route(StepOutput(events=[RowEvent(1, 9)]))
        assert (streams.load().waiting, streams.load().running) == (1, 1)
        streams.close(1, "a")
        streams.route(StepOutput(events=[RowEvent(2, None, "abort")]))
        assert (streams.load().waiting, streams.load().running) == (1, 0)

    asyncio.run(scenario())


def test_a_stream_wakes_for_the_first_token_then_per_batch_then_the_finish():
    async def scenario() -> list[list[int | None]]:
        stream = RequestStream(_request(per_handoff=3))
        batches = []

        async def consume() -> None:
            while True:
                events = await stream.take()
                batches.append([e.token for e in events])
                stream.record_tokens(time.perf_counter())
                if events[-1].finish_reason is not None:
                    return

        consumer = asyncio.ensure_future(consume())
        for token in range(7):
            stream.push(RowEvent(1, token))
            await asyncio.sleep(0)
        stream.push(RowEvent(1, 7, "length"))
        await asyncio.wait_for(consumer, 5)
        return batches

    assert asyncio.run(scenario()) == [[0], [1, 2, 3], [4, 5, 6], [7]]


def test_a_failed_stream_hands_over_what_is_left_then_raises():
    async def scenario() -> None:
        stream = RequestStream(_request(per_handoff=10))
        stream.record_tokens(1.0)  # past its first token: 2 events are not due yet
        stream.push(RowEvent(1, 5))
        stream.push(RowEvent(1, 6))
        stream.fail(RequestError(grpc.StatusCode.INTERNAL, "step failed"))
        assert [e.token for e in await stream.take()] == [5, 6]
        with pytest.raises(RequestError, match="step failed"):
            await stream.take()

    asyncio.run(scenario())


def test_streams_route_events_failures_and_a_fatal_error():
    async def scenario() -> None:
        streams = Streams()
        first, second = (
            streams.open(_request(1, request_id="a")),
            streams.open(_request(2, request_id="b")),
        )
        assert "a" in streams and streams.tickets(["b", "nobody"]) == [2]
        streams.route(StepOutput(events=[RowEvent(1, 9), RowEvent(3, 9)]))  # 3: gone already
        assert [e.token for e in first.events] == [9] and not second.events
        streams.route(StepOutput(fatal="engine died"))
        assert first.failure is not None and second.failure is not None
        assert first.failure.code == grpc.StatusCode.UNAVAILABLE
        assert not await streams.wait_idle(0.01)
        streams.close(1, "a")
        streams.close(2, "b")
        assert await streams.wait_idle(0.01) and len(streams) == 0

    asyncio.run(scenario())


def test_the_inbox_hands_over_everything_at_once():
    inbox = Inbox()
    inbox.put(_request(1))
    inbox.abort([7, 8])
    taken = inbox.take(idle=False, quiet_s=0, max_s=0, burst_size=8)
    assert [r.ticket for r in taken.requests] == [1] and taken.aborts == {7, 8}
    assert not taken.stopping
    again = inbox.take(idle=False, quiet_s=0, max_s=0, burst_size=8)
    assert again.requests == [] and again.aborts == set()


def test_an_idle_inbox_waits_for_work_and_lets_a_burst_finish_arriving():
    inbox = Inbox()

    def arrive() -> None:
        for ticket in range(1, 4):
            inbox.put(_request(ticket))

    threading.Thread(target=arrive).start()
    # The quiet window is far longer than the arrivals can take: the burst's size ends it.
    taken = inbox.take(idle=True, quiet_s=30.0, max_s=60.0, burst_size=3)
    assert [r.ticket for r in taken.requests] == [1, 2, 3]  # not just the first
    assert (
        inbox.take(idle=True, quiet_s=0.01, max_s=0.01, burst_size=3, timeout_s=0.05).requests == []
    )
    inbox.stop()
    assert inbox.take(idle=True, quiet_s=0.01, max_s=0.01, burst_size=3).stopping
