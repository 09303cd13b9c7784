"""Sampler construction (pure logic on MLX, no server)."""

import math

import mlx.core as mx
import pytest

from servicer.engine import sampling
from servicer.messages import SamplingSpec

VOCAB = 64


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.fixture
def calls(monkeypatch):
    """Every call into mlx-lm's compiled sampling functions, with its arguments."""
    seen: list[tuple[str, tuple]] = []
    for name in ("apply_top_p", "_apply_min_p"):
        real = getattr(sampling, name)

        def record(*args, _name=name, _real=real):
            seen.append((_name, args[1:]))
            return _real(*args)

        monkeypatch.setattr(sampling, name, record)
    return seen


@pytest.mark.parametrize("seeded", [False, True])
def test_float_settings_reach_compiled_functions_as_arrays(calls, seeded):
    # mx.compile treats a Python float as a constant and compiles again for every new value,
    # which stalled the engine for about a second per new temperature / top-p / min-p.
    spec = SamplingSpec(0.73, top_p=0.9, top_k=0, min_p=0.05, seed=3 if seeded else None)
    factory = sampling.SamplingFactory(VOCAB, grammars=None, seed=0)  # type: ignore[arg-type]
    draw = factory.sampler(spec)(_log_softmax(mx.random.normal((2, VOCAB))))
    assert draw.shape == (2,)
    assert calls and all(isinstance(arg, mx.array) for _, args in calls for arg in args)


def test_min_p_filter_matches_its_definition():
    logprobs = _log_softmax(mx.array([[2.0, 1.0, 0.0, -3.0]]))
    kept = sampling._apply_min_p(logprobs, mx.array(math.log(0.3)))
    probs = mx.exp(logprobs)[0].tolist()
    expected = [p >= 0.3 * max(probs) for p in probs]
    assert [v > -float("inf") for v in kept[0].tolist()] == expected


def _unseeded_draws(seed: int, others_draw: bool) -> list[list[int]]:
    logprobs = _log_softmax(mx.random.normal((4, VOCAB), key=mx.random.key(1)))
    factory = sampling.SamplingFactory(VOCAB, grammars=None, seed=seed)  # type: ignore[arg-type]
    sampler = factory.sampler(SamplingSpec(temperature=1.0))
    draws = []
    for i in range(6):
        if others_draw:  # another engine, or anyone, reseeds and draws from MLX's global state
            mx.random.seed(1000 + i)
            mx.eval(mx.random.normal((3,)))
        draws.append(sampler(logprobs).tolist())
    return draws


def test_unseeded_sampling_draws_from_the_engine_own_random_stream():
    alone = _unseeded_draws(5, others_draw=False)
    assert _unseeded_draws(5, others_draw=True) == alone
    assert _unseeded_draws(6, others_draw=False) != alone
    assert len({tuple(d) for d in alone}) > 1  # it really samples
