"""Speculative decoding inside the engine's continuous batch (engine thread only)."""

from .batch import SpeculativeDecodeBatch, Speculator
from .config import SpeculationConfig, SpeculationCounters
from .draft_model import DraftModel, check_draft_compatible, draft_supported
from .drafts import DraftSource
from .ngram import PromptLookup
from .runner import SpeculativeRunner
from .support import speculation_supported

__all__ = [
    "DraftModel",
    "DraftSource",
    "PromptLookup",
    "SpeculationConfig",
    "SpeculationCounters",
    "SpeculativeDecodeBatch",
    "SpeculativeRunner",
    "Speculator",
    "check_draft_compatible",
    "draft_supported",
    "speculation_supported",
]
