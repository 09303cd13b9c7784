"""The decoding rows of the engine's batch: one forward a step for every row, sampling, stop
and length checks (engine thread only).

Each step runs the rows' last tokens through the model, samples the next ones and starts
evaluating them, then waits for the tokens the step before sampled: one step of the pipeline
is always in flight, as in mlx-lm's own generation loop. The step's logprobs are evaluated as
one array (`StepRows`); a row is a slice of it that only a reader evaluates.

The caches are mlx-lm's batch caches (or this package's kinds with the same methods): a
joining batch's layers `extend` the running ones, leaving rows `filter` them, a finished row
`extract`s its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import TokenBuffer

from ..messages import FINISH_LENGTH, FINISH_STOP
from .row_inputs import RowContext, RowInputs


class StepRows(list):
    """The rows of one step's logprobs, and the array they slice."""

    __slots__ = ("whole",)

    def __init__(self, whole: mx.array) -> None:
        super().__init__(whole)
        self.whole = whole


def evaluable(value: Any) -> Any:
    """The array in place of its rows, while the rows are still just its rows (a batch that
    grew in the meantime has rows of another array too: those go as they are)."""
    if isinstance(value, StepRows) and len(value) == value.whole.shape[0]:
        return value.whole
    return value


def merge_caches(rows: Sequence[Sequence[Any]]) -> list[Any]:
    """One batch cache per layer from each row's own caches (the cache kind's `merge`)."""
    if not rows:
        return []
    merged = []
    for i, first in enumerate(rows[0]):
        if not hasattr(first, "merge"):
            raise ValueError(f"{type(first).__name__} cannot be batched with a history")
        merged.append(first.merge([row[i] for row in rows]))
    return merged


def extend_caches(caches: list[Any], joining: list[Any]) -> list[Any]:
    """The running batch's layers with a joining batch's rows appended."""
    if not caches:
        return joining
    if not joining:
        return caches
    for running, more in zip(caches, joining, strict=True):
        running.extend(more)
    return caches


