"""Samplers, logits processors, stop matchers and logprobs, built with mlx-lm's helpers.

The decoding batch samples the whole batch in one call only when every row holds the same
sampler object, and runs logits processors row by row as soon as any row has one. So
equal sampling settings share one sampler object, and neutral penalties build nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import apply_top_k, apply_top_p, greedy_sampler, make_logits_processors

from ..codec import TextCodec
from ..messages import GenerationRequest, PenaltySpec, SamplingSpec, TokenLogprob
from ..text import TextTracker
from .constraints import GrammarFactory

Sampler = Callable[[mx.array], mx.array]
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class _BoundedCache(Generic[K, V]):
    """A small LRU map; requests may carry arbitrary floats, so the key space is open."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        value = self._items.get(key)
        if value is None:
            value = build()
            self._items[key] = value
            if len(self._items) > self._capacity:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return value


@mx.compile
def _apply_min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    """mlx-lm's min-p filter, with min_p as an array (see `_filters`)."""
    threshold = mx.max(logprobs, axis=-1, keepdims=True) + log_min_p
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def _filters(spec: SamplingSpec, vocab_size: int) -> list[Sampler]:
    """top-p, min-p, top-k, in mlx-lm's order. The float settings go in as arrays: mlx-lm's
    compiled filters take them as Python floats, which compiles them afresh for every new
    value (about a second each, on the engine thread, stalling every request)."""
    filters: list[Sampler] = []
    if spec.top_p < 1.0:
        top_p = mx.array(spec.top_p, dtype=mx.float32)
        filters.append(lambda x: apply_top_p(x, top_p))
    if spec.min_p > 0.0:
        log_min_p = mx.array(math.log(spec.min_p), dtype=mx.float32)
        filters.append(lambda x: _apply_min_p(x, log_min_p))
    if 0 < spec.top_k < vocab_size:  # one that keeps the whole vocabulary is no top-k
        filters.append(lambda x: apply_top_k(x, spec.top_k))
    return filters


class RandomKeys:
    """One engine's own random stream, for requests without a seed. MLX's global random state
    is shared by every engine in the process (and anyone may reseed it)."""

    def __init__(self, seed: int) -> None:
        self._key = mx.random.key(seed % 2**32)

    def next(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key


class _Filtered:
    """The distribution a sampler draws from: filters, then the temperature."""

    _filters: list[Sampler]
    _scale: mx.array | float

    # Speculation draws each position itself: the distribution and the keys, apart.
    def log_probs(self, logprobs: mx.array) -> mx.array:
        """The filtered, temperature-scaled log-probabilities a draw samples from."""
        for apply in self._filters:
            logprobs = apply(logprobs)
        return logprobs * self._scale


class _Sampler(_Filtered):
    """Filters, then a draw with the engine's own random stream (requests without a seed).
    One instance serves every row with the same settings, so the batch samples in one call."""

    def __init__(self, spec: SamplingSpec, vocab_size: int, keys: RandomKeys) -> None:
        self._filters = _filters(spec, vocab_size)
        self._scale = mx.array(1.0 / spec.temperature, dtype=mx.float32)
        self._keys = keys

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(self.log_probs(logprobs), key=self._keys.next())

    def keys_ahead(self, n: int) -> list[mx.array]:
        """Keys for the next `n` draws (unseeded: fresh keys; unused ones are dropped)."""
        return [self._keys.next() for _ in range(n)]

    def consume(self, n: int) -> None:
        """`n` of the keys from `keys_ahead` were used (nothing to do without a seed)."""


class SeededSampler(_Filtered):
    """A sampler with its own random key: a seed gives the same draws whatever else runs.

    Seeded requests never touch MLX's global random state, so they neither disturb nor are
    disturbed by other requests. Each request gets its own instance (the key advances)."""

    def __init__(self, spec: SamplingSpec, vocab_size: int) -> None:
        assert spec.seed is not None
        self._key = mx.random.key(spec.seed % 2**32)
        self._scale = 1.0 / spec.temperature
        self._filters = _filters(spec, vocab_size)

    def __call__(self, logprobs: mx.array) -> mx.array:
        keys = mx.random.split(self._key)
        self._key = keys[0]
        return mx.random.categorical(self.log_probs(logprobs), key=keys[1])

    def keys_ahead(self, n: int) -> list[mx.array]:
        """The keys of the next `n` draws, as `__call__` would use them, without using them:
        speculation peeks, then `consume`s only the draws it kept, so a seeded row draws
        exactly what it would without speculation."""
        keys, key = [], self._key
        for _ in range(n):
            pair = mx.random.split(key)
            key = pair[0]
            keys.append(pair[1])
        return keys

    def consume(self, n: int) -> None:
        for _ in range(n):
            self._key = mx.random.split(self._key)[0]


class ThinkingBudget:
    """Forces the end of the reasoning section once it has run `budget` tokens.

    The section opens with the tokenizer's think-start sequence (in the prompt, as chat
    templates do, or generated) and closes with its think-end sequence; past the budget the
    end sequence is forced token by token."""

    def __init__(self, budget: int, start: Sequence[int], end: Sequence[int]) -> None:
        self._budget = budget
        self._start = tuple(start)
        self._end = tuple(end)
        self._recent: deque[int] = deque(maxlen=max(len(self._start), len(self._end)))
        self._seen = 0
        self._inside = False
        self._count = 0
        self._forcing = 0  # how much of the end sequence has been forced so far

    def _observe(self, new: list[int]) -> None:
        for token in new:
            self._recent.append(token)
            window = tuple(self._recent)
            if window[-len(self._start) :] == self._start:
                self._inside, self._count = True, 0
            elif window[-len(self._end) :] == self._end:
                self._inside, self._forcing = False, 0
            elif self._inside:
                self._count += 1
        self._seen += len(new)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # `tokens` is the whole context: on the first call the prompt, then one more each step.
        first = self._seen == 0
        self._observe(tokens[self._seen :].tolist())
        if first:
            self._count = 0  # only generated tokens count against the budget
        if not self._inside or self._count < self._budget:
            return logits
        forced = self._end[min(self._forcing, len(self._end) - 1)]
        self._forcing += 1
        keep = mx.arange(logits.shape[-1]) == forced
        return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))


