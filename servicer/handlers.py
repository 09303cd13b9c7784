"""The MlxEngine gRPC handlers: validate, hand requests to the engine, stream events back.

Runs on the asyncio loop only. The engine's one hand-off per step lands in `dispatch`,
which routes each row's events to that request's `RequestStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from .codec import TextCodec
from .lifecycle import Lifecycle, Phase
from .messages import (
    FINISH_ABORT,
    FINISH_STOP,
    Admission,
    EngineLoad,
    FailureKind,
    GenerationRequest,
    ModelInfo,
    RowEvent,
    StepOutput,
)
from .metrics import WorkerMetrics
from .model_files import ModelFiles
from .proto import common_pb2, mlx_engine_pb2, mlx_engine_pb2_grpc
from .text import TextTracker
from .tokenizer_bundle import TokenizerArchive, build_archive
from .validation import GrammarCheck, Limits, RequestError, build_request

log = logging.getLogger(__name__)

SERVER_TYPE = "mlx-grpc-worker"
# A metadata call that waits for the model's files answers this long before its deadline, and
# waits at most METADATA_WAIT_S without one (the smg router sends none and gives up after 10 s).
METADATA_DEADLINE_MARGIN_S = 0.25
METADATA_WAIT_S = 8.0
STARTING_HEALTH_WAIT_S = 3.0  # within the smg router's 5 s health-check timeout
_FAILURE_STATUS = {
    FailureKind.INTERNAL: grpc.StatusCode.INTERNAL,
    FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    FailureKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
}
_FAILURE_METRIC = {
    FailureKind.INTERNAL: "engine_step",
    FailureKind.UNAVAILABLE: "engine_step",
    FailureKind.INVALID_ARGUMENT: "grammar",
}


def _refusal_status(phase: Phase) -> grpc.StatusCode:
    """While the worker starts, RESOURCE_EXHAUSTED: the smg router retries it (on another
    worker when it has one) without counting it against the worker's circuit breaker, which
    UNAVAILABLE would open for a minute after ten refusals. Shutting down or failed:
    UNAVAILABLE, so the router takes the worker out."""
    if phase in (Phase.STARTING, Phase.LOADING):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.UNAVAILABLE


class Codec(Protocol):
    """The model's tokenizer, as the handlers use it."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class EngineHandle(Protocol):
    """What the handlers need from the engine (it lives on its own thread)."""

    def submit(self, request: GenerationRequest) -> None: ...
    def abort(self, tickets: list[int]) -> None: ...
    def load(self) -> EngineLoad: ...
    @property
    def alive(self) -> bool: ...


