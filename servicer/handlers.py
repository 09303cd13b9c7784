"""The MlxEngine gRPC handlers: validate, hand requests to the engine, stream events back.

Runs on the asyncio loop only. The engine's hand-offs arrive through `dispatch`; each call's
`RequestStream` wakes its handler, whose `OutputProcessor` turns the events into messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import grpc
import msgspec

from .admission import Admission
from .codec import TextCodec
from .engine_calls import EngineCalls
from .engine_handle import EngineHandle
from .faces import MLX_FACE, VLLM_FACE, Face
from .images import ImagePreparer, has_media
from .kv_events import KvEventHub
from .lifecycle import Lifecycle, Phase
from .loads import LoadFigures, Throughput, load_figures
from .media import MediaPolicy
from .messages import (
    FINISH_STOP,
    EmbedRequest,
    EngineFigures,
    EngineLoad,
    GenerationRequest,
    ModelInfo,
    PrefixCacheStats,
    RowEvent,
    StepOutput,
)
from .metadata import METADATA_DEADLINE_MARGIN_S, MetadataRpcs
from .metrics import WorkerMetrics
from .model_files import ModelFiles
from .output import OutputProcessor
from .proto import mlx_engine_pb2, mlx_engine_pb2_grpc
from .ratelimit import RateLimitedLog
from .streams import RequestStream, Streams
from .text import IncrementalDecoder, TextTracker
from .tokenizer_bundle import ArchiveBuild
from .validation import (
    GrammarCheck,
    Limits,
    RequestError,
    TextOptions,
    build_request,
    embed_prompt,
    sample_count,
)

log = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # a stream waiting for the model gets an empty chunk this often
BOS_ADDED = (
    "a prompt came without the model's BOS (id %s), which its tokenizer puts first; the "
    "worker adds it (counted in mlx_worker_bos_added; --no-prepend-bos turns this off; "
    "said once)"
)


def _refusal_status(phase: Phase) -> grpc.StatusCode:
    """While the worker starts, RESOURCE_EXHAUSTED: the smg router retries it (on another
    worker when it has one) without counting it against the worker's circuit breaker, which
    UNAVAILABLE would open for a minute after ten refusals. Shutting down or failed:
    UNAVAILABLE, so the router takes the worker out."""
    if phase in (Phase.STARTING, Phase.LOADING):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.UNAVAILABLE


def memory_refusal(admission: Admission, job: GenerationRequest) -> str | None:
    """Why a request that could never fit is refused (what fits only later waits in the
    engine), or None."""
    need, limit = admission.estimate(job.cache_tokens), admission.limit_bytes
    if need <= limit:
        return None
    return (
        f"this request needs about {need / 2**20:.1f} MiB of KV cache "
        f"({len(job.prompt)} prompt + {job.max_tokens} new tokens) but the worker "
        f"allows {limit / 2**20:.1f} MiB (--max-kv-memory); ask for fewer max_tokens"
    )


def observe_tokens(metrics: WorkerMetrics, stream: RequestStream, count: int) -> None:
    """A stream's first token (its TTFT) or the gap since its last ones."""
    now = time.perf_counter()
    if stream.last_token_at is None:
        metrics.ttft.observe(now - stream.accepted_at)
    else:
        metrics.inter_token.observe((now - stream.last_token_at) / count)
    stream.last_token_at = now
    metrics.generated_tokens.inc(count)
    if stream.adapter:
        metrics.adapter_tokens.labels(stream.adapter).inc(count)


class Codec(Protocol):
    """The model's tokenizer, as the handlers use it."""

    def encode(self, text: str) -> list[int]: ...
    def decoder(self) -> IncrementalDecoder: ...


