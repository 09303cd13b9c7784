"""What a router asks to register and probe a worker (HealthCheck, GetModelInfo, GetServerInfo,
GetTokenizer), answered alike by both faces: each builds its own messages from these answers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from .engine_handle import EngineHandle
from .lifecycle import Lifecycle, Phase
from .messages import ModelInfo
from .proto import common_pb2
from .streams import Streams
from .tokenizer_bundle import ArchiveBuild

SERVER_TYPE = "mlx-grpc-worker"
# A metadata call that waits for the model's files answers this long before its deadline, and
# waits at most METADATA_WAIT_S without one (the smg router sends none and gives up after 10 s).
METADATA_DEADLINE_MARGIN_S = 0.25
METADATA_WAIT_S = 8.0
STARTING_HEALTH_WAIT_S = 3.0  # within the smg router's 5 s health-check timeout

# GetModelInfo's fields both faces carry alike: the wire's name, and the ModelInfo attribute
# that answers it (None is left unset: the wire's 0). All come from the files, so the answer is
# the same while the model loads: a router registers a worker from its first answer.
MODEL_INFO_FIELDS = (
    ("model_path", "model_path"),
    ("max_context_length", "context_length"),
    ("vocab_size", "vocab_size"),
    ("served_model_name", "served_model_name"),
    ("model_type", "model_type"),
    ("architectures", "architectures"),
    ("eos_token_ids", "eos_token_ids"),
    ("pad_token_id", "pad_token_id"),
    ("bos_token_id", "bos_token_id"),
    ("embedding_size", "hidden_size"),
)


class Metadata:
    """The metadata answers of one engine's worker: from the model's files once `set_model`
    has them, from the lifecycle and the engine's liveness, and from the calls in flight."""

    def __init__(self, lifecycle: Lifecycle, engine: EngineHandle, streams: Streams) -> None:
        self._lifecycle = lifecycle
        self._engine = engine
        self._streams = streams
        self._info: ModelInfo | None = None
        self._prompt_limit = 0  # the longest prompt accepted (GetModelInfo.max_req_input_len)
        self._archive = ArchiveBuild()
        self._started = time.monotonic()

    def set_model(self, info: ModelInfo, prompt_limit: int) -> None:
        """The model's files are read: its metadata can be answered from now on."""
        self._info = info
        self._prompt_limit = prompt_limit

    @property
    def active_requests(self) -> int:
        return len(self._streams)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    @property
    def tokenizer_path(self) -> str:
        """GetModelInfo's tokenizer_path (the vLLM face's): the router's copy of the tokenizer
        where the family needs one, else what the user asked to serve."""
        info = self._info
        if info is None:
            return ""
        return info.router_tokenizer_dir or info.model_path

    async def health(self, context: grpc.aio.ServicerContext) -> tuple[bool, str]:
        """HealthCheck's answer: healthy or not, and why."""
        if self._lifecycle.phase is Phase.STARTING:
            # A router registers a worker from its first GetModelInfo once this call succeeds:
            # give the files a moment, then fail the call so it cannot register the worker
            # before the model has a name (the smg router tries again 30 s later).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lifecycle.model_known(), STARTING_HEALTH_WAIT_S)
            if self._lifecycle.phase is Phase.STARTING:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self._lifecycle.refusal)
        if not self._lifecycle.serving:
            return False, self._lifecycle.refusal
        if not self._engine.alive:
            return False, "the engine is not running"
        return True, "serving"

    async def model_fields(
        self, context: grpc.aio.ServicerContext, served_name: str = ""
    ) -> dict[str, Any]:
        """GetModelInfo's fields both faces carry, as keyword arguments for either face's
        message; `served_name`: the name this address answers ("": the model's)."""
        info = await self._model_info(context)
        fields = {
            wire: value
            for wire, ours in MODEL_INFO_FIELDS
            if (value := getattr(info, ours)) is not None
        }
        fields.update(is_generation=True, max_req_input_len=self._prompt_limit)
        if served_name:
            fields["served_model_name"] = served_name
        return fields

    async def tokenizer_chunks(
        self, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """GetTokenizer's stream: the tokenizer's archive in chunks, its digest on the last."""
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
