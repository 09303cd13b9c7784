"""Speculative decoding inside mlx-lm's continuous batch (engine thread only)."""

from .batch import SpeculativeGenerationBatch, Speculator
from .config import SpeculationConfig, SpeculationCounters, SpeculationStats
from .drafts import DraftSource
from .generator import SpeculativeBatchGenerator
from .ngram import PromptLookup
from .support import speculation_supported

__all__ = [
    "DraftSource",
    "PromptLookup",
    "SpeculationConfig",
    "SpeculationCounters",
    "SpeculationStats",
    "SpeculativeBatchGenerator",
    "SpeculativeGenerationBatch",
    "Speculator",
    "speculation_supported",
]
