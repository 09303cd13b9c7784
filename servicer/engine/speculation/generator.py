"""mlx-lm's BatchGenerator with a speculating generation batch."""

from __future__ import annotations

from typing import Any

from ...messages import SpeculationFigures
from ..fused_prefill import FusedPrefill
from .batch import SpeculativeGenerationBatch, Speculator
from .config import ModeClock, SpeculationConfig, SpeculationCounters
from .drafts import DraftSource
from .support import padding_inert, speculation_supported


class SpeculativeBatchGenerator(FusedPrefill):
    """A BatchGenerator whose generation batch speculates.

    Prefill is mlx-lm's: prompts that finish it build a plain GenerationBatch, which the
    speculating batch folds in with `extend` (its caches become ones that roll back per
    row from the batch's first drafting step on). insert/next/remove/extract_cache behave
    as in mlx-lm; `next()` may return several responses for one uid in one step, in order,
    the last one carrying the finish reason, `prompt_cache` and `all_tokens`.
    """

    def __init__(
        self,
        model: Any,
        *,
        source: DraftSource,
        speculation: SpeculationConfig | None = None,
        counters: SpeculationCounters | None = None,
        **kwargs: Any,
    ) -> None:
        """`counters`: where to count (a generator built to replace another goes on with its
        counts); fresh ones by default."""
        super().__init__(model, **kwargs)
        supported, reason = speculation_supported(model, self.max_kv_size)
        if not supported:
            self.close()
            raise ValueError(f"speculative decoding is not supported: {reason}")
        config = speculation or SpeculationConfig()
        self._speculator = Speculator(
            source,
            config,
            counters or SpeculationCounters(),
            modes=ModeClock(window=config.mode_window, first_gap=config.mode_gap),
            padding_inert=padding_inert(model),
        )
        self._generation_batch = SpeculativeGenerationBatch.start(
            self.model, self.sampler, self._speculator
        )

    def _next(self) -> Any:
        # A step that prefills prompts spends the prefill budget on them: a draft model's
        # catch-up waits for a step without (see DraftModel).
        prefilling = bool(self._unprocessed_sequences) or len(self._prompt_batch) > 0
        begin = getattr(self._speculator.source, "begin_step", None)
        if begin is not None:
            begin(prefilling)
        self._generation_batch.shares_step_with_prefill = prefilling
        return super()._next()

    def after_pause(self) -> None:
        """The caller did other work since the last step (a benchmark alternating
        generators): neither clock counts that gap as the last step's time."""
        self._generation_batch.after_pause()

    @property
    def speculation(self) -> SpeculationFigures:
        """The counters so far (a snapshot; read it on the engine thread)."""
        return self._speculator.counters.snapshot()
