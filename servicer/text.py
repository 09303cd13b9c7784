"""Decoded text of one request as its tokens arrive, and the stop strings found in it.

Pure logic on the handler side: `decode` is the model tokenizer's, passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete multi-byte character


class TextTracker:
    """Incremental detokenisation with stop-string search.

    Text is decoded over a sliding window of tokens (so a token's text can depend on the ones
    before it, as in SentencePiece and byte-level BPE) and only complete characters are kept.
    Text that could still be the start of a stop string is held back until it cannot be.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are already in `text`
        self._read = 0  # tokens whose text is already in `text`
        self.text = ""
        self.matched: str | None = None
        self._released = 0

    def add(self, tokens: Sequence[int]) -> int:
        """Take tokens until a stop string completes; returns how many were taken."""
        for taken, token in enumerate(tokens, start=1):
            self._ids.append(token)
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            if len(after) <= len(before) or after.endswith(REPLACEMENT):
                continue  # no complete character yet
            start = max(0, len(self.text) - self._hold)
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
            if self._stops and self._find_stop(start):
                return taken
        return len(tokens)

    def _find_stop(self, start: int) -> bool:
        found = [(i, s) for s in self._stops if (i := self.text.find(s, start)) >= 0]
        if not found:
            return False
        index, stop = min(found)
        self.text = self.text[:index]
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