@dataclass(slots=True)
class DecodeResponse:
    """One token of one row. A finished row's last response carries its cache and tokens."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list[Any] | None
    all_tokens: list[int] | None


class DecodeBatch:
    """The rows that decode, by position: their caches (one batch cache per layer), tokens,
    samplers, logits processors, stop matchers and length limits. A new batch runs its rows'
    first forward at once (their last prompt token), so their first token is sampled.

    Each row keeps its inputs beside its tokens (`row_inputs`, row_inputs.py: a multimodal RoPE
    delta, a LoRA adapter), which `context` sets for every forward (`forward`)."""

    Response = DecodeResponse

    def __init__(
        self,
        model: Any,
        uids: list[int],
        inputs: mx.array,
        prompt_cache: list[Any],
        tokens: list[list[int]],
        samplers: list[Any],
        fallback_sampler: Any,
        logits_processors: list[Sequence[Any]],
        stop_sequences: list[StopSequences],
        max_tokens: list[int],
        context: RowContext | None = None,
        row_inputs: list[RowInputs] | None = None,
        grouping: Callable[[list[Any]], list[Any]] | None = None,
    ) -> None:
        """`grouping`: makes a joining batch's layers into row groups (row_groups), if set."""
        self.model = model
        self.grouping = grouping
        self.context = context or RowContext()
        self.row_inputs = row_inputs if row_inputs is not None else [RowInputs() for _ in uids]
        self.uids = uids
        self.prompt_cache = prompt_cache
        self.tokens = tokens
        self.samplers = samplers
        self.fallback_sampler = fallback_sampler
        self.logits_processors = logits_processors
        self.stop_sequences = stop_sequences
        self.max_tokens = max_tokens
        self._current_tokens: mx.array | None = None
        self._current_logprobs: list[Any] = []
        self._next_tokens: mx.array | None = inputs
        self._next_logprobs: list[Any] = []
        self._token_context = [TokenBuffer(t) for t in tokens]
        self._num_tokens = [0] * len(uids)
        self._matchers = [s.matcher() for s in stop_sequences]
        if uids:
            self._step()

    @classmethod
    def empty(cls, model: Any, fallback_sampler: Any, **kwargs: Any) -> Self:
        """An empty batch, as the runner starts with."""
        return cls(
            model=model,
            uids=[],
            inputs=mx.array([], dtype=mx.uint32),
            prompt_cache=[],
            tokens=[],
            samplers=[],
            fallback_sampler=fallback_sampler,
            logits_processors=[],
            stop_sequences=[],
            max_tokens=[],
            **kwargs,
        )

    def __len__(self) -> int:
        return len(self.uids)

    def extend(self, batch: DecodeBatch) -> None:
        """`batch`'s rows join at the end, with their pending tokens."""
        self.uids.extend(batch.uids)
        self.prompt_cache = extend_caches(self.prompt_cache, self._joining(batch.prompt_cache))
        self.tokens.extend(batch.tokens)
        self.samplers.extend(batch.samplers)
        self.logits_processors.extend(batch.logits_processors)
        self.max_tokens.extend(batch.max_tokens)
        self.stop_sequences.extend(batch.stop_sequences)
        self.row_inputs.extend(batch.row_inputs)
        self._current_tokens = _joined(self._current_tokens, batch._current_tokens)
        self._current_logprobs = _rows(self._current_logprobs, batch._current_logprobs)
        self._next_tokens = _joined(self._next_tokens, batch._next_tokens)
        self._next_logprobs = _rows(self._next_logprobs, batch._next_logprobs)
        self._token_context.extend(batch._token_context)
        self._num_tokens.extend(batch._num_tokens)
        self._matchers.extend(batch._matchers)

    def _joining(self, caches: list[Any]) -> list[Any]:
        """A joining batch's layers as this batch holds them: in row groups, with `grouping`."""
        return caches if self.grouping is None else self.grouping(caches)

    def filter(self, keep: list[int]) -> None:
        """Only the rows at positions `keep` stay, in that order."""
        self.uids = [self.uids[i] for i in keep]
        if not keep:
            self.prompt_cache.clear()
        else:
            for cache in self.prompt_cache:
                cache.filter(keep)
        self.tokens = [self.tokens[i] for i in keep]
        self.samplers = [self.samplers[i] for i in keep]
        self.logits_processors = [self.logits_processors[i] for i in keep]
        self.max_tokens = [self.max_tokens[i] for i in keep]
        self.stop_sequences = [self.stop_sequences[i] for i in keep]
        self.row_inputs = [self.row_inputs[i] for i in keep]
        assert self._next_tokens is not None or not keep
        self._next_tokens = self._next_tokens[mx.array(keep)] if keep else None
        self._next_logprobs = [self._next_logprobs[i] for i in keep]
        self._token_context = [self._token_context[i] for i in keep]
        self._num_tokens = [self._num_tokens[i] for i in keep]
        self._matchers = [self._matchers[i] for i in keep]

    def extract_cache(self, i: int) -> list[Any]:
        return [cache.extract(i) for cache in self.prompt_cache]

    @property
    def plain(self) -> bool:
        """No row has inputs beside its tokens (its forwards set nothing)."""
        return all(row.plain for row in self.row_inputs)

    @contextlib.contextmanager
    def forwards_through(self, model: Any) -> Iterator[None]:
        """Every forward within goes through `model` in place of the batch's own (a prompt's
        chunk riding in the decoding rows' forward: fused_prefill's `FusingModel`)."""
        own, self.model = self.model, model
        try:
            yield
        finally:
            self.model = own

    def forward(self, inputs: mx.array, cache: Any = None) -> mx.array:
        """The model on `inputs` (a row each) over `cache` (the batch's by default), each row
        at its positions and with its adapter (neither set where no row has one)."""
        cache = self.prompt_cache if cache is None else cache
        if self.plain:
            return self.model(inputs, cache=cache)
        with self.context.forward(self.row_inputs):
            return self.model(inputs, cache=cache)

    def _sampler(self, i: int) -> Any:
        sampler = self.samplers[i] if self.samplers else None
        return self.fallback_sampler if sampler is None else sampler

    # ----- one step -----

    def _step(self) -> tuple[list[int], list[Any]]:
        """Run the pending tokens, sample the next ones (left evaluating), and return the
        pending tokens and their logprobs once evaluated."""
        self._current_tokens = inputs = self._next_tokens
        self._current_logprobs = self._next_logprobs
        assert inputs is not None
        logits = self.forward(inputs[:, None])[:, -1, :]
        contexts: list[mx.array] = []
        if any(self.logits_processors):
            logits = self._run_processors(logits, inputs, contexts)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [self._sampler(i) for i in range(len(self.uids))]
        if all(s is samplers[0] for s in samplers):
            sampled = samplers[0](logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)])
        self._next_tokens = sampled
        self._next_logprobs = StepRows(logprobs)
        mx.async_eval(sampled, logprobs, contexts)
        mx.eval(inputs, evaluable(self._current_logprobs))
        tokens = inputs.tolist()
        for row, token in zip(self.tokens, tokens, strict=True):
            row.append(token)
        return tokens, self._current_logprobs

    def _run_processors(
        self, logits: mx.array, inputs: mx.array, contexts: list[mx.array]
    ) -> mx.array:
        """Each row's logits processors on its logits (rows, vocab), given its tokens so far
        and `inputs` (rows,), the token each row just ran (its context, into `contexts`)."""
        rows = []
        for e, processors in enumerate(self.logits_processors):
            row = logits[e : e + 1]
            if processors:
                context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
                contexts.append(context)
                for processor in processors:
                    row = processor(context, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def next(self) -> list[DecodeResponse]:
        """One step: a token for every row; finished rows leave the batch."""
        if not self.uids:
            return []
        tokens, logprobs = self._step()
        keep, responses = [], []
        for i, uid in enumerate(self.uids):
            finish = self._advance(i, tokens[i])
            cache = row_tokens = None  # a finished row's last response carries them
            if finish is None:
                keep.append(i)
            else:
                cache, row_tokens = self.extract_cache(i), self.tokens[i]
            responses.append(DecodeResponse(uid, tokens[i], logprobs[i], finish, cache, row_tokens))
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _advance(self, i: int, token: int) -> str | None:
        """Row i emits `token`: its finish reason, if its length or a stop sequence ends it."""
        self._num_tokens[i] += 1
        finish = FINISH_LENGTH if self._num_tokens[i] >= self.max_tokens[i] else None
        return FINISH_STOP if self._matchers[i].advance(token) else finish


def _joined(a: mx.array | None, b: mx.array | None) -> mx.array | None:
    if a is None or a.size == 0:
        return b
    if b is None or b.size == 0:
        return a
    return mx.concatenate([a, b])


def _rows(a: list[Any], b: list[Any]) -> list[Any]:
    """Two batches' per-row logprobs, one step's whole array kept where one side is empty."""
    if not a:
        return b
    if not b:
        return a
    return [*a, *b]
