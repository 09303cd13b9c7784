"""The VllmEngine face: the same handlers as MlxEngine, with vLLM's messages.

Generate, Abort, HealthCheck and GetTokenizer are the handlers' own (`FaceServicer`, in this
face's messages); GetModelInfo and GetServerInfo answer from the same metadata as MlxEngine's;
Embed, GetLoads, SubscribeKvEvents and FlushCache exist on this face only, because only the
router's vLLM path calls them. Profiling is not offered: UNIMPLEMENTED, said in words (the
generated default says "Method not implemented!" and logs a traceback at ERROR for every call).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import grpc

from . import __version__
from .faces import VLLM_FACE
from .handlers import FaceServicer
from .images import media_info
from .kv_events import SubscriberLagged
from .metadata import SERVER_TYPE
from .proto import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from .validation import RequestError

NO_PROFILING = "profiling is not offered by this worker (StartProfile and StopProfile)"


class VllmEngineFace(FaceServicer, vllm_engine_pb2_grpc.VllmEngineServicer):
    """VllmEngine at one address (the model's, or a served adapter's)."""

    face = VLLM_FACE

    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        fields = await self._metadata.model_fields(context, self._adapter)
        return vllm_engine_pb2.GetModelInfoResponse(
            **fields,
            tokenizer_path=self._metadata.tokenizer_path,
            supports_vision=self._handlers.images is not None,
        )

    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        handlers = self._handlers
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=self._metadata.active_requests,
            uptime_seconds=self._metadata.uptime_s,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            block_size=handlers.kv_events.block_size,
            max_num_seqs=handlers.max_running_requests,
            **media_info(handlers.images),
            **handlers.kv.server_info(),
        )

    async def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        figures = self._handlers.load_figures(self._adapter)
        load = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=figures.running,
            num_waiting_reqs=figures.waiting,
            num_total_reqs=figures.running + figures.waiting,
            num_used_tokens=figures.used_tokens,
            max_total_num_tokens=figures.capacity_tokens,
            token_usage=figures.token_usage,
            gen_throughput=figures.gen_throughput,
            cache_hit_rate=figures.cache_hit_rate,
            utilization=figures.utilization,
            max_running_requests=figures.max_running,
            num_waiting_uncached_tokens=figures.waiting_tokens,
        )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=__version__,
            dp_rank_count=1,
            loads=[load],
        )

    async def Embed(
        self, request: vllm_engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.EmbedResponse:
        ids = list(request.tokenized.input_ids)
        try:
            vector, prompt_tokens = await self._handlers.calls.embed(request.request_id, ids)
        except RequestError as error:
            await context.abort(error.code, error.message)
        return vllm_engine_pb2.EmbedResponse(
            embedding=vector, prompt_tokens=prompt_tokens, embedding_dim=len(vector)
        )

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        success, message = await self._handlers.calls.flush_cache()
        return common_pb2.FlushCacheResponse(success=success, message=message)

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_PROFILING)
        return common_pb2.ProfileResponse()  # not reached: abort raises

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_PROFILING)
        return common_pb2.ProfileResponse()

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        hub = self._handlers.kv_events
        if not hub.block_size:  # the router turns events off for this worker, cleanly
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "this worker keeps no prefix cache to report"
            )
        # The smg router drops a worker whose stream says nothing for 2 s: headers at once.
        await context.send_initial_metadata(())
        try:
            async for batch in hub.subscribe(request.start_sequence_number):
                yield batch
        except SubscriberLagged as lag:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(lag))
