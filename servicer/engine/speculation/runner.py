"""The batch runner with a speculating decoding batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...messages import SpeculationFigures
from ..decode_batch import DecodeBatch, DecodeResponse
from ..runner import BatchRunner
from .batch import SpeculativeDecodeBatch, Speculator
from .config import ModeClock, SpeculationConfig, SpeculationCounters
from .drafts import DraftSource
from .support import padding_inert, speculation_supported


class SpeculativeRunner(BatchRunner):
    """A batch runner whose decoding batch speculates.

    Prompts that finish their prefill build a plain DecodeBatch, which the speculating batch
    folds in with `extend` (its caches become ones that roll back per row from the batch's
    first drafting step on). `next()` may return several responses for one uid in one step,
    in order, the last one carrying the finish reason, `prompt_cache` and `all_tokens`."""

    def __init__(
        self,
        model: Any,
        *,
        source: DraftSource,
        speculation: SpeculationConfig | None = None,
        counters: SpeculationCounters | None = None,
        **kwargs: Any,
    ) -> None:
        """`counters`: where to count (a runner built to replace another goes on with its
        counts); fresh ones by default."""
        self._source, self._config = source, speculation or SpeculationConfig()
        self._counters = counters or SpeculationCounters()
        super().__init__(model, **kwargs)
        supported, reason = speculation_supported(model)
        if not supported:
            self.close()
            raise ValueError(f"speculative decoding is not supported: {reason}")

    def _new_decode_batch(self, grouping: Callable[[list[Any]], list[Any]] | None) -> DecodeBatch:
        config = self._config
        self._speculator = Speculator(
            self._source,
            config,
            self._counters,
            modes=ModeClock(window=config.mode_window, first_gap=config.mode_gap),
            padding_inert=padding_inert(self.model),
        )
        self._speculating = SpeculativeDecodeBatch.empty(
            self.model,
            self.sampler,
            speculator=self._speculator,
            context=self.context,
            grouping=grouping,
        )
        return self._speculating

    def _next(self, chunk: int) -> Any:
        # The plan's share of the step for a draft model's catch-up (see DraftModel).
        begin = getattr(self._speculator.source, "begin_step", None)
        if begin is not None:
            begin(self.catch_up)
        return super()._next(chunk)

    def _step_decoding(self) -> list[DecodeResponse]:
        return self._speculating.next(shares_step_with_prefill=self.prefilling)

    @property
    def caught_up(self) -> tuple[int, float]:
        source = self._speculator.source
        return getattr(source, "catch_up_tokens", 0), getattr(source, "catch_up_seconds", 0.0)

    def after_pause(self) -> None:
        """The caller did other work since the last step (a benchmark alternating
        runners): neither clock counts that gap as the last step's time."""
        self._speculating.after_pause()

    @property
    def speculation(self) -> SpeculationFigures:
        """The counters so far (a snapshot; read it on the engine thread)."""
        return self._speculator.counters.snapshot()
