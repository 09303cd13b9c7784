"""What the server and the handlers hold of an engine, wherever it runs: in a thread of this
process (`engine.Engine`) or in a child process (`engine_process.EngineProcess`). Output
comes back through the `Outbox` the engine was built with, never through the handle."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .messages import EmbedRequest, EngineCapabilities, GenerationRequest, ModelInfo


class EngineHandle(Protocol):
    failure: str | None  # why the engine ended, when it failed

    def start(self, info: ModelInfo) -> None:
        """Load the model `info` describes, in the background."""

    def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        """Block until it is warm; EngineStartupError when it cannot start."""
        ...

    @property
    def capabilities(self) -> EngineCapabilities:
        """The admission guard and what the model supports (after `wait_ready`)."""
        ...

    @property
    def alive(self) -> bool: ...

    def submit(self, request: GenerationRequest) -> None: ...

    def abort(self, tickets: Iterable[int]) -> None: ...

    def embed(self, request: EmbedRequest) -> None:
        """Its `EmbedResult` comes back in a `StepOutput.embeddings`."""

    def flush_cache(self, ticket: int) -> None:
        """Empty the prefix store (RAM and disk); `ticket` comes back in a
        `StepOutput.flushed` once done (a `RowFailure` with it where it cannot be done)."""

    def shutdown(self, timeout: float | None = None) -> None:
        """End every request with `abort` and stop."""

    def join(self, timeout: float | None = None) -> None: ...
