"""A draft model as a draft source: a second, smaller mlx-lm model with the target's
tokenizer, with its own batched cache beside the target's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .caches import RaggedKVCache


class DraftModel:
    """Drafts K tokens for every row in K batched forwards of the draft model (its argmax,
    so the draft is deterministic and verification is exact for sampled rows too).

    Its cache rolls back per row like the target's. A row's draft cache is built when
    it joins (the draft runs over the row's tokens); steps without drafts do not run the
    draft, so a row may lag: the next draft first runs it over what it missed.
    """

    def __init__(self, model: Any, prefill_step_size: int = 512) -> None:
        supported, reason = draft_supported(model)
        if not supported:
            raise ValueError(f"the draft model cannot speculate: {reason}")
        self.model = model
        self._step = prefill_step_size
        self._cache: list[Any] = []
        self._held: list[int] = []  # tokens of each row the draft cache holds
        self._fed: list[int] = []  # ... after the last `draft`, before `accepted`
        self._k = 0  # draft length of the last `draft`

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._cache)

    def extend(self, tokens: Sequence[list[int]]) -> None:
        """Rows join empty: the draft runs over a row's tokens at its first draft (the
        catch-up), so a row that never drafts (the batch too large, drafts not paying)
        costs the draft nothing."""
        if not tokens:
            return
        empty = [RaggedKVCache.blank(len(tokens)) for _ in make_prompt_cache(self.model)]
        if not self._cache:
            self._cache = empty
        else:
            for mine, theirs in zip(self._cache, empty, strict=True):
                mine.extend(theirs)
        self._held.extend(0 for _ in tokens)

    def filter(self, keep: Sequence[int]) -> None:
        if not keep:
            self._cache = []
        else:
            for layer in self._cache:
                layer.filter(list(keep))
        self._held = [self._held[i] for i in keep]

    def draft(
        self, tokens: Sequence[list[int]], pending: Sequence[int], ks: Sequence[int]
    ) -> list[list[int]]:
        k = max(ks)
        missing = [[*t[held:], y] for t, held, y in zip(tokens, self._held, pending, strict=True)]
        token = mx.argmax(self._catch_up(missing), axis=-1)
        for layer in self._cache:
            layer.checkpoint([k - 1] * len(missing))
        drafted = [token]
        for _ in range(k - 1):
            logits = self.model(token[:, None], cache=self._cache)
            token = mx.argmax(logits[:, -1], axis=-1)
            drafted.append(token)
        rows = mx.stack(drafted, axis=1)
        mx.eval(rows)
        # The cache now holds each context, its pending token and all drafts but the last.
        self._fed = [len(t) + k for t in tokens]
        self._k = k
        return [row[:n] for row, n in zip(rows.tolist(), ks, strict=True)]

    def _catch_up(self, missing: list[list[int]]) -> mx.array:
        """Run each row's missing tokens (right-padded, in chunks); the logits after each
        row's last one, (B, V)."""
        lengths = [len(m) for m in missing]
        width = max(lengths)
        inputs = mx.array([m + m[-1:] * (width - len(m)) for m in missing], dtype=mx.uint32)
        for layer in self._cache:
            layer.checkpoint(lengths)
        last = mx.array([n - 1 for n in lengths])
        picked = None
        for start in range(0, width, self._step):
            logits = self.model(inputs[:, start : start + self._step], cache=self._cache)
            span = logits.shape[1]
            at = mx.clip(last - start, 0, span - 1)
            here = mx.take_along_axis(logits, at[:, None, None], axis=1)[:, 0]
            inside = (last >= start) & (last < start + span)
            picked = here if picked is None else mx.where(inside[:, None], here, picked)
            if width > self._step:
                mx.eval(picked, [c.state for c in self._cache])
        for layer in self._cache:
            layer.rollback(lengths)  # the right padding goes
        assert picked is not None
        return picked

    def accepted(self, kept: Sequence[int]) -> None:
        # Drafts past the first k-1 were never run through the draft model.
        fed = [min(n, self._k - 1) for n in kept]
        for layer in self._cache:
            layer.rollback(fed)
        drop = self._k - 1
        self._held = [f - drop + n for f, n in zip(self._fed, fed, strict=True)]


def draft_supported(model: Any) -> tuple[bool, str]:
    """(True, "") for a draft model of full-attention layers only: its catch-up pads rows
    by up to a whole context, which only the ragged KV cache gives back at any length."""
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
    if kinds:
        return (
            False,
            f"a draft model must keep only KVCache layers, this one keeps {', '.join(kinds)}",
        )
    return True, ""


def check_draft_compatible(target: Any, draft: Any) -> None:
    """Raise ValueError unless the two tokenizers share the vocabulary and special tokens
    (mlx-lm TokenizerWrappers or Hugging Face tokenizers)."""
    problems = []
    ours, theirs = target.get_vocab(), draft.get_vocab()
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        problems.append(
            f"vocabularies differ ({len(ours)} vs {len(theirs)} tokens, {differ} entries differ)"
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "all_special_tokens"):
        a, b = getattr(target, name, None), getattr(draft, name, None)
        if a != b:
            problems.append(f"{name} differs ({a!r} vs {b!r})")
    a, b = set(getattr(target, "eos_token_ids", ())), set(getattr(draft, "eos_token_ids", ()))
    if a != b:
        problems.append(f"eos_token_ids differ ({sorted(a)} vs {sorted(b)})")
    if problems:
        raise ValueError(
            "the draft model does not share the target's tokenizer: " + "; ".join(problems)
        )
