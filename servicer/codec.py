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
        """Text as mlx-lm encodes a prompt (with the tokenizer's special tokens), but one BOS
        only: text that already starts with the BOS (a rendered chat template) keeps its own."""
        ids = list(self._tokenizer.encode(text))
        bos = getattr(self._tokenizer, "bos_token_id", None)
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            del ids[0]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def decoder(self) -> IncrementalDecoder:
        """A fresh incremental decoder for one request's output."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        return StreamDecoder(backend) if backend is not None else WindowDecoder(self.decode)