class RequestStream:
    """One in-flight Generate call: the events the engine sent it, and a way to wait."""

    __slots__ = (
        "_waiter",
        "accepted_at",
        "events",
        "failure",
        "finish_reason",
        "last_token_at",
        "request",
        "text",
    )

    def __init__(self, request: GenerationRequest, text: TextTracker | None = None) -> None:
        self.request = request
        self.text = text  # decoded text and stop strings, when the request wants them
        self.events: list[RowEvent] = []
        self.failure: RequestError | None = None
        self.finish_reason: str | None = None  # set once the terminal message is built
        self.accepted_at = time.perf_counter()
        self.last_token_at: float | None = None
        self._waiter: asyncio.Future[None] | None = None

    def push(self, event: RowEvent) -> None:
        self.events.append(event)
        if self._due():
            self._wake()

    def fail(self, error: RequestError) -> None:
        if self.failure is None:
            self.failure = error
            self._wake()

    def _due(self) -> bool:
        """Enough events for the handler: the first token (alone, so time to first token
        does not wait for a batch), `tokens_per_handoff` of them, or the finish."""
        events = self.events
        return bool(events) and (
            self.last_token_at is None
            or len(events) >= self.request.tokens_per_handoff
            or events[-1].finish_reason is not None
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


@dataclass
class _Progress:
    """One batch of a request's events, as the client will see it."""

    events: list[RowEvent]  # those carrying a token, cut at a stop string
    finish_reason: str | None
    matched_stop_token_id: int | None
    cached_tokens: int
    text: str = ""
    matched_stop: str | None = None


def _logprobs_proto(events: list[RowEvent]) -> mlx_engine_pb2.OutputLogProbs:
    out = mlx_engine_pb2.OutputLogProbs()
    for event in events:
        if event.logprob is None or event.token is None:
            continue
        out.token_ids.append(event.token)
        out.token_logprobs.append(event.logprob.logprob)
        out.top_logprobs.add(values=event.logprob.top_logprobs, token_ids=event.logprob.top_ids)
    return out


@dataclass(frozen=True)
class HandlerOptions:
    max_prompt_tokens: int | None = None  # None: the context length - 1
    max_queued_requests: int = 256  # accepted but not yet decoding
    # Tokens per streamed chunk after the first (the last chunk may hold fewer). Each message
    # costs the loop a wake and a gRPC write, so more per chunk leaves more CPU to the engine.
    stream_interval: int = 1


class MlxEngineServicer(mlx_engine_pb2_grpc.MlxEngineServicer):
    """Handlers for one engine. The metadata RPCs answer once `set_model` has the model's
    files; Generate is accepted while the lifecycle says serving (after `attach`)."""

    def __init__(
        self,
        engine: EngineHandle,
        lifecycle: Lifecycle,
        on_fatal: Callable[[str], None],
        options: HandlerOptions | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._engine = engine
        self._lifecycle = lifecycle
        self._on_fatal = on_fatal
        self._options = options or HandlerOptions()
        self._metrics = metrics or WorkerMetrics(engine.load)
        self._info: ModelInfo | None = None
        self._codec: Codec | None = None
        self._admission: Admission | None = None
        self._limits: Limits | None = None
        self._tickets = itertools.count(1)
        self._streams: dict[int, RequestStream] = {}
        self._by_request_id: dict[str, RequestStream] = {}
        self._archive: asyncio.Task[TokenizerArchive] | None = None
        self._started = time.monotonic()

    # ----- lifecycle, driven by the server -----

    def set_model(self, files: ModelFiles) -> None:
        """The model's files are read: its metadata can be answered from now on."""
        self._info = files.info
        self._codec = TextCodec(files.tokenizer)
        self._limits = Limits.for_model(files.info, self._options.max_prompt_tokens)

    def attach(
        self,
        admission: Admission,
        has_thinking: bool = False,
        check_grammar: GrammarCheck | None = None,
    ) -> None:
        """The engine is warm: requests can be checked against what it supports."""
        assert self._info is not None
        self._admission = admission
        self._limits = Limits.for_model(
            self._info, self._options.max_prompt_tokens, has_thinking, check_grammar
        )

    @property
    def active_requests(self) -> int:
        return len(self._streams)

    def abort_all(self) -> None:
        self._engine.abort(list(self._streams))

    def dispatch(self, out: StepOutput) -> None:
        """Route one engine step's output (called on the loop thread)."""
        streams = self._streams
        for event in out.events:
            stream = streams.get(event.ticket)
            if stream is not None:
                stream.push(event)
        for seconds in out.step_seconds:
            self._metrics.step_time.observe(seconds)
        for kind in {failure.kind for failure in out.failures}:  # once per step and kind
            self._metrics.errors.labels(_FAILURE_METRIC[kind]).inc()
        for failure in out.failures:
            stream = streams.get(failure.ticket)
            if stream is not None:
                stream.fail(RequestError(_FAILURE_STATUS[failure.kind], failure.message))
        if out.fatal is not None:
            self._metrics.errors.labels("engine_death").inc()
            self._on_fatal(out.fatal)
            error = RequestError(grpc.StatusCode.UNAVAILABLE, out.fatal)
            for stream in streams.values():
                stream.fail(error)

    # ----- RPCs -----

    async def Generate(
        self, request: mlx_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mlx_engine_pb2.GenerateResponse]:
        try:
            stream = self._accept(request, await self._encode_text(request))
        except RequestError as error:
            log.debug("refused request %r: %s", request.request_id, error.message)
            self._metrics.requests.labels(error.code.name.lower()).inc()
            await context.abort(error.code, error.message)
            return
        outcome = "cancelled"  # unless it finishes or fails below
        try:
            if request.stream:
                # The streaming loop lives here, not in a nested generator: one hop less for
                # every message, which is most of the handler's work.
                prompt_tokens = len(stream.request.prompt)
                completion_tokens = 0
                while True:
                    step = self._advance(stream, await stream.take())
                    if step.events or step.text:
                        completion_tokens += len(step.events)
                        yield self._chunk(stream, step, prompt_tokens, completion_tokens)
                    if step.finish_reason is not None:
                        yield self._complete(stream, step, [], completion_tokens)
                        break
            else:
                yield await self._unary_response(stream)
            outcome = stream.finish_reason or outcome
        except RequestError as error:
            outcome = error.code.name.lower()
            stream.finish_reason = outcome
            await context.abort(error.code, error.message)
        finally:
            self._metrics.requests.labels(outcome).inc()
            self._release(stream)

    async def _encode_text(self, request: mlx_engine_pb2.GenerateRequest) -> list[int] | None:
        """The worker's own tokenization of a `text` input (off the loop when it is long)."""
        if request.WhichOneof("input") != "text" or self._codec is None:
            return None
        if len(request.text) < 4096:
            return self._codec.encode(request.text)
        return await asyncio.to_thread(self._codec.encode, request.text)

    def _accept(
        self, request: mlx_engine_pb2.GenerateRequest, text_ids: list[int] | None
    ) -> RequestStream:
        if not self._lifecycle.serving or self._limits is None:
            raise RequestError(_refusal_status(self._lifecycle.phase), self._lifecycle.refusal)
        errors = self._metrics.errors
        try:
            job, text = build_request(request, next(self._tickets), self._limits, text_ids)
        except RequestError:
            errors.labels("invalid_request").inc()
            raise
        if job.request_id in self._by_request_id:
            errors.labels("duplicate_request").inc()
            message = f"request_id {job.request_id!r} is already in flight"
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, message)
        self._check_memory(job)
        waiting = self._engine.load().waiting
        if waiting >= self._options.max_queued_requests:
            errors.labels("queue_full").inc()
            message = (
                f"{waiting} requests are already waiting for the engine "
                f"(limit {self._options.max_queued_requests}); retry later"
            )
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self._metrics.prompt_tokens.inc(len(job.prompt))
        tracker = None
        if text is not None and self._codec is not None:
            tracker = TextTracker(self._codec.decode, text.stops)
        # A unary call needs its handler only for the first token (time-to-first-token
        # metric) and the finish, unless it watches for stop strings.
        unary = not request.stream and tracker is None
        job.tokens_per_handoff = sys.maxsize if unary else self._options.stream_interval
        stream = RequestStream(job, tracker)
        self._streams[job.ticket] = stream
        self._by_request_id[job.request_id] = stream
        self._engine.submit(job)
        return stream

    def _check_memory(self, job: GenerationRequest) -> None:
        """Refuse what could never fit; what fits only later waits in the engine."""
        if self._admission is None:
            return
        need, limit = self._admission.estimate(job), self._admission.limit_bytes
        if need > limit:
            self._metrics.errors.labels("kv_memory").inc()
            message = (
                f"this request needs about {need / 2**20:.1f} MiB of KV cache "
                f"({len(job.prompt)} prompt + {job.max_tokens} new tokens) but the worker "
                f"allows {limit / 2**20:.1f} MiB (--max-kv-memory); ask for fewer max_tokens"
            )
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def _release(self, stream: RequestStream) -> None:
        ticket = stream.request.ticket
        self._streams.pop(ticket, None)
        if self._by_request_id.get(stream.request.request_id) is stream:
            del self._by_request_id[stream.request.request_id]
        if stream.finish_reason is None:  # the client went away or the call was cancelled
            self._engine.abort([ticket])

    def _advance(self, stream: RequestStream, events: list[RowEvent]) -> _Progress:
        """What a batch of engine events means for the client, text and stop strings included."""
        last = events[-1]
        step = _Progress(
            [e for e in events if e.token is not None],
            last.finish_reason,
            last.matched_stop_token_id,
            last.cached_tokens,
        )
        tracker = stream.text
        if tracker is not None:
            taken = tracker.add([e.token for e in step.events])  # type: ignore[misc]
            if tracker.matched is not None and step.finish_reason != FINISH_ABORT:
                del step.events[taken:]
                step.finish_reason, step.matched_stop_token_id = FINISH_STOP, None
                step.matched_stop = tracker.matched
                self._engine.abort([stream.request.ticket])  # its row may still be running
            step.text = tracker.release(final=step.finish_reason is not None)
        if step.events:
            self._observe_tokens(stream, len(step.events))
        if step.finish_reason is not None:
            stream.finish_reason = step.finish_reason
        return step

    @staticmethod
    def _chunk(
        stream: RequestStream, step: _Progress, prompt_tokens: int, completion_tokens: int
    ) -> mlx_engine_pb2.GenerateResponse:
        response = mlx_engine_pb2.GenerateResponse()
        chunk = response.chunk  # filled in place: building it apart and copying costs twice
        chunk.token_ids.extend([e.token for e in step.events])  # type: ignore[misc]
        chunk.prompt_tokens = prompt_tokens
        chunk.completion_tokens = completion_tokens
        chunk.cached_tokens = step.cached_tokens
        if step.text:
            chunk.text = step.text
        if stream.request.top_logprobs is not None:
            chunk.output_logprobs.CopyFrom(_logprobs_proto(step.events))
        return response

    async def _unary_response(self, stream: RequestStream) -> mlx_engine_pb2.GenerateResponse:
        collected: list[RowEvent] = []
        while True:
            step = self._advance(stream, await stream.take())
            collected.extend(step.events)
            if step.finish_reason is not None:
                output_ids = [e.token for e in collected]
                response = self._complete(stream, step, output_ids, len(output_ids))  # type: ignore[arg-type]
                if stream.text is not None:
                    response.complete.output_text = stream.text.text
                if stream.request.top_logprobs is not None:
                    response.complete.output_logprobs.CopyFrom(_logprobs_proto(collected))
                return response

    def _observe_tokens(self, stream: RequestStream, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        metrics = self._metrics
        if stream.last_token_at is None:
            metrics.ttft.observe(now - stream.accepted_at)
        else:
            metrics.inter_token.observe((now - stream.last_token_at) / count)
        stream.last_token_at = now
        metrics.generated_tokens.inc(count)

    @staticmethod
    def _complete(
        stream: RequestStream, step: _Progress, output_ids: list[int], completion_tokens: int
    ) -> mlx_engine_pb2.GenerateResponse:
        complete = mlx_engine_pb2.GenerateComplete(
            output_ids=output_ids,
            finish_reason=step.finish_reason,
            prompt_tokens=len(stream.request.prompt),
            completion_tokens=completion_tokens,
            cached_tokens=step.cached_tokens,
        )
        if step.matched_stop_token_id is not None:
            complete.matched_stop_token_id = step.matched_stop_token_id
        if step.matched_stop is not None:
            complete.matched_stop = step.matched_stop
        return mlx_engine_pb2.GenerateResponse(complete=complete)

    async def Abort(
        self, request: mlx_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.AbortResponse:
        if self._lifecycle.phase not in (Phase.SERVING, Phase.DRAINING):
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._lifecycle.refusal)
        tickets = [
            stream.request.ticket
            for request_id in request.request_ids
            if (stream := self._by_request_id.get(request_id)) is not None
        ]
        if tickets:
            self._engine.abort(tickets)
        return mlx_engine_pb2.AbortResponse()

    async def HealthCheck(
        self, request: mlx_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.HealthCheckResponse:
        if self._lifecycle.phase is Phase.STARTING:
            # A router registers a worker from its first GetModelInfo once this call succeeds:
            # give the files a moment, then fail the call so it cannot register the worker
            # before the model has a name (the smg router tries again 30 s later).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lifecycle.model_known(), STARTING_HEALTH_WAIT_S)
            if self._lifecycle.phase is Phase.STARTING:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self._lifecycle.refusal)
        if not self._lifecycle.serving:
            message = self._lifecycle.refusal
        elif not self._engine.alive:
            message = "the engine thread is not running"
        else:
            return mlx_engine_pb2.HealthCheckResponse(healthy=True, message="serving")
        return mlx_engine_pb2.HealthCheckResponse(healthy=False, message=message)

    async def GetModelInfo(
        self, request: mlx_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetModelInfoResponse:
        info = await self._model_info(context)
        limits = self._limits
        assert limits is not None
        return mlx_engine_pb2.GetModelInfoResponse(
            model_path=info.model_path,
            is_generation=True,
            max_context_length=info.context_length,
            vocab_size=info.vocab_size,
            served_model_name=info.served_model_name,
            model_type=info.model_type,
            architectures=info.architectures,
            eos_token_ids=info.eos_token_ids,
            pad_token_id=info.pad_token_id or 0,
            bos_token_id=info.bos_token_id or 0,
            max_req_input_len=limits.prompt_limit,
        )

    async def GetServerInfo(
        self, request: mlx_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetServerInfoResponse:
        return mlx_engine_pb2.GetServerInfoResponse(
            server_type=SERVER_TYPE,
            active_requests=self.active_requests,
            uptime_seconds=time.monotonic() - self._started,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        info = await self._model_info(context)
        try:
            archive = await asyncio.shield(self._tokenizer_archive(info))
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot read tokenizer files: {exc}")
            return
        pieces = list(archive.chunks())
        for i, data in enumerate(pieces):
            last = i == len(pieces) - 1
            yield common_pb2.GetTokenizerChunk(data=data, sha256=archive.sha256 if last else "")

    async def _model_info(self, context: grpc.aio.ServicerContext) -> ModelInfo:
        """The model's metadata: while the files are still being resolved, the call waits
        (within its deadline) rather than let a router register a model of unknown identity."""
        remaining = context.time_remaining()
        wait = METADATA_WAIT_S if remaining is None else remaining - METADATA_DEADLINE_MARGIN_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._lifecycle.model_known(), max(0.0, wait))
        if self._info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._lifecycle.refusal)
        assert self._info is not None
        return self._info

    def _tokenizer_archive(self, info: ModelInfo) -> asyncio.Task[TokenizerArchive]:
        """Built once off the loop; concurrent callers share the same build."""
        if self._archive is None or (self._archive.done() and self._archive.exception()):
            self._archive = asyncio.ensure_future(
                asyncio.to_thread(build_archive, Path(info.model_dir))
            )
        return self._archive
