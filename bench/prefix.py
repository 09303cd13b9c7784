"""Prefix reuse across model kinds: a shared system prompt's hit against a cold prefill, a disk
hit after a restart, and the bytes that conversations sharing one prompt hold.

Each part takes fresh workers; the restart and the bytes are ours alone (the other servicer
keeps no blocks on disk and reports no cache bytes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
from load import Client, _median_ms
from workers import Worker, scrape_metrics
from workload import chat_prompt, make_prompts, percentile, system_texts

SYSTEM_TOKENS = 1500
TURN_TOKENS = 20
SHARED_TOKENS = 1024  # the conversations' shared prompt
CONVERSATIONS = 16
MAX_TOKENS = 8


async def hit_and_cold(client: Client, seed: str, repeats: int = 3) -> dict[str, Any]:
    """A shared system prompt with a new turn (a hit) against a new system prompt (cold).
    The system prompt has served two turns before the one measured: a worker that learns
    where prompts share their prefix (ours, for models whose state cannot be cut) has seen
    it shared once."""
    prompts = make_prompts(4 * repeats, SYSTEM_TOKENS + TURN_TOKENS, client.vocab_size, seed)
    cold, hit = [], []
    for i in range(repeats):
        system = prompts[4 * i][:SYSTEM_TOKENS]
        for turn in prompts[4 * i + 1 : 4 * i + 3]:
            await client.generate(system + turn[:TURN_TOKENS], MAX_TOKENS)
        cold.append(await client.generate(prompts[4 * i + 3], MAX_TOKENS))
        hit.append(await client.generate(system + prompts[4 * i + 3][:TURN_TOKENS], MAX_TOKENS))
    return _against_cold(cold, hit, "hit")


def _against_cold(cold: list[Any], other: list[Any], name: str) -> dict[str, Any]:
    """The median TTFTs, the median of the pairs' ratios, `other`'s fewest cached tokens."""
    ratios = [o.ttft / c.ttft for c, o in zip(cold, other, strict=True) if o.ttft and c.ttft]
    return {
        "cold_ttft_ms": _median_ms([r.ttft for r in cold if r.ttft]),
        f"{name}_ttft_ms": _median_ms([r.ttft for r in other if r.ttft]),
        "ratio": percentile(ratios, 50),
        f"{name}_cached_tokens": min((r.cached_tokens for r in other), default=0),
        "errors": sum(1 for r in cold + other if r.error is not None),
    }


async def disk_restart(
    start: Callable[[], Worker], client_for: Callable[[Worker], Client], seed: str
) -> dict[str, Any]:
    """A system prompt's turns on a worker, a restart on the same directory, the same system
    prompt again; against the first turn, which was cold."""
    worker = start()
    client = client_for(worker)
    try:
        prompts = make_prompts(4, SYSTEM_TOKENS + TURN_TOKENS, client.vocab_size, seed)
        system = prompts[0][:SYSTEM_TOKENS]
        cold = await client.generate(system + prompts[1][:TURN_TOKENS], MAX_TOKENS)
        await client.generate(system + prompts[2][:TURN_TOKENS], MAX_TOKENS)
    finally:
        await client.close()
        worker.stop()
    worker = start()
    client = client_for(worker)
    try:
        hit = await client.generate(system + prompts[3][:TURN_TOKENS], MAX_TOKENS)
    finally:
        await client.close()
        worker.stop()
    ratio = hit.ttft / cold.ttft if hit.ttft and cold.ttft else None
    return {
        "cold_ttft_ms": _median_ms([cold.ttft] if cold.ttft else []),
        "disk_hit_ttft_ms": _median_ms([hit.ttft] if hit.ttft else []),
        "ratio": ratio,
        "hit_cached_tokens": hit.cached_tokens,
        "errors": int(cold.error is not None) + int(hit.error is not None),
    }


def cache_bytes(metrics_port: int) -> float:
    name = "mlx_worker_prompt_cache_bytes"
    return scrape_metrics(metrics_port, [name])[name]


async def shared_conversations(client: Client, metrics_port: int, seed: str) -> dict[str, Any]:
    """Bytes the prompt cache holds after one conversation, then after 16 sharing its prompt."""
    turns = make_prompts(CONVERSATIONS + 1, SHARED_TOKENS + TURN_TOKENS, client.vocab_size, seed)
    shared = turns[0][:SHARED_TOKENS]
    await client.generate(shared + turns[1][:TURN_TOKENS], MAX_TOKENS)
    one = await _settled_bytes(metrics_port)
    for turn in turns[2:]:
        await client.generate(shared + turn[:TURN_TOKENS], MAX_TOKENS)
    many = await _settled_bytes(metrics_port)
    return {
        "one_bytes": one,
        "many_bytes": many,
        "conversations": CONVERSATIONS,
        "ratio": many / one if one else None,
    }


async def _settled_bytes(metrics_port: int) -> float:
    """The figure after the engine process has reported it (every half second)."""
    await asyncio.sleep(1.2)
    return cache_bytes(metrics_port)


def model_dirs(model: Path | None) -> dict[str, Path]:
    """The models the prefix part runs on: the llama and hybrid demos, or the one given."""
    if model is not None:
        return {model.name: model}
    from servicer.demos.text import demo_model_path

    return {kind: demo_model_path(kind) for kind in ("llama", "hybrid")}


CHAT_SYSTEM_TOKENS = 1500
LONG_INTERVAL = 4096  # a real hybrid's automatic snapshot interval is in the thousands


async def second_conversation(client: Client, model: Path, seed: str, repeats: int = 3):
    """Two conversations sharing only a chat-templated system message: the second one's TTFT
    against a conversation with a new system message (cold)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model)
    systems = system_texts(tokenizer, 2 * repeats, CHAT_SYSTEM_TOKENS, seed)
    cold, second, lengths = [], [], []
    for i in range(repeats):
        shared, other = systems[2 * i], systems[2 * i + 1]
        await client.generate(chat_prompt(tokenizer, shared, f"Question {i}?"), MAX_TOKENS)
        cold.append(await client.generate(chat_prompt(tokenizer, other, "Hello?"), MAX_TOKENS))
        second.append(
            await client.generate(chat_prompt(tokenizer, shared, f"Another {i}?"), MAX_TOKENS)
        )
        message = [{"role": "system", "content": shared}]
        lengths.append(len(tokenizer.apply_chat_template(message, add_generation_prompt=False)))
    return {**_against_cold(cold, second, "second"), "system_message_tokens": min(lengths)}
