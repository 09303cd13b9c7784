"""One small seed of the request fuzz (tests/request_fuzz.py) on both faces of a demo llama:
no hang, no crash, no UNKNOWN or INTERNAL, no lost row, the right refusals, and an engine that
still answers a known greedy request token for token. `make fuzz-requests SEEDS=20` runs more."""

from __future__ import annotations

from request_fuzz import BUILDERS, fuzz


def test_a_seed_of_random_requests_gets_clear_answers_and_leaves_the_worker_whole():
    cover = fuzz(["llama"], [0], requests=120)["llama"]
    assert cover.failures == []
    assert cover.seeds == 1 and cover.requests == 120
    assert cover.expected["ok"] > 10 and cover.expected["refused"] > 10
    assert len(cover.statuses) >= len(BUILDERS)  # every kind of call, on both faces
