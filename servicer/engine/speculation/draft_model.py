"""A draft model as a draft source: a second, smaller mlx-lm model with the target's
tokenizer, with its own batched cache beside the target's rows."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

# Absolute, the module itself: cache_kinds imports this package's caches, so it may be
# mid-import when this module loads.
import servicer.engine.cache_kinds as cache_kinds

from .caches import RaggedKVCache

_IN_BATCH = 32  # a row at most this far behind catches up in the batched draft pass
_MIN_CHUNK = 16  # a lagging row's catch-up moves at least this much in a step


@dataclass(slots=True)
class _Lane:
    """A row catching up on its own: its draft cache and the tokens it holds."""

    cache: list[Any]
    held: int


class DraftModel:
    """Drafts K tokens for every row in K batched forwards of the draft model (its argmax,
    so the draft is deterministic and verification is exact for sampled rows too).

    Its cache rolls back per row like the target's. Rows join empty and steps without drafts
    do not run the draft, so a row may lag: the next draft first runs it over what it
    missed. A row a few tokens behind does so in the batched draft pass. One further behind
    (one that just joined with its whole prompt) catches up alone, within the step's plan:
    `begin_step(tokens)` gives the step's share of the budget in catch-up tokens (0 in a step
    whose target prefills prompts; a step with any share moves at least `_MIN_CHUNK`), and it
    drafts nothing until it is through. It decodes as without speculation meanwhile, so the
    running streams never wait for a long context's catch-up. No share given (None): no
    budget, a row catches up at its first draft."""

    def __init__(self, model: Any, prefill_step_size: int = 512) -> None:
        supported, reason = draft_supported(model)
        if not supported:
            raise ValueError(f"the draft model cannot speculate: {reason}")
        self.model = model
        self._step = prefill_step_size
        self._allowance: int | None = None  # this step's catch-up tokens (None: no bound)
        self._cache: list[Any] = []
        self._held: list[int] = []  # tokens of each row the batched draft cache holds
        self._lanes: list[_Lane | None] = []  # rows catching up alone
        self._base: list[int] = []  # each row's `_held` before the last `draft`'s drafts
        self._drafting: list[bool] = []  # rows the last `draft` drafted for
        self._k = 0  # draft length of the last `draft` (0: it fed no drafts)
        self.catch_up_tokens = 0  # catch-up tokens the last step ran alone
        self.catch_up_seconds = 0.0  # and what they took

    @property
    def nbytes(self) -> int:
        lanes = sum(c.nbytes for lane in self._lanes if lane is not None for c in lane.cache)
        return sum(c.nbytes for c in self._cache) + lanes

    def begin_step(self, tokens: int | None) -> None:
        """A step begins; `tokens`: its catch-up share (None: no bound)."""
        self._allowance = tokens
        self.catch_up_tokens, self.catch_up_seconds = 0, 0.0

    def extend(self, tokens: Sequence[list[int]]) -> None:
        """Rows join empty: the draft runs over a row's tokens once it drafts (the catch-up), so a
        row that never drafts (the batch too large, drafts not paying) costs the draft nothing."""
        if not tokens:
            return
        empty = [RaggedKVCache.blank(len(tokens)) for _ in make_prompt_cache(self.model)]
        if not self._cache:
            self._cache = empty
        else:
            for mine, theirs in zip(self._cache, empty, strict=True):
                mine.extend(theirs)
        self._held.extend(0 for _ in tokens)
        self._lanes.extend(None for _ in tokens)

    def filter(self, keep: Sequence[int]) -> None:
        if not keep:
            self._cache = []
        else:
            for layer in self._cache:
                layer.filter(list(keep))
        self._held = [self._held[i] for i in keep]
        self._lanes = [self._lanes[i] for i in keep]

    def draft(
        self, tokens: Sequence[list[int]], pending: Sequence[int], ks: Sequence[int]
    ) -> list[list[int]]:
        self._catch_up_alone(tokens, ks)
        ready = [
            k > 0 and lane is None and len(t) - held <= _IN_BATCH
            for t, held, lane, k in zip(tokens, self._held, self._lanes, ks, strict=True)
        ]
        self._base, self._drafting, self._k = list(self._held), ready, 0
        if not any(ready):
            return [[] for _ in tokens]
        k = max(n for n, r in zip(ks, ready, strict=True) if r)
        missing = [
            [*t[held:], y] if r else []
            for t, held, y, r in zip(tokens, self._held, pending, ready, strict=True)
        ]
        token = mx.argmax(self._catch_up(missing), axis=-1)
        self._base = [held + len(m) for held, m in zip(self._held, missing, strict=True)]
        for layer in self._cache:
            layer.checkpoint([k - 1] * len(missing))
        drafted = [token]
        for _ in range(k - 1):
            logits = self.model(token[:, None], cache=self._cache)
            token = mx.argmax(logits[:, -1], axis=-1)
            drafted.append(token)
        rows = mx.stack(drafted, axis=1)
        mx.eval(rows)
        # The ready rows' caches now hold each context, its pending token and all drafts
        # but the last; the others' drafts-to-be are padding, rolled back in `accepted`.
        self._k = k
        return [row[:n] if r else [] for row, n, r in zip(rows.tolist(), ks, ready, strict=True)]

    def _catch_up_alone(self, tokens: Sequence[list[int]], ks: Sequence[int]) -> None:
        """Rows that want drafts but lag too far run their missing tokens alone (batch of one, no
        padding), within this step's budget; a row that is through rejoins the batched cache."""
        spent, ran = 0.0, 0
        for i, (context, k) in enumerate(zip(tokens, ks, strict=True)):
            lane = self._lanes[i]
            if k == 0 or (lane is None and len(context) - self._held[i] <= _IN_BATCH):
                continue
            if lane is None:  # it leaves the batched cache with what it holds there
                held = self._held[i]
                caches = [layer.extract(i) for layer in self._cache] if held else None
                lane = _Lane(caches or make_prompt_cache(self.model), held)
                for layer in self._cache:
                    layer.put_row(i, None)
                self._held[i], self._lanes[i] = 0, lane
            while lane.held < len(context):
                n = self._chunk(ran)
                n = min(n, len(context) - lane.held)
                if n <= 0:
                    break
                started = time.perf_counter()
                chunk = mx.array([context[lane.held : lane.held + n]], dtype=mx.uint32)
                self.model(chunk, cache=lane.cache)
                mx.eval([c.state for c in lane.cache])
                spent, ran, lane.held = (
                    spent + time.perf_counter() - started,
                    ran + n,
                    lane.held + n,
                )
            if lane.held == len(context):  # through: back into the batched cache
                for layer, mine in zip(self._cache, lane.cache, strict=True):
                    layer.put_row(i, mine)
                self._held[i], self._lanes[i] = lane.held, None
        self.catch_up_tokens += ran
        self.catch_up_seconds += spent

    def _chunk(self, ran: int) -> int:
        """Tokens the next catch-up forward may take, `ran` already run this step: what is
        left of the step's share, and at least a small chunk in a step that ran none yet (so
        a lagging row always moves), none in a step with no share."""
        if self._allowance is None:
            return self._step
        if self._allowance <= 0:
            return 0
        left = min(self._step, self._allowance - ran)
        if ran == 0:
            return max(left, _MIN_CHUNK)
        return left if left >= _MIN_CHUNK else 0

    def _catch_up(self, missing: list[list[int]]) -> mx.array:
        """Run each row's missing tokens (right-padded, in chunks; a row with none feeds
        only padding); the logits after each row's last one, (B, V)."""
        lengths = [len(m) for m in missing]
        width = max(lengths)
        inputs = mx.array(
            [m + (m[-1:] or [0]) * (width - len(m)) for m in missing], dtype=mx.uint32
        )
        for layer in self._cache:
            layer.checkpoint(lengths)
        last = mx.array([max(n - 1, 0) for n in lengths])
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
        if self._k == 0:  # the last `draft` fed no drafts
            return
        # Drafts past the first k-1 were never run through the draft model.
        fed = [min(n, self._k - 1) if r else 0 for n, r in zip(kept, self._drafting, strict=True)]
        for layer in self._cache:
            layer.rollback(fed)
        self._held = [base + f for base, f in zip(self._base, fed, strict=True)]
        self._k = 0


def draft_supported(model: Any) -> tuple[bool, str]:
    """(True, "") for a draft model of full-attention layers only: its catch-up pads rows
    by up to a whole context, which only the ragged KV cache gives back at any length."""
    caches = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in caches if not cache_kinds.kind_of(c).drafts})
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
