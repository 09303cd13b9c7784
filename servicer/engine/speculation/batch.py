"""A decoding batch that drafts, verifies every row's drafts in one target forward, and
rolls each row back to what it accepted."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

# Absolute, the module itself: cache_kinds imports this package's caches, so it may be
# mid-import when this module loads.
import servicer.engine.cache_kinds as cache_kinds

from ..decode_batch import DecodeBatch, DecodeResponse
from ..prefix.children import common_length
from .config import ModeClock, RowPace, SpeculationConfig, SpeculationCounters, StepClock
from .drafts import DraftSource
from .timing import StepTimer
from .verify import can_speculate, choose

# Steps without drafts per shadow lookup: the promise it feeds is an average, which a sample of
# the steps reads as well (a lookup costs ~5-10 us a row on a slow CPU, a demo model's step 1-2 ms).
SHADOW_EVERY = 16


@dataclass(slots=True)
class Speculator:
    """What a speculating batch drafts with, how, and what it counted."""

    source: DraftSource
    config: SpeculationConfig = field(default_factory=SpeculationConfig)
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    clock: StepClock = field(default_factory=StepClock)
    modes: ModeClock = field(default_factory=ModeClock)
    padding_inert: bool = True  # the model's recurrent layers honour per-row lengths


@dataclass(slots=True)
class _Verified:
    """One step's verification, still to be turned into responses."""

    pending: list[int]  # each row's pending token, emitted first
    drafts: list[list[int]]
    fed: list[list[int]]  # what each row fed the forward: its pending token and drafts
    chosen: list[list[int]]  # the target's draw at each of the row's positions
    logprobs: mx.array  # (B, S, V), the target's, at every verified position
    used_keys: list[int] = field(default_factory=list)  # draws each row kept