def finite_logits(tokens: mx.array, logits: mx.array) -> mx.array:
    """The logits kept finite, with room to add to them: a penalty at an extreme a request may
    ask (a repetition penalty of 1e-38 divides a logit by it) overflows to inf, and the
    logprobs' inf - inf is a NaN for every token."""
    bound = mx.finfo(logits.dtype).max / 4
    return mx.clip(logits, -bound, bound)


class MinTokens:
    """Masks the stop tokens (EOS included) until the row has generated `min_tokens`."""

    def __init__(self, min_tokens: int, prompt_tokens: int, stop_ids: Sequence[int]) -> None:
        self._until = prompt_tokens + min_tokens  # context length from which stopping is allowed
        self._stop_ids = mx.array(sorted(stop_ids), dtype=mx.int32)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # `tokens` is the whole context: the prompt and what the row has generated so far.
        if tokens.shape[-1] >= self._until or self._stop_ids.size == 0:
            return logits
        masked = mx.array(-mx.inf, dtype=logits.dtype)
        return logits.at[..., self._stop_ids].add(masked)


class SamplingFactory:
    """Per-engine builder of per-request sampling objects, sharing what can be shared."""

    def __init__(
        self,
        vocab_size: int,
        grammars: GrammarFactory,
        seed: int,
        think_start: Sequence[int] | None = None,
        think_end: Sequence[int] | None = None,
        cache_capacity: int = 128,
    ) -> None:
        self._vocab_size = vocab_size
        self._keys = RandomKeys(seed)
        self._grammars = grammars
        self._think = (tuple(think_start), tuple(think_end)) if think_start and think_end else None
        self._samplers: _BoundedCache[SamplingSpec, Sampler] = _BoundedCache(cache_capacity)
        self._stops: _BoundedCache[frozenset[int], StopSequences] = _BoundedCache(cache_capacity)
        self._codec: TextCodec | None = None  # decodes the rows that have stop strings

    def stop_text(self, request: GenerationRequest) -> TextTracker | None:
        """The text a row with stop strings watches: the handlers' `TextTracker` on the
        model's tokenizer, so the engine ends the row (finish `stop`) at the token where the
        handler's finds the stop string, and the handler cuts the text."""
        if not request.stop_strings:
            return None
        if self._codec is None:
            self._codec = TextCodec(self._grammars.hf_tokenizer)
        decoder = self._codec.decoder()
        return TextTracker(decoder, request.stop_strings, min_tokens=request.min_tokens)

    def sampler(self, spec: SamplingSpec) -> Sampler:
        if spec.greedy:
            return greedy_sampler
        if spec.seed is not None:
            return SeededSampler(spec, self._vocab_size)
        return self._samplers.get_or_build(
            spec, lambda: _Sampler(spec, self._vocab_size, self._keys)
        )

    def processors(self, request: GenerationRequest) -> list[LogitsProcessor]:
        """The request's own processors, in order: penalties, thinking budget, grammar."""
        chain = self._penalties(request.penalties)
        if request.min_tokens > 0:
            chain.append(MinTokens(request.min_tokens, len(request.prompt), request.stop_token_ids))
        if request.thinking_budget is not None and self._think is not None:
            chain.append(ThinkingBudget(request.thinking_budget, *self._think))
        if request.constraint is not None:
            chain.append(self._grammars.processor(request.constraint))
        return chain

    @staticmethod
    def _penalties(spec: PenaltySpec) -> list[LogitsProcessor]:
        if not spec.active:
            return []
        chain = make_logits_processors(
            logit_bias=dict(spec.logit_bias) or None,
            repetition_penalty=spec.repetition_penalty if spec.repetition_penalty != 1.0 else None,
            frequency_penalty=spec.frequency_penalty or None,
            presence_penalty=spec.presence_penalty or None,
        )
        return [*chain, finite_logits]

    def stop_sequences(self, stop_token_ids: frozenset[int]) -> StopSequences:
        return self._stops.get_or_build(
            stop_token_ids, lambda: StopSequences([[t] for t in sorted(stop_token_ids)])
        )


def gather_logprobs(
    tokens: Sequence[int], rows: Sequence[mx.array], top_n: Sequence[int]
) -> list[TokenLogprob]:
    """Token logprob and top-N for several rows, pulled to Python in one evaluation."""
    logprobs = mx.stack(list(rows)).astype(mx.float32)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    k = min(max(top_n), logprobs.shape[-1])
    if k > 0:
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_values, axis=-1)
        top_ids = mx.take_along_axis(top_ids, order, axis=-1)
        top_values = mx.take_along_axis(top_values, order, axis=-1)
        mx.eval(chosen, top_ids, top_values)
        ids_list, values_list = top_ids.tolist(), top_values.tolist()
    else:
        mx.eval(chosen)
        ids_list = values_list = [[] for _ in tokens]
    return [
        TokenLogprob(logprob=lp, top_ids=tuple(ids[:n]), top_logprobs=tuple(vals[:n]))
        for lp, ids, vals, n in zip(chosen.tolist(), ids_list, values_list, top_n, strict=True)
    ]
