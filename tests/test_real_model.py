"""The real google/gemma-3-270m end to end (skipped where ../shared is absent): a raw-text
completion through the real smg router, which tokenizes it without the model's BOS, gives
mlx-lm's greedy text for the prompt with its BOS. A token costs ~0.2 s: a few short runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import real_model_env
from support import SMG, Router, WorkerProcess

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")

PROMPT = "def quicksort(arr):"
N = 12


@pytest.fixture(scope="module")
def real_greedy(real_model_dir: Path):
    from mlx_lm import load

    model, tokenizer = load(str(real_model_dir))

    def greedy(text: str, max_tokens: int = N) -> tuple[list[int], list[int]]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        prompt = list(tokenizer.encode(text))  # as mlx_lm.generate does: with the BOS
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
        tokens = [int(token) for token, _ in steps]
        return prompt, tokens

    return greedy, tokenizer


@pytest.fixture(scope="module")
def routed(real_model_dir: Path, tmp_path_factory) -> Iterator[tuple[Router, str]]:
    worker = WorkerProcess("--model", str(real_model_dir), env=real_model_env())
    with worker:
        worker.wait_ready(300)
        router = Router([worker.address], tmp_path_factory.mktemp("router") / "smg.log")
        try:
            yield router, router.wait_until_serving(300)
        finally:
            router.close()


def test_a_raw_text_completion_through_the_router_is_mlx_lm_greedy_with_the_bos(
    routed, real_greedy
):
    router, model = routed
    greedy, tokenizer = real_greedy
    prompt, tokens = greedy(PROMPT)
    assert prompt[0] == tokenizer.bos_token_id
    eos = set(tokenizer.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    expected = tokenizer.decode(tokens[:cut], skip_special_tokens=True)
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0}
    response = router.client.post("/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["prompt_tokens"] == len(prompt)  # the BOS the worker put first
    assert "((((" not in reply["choices"][0]["text"]
