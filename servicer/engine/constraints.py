"""Structured output with llguidance, applied as a per-request logits processor.

llguidance computes the allowed-token bitmask on the CPU; the mask is applied with portable
MLX ops (its own `llguidance.mlx` helper is a Metal-only kernel), so this runs on CPU, CUDA
and Metal alike.
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from ..messages import Constraint


class GrammarProcessor:
    """Masks every token the grammar forbids; once the grammar is complete, only EOS remains."""

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, constraint: Constraint, vocab_size: int, eos: int
    ) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0)
        self._vocab_size = vocab_size
        self._eos = eos
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self._prompt_len: int | None = None
        self._consumed = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # `tokens` is the request's whole context: its prompt, then what it generated so far.
        if self._prompt_len is None:
            self._prompt_len = tokens.shape[0]
        generated = tokens.shape[0] - self._prompt_len
        if generated > self._consumed:
            new = tokens[self._prompt_len + self._consumed :].tolist()
            self._matcher.consume_tokens(new)
            self._consumed = generated
        if self._matcher.is_stopped() or self._matcher.is_error():
            allowed = np.zeros(self._vocab_size, dtype=bool)
            allowed[self._eos] = True
        else:
            llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
            bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
            allowed = bits[: self._vocab_size].astype(bool)
        mask = mx.array(allowed)
        width = logits.shape[-1]
        if width != self._vocab_size:  # embeddings padded past the tokenizer, or the reverse
            mask = mx.pad(mask, (0, max(0, width - self._vocab_size)))[:width]
        return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))


class GrammarFactory:
    """Builds the llguidance tokenizer once, on first use (slow for big vocabularies)."""

    def __init__(self, hf_tokenizer: object, vocab_size: int, eos: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos = eos
        self._tokenizer: llguidance.LLTokenizer | None = None

    def processor(self, constraint: Constraint) -> GrammarProcessor:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos
            )
        return GrammarProcessor(self._tokenizer, constraint, self._vocab_size, self._eos)
