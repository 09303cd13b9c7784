"""One served adapter's view of the handlers: the smg router picks a model by the name a
worker address answers (one name per address), so each adapter served beside the base model
listens on an address of its own. Its calls reach the same handlers and engine; only the
name its GetModelInfo answers and the adapter its requests are for differ. Health, drain,
loads and KV events are the engine's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import grpc

from .faces import MLX_FACE, VLLM_FACE
from .handlers import MlxEngineServicer, generate_rpc
from .loads import LoadFigures
from .messages import GenerationRequest
from .proto import mlx_engine_pb2
from .validation import TextOptions


class AdapterView:
    """The handlers, as the address serving adapter `name` answers (MlxEngine directly; the
    vLLM face wraps it as it wraps the handlers)."""

    def __init__(self, handlers: MlxEngineServicer, name: str) -> None:
        self._handlers = handlers
        self.name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._handlers, attribute)

    # Generate's body reads everything else from the handlers through this view.
    Generate = generate_rpc(MLX_FACE)
    generate_vllm = generate_rpc(VLLM_FACE)

    async def _build(self, request: Any) -> tuple[GenerationRequest, TextOptions | None]:
        return await self._handlers._build(request, adapter=self.name)

    def load_figures(self) -> LoadFigures:
        """GetLoads: the engine's (its KV and batch are shared by every name), with this
        adapter's own requests as the running and waiting ones."""
        load = self._handlers._streams.load(self.name)
        figures = self._handlers.load_figures()
        return dataclasses.replace(figures, running=load.running, waiting=load.waiting)

    async def GetModelInfo(
        self, request: mlx_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetModelInfoResponse:
        info = await self._handlers.GetModelInfo(request, context)
        info.served_model_name = self.name
        return info


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
