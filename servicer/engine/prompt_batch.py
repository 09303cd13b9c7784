"""The rows whose prompts are going through the model, a chunk a step (engine thread only).

Each row keeps its prompt's remaining segments (cut where the prefix store wants a snapshot,
the last one a single token: the forward that samples the row's first token, which runs as
the row joins the decoding batch) and how far it got. Rows in prefill share one batch cache
per layer; a step's chunks of different lengths are right-padded, the cache told which rows
are shorter (`prepare` / `finalize`, the cache kind's own).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences

from .decode_batch import DecodeBatch, extend_caches, merge_caches
from .row_inputs import RowContext, RowInputs
from .vision import VisionEncoder, chunk_embeddings


@dataclass(slots=True)
class PromptRow:
    """One request waiting for, or in, prefill: its prompt left in segments, the tokens its
    caches hold, and what its decoding will need."""

    uid: int
    segments: list[list[int]]
    max_tokens: int
    cache: list[Any]
    tokens: list[int]  # the tokens its cache holds
    sampler: Any
    processors: Sequence[Any]
    stop: StopSequences
    inputs: RowInputs = field(default_factory=RowInputs)  # beside its tokens, to its end
    done: int = 0  # prompt tokens through the model
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.total = sum(len(s) for s in self.segments)

    @property
    def remaining(self) -> int:
        return self.total - self.done

    @property
    def starting(self) -> bool:
        """Only its last token is left: the row joins the decoding batch this step."""
        return len(self.segments) == 1 and len(self.segments[0]) == 1

    def take(self, n: int) -> tuple[list[int], bool]:
        """Up to `n` tokens of its current segment, and whether that ends the segment."""
        segment = self.segments[0]
        taken, self.segments[0] = segment[:n], segment[n:]
        self.done += len(taken)
        if not self.segments[0]:
            self.segments.pop(0)
            return taken, True
        return taken, False


@dataclass(slots=True)
class PromptProgress:
    """What a step did for one prompt."""

    uid: int
    progress: tuple[int, int]  # (tokens done, tokens in all)
    end_of_segment: bool
    end_of_prompt: bool


class PromptBatch:
    """Rows in prefill, by position, with their merged caches."""

    def __init__(
        self, model: Any, vision: VisionEncoder | None = None, context: RowContext | None = None
    ) -> None:
        self.model = model
        self.vision = vision  # a vision-language model's image side
        self.context = context or RowContext()  # the rows' per-forward hooks
        self.rows: list[PromptRow] = []
        self.prompt_cache: list[Any] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def uids(self) -> list[int]:
        return [row.uid for row in self.rows]

    def add(self, rows: list[PromptRow]) -> None:
        """Rows begin their prefill (their own caches merged into the batch's)."""
        self.prompt_cache = extend_caches(self.prompt_cache, merge_caches([r.cache for r in rows]))
        for row in rows:
            row.cache = []  # the batch holds it now
        self.rows.extend(rows)

    def filter(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.prompt_cache = []
        else:
            for cache in self.prompt_cache:
                cache.filter(keep)

    def extract_cache(self, i: int) -> list[Any]:
        return [cache.extract(i) for cache in self.prompt_cache]

    def split(self, indices: list[int]) -> tuple[list[PromptRow], list[Any]]:
        """The rows at `indices` leave, with their caches (as one batch cache per layer)."""
        indices = sorted(indices)
        leaving = set(indices)
        staying = [i for i in range(len(self.rows)) if i not in leaving]
        rows = [self.rows[i] for i in indices]
        caches = copy.deepcopy(self.prompt_cache) if staying else self.prompt_cache
        for cache in caches:
            cache.filter(indices)
        self.filter(staying)
        return rows, caches

    def prompt(self, chunks: list[list[int]]) -> None:
        """Each row's chunk through the model into its cache (chunks of different lengths
        right-padded)."""
        if len(chunks) != len(self.rows):
            raise ValueError(f"{len(chunks)} chunks for {len(self.rows)} prompts")
        if not chunks:
            return
        starts = [len(row.tokens) for row in self.rows]
        for row, chunk in zip(self.rows, chunks, strict=True):
            row.tokens += chunk
        lengths = [len(c) for c in chunks]
        width = max(lengths)
        padding = [width - n for n in lengths]
        padded = max(padding) > 0
        if padded:
            inputs = mx.array([c + [0] * (width - len(c)) for c in chunks])
            for cache in self.prompt_cache:
                cache.prepare(lengths=lengths, right_padding=padding)
        else:
            inputs = mx.array(chunks)
        embeddings, deepstack = None, contextlib.nullcontext()
        given = [row.inputs for row in self.rows]
        if self.vision is not None:
            images = [row.images for row in given]
            embeddings, deepstack = chunk_embeddings(self.vision, inputs, starts, lengths, images)
        with self.context.forward(given, list(zip(starts, lengths, strict=True))), deepstack:
            self.model(inputs, cache=self.prompt_cache, **(embeddings or {}))
        for row in self.rows:
            row.inputs.prefilled_to(len(row.tokens))
        mx.eval([c.state for c in self.prompt_cache])
        mx.clear_cache()
        if padded:
            for cache in self.prompt_cache:
                cache.finalize()
            mx.eval([c.state for c in self.prompt_cache])
            mx.clear_cache()

    def start_decoding(self, indices: list[int], fallback_sampler: Any) -> DecodeBatch:
        """The rows at `indices` (each with only its last token left) leave prefill as a
        decoding batch, whose construction runs that token."""
        rows, caches = self.split(indices)
        last = mx.array([row.segments[0][0] for row in rows])
        for row in rows:
            row.done, row.segments = row.total, []
        return DecodeBatch(
            self.model,
            [row.uid for row in rows],
            last,
            caches,
            [row.tokens for row in rows],
            [row.sampler for row in rows],
            fallback_sampler,
            [row.processors for row in rows],
            [row.stop for row in rows],
            [row.max_tokens for row in rows],
            context=self.context,
            row_inputs=[row.inputs for row in rows],
        )
