"""mlx-lm's BatchGenerator with a speculating generation batch."""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import BatchGenerator

from .batch import SpeculativeGenerationBatch, Speculator
from .config import SpeculationConfig, SpeculationCounters, SpeculationStats
from .draft_model import load_draft
from .drafts import DraftSource
from .ngram import PromptLookup
from .support import speculation_supported


class SpeculativeBatchGenerator(BatchGenerator):
    """A BatchGenerator whose generation batch speculates.

    Prefill is mlx-lm's: prompts that finish it build a plain GenerationBatch, which the
    speculating batch folds in with `extend`. insert/next/remove/extract_cache behave as in
    mlx-lm; `next()` may return several responses for one uid in one step, in order, the
    last one carrying the finish reason, `prompt_cache` and `all_tokens`.
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
        self._speculator = Speculator(
            source, speculation or SpeculationConfig(), counters or SpeculationCounters()
        )
        self._generation_batch = SpeculativeGenerationBatch.start(
            self.model, self.sampler, self._speculator
        )

    @property
    def speculation(self) -> SpeculationStats:
        """The counters so far (a snapshot; read it on the engine thread)."""
        return self._speculator.counters.snapshot()

    @property
    def speculation_config(self) -> SpeculationConfig:
        return self._speculator.config


def make_source(
    kind: str,
    *,
    draft_model: str | None = None,
    tokenizer: Any = None,
    ngram_sizes: tuple[int, ...] = (3, 2),
    prefill_step_size: int = 512,
) -> DraftSource:
    """The draft source an engine setting names: "ngram" (prompt lookup) or "draft" (a
    draft model directory, checked against the target's `tokenizer`)."""
    if kind == "ngram":
        return PromptLookup(ngram_sizes)
    if kind == "draft":
        if draft_model is None or tokenizer is None:
            raise ValueError("a draft-model source needs the draft model's path and the tokenizer")
        return load_draft(draft_model, tokenizer, prefill_step_size)
    raise ValueError(f"unknown draft source {kind!r} (known: ngram, draft)")
