"""Per-request sampling stays with its request under churn.

Hundreds of concurrent requests with staggered arrivals and cancels mix plain greedy
requests, requests whose logit_bias forces a token, heavily penalised ones, regex-constrained
ones and seeded ones; each output must obey its own parameters and nobody else's (a plain
request that picked up someone's bias or grammar would no longer match its solo output).
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from support import generate, make_request, server_info, wait_until

from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

REQUESTS = 240
CONCURRENCY = 16
N = 16
PATTERN = r"[a-c]{2}[0-9]{3}"
WINDOW = 20  # mlx-lm's penalty context size


def _params(kind: str, rng: random.Random, forced: int) -> dict:
    if kind == "plain":
        return {"temperature": 0}
    if kind == "biased":
        return {"temperature": 0.7, "logit_bias": {forced: 100.0}}
    if kind == "penalised":
        return {"temperature": 0.9, "presence_penalty": 1e4, "repetition_penalty": 1.3}
    if kind == "regex":
        return {"temperature": 1.0, "regex": PATTERN}
    return {"temperature": 1.0, "seed": rng.randrange(4)}


def _violation(kind, prompt, params, tokens, reference, seeded, complete) -> str | None:
    if kind == "plain" and tokens != reference.greedy(prompt, N)[: len(tokens)]:
        return "plain output differs from its solo run"
    if kind == "biased" and set(tokens) - set(params["logit_bias"]):
        return f"biased output {tokens}"
    if kind == "penalised":
        context = prompt + tokens
        for i in range(len(prompt), len(context)):
            if context[i] in context[max(0, i - WINDOW) : i]:
                return f"penalised output repeats {context[i]} within {WINDOW} tokens"
    if kind == "regex" and complete:
        text = reference.tokenizer.decode(tokens, skip_special_tokens=True)
        if not re.fullmatch(PATTERN, text):
            return f"constrained output {text!r}"
    if kind == "seeded" and tokens != seeded[(tuple(prompt), params["seed"])][: len(tokens)]:
        return "seeded output differs from its solo run"
    return None


def test_each_request_keeps_its_own_sampling_under_churn(server, channel, reference, prompts):
    rng = random.Random(7)
    forced = 300
    kinds = ["plain", "biased", "penalised", "regex", "seeded"]
    seeded = {
        (tuple(p), seed): generate(
            channel, p, temperature=1.0, seed=seed, max_tokens=N, ignore_eos=True
        ).tokens
        for p in prompts
        for seed in range(4)
    }
    jobs = []
    for i in range(REQUESTS):
        kind = kinds[i % len(kinds)]
        prompt = prompts[rng.randrange(len(prompts))]
        params = _params(kind, rng, forced)
        cancel_after = rng.randrange(2, 8) if rng.random() < 0.15 else None
        jobs.append((i, kind, prompt, params, cancel_after, rng.uniform(0, 0.05)))

    stub = pb_grpc.MlxEngineStub(channel)

    def run(job) -> str | None:
        i, kind, prompt, params, cancel_after, delay = job
        time.sleep(delay)  # staggered arrivals
        request = make_request(
            prompt, request_id=f"churn-{i}", max_tokens=N, ignore_eos=kind != "regex", **params
        )
        tokens, complete = [], False
        try:
            call = stub.Generate(request, timeout=120)
            for response in call:
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
                    if cancel_after is not None and len(tokens) >= cancel_after:
                        call.cancel()
                        break
                else:
                    complete = True
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                return f"churn-{i} ({kind}): {error.code().name} {error.details()}"
        if cancel_after is None and not complete:
            return f"churn-{i} ({kind}): no complete message"
        problem = _violation(kind, prompt, params, tokens, reference, seeded, complete)
        return f"churn-{i} ({kind}): {problem}" if problem else None

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(run, jobs))
    violations = [r for r in results if r]
    print(f"churn: {REQUESTS} requests at concurrency {CONCURRENCY}, {len(violations)} violations")
    assert violations == []
    assert wait_until(lambda: server_info(channel).active_requests == 0)
    load = server.server.load()
    assert (load.running, load.waiting) == (0, 0)
