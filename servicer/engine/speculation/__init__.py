"""Speculative decoding inside mlx-lm's continuous batch (engine thread only)."""

from .batch import SpeculativeGenerationBatch, Speculator
from .config import SpeculationConfig, SpeculationCounters, SpeculationStats
from .draft_model import DraftModel, check_draft_compatible, load_draft
from .drafts import DraftSource
from .generator import SpeculativeBatchGenerator, make_source
from .ngram import PromptLookup
from .support import speculation_supported

__all__ = [
    "DraftModel",
    "DraftSource",
    "PromptLookup",
    "SpeculationConfig",
    "SpeculationCounters",
    "SpeculationStats",
    "SpeculativeBatchGenerator",
    "SpeculativeGenerationBatch",
    "Speculator",
    "check_draft_compatible",
    "load_draft",
    "make_source",
    "speculation_supported",
]
