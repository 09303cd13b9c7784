"""A hybrid model's second conversation resumes right after the system message it shares with
the first, however long the snapshot interval: snapshots are taken where chat messages end."""

from __future__ import annotations

import random

import pytest
from conftest import Reference, demo_config
from support import SMG, Router, ServerThread, generate

from servicer.demos.text import TEST_PROMPTS, demo_model_path

N = 8
QUESTIONS = ("Tell me about the river.", "What does our cat eat?", "When does the train leave?")


def _system_text(reference: Reference, tokens: int = 1500) -> str:
    rng = random.Random(7)
    words: list[str] = []
    while len(reference.encode(" ".join(words))) < tokens:
        words.append(rng.choice(TEST_PROMPTS))
    return " ".join(words)


def _chat(reference: Reference, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return list(reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _system_message_length(reference: Reference, system: str) -> int:
    messages = [{"role": "system", "content": system}]
    return len(reference.tokenizer.apply_chat_template(messages, add_generation_prompt=False))


@pytest.fixture(scope="module")
def hybrid() -> tuple[Reference, str, int]:
    reference = Reference(demo_model_path("hybrid"))
    system = _system_text(reference)
    return reference, system, _system_message_length(reference, system)


def _long_interval():
    return demo_config(demo_model_path("hybrid"), prompt_cache_snapshot_interval=4096)


def test_the_second_conversation_reuses_the_whole_system_message(hybrid):
    reference, system, message = hybrid
    assert message >= 1500
    with ServerThread(_long_interval()) as running, running.channel() as chan:
        outcomes = []
        for question in QUESTIONS:
            prompt = _chat(reference, system, question)
            outcome = generate(chan, prompt, temperature=0, max_tokens=N, ignore_eos=True)
            assert outcome.error is None, outcome.error
            assert outcome.tokens == reference.greedy(prompt, N)
            outcomes.append(outcome)
    assert outcomes[0].complete.cached_tokens == 0
    assert all(o.complete.cached_tokens >= message for o in outcomes[1:])


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_the_same_through_the_routers_chat_api(hybrid, tmp_path):
    _, system, message = hybrid
    with ServerThread(_long_interval()) as running:
        router = Router([running.address], tmp_path / "smg.log")
        try:
            model = router.wait_until_serving()
            cached = []
            for question in QUESTIONS[:2]:
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ]
                body = {"model": model, "messages": messages, "max_tokens": N, "temperature": 0}
                response = router.client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                details = response.json()["usage"].get("prompt_tokens_details") or {}
                cached.append(details.get("cached_tokens", 0))
        finally:
            router.close()
    assert cached[0] == 0
    assert cached[1] >= message