class SpeculativeDecodeBatch(DecodeBatch):
    """The decoding batch with drafts.

    Each step, for every row: the pending token (sampled last step, not yet run) plus up to
    K drafts go through ONE target forward for all rows at once, rows with fewer drafts
    right-padded. The row emits its pending token and the drafts the target agrees with;
    the target's draw at the first disagreement (or after the last draft) becomes its
    pending token; its cache is rolled back to exactly the emitted tokens. A step with no
    drafts is the plain (pipelined) step. Rows join (`extend`) and leave (`filter`) as in the
    plain batch."""

    def __init__(self, *args: Any, speculator: Speculator, **kwargs: Any) -> None:
        self.speculator = speculator
        self._paces: list[RowPace] = []
        self._timer = StepTimer(speculator.clock, speculator.modes)
        self._rolls_back = False  # whether the caches are this package's (see extend)
        self._shadow_wait = 0  # steps without drafts until the next shadow lookup
        super().__init__(*args, **kwargs)
        if self.uids:
            speculator.source.extend(self.tokens)
            self._paces = [RowPace() for _ in self.uids]

    def extend(self, batch: DecodeBatch) -> None:
        if not self.uids:
            self.prompt_cache, self._rolls_back = [], False  # mlx-lm's caches again
            self._timer.restart()
        self.speculator.source.extend(batch.tokens)
        self._paces.extend(RowPace() for _ in batch.uids)
        super().extend(batch)

    def _joining(self, caches: list[Any]) -> list[Any]:
        """A joining batch's layers roll back per row as the running rows' do, once they do."""
        if self._rolls_back:
            caches = self._adopted(caches)
        return super()._joining(caches)

    def after_pause(self) -> None:
        self._timer.restart()

    def _adopted(self, caches: list[Any]) -> list[Any]:
        k, inert = self.speculator.config.k_max, self.speculator.padding_inert
        return [cache_kinds.adopt(c, k, inert) for c in caches]

    def _roll_back_ready(self) -> None:
        """The batch's caches as ones that roll back per row, from its first drafting step on.
        Until then (and while the batch is too large to draft) it steps on mlx-lm's own
        caches, whose step is cheaper: a ring per row costs a copy of its window to join
        and a write and mask per row every step."""
        if not self._rolls_back:
            self.prompt_cache, self._rolls_back = self._adopted(self.prompt_cache), True

    def _release(self) -> None:
        """Back to mlx-lm's caches once the batch stops drafting (the mode clock found that
        drafting does not pay at this size, or the batch is past the cap): a plain step on
        the caches that roll back pays their per-row writes and masks (up to 1.6x mlx-lm's
        step on the demo gemma3), and the clock should measure plain steps as they run."""
        self.prompt_cache = [cache_kinds.release(c) for c in self.prompt_cache]
        self._rolls_back = False

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self.speculator.source.filter(keep)
        self._paces = [self._paces[i] for i in keep]

    # ----- one step -----

    def next(self, shares_step_with_prefill: bool = False) -> list[DecodeResponse]:
        """One step (`shares_step_with_prefill`: prompts prefill in it too, so the mode clock
        does not take its time for a decoding step's)."""
        rows = len(self.uids)
        self._timer.step_begins(rows, shares_step_with_prefill)
        if not rows:
            self._timer.forward_begins(waited=False)
            return []
        if self._may_draft(rows):
            responses = self._step_with_drafts()
        else:
            responses = self._plain_step(rows, shadow=rows <= self.speculator.config.max_rows)
        self._timer.step_gave(len(responses))
        return responses

    def _may_draft(self, rows: int) -> bool:
        """Whether any row may draft this step: not in a batch past the cap, nor of a size
        where the mode clock finds that drafting does not pay now (where the batch goes back
        to mlx-lm's caches, and its step is mlx-lm's and little more)."""
        config = self.speculator.config
        if rows <= config.max_rows and (not config.costed or self.speculator.modes.drafting(rows)):
            return True
        self.speculator.counters.record_cutoff()
        if self._rolls_back:
            self._release()
        return False

    def _step_with_drafts(self) -> list[DecodeResponse]:
        ks, probing = self._plan()
        if not any(ks):
            return self._plain_step(len(self.uids), shadow=True)
        pending = self._next_tokens.tolist()  # waits for a plain step's forward
        self._timer.forward_begins(waited=True)
        source = self.speculator.source
        drafts = source.draft(self.tokens, pending, ks)
        if not probing:
            drafts = worth_verifying(self.speculator, self._paces, drafts)
        if any(drafts):
            self._roll_back_ready()
            self._timer.step_ran(len(self.uids), 1 + max(len(d) for d in drafts))
            return self._speculate(pending, drafts)
        source.accepted([0] * len(drafts))
        return self._plain_step(len(self.uids), shadow=False, waited=True)

    def _plain_step(self, rows: int, shadow: bool, waited: bool = False) -> list[DecodeResponse]:
        """The plain step (its forward left running for the next step to wait on). `shadow`:
        the rows' lookups, which did not run, may tell the mode clock what they would have
        drafted; `waited`: the step already read its pending tokens (looking for drafts)."""
        if not waited:
            self._timer.forward_begins(waited=False)
        self._timer.step_ran(rows, 1)
        responses = super().next()
        self.speculator.counters.record_plain(len(responses))
        if shadow:
            self._shadow()
        return responses

    def _shadow(self) -> None:
        """Every `SHADOW_EVERY` steps without drafts: whether the rows' lookups would have
        drafted the tokens they just got, for the mode clock (sources that cannot tell for
        free say nothing)."""
        if self._shadow_wait > 0:
            self._shadow_wait -= 1
            return
        self._shadow_wait = SHADOW_EVERY - 1
        predicted = getattr(self.speculator.source, "predicted", None)
        if predicted is not None and self.speculator.config.costed:
            self.speculator.modes.shadow(len(self.uids), predicted(self.tokens))

    def _plan(self) -> tuple[list[int], bool]:
        """Each row's draft length this step (none while a row's first token is pending; its
        pace, within its max_tokens; nothing for rows with logits processors; no more than the
        verify width the clock expects to give the most tokens a second), and whether this
        step re-measures the widest width."""
        if 0 in self._num_tokens:
            # A row's first token is pending: a plain step sends it as its forward starts,
            # a verify only once a forward several tokens wide is done (+20-27 % first-token
            # time on the real Gemma at c = 1).
            return [0] * len(self.uids), False
        config = self.speculator.config
        ks = []
        for i in range(len(self.uids)):
            budget = self.max_tokens[i] - self._num_tokens[i] - 1
            if budget <= 0 or self.logits_processors[i] or not can_speculate(self._sampler(i)):
                ks.append(0)
            else:
                ks.append(min(self._paces[i].k(config), budget))
        if not any(ks) or not config.costed:
            return ks, False
        rows = len(self.uids)
        width, probing = self.speculator.clock.choose(
            rows, 1 + max(ks), expected_tokens(self._paces, ks)
        )
        if width == 1:
            self.speculator.counters.record_cutoff()
        return [min(k, width - 1) for k in ks], probing

    def _speculate(self, pending: list[int], drafts: list[list[int]]) -> list[Any]:
        width = 1 + max(len(d) for d in drafts)
        fed = [[y, *d] for y, d in zip(pending, drafts, strict=True)]
        rows = [f + [f[0]] * (width - len(f)) for f in fed]
        inputs = mx.array(rows, dtype=mx.uint32)
        for layer in self.prompt_cache:
            layer.checkpoint([len(f) for f in fed])
        logits = self.forward(inputs)
        logits, contexts = self._process(logits, inputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [self._sampler(i) for i in range(len(self.uids))]
        chosen = choose(logprobs, samplers, [1 + len(d) for d in drafts])
        mx.eval(chosen, logprobs, contexts)
        step = _Verified(pending, drafts, fed, [c.tolist() for c in chosen], logprobs)
        return self._settle(step, samplers)

    def _process(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """Logits processors on the first position of the rows that have them (such rows
        draft nothing, so that is their only position), as the plain step runs them."""
        if not any(self.logits_processors):
            return logits, []
        contexts: list[mx.array] = []
        first = self._run_processors(logits[:, 0], inputs[:, 0], contexts)
        return mx.concatenate([first[:, None], logits[:, 1:]], axis=1), contexts

    def _settle(self, step: _Verified, samplers: Sequence[Any]) -> list[Any]:
        """Accept, emit through the stop and length checks, roll back what was not kept."""
        responses: list[Any] = []
        finished: list[tuple[int, Any]] = []
        keep, kept_drafts, emitted = [], [], []
        next_tokens, next_logprobs = [], []
        drafted = accepted = 0
        for i, uid in enumerate(self.uids):
            drafts, chosen = step.drafts[i], step.chosen[i]
            n = common_length(drafts, chosen)  # the drafts equal to the target's draws
            tokens = [step.pending[i], *drafts[:n]]
            logprobs = [self._next_logprobs[i], *(step.logprobs[i, j] for j in range(n))]
            finish, used = self._count(i, tokens)
            row = [
                self.Response(uid, t, lp, None, None, None)
                for t, lp in zip(tokens, logprobs, strict=True)
            ]
            responses.extend(row[:used])
            self.tokens[i].extend(tokens[:used])
            kept_drafts.append(used - 1)
            emitted.append(used)
            drafted, accepted = drafted + len(drafts), accepted + n
            self._paces[i].update(len(drafts), n, self.speculator.config)
            step.used_keys.append(n + 1)
            next_tokens.append(chosen[n])
            next_logprobs.append(step.logprobs[i, n])
            if finish is None:
                keep.append(i)
            else:
                row[used - 1].finish_reason = finish
                finished.append((i, row[used - 1]))
        _consume(samplers, step.used_keys)
        roll_back(self.forward, self.prompt_cache, step.fed, emitted, self.speculator.padding_inert)
        self.speculator.source.accepted(kept_drafts)
        self.speculator.counters.record(drafted, accepted, emitted)
        self._next_tokens = mx.array(next_tokens, dtype=mx.uint32)
        self._next_logprobs = next_logprobs
        for i, response in finished:
            response.prompt_cache = self.extract_cache(i)
            response.all_tokens = self.tokens[i]
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _count(self, i: int, tokens: list[int]) -> tuple[str | None, int]:
        """Emit `tokens` in order through row i's length and stop checks: the finish reason
        (or None) and how many are emitted."""
        for used, token in enumerate(tokens, start=1):
            finish = self._advance(i, token)
            if finish is not None:
                return finish, used
        return None, len(tokens)


def expected_tokens(paces: Sequence[RowPace], lengths: list[int]) -> Callable[[int], float]:
    """Tokens a step of verify width w is expected to give, with these draft lengths."""

    def tokens(width: int) -> float:
        return sum(p.expected(min(n, width - 1)) for p, n in zip(paces, lengths, strict=True))

    return tokens


def worth_verifying(
    speculator: Speculator, paces: Sequence[RowPace], drafts: list[list[int]]
) -> list[list[int]]:
    """The drafts cut to the width the clock expects to pay, now that their lengths are known
    (prompt lookup finds nothing for many rows; the plan assumed every row would draft its
    full length)."""
    if not speculator.config.costed or not any(drafts):
        return drafts
    lengths = [len(d) for d in drafts]
    width = speculator.clock.best(len(drafts), 1 + max(lengths), expected_tokens(paces, lengths))
    if width == 1:
        speculator.counters.record_cutoff()
    return [d[: width - 1] for d in drafts]


def _consume(samplers: Sequence[Any], used: Sequence[int]) -> None:
    """Each sampler moves past the draws its rows kept (a shared one: the most any kept)."""
    most: dict[int, tuple[Any, int]] = {}
    for sampler, n in zip(samplers, used, strict=True):
        if hasattr(sampler, "consume"):
            most[id(sampler)] = (sampler, max(n, most.get(id(sampler), (None, 0))[1]))
    for sampler, n in most.values():
        sampler.consume(n)


def roll_back(
    model: Any, caches: list[Any], fed: list[list[int]], kept: list[int], padding_inert: bool
) -> None:
    """Every layer keeps each row's first `kept[i]` fed tokens (one call per layer, the cache's own
    rollback). Rows whose state a layer could not cut there (recurrent layers: it put them back to
    before the verify) run those tokens again: in one forward for all of them where the model
    honours per-row lengths (`padding_inert`), else one forward per replay length (a row padded past
    its length would be replayed again, forever). So a step runs at most k + 1 replays, and a replay
    that still leaves a row uncut fails the step rather than loop. `model`: the batch's forward (its
    rows at their positions, `DecodeBatch.forward`)."""
    again = _cut(caches, kept)
    if not again:
        return
    _cut(caches, [0 if i in again else k for i, k in enumerate(kept)])
    if padding_inert:
        groups = [sorted(again)]
    else:
        by_length: dict[int, list[int]] = {}
        for i in sorted(again):
            by_length.setdefault(kept[i], []).append(i)
        groups = list(by_length.values())
    for rows in groups:
        _replay(model, caches, fed, kept, set(rows))


def _replay(
    model: Any, caches: list[Any], fed: list[list[int]], kept: list[int], rows: set[int]
) -> None:
    """Rows `rows` run their first `kept[i]` fed tokens again, the others feed nothing."""
    replay = [fed[i][: kept[i]] if i in rows else [] for i in range(len(fed))]
    width = max(len(r) for r in replay)
    inputs = [r + [fed[i][0]] * (width - len(r)) for i, r in enumerate(replay)]
    lengths = [len(r) for r in replay]
    for layer in caches:
        layer.checkpoint(lengths)
    model(mx.array(inputs, dtype=mx.uint32), cache=caches)
    left = _cut(caches, lengths)
    if left:
        raise RuntimeError(
            f"speculation: rows {sorted(left)} could not be rolled back after a replay"
        )


def _cut(caches: list[Any], kept: list[int]) -> set[int]:
    return set().union(*(layer.rollback(kept) for layer in caches))
