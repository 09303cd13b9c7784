"""Replicated routers: each one's own guess of where a prefix lives knows only the traffic it
routed, so a conversation whose turns alternate between two routers lands on a cold worker
unless the routers learn from the workers' KV events (the vLLM face's SubscribeKvEvents)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread, wait_until

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")

CONVERSATIONS = 8
TURNS = 3
SYSTEM_TOKENS = 3300


def system_prompts(tokenizer, count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` different system prompts of about `tokens` tokens each."""
    words = tokenizer.decode(list(range(40, 400))).split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(tokens))
        ids = tokenizer.encode(text)[:tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


@dataclasses.dataclass
class TurnResult:
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit(self) -> bool:
        return self.cached_tokens >= 0.9 * self.prompt_tokens


def run_conversations(routers: list[Router], model: str, systems: list[str]) -> list[TurnResult]:
    """Every conversation's turns, each turn through the next router; the later turns'
    results."""
    histories = [[{"role": "system", "content": system}] for system in systems]
    later: list[TurnResult] = []
    for turn in range(TURNS):
        for index, history in enumerate(histories):
            history.append({"role": "user", "content": f"Question {turn} about part {index}?"})
            router = routers[(index + turn) % len(routers)]
            body = {"model": model, "messages": history, "max_tokens": 8, "temperature": 0}
            response = router.client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            reply = response.json()
            history.append(reply["choices"][0]["message"] | {"role": "assistant"})
            usage = reply["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if turn > 0:
                later.append(TurnResult(usage["prompt_tokens"], cached))
    return later


@pytest.fixture
def fleet(demo_dir, tmp_path) -> Iterator[tuple[list[Router], str]]:
    config = dataclasses.replace(demo_config(demo_dir), protocols=("mlx", "vllm"))
    with ExitStack() as stack:
        workers = [stack.enter_context(ServerThread(config)) for _ in range(2)]
        addresses = [worker.address for worker in workers]
        routers = [Router(addresses, Path(tmp_path) / f"smg{i}.log") for i in range(2)]
        for router in routers:
            stack.callback(router.close)
        models = [router.wait_until_serving() for router in routers]
        hubs = [worker.server.servicer.kv_events for worker in workers]
        # Each router subscribes to each worker's events.
        assert wait_until(lambda: all(len(hub._subscribers) >= 2 for hub in hubs), timeout=30)
        yield routers, models[0]


def test_with_kv_events_every_later_turn_hits_whichever_router_sends_it(fleet, reference):
    routers, model = fleet
    systems = system_prompts(reference.tokenizer, CONVERSATIONS, SYSTEM_TOKENS)
    later = run_conversations(routers, model, systems)
    assert len(later) == CONVERSATIONS * (TURNS - 1)
    misses = [turn for turn in later if not turn.hit]
    assert not misses, misses
