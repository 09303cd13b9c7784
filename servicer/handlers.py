"""The handlers both faces share: the handler side of one engine (`Handlers`), the Generate RPC
over it (`Generation`), and the RPCs both faces answer alike (`FaceServicer`).

Runs on the asyncio loop only. The engine's hand-offs arrive through `Handlers.dispatch`; each
call's `RequestStream` wakes its handler, whose `OutputProcessor` turns the events into messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import grpc
import msgspec

from .admission import Admission
from .codec import TextCodec
from .engine_calls import EngineCalls
from .engine_handle import EngineHandle
from .faces import Face
from .images import ImagePreparer, has_media
from .kv_events import KvEventHub
from .kv_transfer import KvTransfer, KvTransferOptions
from .lifecycle import Lifecycle, Phase
from .loads import LoadFigures, Throughput, load_figures
from .media import MediaPolicy
from .messages import (
    FINISH_STOP,
    EngineFigures,
    EngineLoad,
    GenerationRequest,
    PrefixCacheStats,
    RowEvent,
    StepOutput,
)
from .metadata import METADATA_DEADLINE_MARGIN_S, Metadata
from .metrics import WorkerMetrics
from .model_files import ModelFiles
from .output import OutputProcessor
from .proto import common_pb2
from .ratelimit import RateLimitedLog
from .streams import RequestStream, Streams
from .text import IncrementalDecoder, TextTracker
from .validation import (
    GrammarCheck,
    Handoff,
    Limits,
    RequestContext,
    RequestError,
    TextOptions,
    build_request,
    not_serving,
    sample_count,
)

log = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # a stream waiting for the model gets an empty chunk this often
BOS_ADDED = (
    "a prompt came without the model's BOS (id %s), which its tokenizer puts first; the "
    "worker adds it (counted in mlx_worker_bos_added; --no-prepend-bos turns this off; "
    "said once)"
)


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
    kv: KvTransferOptions = field(default_factory=KvTransferOptions)  # KV between workers


class Handlers:
    """The handler side of one engine, shared by every address and face that serves it: its
    Generate requests from check to release and their streams, Abort, and the engine's
    hand-offs (Embed and FlushCache: `calls`; the metadata RPCs' answers: `metadata`). The
    metadata answers once `set_model` has the model's files; Generate is accepted while the
    lifecycle says serving (after `attach`).
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
        kv_cache_dtype: str = "auto",
    ) -> None:
        self._engine = engine
        self._lifecycle = lifecycle
        self._on_fatal = on_fatal
        self._options = options or HandlerOptions()
        self._metrics = metrics or WorkerMetrics(self.load, self.figures)
        self._codec: Codec | None = None
        self._admission: Admission | None = None
        self._limits: Limits | None = None
        self._tickets = itertools.count(1)
        self._streams = Streams()
        # Paces each request's hand-offs; names its prompt's blocks as the engine's store does.
        window_s = self._options.stream_window_ms / 1000
        self._handoff = Handoff(self._options.stream_interval, window_s, block_size)
        self._figures = EngineFigures()  # the engine's, as it last published them
        self._throughput = Throughput()
        self._once = RateLimitedLog(log, float("inf"))  # says each thing once
        self._images: ImagePreparer | None = None  # a vision model's image fetch and processing
        self._adapter_keys: dict[str, str] = {}  # served adapters' names in the prefix store
        self._building: dict[str, bool] = {}  # request ids not in flight yet: aborted?
        self.metadata = Metadata(lifecycle, engine, self._streams)
        self.calls = EngineCalls(  # Embed and FlushCache
            engine,
            lifecycle,
            self._metrics,
            self._tickets,
            self._options.embedding_pooling,
            keeps_prefixes=block_size > 0,
        )
        self.kv_events = KvEventHub(block_size)
        self.kv = KvTransfer(self._options.kv, block_size, kv_cache_dtype)
        self.max_running_requests = max_running_requests

    # ----- lifecycle, driven by the server -----

    def set_model(self, files: ModelFiles, adapter_keys: dict[str, str] | None = None) -> None:
        """The model's files are read: its metadata can be answered from now on.
        `adapter_keys`: each served adapter's name in the prefix store
        (`adapter_faces.adapter_keys`)."""
        self._codec = TextCodec(files.tokenizer)
        self._limits = Limits.for_model(
            files.info, self._options.max_prompt_tokens, prepend_bos=self._options.prepend_bos
        )
        self._adapter_keys = dict(adapter_keys or {})
        if files.vision is not None:
            self._images = ImagePreparer(files.model_dir, files.vision, self._options.media)
        self.metadata.set_model(files.info, self._limits.prompt_limit)

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
        # The model's limits, as set_model made them, and now what the engine supports.
        self._limits = replace(self._limits, has_thinking=has_thinking, check_grammar=check_grammar)
        self.calls.attach(self._limits, embedding_size)

    @property
    def lifecycle(self) -> Lifecycle:
        return self._lifecycle

    @property
    def metrics(self) -> WorkerMetrics:
        return self._metrics

    @property
    def options(self) -> HandlerOptions:
        return self._options

    @property
    def images(self) -> ImagePreparer | None:
        """A vision model's image fetch and processing (None: it takes no images)."""
        return self._images

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

    def load_figures(self, adapter: str = "") -> LoadFigures:
        """The load a router reads (GetLoads), from the engine's last published figures; an
        adapter's address: the engine's (its KV and batch are shared by every name), with that
        adapter's own requests as the running and waiting ones."""
        figures = load_figures(
            self._figures, self._admission, self._throughput, self.max_running_requests
        )
        if not adapter:
            return figures
        load = self._streams.load(adapter)
        return replace(figures, running=load.running, waiting=load.waiting)

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
        self.calls.settle(out)

    # ----- Generate: check, build, accept, release -----

    def check_early(self, request: Any, context: RequestContext) -> None:
        """What can be checked of a request while the model loads (its files read, a tokenized
        prompt): RequestError for a bad one, so that it is refused at once."""
        if self._limits is not None and request.WhichOneof("input") == "tokenized":
            build_request(request, context, self._limits)

    async def build(
        self, request: Any, context: RequestContext
    ) -> tuple[GenerationRequest, TextOptions | None]:
        """Validate into a GenerationRequest, with a ticket for each of its n samples past the
        first; text encoding and grammar compilation, which can take a while, run off the loop.
        `context`: the face and adapter of the address it came to."""
        if not self._lifecycle.serving or self._limits is None:
            raise not_serving(self._lifecycle)
        self._building[request.request_id] = False  # `accept` takes it over
        try:
            return await self._build(request, context)
        except BaseException:
            self._building.pop(request.request_id, None)
            raise

    async def _build(
        self, request: Any, context: RequestContext
    ) -> tuple[GenerationRequest, TextOptions | None]:
        assert self._limits is not None
        text_ids = None
        if request.WhichOneof("input") == "text" and self._codec is not None:
            if len(request.text) < 4096:
                text_ids = self._codec.encode(request.text)
            else:
                text_ids = await asyncio.to_thread(self._codec.encode, request.text)
        try:
            images = None
            if self._images is not None and has_media(request):
                images = await self._images.prepare(request, await self.kv.image_keys(request))
                by = "router" if request.mm_inputs.ByteSize() else "worker"
                self._metrics.image_requests.labels(by).inc()
            adapter = context.adapter
            prepared = replace(
                context,
                adapter_key=self._adapter_keys.get(adapter, adapter),
                ticket=next(self._tickets),
                text_ids=text_ids,
                images=images,
            )
            args = (request, prepared, self._limits, self._handoff)
            if request.sampling_params.WhichOneof("constraint") is None:
                job, text = build_request(*args)
            else:
                job, text = await asyncio.to_thread(build_request, *args)
        except RequestError:
            self._metrics.errors.labels("invalid_request").inc()
            raise
        samples = sample_count(request.sampling_params)
        if samples > 1:  # one request to the engine, with a ticket for each other sample
            tickets = tuple(itertools.islice(self._tickets, samples - 1))
            job = msgspec.structs.replace(job, sample_tickets=tickets)
        return job, text

    def abandon(self, job: GenerationRequest) -> None:
        """A request built but never accepted (its call ended first)."""
        self._building.pop(job.request_id, None)

    def accept(self, job: GenerationRequest) -> list[RequestStream]:
        """The request checked against what the worker holds, and submitted to the engine:
        its streams, one for each of its n samples. One aborted while it was built (its images
        fetched, its grammar compiled) ends as an abort of a request in flight does."""
        aborted = self._building.pop(job.request_id, False)
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
        if aborted:
            self._engine.abort([stream.ticket for stream in streams])
        return streams

    def tracker(self, text: TextOptions | None) -> TextTracker | None:
        """The decoded text and stop strings of one row, when its request wants them."""
        if text is None or self._codec is None:
            return None
        return TextTracker(self._codec.decoder(), text.stops, text.include_stop, text.min_tokens)

    def release(self, job: GenerationRequest, streams: list[RequestStream]) -> None:
        """The call is over: its streams close; rows it did not see finish are aborted (the
        client went away, the call was cancelled, or a sibling sample failed)."""
        unfinished = []
        for stream in streams:
            self._streams.close(stream.ticket, job.request_id)
            if stream.finish_reason is None:
                unfinished.append(stream.ticket)
        if unfinished:
            self._engine.abort(unfinished)

    def abort(self, request_ids: list[str]) -> None:
        """Abort: these requests end `abort` (those in flight, and those still being built,
        once they are). RequestError outside serving and draining."""
        if self._lifecycle.phase not in (Phase.SERVING, Phase.DRAINING):
            raise RequestError(grpc.StatusCode.UNAVAILABLE, self._lifecycle.refusal)
        for rid in request_ids:
            if rid in self._building:
                self._building[rid] = True
        tickets = self._streams.tickets(request_ids)
        if tickets:
            self._engine.abort(tickets)