@dataclass(frozen=True)
class HandlerOptions:
    max_prompt_tokens: int | None = None  # None: the context length - 1
    max_queued_requests: int = 256  # accepted but not yet decoding
    # Tokens per streamed chunk after the first (the last chunk may hold fewer). Each message
    # costs the loop a wake and a gRPC write, so more per chunk leaves more CPU to the engine.
    stream_interval: int = 1
    # ...and a chunk waits this long for more tokens to join it (0: never): on a fast model
    # (a step of a few ms) messages then carry several tokens, at no cost to a slow one.
    stream_window_ms: float = 10.0
    # Put the model's BOS before prompts that lack it, when its tokenizer adds one to every
    # encoding (the smg router tokenizes raw-text completions without it).
    prepend_bos: bool = True
    # A Generate call that arrives while the model loads waits this long for it (within its
    # own deadline) instead of being refused.
    max_load_wait_s: float = 120.0
    embedding_pooling: str = "last"  # Embed: "last" token's hidden state or their "mean"
    media: MediaPolicy = field(default_factory=MediaPolicy)  # what images may be fetched


async def wait_for_model(
    lifecycle: Lifecycle,
    limits: Limits | None,
    metrics: WorkerMetrics,
    options: HandlerOptions,
    request: Any,
    context: grpc.aio.ServicerContext,
    face: Face = MLX_FACE,
) -> AsyncIterator[Any]:
    """A request that comes while the model loads waits for it, up to `max_load_wait_s` and
    within its deadline, so the first clients of a worker the router has just registered are
    served instead of refused. What can be checked already is checked first (a bad request is
    refused at once, before any message). A stream gets an empty chunk every KEEPALIVE_S
    meanwhile: the smg router takes a worker whose streams see nothing for 3 s for wedged,
    and clients see no tokens in it."""
    if limits is not None and request.WhichOneof("input") == "tokenized":
        try:
            build_request(request, 0, limits)
        except RequestError as error:
            metrics.errors.labels("invalid_request").inc()
            await context.abort(error.code, error.message)
    wait = options.max_load_wait_s
    remaining = context.time_remaining()
    if remaining is not None:
        wait = min(wait, remaining - METADATA_DEADLINE_MARGIN_S)
    deadline = time.monotonic() + wait
    metrics.load_waiting.inc()
    try:
        while lifecycle.starting and (left := deadline - time.monotonic()) > 0:
            await lifecycle.wait_started(min(left, KEEPALIVE_S))
            if lifecycle.starting and request.stream:
                yield face.pb.GenerateResponse(chunk=face.pb.GenerateStreamChunk())
    finally:
        metrics.load_waiting.dec()


def emit_row(
    self: MlxEngineServicer, stream: RequestStream, output: OutputProcessor, events: list[RowEvent]
) -> list[Any]:
    """One batch of a row's events: the messages its client gets now (the engine ended the
    row itself where a stop string completed)."""
    emission = output.process(events)
    if emission.tokens:
        observe_tokens(self._metrics, stream, emission.tokens)
    stream.finish_reason = emission.finish_reason
    return emission.responses


