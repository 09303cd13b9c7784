"""What a quantized KV cache costs in fidelity, on the demo models (kv-quant's fidelity rows).

For the demo llama and the hybrid demo (group size 32 = their head_dim), 8 and 4 bits against
the full-precision cache, all through this project's BatchQuantizedKVCache (batch caches built
by merging per-row caches, as BatchGenerator does):

- perplexity, teacher-forced, each paragraph one sequence: (a) the last HELD_OUT prose
  paragraphs of servicer/demos/corpus.txt (never used as prompts here, but the demo models were
  trained on the whole corpus, so they are seen text) and (b) UNSEEN_TEXT, written for this
  bench and in no training data;
- the largest logprob difference (any vocabulary entry, any position) on those same texts;
- greedy agreement over NEW_TOKENS-token continuations of the demo TEST_PROMPTS run as one
  batch in BatchGenerator: the fraction of positions equal before the first divergence, and of
  all positions.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from servicer.demos.text import TEST_PROMPTS, demo_model_path
from servicer.engine.cache_kinds import make_row_cache

ROOT = Path(__file__).resolve().parents[1]

GROUP = 32
BITS: tuple[int | None, ...] = (None, 8, 4)  # None: full precision
HELD_OUT = 8
NEW_TOKENS = 64
UNSEEN_TEXT = (
    "The lighthouse keeper kept a notebook of every ship that passed, with the weather, the "
    "hour, and a guess at where it was going. After forty years the notebooks filled a shelf, "
    "and a historian from the university came to read them. She found storms nobody else had "
    "recorded, a ship that passed twice on the same night, and, on the last page, a drawing of "
    "the keeper's cat asleep on the lamp room stairs.\n"
    "Learning to bake bread takes patience more than skill. The dough needs time to rise, and "
    "a cold kitchen slows everything down. Most beginners add too much flour because the dough "
    "feels sticky, but a wet dough makes a lighter loaf with a crisp crust."
)


def label(bits: int | None) -> str:
    return "fp" if bits is None else f"q{bits}"


def held_out_paragraphs() -> list[str]:
    text = (ROOT / "servicer" / "demos" / "corpus.txt").read_text(encoding="utf-8")
    blocks = [b.strip() for b in re.split(r"\n\s*\n", text.strip())]
    prose = [b for b in blocks if b and not b.startswith("User:")]
    return prose[-HELD_OUT:]


def batch_caches(model: Any, bits: int | None) -> list[Any]:
    """One-row batch caches, built the way BatchGenerator builds them (merge of row caches)."""
    rows = make_prompt_cache(model) if bits is None else make_row_cache(model, bits, GROUP)
    return [c.merge([c]) for c in rows]


def teacher_forced(model: Any, tokens: list[int], bits: int | None) -> mx.array:
    """Logprobs over the vocabulary at every position but the last, quantized as served."""
    logits = model(mx.array(tokens)[None], cache=batch_caches(model, bits))[0, :-1]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return logprobs


def perplexity_and_gap(model: Any, texts: list[list[int]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    full: list[mx.array] = []
    for bits in BITS:
        nll, count, gap = 0.0, 0, 0.0
        for i, tokens in enumerate(texts):
            lp = teacher_forced(model, tokens, bits)
            targets = mx.array(tokens[1:])[:, None]
            nll -= mx.take_along_axis(lp, targets, axis=-1).sum().item()
            count += len(tokens) - 1
            if bits is None:
                full.append(lp)
            else:
                gap = max(gap, mx.abs(lp - full[i]).max().item())
        out[label(bits)] = {"ppl": float(mx.exp(mx.array(nll / count)).item()), "gap": gap}
    return out


def greedy(model: Any, prompts: list[list[int]], bits: int | None) -> list[tuple[list, list]]:
    """Each prompt's greedy continuation and per-step logprobs, all prompts in one batch."""
    gen = BatchGenerator(model, max_tokens=NEW_TOKENS)
    caches = None if bits is None else [make_row_cache(model, bits, GROUP) for _ in prompts]
    uids = gen.insert(prompts, caches=caches)
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    logprobs: dict[int, list[mx.array]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        mx.eval([r.logprobs for r in responses])
        for r in responses:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
    return [(tokens[u], logprobs[u]) for u in uids]


def agreement(model: Any, prompts: list[list[int]]) -> dict[str, dict[str, float]]:
    ref = greedy(model, prompts, None)
    out = {}
    for bits in BITS[1:]:
        runs = greedy(model, prompts, bits)
        until, total, gap, margins = 0, 0, 0.0, []
        for (want, want_lp), (got, got_lp) in zip(ref, runs, strict=True):
            same = [a == b for a, b in zip(want, got, strict=True)]
            first = same.index(False) if False in same else len(same)
            until += first
            total += sum(same)
            if first < len(same):  # how close full precision's own top two were there
                top2 = mx.sort(want_lp[first])[-2:]
                margins.append((top2[1] - top2[0]).item())
            # Logprobs compare only while both runs have the same context.
            for a, b in zip(want_lp[: first + 1], got_lp[: first + 1], strict=False):
                gap = max(gap, mx.abs(a - b).max().item())
        n = len(prompts) * NEW_TOKENS
        out[label(bits)] = {
            "until_divergence": until / n,
            "total": total / n,
            "gap": gap,
            "diverged": len(margins),
            "margin_at_divergence": statistics.median(margins) if margins else None,
        }
    return out


def fidelity(kind: str) -> dict[str, Any]:
    model, tokenizer = load(str(demo_model_path(kind)))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    held = [encode(p) for p in held_out_paragraphs()]
    unseen = [encode(p) for p in UNSEEN_TEXT.split("\n")]
    return {
        "held_out": perplexity_and_gap(model, held),
        "held_out_tokens": sum(len(t) for t in held),
        "unseen": perplexity_and_gap(model, unseen),
        "unseen_tokens": sum(len(t) for t in unseen),
        "greedy": agreement(model, [encode(p) for p in TEST_PROMPTS]),
    }