class Generation:
    """The Generate RPC as one address answers it through one face (the model's address or a
    served adapter's; MlxEngine's messages or VllmEngine's): the call waits while the model
    loads, the shared `Handlers` check and accept it, and its rows' events go back as messages.

    gRPC wants an async generator function for a streaming method, and wrapping one in another
    would cost every message a hop: so a face serves `generate` itself, as its Generate."""

    def __init__(self, handlers: Handlers, face: Face, adapter: str = "") -> None:
        self._handlers = handlers
        self._metrics = handlers.metrics
        self._face = face  # the messages its calls get
        # What every call through here shares; `Handlers.build` adds each one's own.
        self._context = RequestContext(face, adapter)

    async def generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        handlers = self._handlers
        if handlers.lifecycle.starting:
            async for keepalive in self._wait_for_model(request, context):
                yield keepalive
        try:
            job, text = await handlers.build(request, self._context)
            # A PD leg's blocks found or fetched; smg takes 3 s of nothing for a hang meanwhile.
            preparing = asyncio.ensure_future(
                handlers.kv.prepare(request, job, context.time_remaining())
            )
            try:
                async for keepalive in self._until(preparing, handlers.kv.keepalive_s()):
                    yield keepalive
                job = await preparing
            except BaseException:
                preparing.cancel()
                handlers.abandon(job)
                raise
            streams = handlers.accept(job)
        except RequestError as error:
            log.debug("refused request %r: %s", request.request_id, error.message)
            self._metrics.requests.labels(error.code.name.lower()).inc()
            await context.abort(error.code, error.message)
            return
        if len(streams) > 1:  # n samples
            try:
                async for response in self._merged_rows(job, streams, text, request.stream):
                    yield response
            except RequestError as error:
                await context.abort(error.code, error.message)
            return
        stream = streams[0]
        output = OutputProcessor(job, request.stream, handlers.tracker(text), self._face)
        outcome = "cancelled"  # unless it finishes or fails below
        try:
            # The loop lives here, not in a nested generator: one hop less for every message.
            keepalive_s = handlers.kv.keepalive_s()
            while stream.finish_reason is None:
                try:
                    events = await asyncio.wait_for(stream.take(), keepalive_s)
                except TimeoutError:  # a PD leg before its first token: still at work
                    yield self._face.pb.GenerateResponse(chunk=self._face.pb.GenerateStreamChunk())
                    continue
                keepalive_s = None
                for response in self._emit(stream, output, events):
                    if stream.finish_reason is not None and response.HasField("complete"):
                        await handlers.kv.publish(request, job, response.complete)
                    yield response
            outcome = stream.finish_reason
        except RequestError as error:
            outcome = error.code.name.lower()
            stream.set_finish_reason(outcome)
            await context.abort(error.code, error.message)
        finally:
            self._metrics.count_request(outcome, job.adapter)
            handlers.release(job, streams)

    async def _until(self, task: asyncio.Future[Any], every_s: float | None) -> AsyncIterator[Any]:
        """An empty chunk every `every_s` until `task` is done (none without `every_s`)."""
        while every_s is not None and not task.done():
            await asyncio.wait({task}, timeout=every_s)
            if not task.done():
                yield self._face.pb.GenerateResponse(chunk=self._face.pb.GenerateStreamChunk())

    async def _wait_for_model(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """A request that comes while the model loads waits for it, up to `max_load_wait_s`
        and within its deadline, so the first clients of a worker the router has just
        registered are served instead of refused. What can be checked already is checked first
        (a bad request is refused at once, before any message). A stream gets an empty chunk
        every KEEPALIVE_S meanwhile: the smg router takes a worker whose streams see nothing
        for 3 s for wedged, and clients see no tokens in it."""
        handlers, metrics = self._handlers, self._metrics
        try:
            handlers.check_early(request, self._context)
        except RequestError as error:
            metrics.errors.labels("invalid_request").inc()
            await context.abort(error.code, error.message)
        wait = handlers.options.max_load_wait_s
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, remaining - METADATA_DEADLINE_MARGIN_S)
        deadline = time.monotonic() + wait
        lifecycle, pb = handlers.lifecycle, self._face.pb
        metrics.load_waiting.inc()
        try:
            while lifecycle.starting and (left := deadline - time.monotonic()) > 0:
                await lifecycle.wait_started(min(left, KEEPALIVE_S))
                if lifecycle.starting and request.stream:
                    yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk())
        finally:
            metrics.load_waiting.dec()

    async def _merged_rows(
        self,
        job: GenerationRequest,
        streams: list[RequestStream],
        text: TextOptions | None,
        streaming: bool,
    ) -> AsyncIterator[Any]:
        """n rows from one prompt, their messages merged as they come, each with its `index`.
        The engine got one request: it admits the other samples once the first's prompt is
        through, and ends or fails them together when the first ends before that."""
        merged: asyncio.Queue[Any] = asyncio.Queue()
        tracker = self._handlers.tracker
        tasks = [
            asyncio.ensure_future(
                self._row_into(
                    stream, OutputProcessor(job, streaming, tracker(text), self._face, i), merged
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
            self._handlers.release(job, streams)

    async def _row_into(
        self, stream: RequestStream, output: OutputProcessor, merged: asyncio.Queue[Any]
    ) -> None:
        """One of n rows: its messages into `merged`, then None (done) or its RequestError."""
        try:
            while stream.finish_reason is None:
                for response in self._emit(stream, output, await stream.take()):
                    merged.put_nowait(response)
        except RequestError as error:
            merged.put_nowait(error)
        else:
            merged.put_nowait(None)

    def _emit(
        self, stream: RequestStream, output: OutputProcessor, events: list[RowEvent]
    ) -> list[Any]:
        """One batch of a row's events: the messages its client gets now (the engine ended the
        row itself where a stop string completed)."""
        emission = output.process(events)
        if emission.tokens:
            self._observe_tokens(stream, emission.tokens)
        stream.set_finish_reason(emission.finish_reason)
        return emission.responses

    def _observe_tokens(self, stream: RequestStream, count: int) -> None:
        """A stream's first tokens (its TTFT) or the gap since its last ones."""
        metrics = self._metrics
        first, elapsed = stream.record_tokens(time.perf_counter())
        if first:
            metrics.ttft.observe(elapsed)
        else:
            metrics.inter_token.observe(elapsed / count)
        metrics.generated_tokens.inc(count)
        if stream.adapter:
            metrics.adapter_tokens.labels(stream.adapter).inc(count)


class FaceServicer:
    """The RPCs both faces answer alike, in the messages of the subclass's `face`, as the
    address serving `adapter` ("": the base model's) answers them: Generate, Abort, HealthCheck
    and GetTokenizer. Each face's servicer (`adapter_faces.MlxEngineFace`,
    `vllm_face.VllmEngineFace`) names its face and adds the rest."""

    face: ClassVar[Face]

    def __init__(self, handlers: Handlers, adapter: str = "") -> None:
        self._handlers = handlers
        self._metadata = handlers.metadata
        self._adapter = adapter
        # The shared Generate, for this face's messages and this address's adapter: gRPC calls
        # this bound async generator function as the face's own.
        self.Generate = Generation(handlers, self.face, adapter).generate

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._handlers.abort(list(request.request_ids))
        except RequestError as error:
            await context.abort(error.code, error.message)
        return self.face.pb.AbortResponse()

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        healthy, message = await self._metadata.health(context)
        return self.face.pb.HealthCheckResponse(healthy=healthy, message=message)

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for chunk in self._metadata.tokenizer_chunks(context):
            yield chunk
