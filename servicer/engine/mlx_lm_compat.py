"""What the engine takes from mlx-lm beyond its public API, in one list.

mlx-lm 0.32's `BatchGenerator` has no hooks for speculation: the speculating generation batch
(a `GenerationBatch` subclass) reads and writes the batch's private per-row state, the
generator swaps in that batch and asks whether prompts are still in prefill, and the rolling-back
caches take over the batched caches' write position. Each touch point is listed here with what
it is for; `missing_touch_points` reads mlx-lm's own source for each, so that an mlx-lm upgrade
that moves one turns speculation off at start with a clear log line (`parts`) and fails one
test (tests/test_mlx_lm_compat.py), not a run.
"""

from __future__ import annotations

import inspect
from functools import cache

from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import cache as mlx_cache

# (class, attribute, what we use it for)
TOUCH_POINTS: tuple[tuple[type, str, str], ...] = (
    (GenerationBatch, "_next_tokens", "the tokens a step sampled, replaced after a verify"),
    (GenerationBatch, "_next_logprobs", "their logprobs, replaced likewise"),
    (GenerationBatch, "_num_tokens", "each row's generated count, for its length limit"),
    (GenerationBatch, "_matchers", "each row's stop matcher, fed the accepted tokens"),
    (GenerationBatch, "_token_context", "each row's recent tokens, for its logits processors"),
    (BatchGenerator, "_generation_batch", "swapped for the speculating batch"),
    (BatchGenerator, "_prompt_batch", "whether prompts are in prefill this step"),
    (BatchGenerator, "_unprocessed_sequences", "whether prompts wait for prefill"),
    (BatchGenerator, "_next", "the step the speculating generator wraps"),
    (BatchGenerator, "_currently_processing", "the prompt in prefill a fused step chunks"),
    (BatchGenerator, "_counters", "the prompt and generation counts a fused step keeps"),
    (GenerationBatch, "model", "what a fused step's decoding rows call for their forward"),
    (GenerationBatch, "_step", "run with its logprobs evaluated as one array (step_logprobs)"),
    (mlx_cache.BatchKVCache, "_idx", "the write position a rolling-back cache takes over"),
    (mlx_cache.BatchRotatingKVCache, "_idx", "likewise for sliding windows"),
    (mlx_cache.ArraysCache, "lengths", "per-row lengths: recurrent layers that honour padding"),
)


@cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def missing_touch_points() -> list[str]:
    """The touch points the installed mlx-lm no longer has, as "Class.attribute"."""
    missing = []
    for cls, name, _ in TOUCH_POINTS:
        if not hasattr(cls, name) and f"self.{name}" not in _source(cls):
            missing.append(f"{cls.__name__}.{name}")
    return missing
