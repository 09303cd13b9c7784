"""One address's MlxEngine service: the model's, or a served adapter's. The smg router picks a
model by the name a worker address answers (one name per address), so each adapter served
beside the base model listens on an address of its own. Its calls reach the same handlers and
engine; only the name its GetModelInfo answers, the adapter its requests are for and the load
it reports differ. Health, drain and KV events are the engine's.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from .faces import MLX_FACE
from .handlers import Generation, Handlers
from .metadata import SERVER_TYPE
from .proto import common_pb2, mlx_engine_pb2, mlx_engine_pb2_grpc
from .validation import RequestError


class MlxEngineFace(mlx_engine_pb2_grpc.MlxEngineServicer):
    """MlxEngine over the shared `Handlers`, as the address serving `adapter` answers it ("":
    the base model's)."""

    def __init__(self, handlers: Handlers, adapter: str = "") -> None:
        self._handlers = handlers
        self._metadata = handlers.metadata
        self._adapter = adapter
        # The shared Generate, for this face's messages and this address's adapter: gRPC calls
        # this bound async generator function as the face's own.
        self.Generate = Generation(handlers, MLX_FACE, adapter).generate

    async def Abort(
        self, request: mlx_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.AbortResponse:
        try:
            self._handlers.abort(list(request.request_ids))
        except RequestError as error:
            await context.abort(error.code, error.message)
        return mlx_engine_pb2.AbortResponse()

    async def HealthCheck(
        self, request: mlx_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.HealthCheckResponse:
        healthy, message = await self._metadata.health(context)
        return mlx_engine_pb2.HealthCheckResponse(healthy=healthy, message=message)

    async def GetModelInfo(
        self, request: mlx_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetModelInfoResponse:
        fields = await self._metadata.model_fields(context, self._adapter)
        return mlx_engine_pb2.GetModelInfoResponse(**fields)

    async def GetServerInfo(
        self, request: mlx_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetServerInfoResponse:
        return mlx_engine_pb2.GetServerInfoResponse(
            server_type=SERVER_TYPE,
            active_requests=self._metadata.active_requests,
            uptime_seconds=self._metadata.uptime_s,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for chunk in self._metadata.tokenizer_chunks(context):
            yield chunk


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def adapter_keys(adapters: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Each served adapter's name in the prefix store: its name and a digest of its files, so
    that blocks kept (on disk, across a restart) for other weights under the same name are
    never reused (a file missing: the name alone; the engine refuses to start then)."""
    keys = {}
    for name, path in adapters:
        digest = hashlib.blake2b(name.encode(), digest_size=16)
        try:
            for file in ADAPTER_FILES:
                with (Path(path) / file).open("rb") as handle:
                    while chunk := handle.read(1 << 20):
                        digest.update(chunk)
        except OSError:
            keys[name] = name
            continue
        keys[name] = f"{name}:{digest.hexdigest()}"
    return keys