def generate_rpc(face: Face) -> Callable[..., AsyncIterator[Any]]:
    """The Generate handler of one face. gRPC wants an async generator function for a
    streaming method, and wrapping one shared body in another would cost every message a
    hop: so each face gets its own function with this body."""

    async def generate(
        self: MlxEngineServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        if self._lifecycle.starting:
            waiting = wait_for_model(
                self._lifecycle, self._limits, self._metrics, self._options, request, context, face
            )
            async for keepalive in waiting:
                yield keepalive
        try:
            job, text = await self._build(request)
            samples = sample_count(request.sampling_params)
            if samples > 1:  # one request to the engine, with a ticket for each other sample
                tickets = tuple(itertools.islice(self._tickets, samples - 1))
                job = msgspec.structs.replace(job, sample_tickets=tickets)
            streams = self._accept(job)
        except RequestError as error:
            log.debug("refused request %r: %s", request.request_id, error.message)
            self._metrics.requests.labels(error.code.name.lower()).inc()
            await context.abort(error.code, error.message)
            return
        if samples > 1:
            try:
                async for response in sample_rows(self, job, streams, text, request.stream, face):
                    yield response
            except RequestError as error:
                await context.abort(error.code, error.message)
            return
        stream = streams[0]
        output = OutputProcessor(job, request.stream, self._tracker(text), face)
        outcome = "cancelled"  # unless it finishes or fails below
        try:
            # The loop lives here, not in a nested generator: one hop less for every message.
            while stream.finish_reason is None:
                for response in emit_row(self, stream, output, await stream.take()):
                    yield response
            outcome = stream.finish_reason
        except RequestError as error:
            outcome = error.code.name.lower()
            stream.finish_reason = outcome
            await context.abort(error.code, error.message)
        finally:
            self._metrics.count_request(outcome, job.adapter)
            self._release(job, streams)

    return generate


async def sample_rows(
    self: MlxEngineServicer,
    job: GenerationRequest,
    streams: list[RequestStream],
    text: TextOptions | None,
    streaming: bool,
    face: Face,
) -> AsyncIterator[Any]:
    """n rows from one prompt, their messages merged as they come, each with its `index`.
    The engine got one request: it admits the other samples once the first's prompt is
    through, and ends or fails them together when the first ends before that."""
    merged: asyncio.Queue[Any] = asyncio.Queue()
    tasks = [
        asyncio.ensure_future(
            _sample_row(
                self, stream, OutputProcessor(job, streaming, self._tracker(text), face, i), merged
            )
        )
        for i, stream in enumerate(streams)
    ]
    outcome = "cancelled"
    try:
        left = len(streams)
        while left:
            item = await merged.get()
            if item is None:
                left -= 1
            elif isinstance(item, RequestError):
                outcome = item.code.name.lower()
                raise item
            else:
                yield item
        outcome = streams[0].finish_reason or FINISH_STOP
    finally:
        for task in tasks:
            task.cancel()
        self._metrics.count_request(outcome, job.adapter)
        self._release(job, streams)


async def _sample_row(
    self: MlxEngineServicer,
    stream: RequestStream,
    output: OutputProcessor,
    merged: asyncio.Queue[Any],
) -> None:
    """One of n rows: its messages into `merged`, then None (done) or its RequestError."""
    try:
        while stream.finish_reason is None:
            for response in emit_row(self, stream, output, await stream.take()):
                merged.put_nowait(response)
    except RequestError as error:
        merged.put_nowait(error)
    else:
        merged.put_nowait(None)


async def embed_request(
    self: MlxEngineServicer, request_id: str, ids: list[int]
) -> tuple[list[float], int]:
    """The prompt's pooled, L2-normalised hidden state, and its length."""
    if self._limits is None or not self._lifecycle.serving:
        raise RequestError(_refusal_status(self._lifecycle.phase), self._lifecycle.refusal)
    if not self._embedding_size:
        raise RequestError(
            grpc.StatusCode.UNIMPLEMENTED, "this model cannot embed (no hidden states)"
        )
    prompt = embed_prompt(request_id, ids, self._limits)
    ticket = next(self._tickets)
    request = EmbedRequest(ticket, prompt, self._options.embedding_pooling)
    self._metrics.prompt_tokens.inc(len(prompt))
    result = await self._calls.call(ticket, lambda: self._engine.embed(request))
    if result.error is not None:
        raise RequestError(grpc.StatusCode.INTERNAL, result.error)
    return result.embedding, len(prompt)


class MlxEngineServicer(MetadataRpcs, mlx_engine_pb2_grpc.MlxEngineServicer):
    """Handlers for one engine. The metadata RPCs answer once `set_model` has the model's
    files; Generate is accepted while the lifecycle says serving (after `attach`).
    `block_size`: the engine's prefix store's tokens per block (`EngineConfig.block_size`;
    0: no prefix reuse)."""

    def __init__(
        self,
        engine: EngineHandle,
        lifecycle: Lifecycle,
        on_fatal: Callable[[str], None],
        options: HandlerOptions | None = None,
        metrics: WorkerMetrics | None = None,
        block_size: int = 0,
        max_running_requests: int = 0,
    ) -> None:
        self._engine = engine
        self._lifecycle = lifecycle
        self._on_fatal = on_fatal
        self._options = options or HandlerOptions()
        self._metrics = metrics or WorkerMetrics(self.load, self.figures)
        self._info: ModelInfo | None = None
        self._codec: Codec | None = None
        self._admission: Admission | None = None
        self._limits: Limits | None = None
        self._tickets = itertools.count(1)
        self._streams = Streams()
        self._archive = ArchiveBuild()
        self._block_size = block_size  # names each prompt's blocks, as the engine's store does
        self._started = time.monotonic()
        self._figures = EngineFigures()  # the engine's, as it last published them
        self.kv_events = KvEventHub(block_size)
        self.max_running_requests = max_running_requests
        self._throughput = Throughput()
        self._embedding_size = 0
        self._calls = EngineCalls()  # embeds and flushes waiting for the engine
        self._once = RateLimitedLog(log, float("inf"))  # says each thing once
        self.images: ImagePreparer | None = None  # a vision model's image fetch and processing
        self.adapter_keys: dict[str, str] = {}  # served adapters' names in the prefix store
        self._preparing: dict[
            str, bool
        ] = {}  # request ids whose images are being prepared: aborted?

    # ----- lifecycle, driven by the server -----

    def set_model(self, files: ModelFiles) -> None:
        """The model's files are read: its metadata can be answered from now on."""
        self._info = files.info
        self._codec = TextCodec(files.tokenizer)
        self._limits = Limits.for_model(
            files.info, self._options.max_prompt_tokens, prepend_bos=self._options.prepend_bos
        )
        if files.vision is not None:
            self.images = ImagePreparer(files.model_dir, files.vision, self._options.media)

    def attach(
        self,
        admission: Admission,
        has_thinking: bool = False,
        check_grammar: GrammarCheck | None = None,
        embedding_size: int = 0,
    ) -> None:
        """The engine is warm: requests can be checked against what it supports.
        `embedding_size`: its pooled hidden states' size (0: it cannot embed)."""
        assert self._limits is not None, "set_model first"
        self._admission = admission
        self._embedding_size = embedding_size
        # The model's limits, as set_model made them, and now what the engine supports.
        self._limits = replace(self._limits, has_thinking=has_thinking, check_grammar=check_grammar)

    @property
    def active_requests(self) -> int:
        return len(self._streams)

    def load(self) -> EngineLoad:
        return self._streams.load()

    def figures(self) -> EngineFigures:
        """The engine's figures as it last published them."""
        return self._figures

    def prefix_stats(self) -> PrefixCacheStats | None:
        return self._figures.prefix

    def abort_all(self) -> None:
        self._engine.abort(self._streams.tickets())

    async def wait_idle(self, timeout: float) -> bool:
        """True once no call is in flight, False if `timeout` passes first."""
        return await self._streams.wait_idle(timeout)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    def load_figures(self) -> LoadFigures:
        """The load a router reads (GetLoads), from the engine's last published figures."""
        return load_figures(
            self._figures, self._admission, self._throughput, self.max_running_requests
        )

    def dispatch(self, out: StepOutput) -> None:
        """Route one engine hand-off (called on the loop thread)."""
        if out.figures is not None:
            self._figures = out.figures
        self._metrics.observe_output(out)
        if out.fatal is not None:
            self._on_fatal(out.fatal)
        self._streams.route(out)
        if out.kv_events:
            self.kv_events.publish(out.kv_events)
        self._calls.settle(out)

    embed = embed_request  # Embed (VllmEngine only)

    async def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix store (RAM and disk); requests in flight go on."""
        if not self.kv_events.block_size:
            return True, "this worker keeps no prefix cache"
        if not self._lifecycle.serving:
            return False, self._lifecycle.refusal
        ticket = next(self._tickets)
        try:
            await self._calls.call(ticket, lambda: self._engine.flush_cache(ticket))
        except RequestError as error:
            return False, error.message
        return True, "prefix cache flushed"

    # ----- Generate -----

    Generate = generate_rpc(MLX_FACE)
    generate_vllm = generate_rpc(VLLM_FACE)  # VllmEngine's Generate (servicer.vllm_face)

    async def _build(
        self, request: Any, adapter: str = ""
    ) -> tuple[GenerationRequest, TextOptions | None]:
        """Validate into a GenerationRequest; text encoding and grammar compilation, which can
        take a while, run off the loop."""
        if not self._lifecycle.serving or self._limits is None:
            raise RequestError(_refusal_status(self._lifecycle.phase), self._lifecycle.refusal)
        text_ids = None
        if request.WhichOneof("input") == "text" and self._codec is not None:
            if len(request.text) < 4096:
                text_ids = self._codec.encode(request.text)
            else:
                text_ids = await asyncio.to_thread(self._codec.encode, request.text)
        try:
            expand_images = None
            if self.images is not None and has_media(request):
                expand_images = await self._prepare_images(request)
            args = (
                request,
                next(self._tickets),
                self._limits,
                text_ids,
                self._options.stream_interval,
                self._block_size,
                self._options.stream_window_ms / 1000,
                expand_images,
                adapter,
                self.adapter_keys.get(adapter, adapter),
            )
            if request.sampling_params.WhichOneof("constraint") is None:
                return build_request(*args)
            return await asyncio.to_thread(build_request, *args)
        except RequestError:
            self._metrics.errors.labels("invalid_request").inc()
            raise

    async def _prepare_images(self, request: Any) -> Any:
        """The request's images fetched and processed; an Abort of its id meanwhile (it is
        not in flight yet) cancels it once they are."""
        rid = request.request_id
        self._preparing[rid] = False
        try:
            expand_images = await self.images.prepare(request)  # type: ignore[union-attr]
        finally:
            aborted = self._preparing.pop(rid, False)
        if aborted:
            raise RequestError(grpc.StatusCode.CANCELLED, "aborted while its images were prepared")
        by = "router" if request.mm_inputs.ByteSize() else "worker"
        self._metrics.image_requests.labels(by).inc()
        return expand_images

    def _accept(self, job: GenerationRequest) -> list[RequestStream]:
        """The request checked against what the worker holds, and submitted to the engine:
        its streams, one for each of its n samples."""
        errors = self._metrics.errors
        if job.request_id in self._streams:
            errors.labels("duplicate_request").inc()
            message = f"request_id {job.request_id!r} is already in flight"
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, message)
        if self._admission is not None and (refusal := memory_refusal(self._admission, job)):
            errors.labels("kv_memory").inc()
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        waiting = self._streams.load().waiting
        if waiting >= self._options.max_queued_requests:
            errors.labels("queue_full").inc()
            message = (
                f"{waiting} requests are already waiting for the engine "
                f"(limit {self._options.max_queued_requests}); retry later"
            )
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self._metrics.prompt_tokens.inc(len(job.prompt))
        if job.bos_added:
            self._metrics.bos_added.inc()
            self._once.log(
                logging.INFO, "bos", BOS_ADDED, self._limits and self._limits.bos_token_id
            )
        samples = job.samples() if job.sample_tickets else [job]
        streams = [self._streams.open(sample) for sample in samples]
        self._engine.submit(job)
        return streams

    def _tracker(self, text: TextOptions | None) -> TextTracker | None:
        if text is None or self._codec is None:
            return None
        return TextTracker(self._codec.decoder(), text.stops, text.include_stop, text.min_tokens)

    def _release(self, job: GenerationRequest, streams: list[RequestStream]) -> None:
        """The call is over: its streams close; rows it did not see finish are aborted (the
        client went away, the call was cancelled, or a sibling sample failed)."""
        unfinished = []
        for stream in streams:
            self._streams.close(stream.ticket, job.request_id)
            if stream.finish_reason is None:
                unfinished.append(stream.ticket)
        if unfinished:
            self._engine.abort(unfinished)

    # ----- the other RPCs -----

    async def Abort(
        self, request: mlx_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.AbortResponse:
        if self._lifecycle.phase not in (Phase.SERVING, Phase.DRAINING):
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._lifecycle.refusal)
        for rid in request.request_ids:
            if rid in self._preparing:
                self._preparing[rid] = True
        tickets = self._streams.tickets(list(request.request_ids))
        if tickets:
            self._engine.abort(tickets)
        return mlx_engine_pb2.AbortResponse()
