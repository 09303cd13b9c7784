"""The Generate calls in flight: each one's events from the engine and a way to await them.

Runs on the event loop only. The engine's hand-offs land in `Streams.route`, which routes
each row's events to its request's `RequestStream`; a stream wakes its handler when the
hand-off rule says the events are due.
"""

from __future__ import annotations

import asyncio
import time
from types import MappingProxyType

import grpc

from .messages import EngineLoad, FailureKind, GenerationRequest, RowEvent, StepOutput
from .outbox import handoff_due
from .validation import RequestError

FAILURE_STATUS = MappingProxyType(
    {
        FailureKind.INTERNAL: grpc.StatusCode.INTERNAL,
        FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
        FailureKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    }
)


class RequestStream:
    """One in-flight Generate call: the events the engine sent it, and a way to wait."""

    __slots__ = (
        "_per_handoff",
        "_waiter",
        "accepted_at",
        "adapter",
        "decoding",
        "events",
        "failure",
        "finish_reason",
        "last_token_at",
        "ticket",
    )

    def __init__(self, request: GenerationRequest) -> None:
        self.events: list[RowEvent] = []
        self.failure: RequestError | None = None
        self.finish_reason: str | None = None  # set once the terminal message is built
        self.accepted_at = time.perf_counter()
        self.adapter = request.adapter  # the served adapter it is for ("": the base model)
        self.last_token_at: float | None = None  # when its client last got tokens
        self.decoding = False  # a token has arrived
        self._waiter: asyncio.Future[None] | None = None
        self._per_handoff = request.tokens_per_handoff
        self.ticket = request.ticket

    def record_tokens(self, now: float) -> tuple[bool, float]:
        """Its client got tokens at `now`: whether they were its first, and the seconds since
        the ones before (the first: since the call was accepted)."""
        first = self.last_token_at is None
        elapsed = now - (self.accepted_at if self.last_token_at is None else self.last_token_at)
        self.last_token_at = now
        return first, elapsed

    def set_finish_reason(self, reason: str | None) -> None:
        """Its terminal message is built, for `reason` (None: not yet)."""
        self.finish_reason = reason

    def mark_decoding(self) -> None:
        """A token has arrived for it."""
        self.decoding = True

    def push(self, event: RowEvent) -> None:
        self.events.append(event)
        if self._due():
            self._wake()

    def fail(self, error: RequestError) -> None:
        if self.failure is None:
            self.failure = error
            self._wake()

    def _due(self) -> bool:
        events = self.events
        return handoff_due(
            started=self.last_token_at is not None,
            pending=len(events),
            per_handoff=self._per_handoff,
            finished=bool(events) and events[-1].finish_reason is not None,
        )

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[RowEvent]:
        """The events gathered since the last call, once they are due; after a failure, what
        is left, then the failure."""
        while not (self._due() or (self.events and self.failure is not None)):
            if self.failure is not None:
                raise self.failure
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self.events = self.events, []
        return events


class Streams:
    """The streams in flight, by engine ticket and by the client's request id."""

    def __init__(self) -> None:
        self._by_ticket: dict[int, RequestStream] = {}
        self._by_request_id: dict[str, list[RequestStream]] = {}  # n > 1: several
        self._decoding = 0  # streams a token has arrived for
        self.generated_total = 0  # tokens routed to any stream so far
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._by_ticket)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request_id

    def load(self, adapter: str | None = None) -> EngineLoad:
        """Requests waiting for their first token, and requests decoding (of one served
        adapter's, with `adapter`)."""
        if adapter is None:
            return EngineLoad(len(self._by_ticket) - self._decoding, self._decoding)
        streams = [s for s in self._by_ticket.values() if s.adapter == adapter]
        decoding = sum(s.decoding for s in streams)
        return EngineLoad(len(streams) - decoding, decoding)

    def tickets(self, request_ids: list[str] | None = None) -> list[int]:
        """The engine tickets of these request ids (those in flight), or of every stream."""
        if request_ids is None:
            return list(self._by_ticket)
        by_id = self._by_request_id
        return [s.ticket for request_id in request_ids for s in by_id.get(request_id, ())]

    def open(self, request: GenerationRequest) -> RequestStream:
        stream = RequestStream(request)
        self._by_ticket[request.ticket] = stream
        self._by_request_id.setdefault(request.request_id, []).append(stream)
        self._idle.clear()
        return stream

    def close(self, ticket: int, request_id: str) -> None:
        stream = self._by_ticket.pop(ticket, None)
        if stream is not None and stream.decoding:
            self._decoding -= 1
        siblings = self._by_request_id.get(request_id, [])
        if stream in siblings:
            siblings.remove(stream)
            if not siblings:
                del self._by_request_id[request_id]
        if not self._by_ticket:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no stream is in flight, False if `timeout` passes first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def route(self, out: StepOutput) -> None:
        """One hand-off from the engine: each event and failure to its stream; a fatal error
        to every stream."""
        streams = self._by_ticket
        for event in out.events:
            stream = streams.get(event.ticket)
            if stream is not None:
                if event.token is not None:
                    self.generated_total += 1
                    if not stream.decoding:
                        stream.mark_decoding()
                        self._decoding += 1
                stream.push(event)
        for failure in out.failures:
            stream = streams.get(failure.ticket)
            if stream is not None:
                stream.fail(RequestError(FAILURE_STATUS[failure.kind], failure.message))
        if out.fatal is not None:
            error = RequestError(grpc.StatusCode.UNAVAILABLE, out.fatal)
            for stream in streams.values():
                stream.fail(error)
