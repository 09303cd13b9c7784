"""Shared helpers for the speculation tests: the demo model, prompts, and a driver that runs
a batch runner (ours, or mlx-lm's BatchGenerator) through a schedule of joins and removals."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import BatchGenerator

from servicer.engine.parts import batch_generator_settings, runner_settings
from servicer.engine_config import EngineConfig

CORPUS = Path(__file__).resolve().parent.parent / "servicer" / "demos" / "corpus.txt"


def passages(min_chars: int = 200) -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) >= min_chars]


def repeat_prompt(tokenizer: Any, text: str, limit: int = 120) -> list[int]:
    """A passage then its first half again: prompt lookup has something to find."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))[:limit]
    return ids + ids[: len(ids) // 2]


def runner_kwargs(config: EngineConfig | None = None) -> dict[str, Any]:
    """The arguments the engine builds its batch runner with."""
    return runner_settings(config or EngineConfig(), mx.new_stream(mx.default_device()))


def plain_generator(model: Any, **overrides: Any) -> BatchGenerator:
    """mlx-lm's BatchGenerator with the engine's default settings."""
    settings = batch_generator_settings(EngineConfig(), mx.new_stream(mx.default_device()))
    return BatchGenerator(model, **{**settings, **overrides})


def perturbed_copy(model_dir: Path, scale: float = 0.35, seed: int = 1) -> Any:
    """The demo model again with every weight nudged by seeded noise: a draft that agrees
    with the target often, not always."""
    from mlx_lm import load

    model, _ = load(str(model_dir))
    params = tree_flatten(model.parameters())
    nudged = []
    for i, (name, weight) in enumerate(params):
        noise = mx.random.normal(weight.shape, key=mx.random.key(seed * 1000 + i))
        std = mx.std(weight) if weight.size > 1 else mx.array(0.0)
        nudged.append((name, weight + scale * std * noise.astype(weight.dtype)))
    model.update(tree_unflatten(nudged))
    mx.eval(model.parameters())
    return model


@dataclass
class Job:
    """One request in a schedule."""

    name: str
    prompt: list[int]
    max_tokens: int
    join_at: int = 0  # runner step at which it is inserted
    remove_after: int | None = None  # removed once it has this many tokens
    sampler: Any = None
    processors: list[Any] | None = None
    stop: Any = None  # a StopSequences
    caches: Callable[[], list[Any]] | None = None  # the row's empty caches (--kv-bits)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[mx.array] = field(default_factory=list)
    finish: str | None = None
    all_tokens: list[int] | None = None
    cache: list[Any] | None = None
    removed: bool = False


def _insert(runner: Any, job: Job) -> int:
    kwargs: dict[str, Any] = {"max_tokens": [job.max_tokens]}
    if job.sampler is not None:
        kwargs["samplers"] = [job.sampler]
    if job.processors:
        kwargs["logits_processors"] = [job.processors]
    if job.stop is not None:
        kwargs["stop_sequences"] = [job.stop]
    if job.caches is not None:
        kwargs["caches"] = [job.caches()]
    return runner.insert([job.prompt], **kwargs)[0]


def drive(
    runner: Any,
    jobs: Sequence[Job],
    on_step: Callable[[int], None] | None = None,
    results: dict[str, Result] | None = None,
) -> dict[str, Result]:
    """Run the schedule to the end on `runner` (ours, or mlx-lm's BatchGenerator); each job's
    tokens, logprobs and finish (in `results` as they come, where given: for `on_step` to
    look at)."""
    results = {} if results is None else results
    results.update({job.name: Result() for job in jobs})
    active: dict[int, Job] = {}
    waiting = sorted(jobs, key=lambda j: j.join_at)
    step = 0
    while waiting or active:
        while waiting and waiting[0].join_at <= step:
            job = waiting.pop(0)
            active[_insert(runner, job)] = job
        _, responses = runner.next()
        step += 1
        for response in responses:
            job = active[response.uid]
            result = results[job.name]
            result.tokens.append(response.token)
            result.logprobs.append(response.logprobs)
            if response.finish_reason is not None:
                result.finish = response.finish_reason
                result.all_tokens = list(response.all_tokens)
                result.cache = response.prompt_cache
                del active[response.uid]
        for uid, job in list(active.items()):
            if job.remove_after is not None and len(results[job.name].tokens) >= job.remove_after:
                runner.remove([uid])
                results[job.name].removed = True
                del active[uid]
        if on_step is not None:
            on_step(step)
        assert step < 10_000, "the schedule did not finish"
    return results


def draft_three_steps_then_stop_three(monkeypatch: Any) -> None:
    """The mode clock drafts three steps, then stops for three, and so on; the width clock
    (which measures wall time, and on a slow or busy machine would cut some drafting steps
    to plain ones) always verifies the widest: the switches follow this schedule alone."""
    from servicer.engine.speculation.config import ModeClock, StepClock

    asked = [0]

    def three_on_three_off(self: ModeClock, rows: int) -> bool:
        asked[0] += 1
        return (asked[0] // 3) % 2 == 0

    monkeypatch.setattr(ModeClock, "drafting", three_on_three_off)
    monkeypatch.setattr(StepClock, "choose", lambda self, rows, widest, tokens: (widest, False))
    monkeypatch.setattr(StepClock, "best", lambda self, rows, widest, tokens: widest)


class Oracle:
    """A draft source that knows the answers: each row's drafts are what followed its
    context in a reference run (prompt + output), with every `spoil`-th draft call's last
    draft changed so that some are rejected. Stateless per row: it looks the context up."""

    def __init__(self, references: Sequence[list[int]], spoil: int = 3) -> None:
        self._references = [list(r) for r in references]
        self._spoil = spoil
        self._calls = 0

    def extend(self, tokens: Sequence[list[int]]) -> None:
        pass

    def filter(self, keep: Sequence[int]) -> None:
        pass

    def draft(
        self, tokens: Sequence[list[int]], pending: Sequence[int], ks: Sequence[int]
    ) -> list[list[int]]:
        drafts = []
        for context, last, k in zip(tokens, pending, ks, strict=True):
            full = [*context, last]
            ref = next((r for r in self._references if r[: len(full)] == full), None)
            found = [] if ref is None or k == 0 else ref[len(full) : len(full) + k]
            self._calls += 1
            if found and self._calls % self._spoil == 0:
                found[-1] = (found[-1] + 1) % 64
            drafts.append(found)
        return drafts

    def accepted(self, kept: Sequence[int]) -> None:
        pass


def chi_square_p(statistic: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (scipy is not installed): the regularised
    upper incomplete gamma Q(dof/2, statistic/2), by series or continued fraction."""
    a, x = dof / 2.0, statistic / 2.0
    if x <= 0:
        return 1.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # series for the lower part P
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - math.exp(log_prefix) * total)
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)  # Lentz's continued fraction for Q
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_prefix) * h


def two_sample_chi_square(a: Sequence[int], b: Sequence[int], min_expected: float = 5.0) -> float:
    """p-value that two samples of categories come from one distribution (rare categories
    pooled so every expected count is at least `min_expected`)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cells = sorted(set(ca) | set(cb), key=lambda t: -(ca[t] + cb[t]))
    pooled: list[tuple[int, int]] = []
    rest = [0, 0]
    for token in cells:
        total = ca[token] + cb[token]
        if total * min(na, nb) / (na + nb) >= min_expected:
            pooled.append((ca[token], cb[token]))
        else:
            rest[0] += ca[token]
            rest[1] += cb[token]
    if sum(rest):
        pooled.append((rest[0], rest[1]))
    if len(pooled) < 2:
        return 1.0
    statistic = 0.0
    for x, y in pooled:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            statistic += (observed - expected) ** 2 / expected
    return chi_square_p(statistic, len(pooled) - 1)


def goodness_of_fit(
    sample: Sequence[int], probs: Sequence[float], min_expected: float = 5.0
) -> float:
    """p-value that `sample` (category indices) was drawn from `probs`."""
    from collections import Counter

    counts, n = Counter(sample), len(sample)
    cells: list[tuple[int, float]] = []
    rest = [0, 0.0]
    for category, prob in enumerate(probs):
        if prob * n >= min_expected:
            cells.append((counts[category], prob * n))
        else:
            rest[0] += counts[category]
            rest[1] += prob * n
    assert not any(c not in range(len(probs)) for c in counts), "drew an impossible category"
    if rest[1] > 0:
        cells.append((int(rest[0]), rest[1]))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    return chi_square_p(statistic, len(cells) - 1)


def replicated_batch(
    model: Any, prompt: list[int], rows: int, sampler: Any, max_tokens: int
) -> Any:
    """A DecodeBatch of `rows` copies of one prefilled prompt, as prefill would hand it to
    decoding (prefilled once, not `rows` times: the sampling tests need thousands)."""
    from mlx_lm.generate import StopSequences
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler

    single = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=single)
    layers = []
    for layer in single:
        batched = BatchKVCache([0] * rows)
        batched.keys = mx.repeat(layer.keys[..., : layer.offset, :], rows, axis=0)
        batched.values = mx.repeat(layer.values[..., : layer.offset, :], rows, axis=0)
        batched.offset = batched.offset + layer.offset
        batched._idx = layer.offset
        layers.append(batched)
    from servicer.engine.decode_batch import DecodeBatch

    return DecodeBatch(
        model,
        list(range(rows)),
        mx.array([prompt[-1]] * rows, dtype=mx.uint32),
        layers,
        [list(prompt[:-1]) for _ in range(rows)],
        [sampler] * rows,
        greedy_sampler,
        [()] * rows,
        [StopSequences()] * rows,
        [max_tokens] * rows,
    )
