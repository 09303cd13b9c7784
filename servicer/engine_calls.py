"""Engine calls that are not generations (Embed, FlushCache): each waits on a future that the
engine's hand-off settles by ticket, with its result, its failure, or the engine's death."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from .engine_handle import EngineHandle
from .lifecycle import Lifecycle
from .messages import EmbedRequest, StepOutput
from .metrics import WorkerMetrics
from .streams import FAILURE_STATUS
from .validation import Limits, RequestError, embed_prompt, not_serving


class EngineCalls:
    """Embed and FlushCache for one engine, and the calls in flight by ticket (event loop
    only). `tickets`: the engine's names for requests, shared with the Generate calls;
    `pooling`: Embed's, "last" token's hidden state or their "mean"; `keeps_prefixes`: the
    engine has a prefix store to flush."""

    def __init__(
        self,
        engine: EngineHandle,
        lifecycle: Lifecycle,
        metrics: WorkerMetrics,
        tickets: Iterator[int],
        pooling: str = "last",
        keeps_prefixes: bool = False,
    ) -> None:
        self._engine, self._tickets = engine, tickets
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._pending: dict[int, asyncio.Future[Any]] = {}  # the calls in flight, by ticket
        # Embed: what a call is checked against (once the engine is warm), and how it pools.
        self._limits: Limits | None = None
        self._embedding_size = 0
        self._pooling = pooling
        self._keeps_prefixes = keeps_prefixes  # FlushCache has something to flush

    def attach(self, limits: Limits, embedding_size: int) -> None:
        """The engine is warm: the model's limits, and its pooled hidden states' size (0: it
        cannot embed)."""
        self._limits = limits
        self._embedding_size = embedding_size

    async def embed(self, request_id: str, ids: list[int]) -> tuple[list[float], int]:
        """The prompt's pooled, L2-normalised hidden state, and its length."""
        if self._limits is None or not self._lifecycle.serving:
            raise not_serving(self._lifecycle)
        if not self._embedding_size:
            raise RequestError(
                grpc.StatusCode.UNIMPLEMENTED, "this model cannot embed (no hidden states)"
            )
        prompt = embed_prompt(request_id, ids, self._limits)
        ticket = next(self._tickets)
        request = EmbedRequest(ticket, prompt, self._pooling)
        self._metrics.prompt_tokens.inc(len(prompt))
        result = await self._call(ticket, lambda: self._engine.embed(request))
        if result.error is not None:
            raise RequestError(grpc.StatusCode.INTERNAL, result.error)
        return result.embedding, len(prompt)

    async def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix store (RAM and disk); requests in flight go on. Whether it was
        done, and what happened, in words."""
        if not self._keeps_prefixes:
            return True, "this worker keeps no prefix cache"
        if not self._lifecycle.serving:
            return False, self._lifecycle.refusal
        ticket = next(self._tickets)
        try:
            await self._call(ticket, lambda: self._engine.flush_cache(ticket))
        except RequestError as error:
            return False, error.message
        return True, "prefix cache flushed"

    async def _call(self, ticket: int, send: Callable[[], None]) -> Any:
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
