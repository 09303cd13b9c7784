"""The MlxEngine service's metadata RPCs (HealthCheck, GetModelInfo, GetServerInfo,
GetTokenizer), mixed into the handlers: what a router asks to register and probe a worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from .lifecycle import Phase
from .messages import ModelInfo
from .proto import common_pb2, mlx_engine_pb2

if TYPE_CHECKING:
    from .engine_handle import EngineHandle
    from .lifecycle import Lifecycle
    from .tokenizer_bundle import ArchiveBuild
    from .validation import Limits

SERVER_TYPE = "mlx-grpc-worker"
# A metadata call that waits for the model's files answers this long before its deadline, and
# waits at most METADATA_WAIT_S without one (the smg router sends none and gives up after 10 s).
METADATA_DEADLINE_MARGIN_S = 0.25
METADATA_WAIT_S = 8.0
STARTING_HEALTH_WAIT_S = 3.0  # within the smg router's 5 s health-check timeout


class MetadataRpcs:
    """The metadata RPCs over the handlers' state (set by `MlxEngineServicer`)."""

    _engine: EngineHandle
    _lifecycle: Lifecycle
    _info: ModelInfo | None
    _limits: Limits | None
    _archive: ArchiveBuild
    _started: float
    active_requests: int  # the handlers' calls in flight

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
            message = "the engine is not running"
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
            # From the files, so the answer is the same while loading: a router registers
            # a worker from its first answer.
            embedding_size=info.hidden_size,
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
            archive = await self._archive.get(Path(info.router_tokenizer_dir or info.model_dir))
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot read tokenizer files: {exc}")
            return
        pieces = list(archive.chunks())
        for i, data in enumerate(pieces):
            last = i == len(pieces) - 1
            yield common_pb2.GetTokenizerChunk(data=data, sha256=archive.sha256 if last else "")

    @property
    def tokenizer_path(self) -> str:
        """GetModelInfo's tokenizer_path (the vLLM face's): the router's copy of the tokenizer
        where the family needs one, else what the user asked to serve."""
        info = self._info
        if info is None:
            return ""
        return info.router_tokenizer_dir or info.model_path

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
