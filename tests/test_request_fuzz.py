"""One small seed of the request fuzz (tests/request_fuzz.py) on both faces of a demo llama, and
one of the demo vision-language model with image parts on its vLLM face: no hang, no crash, no
UNKNOWN or INTERNAL, no lost row, the right refusals (a bad image's naming its index), and an
engine that still answers a known greedy request token for token. `make fuzz-requests SEEDS=20`
runs more."""

from __future__ import annotations

import importlib.util

import pytest
from request_fuzz import BUILDERS, fuzz


def test_a_seed_of_random_requests_gets_clear_answers_and_leaves_the_worker_whole():
    cover = fuzz(["llama"], [0], requests=120)["llama"]
    assert cover.failures == []
    assert cover.seeds == 1 and cover.requests == 120
    assert cover.expected["ok"] > 10 and cover.expected["refused"] > 10
    assert len(cover.statuses) >= len(BUILDERS)  # every kind of call, on both faces


@pytest.mark.skipif(
    importlib.util.find_spec("mlx_vlm") is None,
    reason="mlx-vlm is not installed (the vision extra)",
)
def test_a_seed_of_random_image_requests_gets_clear_answers_and_leaves_the_worker_whole():
    cover = fuzz(["vlm"], [0], requests=80)["vlm"]
    assert cover.failures == []
    assert cover.seeds == 1 and cover.requests == 80
    assert cover.expected["ok"] > 10 and cover.expected["refused"] > 10
    assert len(cover.statuses) >= len(BUILDERS)  # every kind of call, on both faces
    served = cover.images.get("valid", {}).get("OK", 0)
    refused = sum(
        n for what, codes in cover.images.items() if what != "valid" for n in codes.values()
    )
    assert served > 3 and refused > 3  # images served, and bad ones refused
