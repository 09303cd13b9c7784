"""Build the speculative-decoding fixtures (bench/spec_models.py) and measure what they give,
with no server: greedy generation with mlx-lm, drafts checked against the greedy output.

    .venv/bin/python bench/spec_fixtures.py [--tokens 64] [--out bench/results/spec_fixtures.json]

- Prompt lookup (n = 3, K = 4): at each target step, find the latest earlier occurrence of the
  last 3 tokens of prompt + output and draft the 4 tokens that followed it; the target keeps
  the longest prefix that matches its own greedy tokens, plus one token of its own. Reported
  as tokens per target step, for the copier and the demo llama, on copy-heavy prompts (held-out
  passages the corpus never saw), plain corpus prompts and random tokens.
- Draft model (K = 4): the demo llama drafts 4 greedy tokens, the target keeps the matching
  prefix. Reported as acceptance (accepted / drafted) and tokens per target step, beside the
  target's decode step time over the demo llama's at batch 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from spec_models import spec_model_path

from servicer import demo_model
from servicer.demo_model import BOS_TOKEN, TEST_PROMPTS, demo_model_path

NGRAM = 3
DRAFT_TOKENS = 4
# Held-out text: none of it is in the demo corpus, so copying it takes induction, not memory.
PASSAGES: tuple[str, ...] = (
    "The lighthouse keeper wrote the weather in a green notebook every evening, even when "
    "nothing changed, because his father had done the same for forty years.",
    "Maria planted tomatoes along the fence, basil between them, and marigolds at the ends "
    "to keep the beetles away from the young leaves.",
    "The committee met on Thursday and agreed to paint the town hall blue, although nobody "
    "could say who had suggested blue in the first place.",
    "A bicycle chain needs oil every few hundred miles, more often in the rain, and it will "
    "tell you with a dry squeak when you have forgotten.",
    "Our neighbour keeps bees on the roof of his garage and sells the honey in small jars "
    "with hand written labels that say the month it was taken.",
    "The museum closed its east wing for repairs, so the dinosaur skeleton was moved into "
    "the lobby where children now eat their lunch beneath it.",
)
REPEAT_REQUEST = "Repeat the text above."


def copy_prompts(tokenizer: Any) -> dict[str, list[list[int]]]:
    """The copy-heavy prompts: a passage then its first words again; a passage then a chat
    request to repeat it."""
    start_again, repeat_request = [], []
    for passage in PASSAGES:
        opening = " ".join(passage.split()[:4])
        start_again.append(_encode(tokenizer, f"{passage}\n\n{opening}"))
        chat = [{"role": "user", "content": f"{passage}\n\n{REPEAT_REQUEST}"}]
        repeat_request.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True))
    return {"copy: passage, then its start": start_again, "copy: repeat request": repeat_request}


def plain_prompts(tokenizer: Any) -> list[list[int]]:
    return [_encode(tokenizer, text) for text in TEST_PROMPTS]


def corpus_prompts(tokenizer: Any) -> list[list[int]]:
    """The draft/target prompts: the test prompts, openings of every 5th corpus paragraph and
    the first chat questions (in the chat template)."""
    prose, chats = demo_model._read_corpus()
    prompts = plain_prompts(tokenizer)
    prompts += [_encode(tokenizer, " ".join(p.split()[:5])) for p in prose[::5]]
    for user, _ in chats[:6]:
        chat = [{"role": "user", "content": user}]
        prompts.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True))
    return prompts


def random_prompts(tokenizer: Any, count: int = 6, length: int = 32) -> list[list[int]]:
    rng = np.random.default_rng(1234)
    first = tokenizer.convert_tokens_to_ids(BOS_TOKEN) + 8  # past the special tokens
    return rng.integers(first, len(tokenizer), (count, length)).tolist()


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------- measuring


def greedy(model: Any, prompt: Sequence[int], max_tokens: int, eos: set[int]) -> list[int]:
    """Greedy continuation, up to and including the first end-of-sequence token."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out: list[int] = []
    for token, _ in generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] in eos:
            break
    return out


def ngram_draft(context: Sequence[int], n: int = NGRAM, k: int = DRAFT_TOKENS) -> list[int]:
    """The k tokens after the latest earlier occurrence of the last n tokens, or none."""
    if len(context) <= n:
        return []
    tail = list(context[-n:])
    for start in range(len(context) - n - 1, -1, -1):
        if list(context[start : start + n]) == tail:
            return list(context[start + n : start + n + k])
    return []


def speculate(
    prompt: Sequence[int], out: Sequence[int], draft: Callable[[list[int], int], list[int]]
) -> tuple[int, int, int]:
    """Replay greedy speculation over the target's greedy output `out`: each target step
    keeps the draft's longest prefix that matches, plus one token of its own.

    Returns (target steps, drafted tokens, accepted tokens)."""
    steps = drafted = accepted = done = 0
    while done < len(out):
        proposal = draft([*prompt, *out[:done]], min(DRAFT_TOKENS, len(out) - done))
        match = 0
        while match < len(proposal) and proposal[match] == out[done + match]:
            match += 1
        steps, drafted, accepted = steps + 1, drafted + len(proposal), accepted + match
        done += match + 1
    return steps, drafted, accepted


def summarize(prompts: Sequence[Sequence[int]], outs: Sequence[list[int]], draft) -> dict:
    steps = drafted = accepted = tokens = 0
    for prompt, out in zip(prompts, outs, strict=True):
        s, d, a = speculate(prompt, out, draft)
        steps, drafted, accepted, tokens = steps + s, drafted + d, accepted + a, tokens + len(out)
    return {
        "tokens_per_step": tokens / steps,
        "acceptance": accepted / drafted if drafted else 0.0,
        "tokens": tokens,
        "steps": steps,
    }


