"""Decoded text of one request as its tokens arrive, and the stop strings found in it.

Pure logic on the handler side. The text comes from the tokenizer's own streaming decoder
(`tokenizers`' DecodeStream, in Rust: about 2 µs a token against 15 µs for decoding a window
in Python); a tokenizer with no Rust backend gets `WindowDecoder`, which does the same by
decoding a sliding window of tokens with the tokenizer's `decode`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete multi-byte character


class IncrementalDecoder(Protocol):
    def step(self, token: int) -> str | None:
        """The text `token` completes (None while a character is still incomplete)."""
        ...


class StreamDecoder:
    """The Rust tokenizer's DecodeStream, which skips special tokens."""

    def __init__(self, backend: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token: int) -> str | None:
        return self._stream.step(self._backend, token)


class WindowDecoder:
    """Decodes a sliding window of tokens (so a token's text can depend on the ones before it,
    as in SentencePiece and byte-level BPE) and keeps only complete characters."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are already in the text
        self._read = 0  # tokens whose text is already out

    def step(self, token: int) -> str | None:
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return None  # no complete character yet
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


class TextTracker:
    """Incremental text with stop-string search. Text that could still be the start of a
    stop string is held back until it cannot be."""

    def __init__(
        self,
        decoder: IncrementalDecoder,
        stops: Sequence[str] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decoder = decoder
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = include_stop
        self._min_tokens = min_tokens  # stop strings count from this many tokens on
        self._tokens = 0
        self.text = ""
        self.matched: str | None = None
        self._released = 0

    def add(self, tokens: Sequence[int]) -> int:
        """Take tokens until a stop string completes; returns how many were taken."""
        for taken, token in enumerate(tokens, start=1):
            self._tokens += 1
            piece = self._decoder.step(token)
            if not piece:
                continue
            start = max(0, len(self.text) - self._hold)
            self.text += piece
            if self._stops and self._tokens >= self._min_tokens and self._find_stop(start):
                return taken
        return len(tokens)

    def _find_stop(self, start: int) -> bool:
        found = [(i, s) for s in self._stops if (i := self.text.find(s, start)) >= 0]
        if not found:
            return False
        index, stop = min(found)
        self.text = self.text[: index + len(stop) if self._include_stop else index]
        self.matched = stop
        return True

    def release(self, final: bool = False) -> str:
        """Text that can be sent now: all of it once finished, else all but a held tail."""
        end = len(self.text) if final or self.matched else len(self.text) - self._hold
        if end <= self._released:
            return ""
        delta = self.text[self._released : end]
        self._released = end
        return delta
