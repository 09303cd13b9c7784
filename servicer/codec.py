"""The model's tokenizer as the handler side uses it: text input, decoded text, stop strings.

It holds the Hugging Face tokenizer only; nothing here touches MLX.
"""

from __future__ import annotations

from typing import Any

from .text import IncrementalDecoder, StreamDecoder, WindowDecoder


class TextCodec:
    def __init__(self, hf_tokenizer: Any) -> None:
        self._tokenizer = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        """Text as the model's tokenizer encodes it by default (its own special tokens)."""
        return list(self._tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def decoder(self) -> IncrementalDecoder:
        """A fresh incremental decoder for one request's output."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        return StreamDecoder(backend) if backend is not None else WindowDecoder(self.decode)
