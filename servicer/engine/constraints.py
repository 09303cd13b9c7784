"""Structured output with llguidance, applied as a per-request logits processor.

llguidance computes the allowed-token bitmask on the CPU; the mask is applied with portable
MLX ops (its own `llguidance.mlx` helper is a Metal-only kernel), so this runs on CPU, CUDA
and Metal alike.
"""

from __future__ import annotations

import logging

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

from ..grammar import GrammarChecker, matcher_error
from ..messages import Constraint

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 300


class GrammarProcessor:
    """Masks every token the grammar forbids; once the grammar is complete, only EOS remains.

    A grammar can still fail while generating (a parser limit, say): then only EOS remains
    too, and `error` says why, so the engine ends the request with an error, not `stop`."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: int) -> None:
        self._matcher = matcher  # the row's own, at the grammar's start
        self._vocab_size = vocab_size
        self._eos = eos
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self._prompt_len: int | None = None
        self._consumed = 0
        self.error: str | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # `tokens` is the request's whole context: its prompt, then what it generated so far.
        if self._prompt_len is None:
            self._prompt_len = tokens.shape[0]
        generated = tokens.shape[0] - self._prompt_len
        if generated > self._consumed:
            # Once the grammar is complete only EOS follows, and the batch may show it here a
            # step before the row ends: a stopped matcher takes no more tokens.
            if not self._matcher.is_stopped():
                new = tokens[self._prompt_len + self._consumed :].tolist()
                self._matcher.consume_tokens(new)
            self._consumed = generated
        if self._matcher.is_error() and self.error is None:
            # The log keeps llguidance's parser state; the client gets the reason.
            full = matcher_error(self._matcher) or "the grammar matcher failed"
            log.info("grammar failed while generating: %s", full)
            self.error = full.splitlines()[0][:MAX_ERROR_CHARS]
        width = logits.shape[-1]
        if self._matcher.is_stopped() or self.error is not None:
            return self._only_eos(logits)
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = bits[: self._vocab_size].astype(bool)
        if allowed[self._eos] and np.count_nonzero(allowed) == 1:
            return self._only_eos(logits)
        mask = mx.array(allowed)
        if width != self._vocab_size:  # embeddings padded past the tokenizer, or the reverse
            mask = mx.pad(mask, (0, max(0, width - self._vocab_size)))[:width]
        return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _only_eos(self, logits: mx.array) -> mx.array:
        """EOS, certain: the grammar allows nothing else, whatever came before in the chain
        (`min_tokens` masks EOS, and masking the rest too left no token at all: a NaN draw)."""
        eos = mx.arange(logits.shape[-1]) == self._eos
        certain = mx.where(eos, mx.array(0.0, logits.dtype), mx.array(-mx.inf, logits.dtype))
        return mx.broadcast_to(certain, logits.shape)


class GrammarFactory:
    """Structured-output processors for the engine.

    A constraint from handlers in this process (thread mode) carries its grammar as their
    check compiled it, on their llguidance tokenizer (`Constraint.compiled`): each row starts
    from a copy, and nothing is compiled or built here. One that crossed a process boundary
    (the engine process, the ranks of --distributed) comes as text and is compiled here, on a
    tokenizer of this factory's own: built as the engine loads with `build_at_load` (where
    every request crosses a boundary, so that the first structured one does not wait for it),
    else when the first such constraint comes."""

    def __init__(
        self, hf_tokenizer: object, vocab_size: int, eos: int, build_at_load: bool = False
    ) -> None:
        self.hf_tokenizer = hf_tokenizer  # the model's (stop strings decode with it too)
        self._vocab_size = vocab_size
        self._eos = eos
        self._checker: GrammarChecker | None = None
        if build_at_load:
            # A tokenizer llguidance cannot read leaves structured output unavailable (the
            # requests that ask for it fail alone); the model serves on.
            self._checker = GrammarChecker(hf_tokenizer, vocab_size, eos)

    def processor(self, constraint: Constraint) -> GrammarProcessor:
        compiled = constraint.compiled
        if compiled is not None:
            matcher = compiled.deep_copy()  # rows of n > 1 share the constraint: each its own
        else:
            matcher = llguidance.LLMatcher(self._tokenizer(), constraint.grammar, log_level=0)
        return GrammarProcessor(matcher, self._vocab_size, self._eos)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._checker is None:
            self._checker = GrammarChecker(self.hf_tokenizer, self._vocab_size, self._eos)
        tokenizer = self._checker.tokenizer
        if tokenizer is None:
            raise ValueError(self._checker.unavailable)
        return tokenizer
