"""What a quantized KV cache costs: fidelity and decode speed on the demo models.

    python bench/kv_fidelity.py [--out bench/results/kv_fidelity.json] [--prompt-len 128]

For the demo llama and the hybrid demo (group size 32 = their head_dim), 8 and 4 bits against
the full-precision cache, all through this project's BatchQuantizedKVCache (batch caches built
by merging per-row caches, as BatchGenerator does):

- perplexity, teacher-forced, each paragraph one sequence: (a) the last HELD_OUT prose
  paragraphs of servicer/demo_corpus.txt (never used as prompts here, but the demo models were
  trained on the whole corpus, so they are seen text) and (b) UNSEEN_TEXT, written for this
  bench and in no training data;
- the largest logprob difference (any vocabulary entry, any position) on those same texts;
- greedy agreement over NEW_TOKENS-token continuations of the demo TEST_PROMPTS run as one
  batch in BatchGenerator: the fraction of positions equal before the first divergence, and of
  all positions;
- decode tokens/s of a BatchGenerator (demo llama) with quantized vs plain caches at batch 1,
  8, 32: three generators (fp, 8, 4 bits) decode the same prompts taking turns step by step,
  and each step is timed; ratios are of steps milliseconds apart. Absolute numbers mean
  little on this shared 2-core CPU.

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's servicer, not the installed one

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from servicer.demo_model import TEST_PROMPTS, demo_model_path  # noqa: E402
from servicer.engine.quantized_kv import make_row_cache  # noqa: E402

GROUP = 32
BITS: tuple[int | None, ...] = (None, 8, 4)  # None: full precision
HELD_OUT = 8
NEW_TOKENS = 64
BATCHES = (1, 8, 32)
SPEED_TOKENS = 128  # decode steps per speed run
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
    text = (ROOT / "servicer" / "demo_corpus.txt").read_text(encoding="utf-8")
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


def ready_generator(model: Any, prompts: list[list[int]], bits: int | None) -> Any:
    """A BatchGenerator with every prompt prefilled and every row decoding."""
    batch = len(prompts)
    gen = BatchGenerator(
        model,
        max_tokens=SPEED_TOKENS + 8,
        completion_batch_size=batch,
        prefill_batch_size=batch,
    )
    caches = None if bits is None else [make_row_cache(model, bits, GROUP) for _ in prompts]
    gen.insert(prompts, caches=caches)
    while True:
        prompt_responses, responses = gen.next()
        if not prompt_responses and len(responses) == batch:
            return gen


def step_times(model: Any, prompts: list[list[int]]) -> dict[str, list[float]]:
    """Seconds per decode step of one generator per cache kind, taking turns step by step (in
    a rotating order) so that a burst of others' load on the machine hits all alike. Each step
    is timed up to a sync: it is the whole step, without the loop's overlap of Python work and
    compute, so absolute rates sit a little below the pipelined loop's."""
    gens = {label(bits): ready_generator(model, prompts, bits) for bits in BITS}
    names = list(gens)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(SPEED_TOKENS):
        turn = step % len(names)
        for name in names[turn:] + names[:turn]:
            gen = gens[name]
            mx.synchronize(gen.stream)
            tic = time.perf_counter()
            gen.next()
            mx.synchronize(gen.stream)
            times[name].append(time.perf_counter() - tic)
    return times


def speed(model: Any, corpus: list[int], prompt_len: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    step_times(model, [corpus[:prompt_len]])  # warm-up
    for batch in BATCHES:
        prompts = [corpus[i * 7 : i * 7 + prompt_len] for i in range(batch)]
        times = step_times(model, prompts)
        plain = times["fp"]
        out[str(batch)] = {
            name: {
                "tok_s": batch / statistics.median(t),
                "ratio": statistics.median(t_fp / t_q for t_fp, t_q in zip(plain, t, strict=True)),
                "step_ms_median": 1e3 * statistics.median(t),
            }
            for name, t in times.items()
        }
    return {"steps": SPEED_TOKENS, "batches": out}


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


def print_tables(results: dict[str, Any]) -> None:
    print(f"\nFidelity at group {GROUP} (ppl change vs fp; gap = largest |logprob diff|)")
    head = "model   bits  ppl held-out      ppl unseen        max gap  greedy until/total  gap"
    print(head)
    for kind, r in results["fidelity"].items():
        base_h, base_u = r["held_out"]["fp"]["ppl"], r["unseen"]["fp"]["ppl"]
        print(f"{kind:7} fp    {base_h:7.3f}           {base_u:7.3f}")
        for name in ("q8", "q4"):
            h, u, g = r["held_out"][name], r["unseen"][name], r["greedy"][name]
            print(
                f"{kind:7} {name:5} {h['ppl']:7.3f} ({h['ppl'] / base_h - 1:+6.2%})"
                f"  {u['ppl']:7.3f} ({u['ppl'] / base_u - 1:+6.2%})"
                f"  {max(h['gap'], u['gap']):6.3f}"
                f"  {g['until_divergence']:6.1%} / {g['total']:6.1%}   {g['gap']:6.3f}"
            )
    print("\nGreedy divergences: prompts diverged, median fp top-2 logprob margin there")
    for kind, r in results["fidelity"].items():
        for name in ("q8", "q4"):
            g = r["greedy"][name]
            margin = g["margin_at_divergence"]
            shown = "-" if margin is None else f"{margin:.3f}"
            print(f"{kind:7} {name:5} {g['diverged']}/{len(TEST_PROMPTS)}  {shown}")
    print(f"\nDecode tok/s, demo llama, prompts of {results['prompt_len']} tokens (median)")
    print("tok/s = batch / median step time; ratio = median over steps of fp step / this step")
    print("batch   fp tok/s   q8 tok/s (ratio)   q4 tok/s (ratio)")
    for batch, r in results["speed"].get("batches", {}).items():
        fp, q8, q4 = r["fp"], r["q8"], r["q4"]
        print(
            f"{batch:>5}  {fp['tok_s']:9.0f}  {q8['tok_s']:9.0f} ({q8['ratio']:.2f})"
            f"  {q4['tok_s']:9.0f} ({q4['ratio']:.2f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_fidelity.json")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--no-speed", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {"group_size": GROUP, "prompt_len": args.prompt_len}
    results["fidelity"] = {kind: fidelity(kind) for kind in ("llama", "hybrid")}
    if not args.no_speed:
        model, tokenizer = load(str(demo_model_path("llama")))
        text = (ROOT / "servicer" / "demo_corpus.txt").read_text(encoding="utf-8")
        corpus = list(tokenizer.encode(text, add_special_tokens=False))
        results["speed"] = speed(model, corpus, args.prompt_len)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if "speed" not in results:
        results["speed"] = {}
    print_tables(results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
