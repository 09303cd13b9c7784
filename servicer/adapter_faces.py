"""One address's MlxEngine service: the model's, or a served adapter's. The smg router picks a
model by the name a worker address answers (one name per address), so each adapter served
beside the base model listens on an address of its own. Its calls reach the same handlers and
engine; only the name its GetModelInfo answers, the adapter its requests are for and the load
it reports differ. Health, drain and KV events are the engine's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc

from .faces import MLX_FACE
from .handlers import FaceServicer
from .metadata import SERVER_TYPE
from .proto import mlx_engine_pb2, mlx_engine_pb2_grpc


class MlxEngineFace(FaceServicer, mlx_engine_pb2_grpc.MlxEngineServicer):
    """MlxEngine at one address: the RPCs both faces share, and its own metadata messages."""

    face = MLX_FACE

    async def GetModelInfo(
        self, request: mlx_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetModelInfoResponse:
        return mlx_engine_pb2.GetModelInfoResponse(
            **await self._metadata.model_fields(context, self._adapter)
        )

    async def GetServerInfo(
        self, request: mlx_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetServerInfoResponse:
        return mlx_engine_pb2.GetServerInfoResponse(
            server_type=SERVER_TYPE,
            active_requests=self._metadata.active_requests,
            uptime_seconds=self._metadata.uptime_s,
        )


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
