"""Engine calls that are not generations (Embed, FlushCache): each waits on a future that the
engine's hand-off settles by ticket, with its result, its failure, or the engine's death."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from .messages import StepOutput
from .streams import FAILURE_STATUS
from .validation import RequestError


class EngineCalls:
    """The calls in flight, by ticket (event loop only)."""

    def __init__(self) -> None:
        self._pending: dict[int, asyncio.Future[Any]] = {}

    async def call(self, ticket: int, send: Callable[[], None]) -> Any:
        """Send with `send`, then wait for the engine's answer to `ticket`."""
        future = asyncio.get_running_loop().create_future()
        self._pending[ticket] = future
        try:
            send()
            return await future
        finally:
            self._pending.pop(ticket, None)

    def settle(self, out: StepOutput) -> None:
        """One engine hand-off: embeddings, flushes done, refusals, or its death."""
        for result in out.embeddings:
            self._resolve(result.ticket, result)
        for ticket in out.flushed:
            self._resolve(ticket, True)
        for failure in out.failures:  # a flush the engine refused (distributed)
            code = FAILURE_STATUS[failure.kind]
            self._resolve(failure.ticket, error=RequestError(code, failure.message))
        if out.fatal is not None:
            error = RequestError(grpc.StatusCode.UNAVAILABLE, out.fatal)
            for ticket in list(self._pending):
                self._resolve(ticket, error=error)

    def _resolve(self, ticket: int, result: Any = None, error: Exception | None = None) -> None:
        future = self._pending.pop(ticket, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