def lookup_draft(context: list[int], k: int) -> list[int]:
    return ngram_draft(context, NGRAM, k)


def model_draft(model: Any) -> Callable[[list[int], int], list[int]]:
    def draft(context: list[int], k: int) -> list[int]:
        return greedy(model, context, k, eos=set())

    return draft


def step_times(model: Any, prompt: Sequence[int], steps: int = 100, warmup: int = 5) -> list[float]:
    """Seconds per decode step at batch 1 (mlx-lm's generate_step, one yield per token)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    times = []
    last = time.perf_counter()
    for _ in generate_step(mx.array(list(prompt)), model, max_tokens=steps + warmup):
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[warmup:]


# --------------------------------------------------------------------------- the report


def lookup_table(models: dict[str, Any], tokenizer: Any, tokens: int) -> dict[str, dict]:
    """Prompt lookup on each model, per prompt set: {set: {model: summary}}."""
    sets = dict(copy_prompts(tokenizer))
    sets["plain (corpus starts)"] = plain_prompts(tokenizer)
    sets["random tokens"] = random_prompts(tokenizer)
    eos = {tokenizer.eos_token_id}
    table: dict[str, dict] = {}
    for name, prompts in sets.items():
        table[name] = {}
        for label, model in models.items():
            outs = [greedy(model, p, tokens, eos) for p in prompts]
            table[name][label] = summarize(prompts, outs, lookup_draft)
    return table


def step_ratio(models: dict[str, Any], prompt: Sequence[int], rounds: int, steps: int) -> dict:
    """Median seconds per decode step of each model, rounds alternating between them."""
    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(rounds):
        for label, model in models.items():
            times[label] += step_times(model, prompt, steps)
    return {label: statistics.median(values) for label, values in times.items()}


def draft_report(target: Any, draft: Any, tokenizer: Any, tokens: int) -> dict:
    prompts = corpus_prompts(tokenizer)
    eos = {tokenizer.eos_token_id}
    outs = [greedy(target, p, tokens, eos) for p in prompts]
    report = summarize(prompts, outs, model_draft(draft))
    same = sum(out == greedy(draft, p, tokens, eos) for p, out in zip(prompts, outs, strict=True))
    report["identical_continuations"] = f"{same}/{len(prompts)}"
    return report


def build_all(cache_dir: Path | None) -> tuple[dict[str, Path], dict[str, float]]:
    paths, seconds = {"llama": demo_model_path("llama", cache_dir=cache_dir)}, {}
    for kind in ("copier", "target"):
        start = time.perf_counter()
        paths[kind] = spec_model_path(kind, cache_dir=cache_dir)
        seconds[kind] = time.perf_counter() - start
    return paths, seconds


def print_report(result: dict) -> None:
    print("\nPrompt lookup (n=3, K=4), tokens per target step (acceptance of drafted tokens):")
    print("| prompts | demo llama | copier |\n|---|---|---|")
    for name, row in result["prompt_lookup"].items():
        cells = [f"{row[m]['tokens_per_step']:.2f} ({row[m]['acceptance']:.2f})" for m in row]
        print(f"| {name} | {' | '.join(cells)} |")
    times, draft = result["step_seconds"], result["draft_model"]
    print("\nDecode step at batch 1 (generate_step, median ms):")
    print("| demo llama | copier | target | target / llama |\n|---|---|---|---|")
    ms = [f"{times[m] * 1e3:.2f}" for m in ("llama", "copier", "target")]
    print(f"| {' | '.join(ms)} | {result['target_step_ratio']:.1f}x |")
    print("\nTarget with the demo llama as draft (K=4, corpus prompts):")
    print(
        f"acceptance {draft['acceptance']:.2f}, {draft['tokens_per_step']:.2f} tokens per "
        f"target step, identical greedy continuations {draft['identical_continuations']}"
    )
    print(f"\nbuild seconds (0 when cached): {result['build_seconds']}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--steps", type=int, default=100, help="decode steps per timing run")
    parser.add_argument("--rounds", type=int, default=3, help="timing runs per model")
    parser.add_argument("--out", type=Path, default=Path("bench/results/spec_fixtures.json"))
    parser.add_argument("--cache-dir", type=Path, help="model cache (default: the demo cache)")
    args = parser.parse_args(argv)
    from mlx_lm import load

    paths, build_seconds = build_all(args.cache_dir)
    loaded = {label: load(str(path)) for label, path in paths.items()}
    tokenizer = loaded["llama"][1]
    models = {label: model for label, (model, _) in loaded.items()}
    lookup = lookup_table({k: models[k] for k in ("llama", "copier")}, tokenizer, args.tokens)
    times = step_ratio(models, corpus_prompts(tokenizer)[0], args.rounds, args.steps)
    result = {
        "paths": {k: str(v) for k, v in paths.items()},
        "build_seconds": {k: round(v, 1) for k, v in build_seconds.items()},
        "prompt_lookup": lookup,
        "step_seconds": times,
        "target_step_ratio": times["target"] / times["llama"],
        "draft_model": draft_report(models["target"], models["llama"], tokenizer, args.tokens),
        "settings": {"ngram": NGRAM, "draft_tokens": DRAFT_TOKENS, **vars(args)},
        "machine": platform.platform(),
    }
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
