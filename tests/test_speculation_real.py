"""Speculation on the real google/gemma-3-270m (five 512-token sliding-window layers to one
global): the same tokens as without speculation, with prompt lookup and with a draft source
that is sometimes wrong (rollbacks); randomized prompts, some crossing the window so the rings
wrap while speculating; greedy and seeded; one row and four, rows joining mid-speculation.
One model load and a few short generations only (a token costs ~0.2 s with OpenBLAS, ~1 s
without: where OpenBLAS is installed and this process did not preload it, the tests run in a
child pytest that does); skipped where ../shared is absent."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import real_model_env
from spec_support import Job, drive, passages, plain_generator, runner_kwargs
from test_speculation_kinds import (
    check_greedy_identical,
    check_oracle_identical,
)

from servicer.engine.sampling import SeededSampler
from servicer.engine.speculation import PromptLookup, SpeculationConfig, SpeculativeRunner
from servicer.messages import SamplingSpec

BOS = 2  # Gemma writes garbage without it
WINDOW = 512  # the sliding layers' window
VOCAB = 262_144


def _needs_child() -> bool:
    """OpenBLAS is installed but not in this process: MLX's own BLAS makes the real model
    ~5x slower here, so the tests run in a child that preloads it."""
    env = real_model_env()
    return bool(env) and env["LD_PRELOAD"] not in os.environ.get("LD_PRELOAD", "")


# `make test` runs a slice in the child (one row and four across the window, rows joining
# seeded); `make test-slow` the rest.
CHILD_SLICES = {
    "fast": ("across_the_window or seeded", 2),
    "rest": ("not across_the_window and not seeded", 3),
}


@pytest.mark.parametrize("part", ["fast", pytest.param("rest", marks=pytest.mark.slow)])
def test_in_a_process_with_openblas(real_model_dir: Path, part: str) -> None:
    if not _needs_child():
        pytest.skip("this process has OpenBLAS (or it is not installed): the tests run here")
    selection, least = CHILD_SLICES[part]
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "-k", selection, __file__],
        env={**os.environ, **real_model_env()},
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= least, done.stdout[-2000:]  # none skipped there


@pytest.fixture(scope="module")
def gemma(real_model_dir: Path) -> tuple[Any, Any]:
    if _needs_child():
        pytest.skip("run in a child pytest with OpenBLAS preloaded (test_in_a_process_...)")
    import mlx.core as mx

    if sys.platform == "linux" and mx.default_device() == mx.cpu and not real_model_env():
        pytest.skip(
            "OpenBLAS is not installed (apt-get install libopenblas0-pthread): on MLX's own "
            "CPU BLAS these generations take ~5 minutes, past make test's time"
        )
    from mlx_lm import load

    return load(str(real_model_dir))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_real_gemma_greedy_identical_across_the_window(gemma: tuple[Any, Any]) -> None:
    model, tokenizer = gemma
    texts = passages()
    passage = _ids(tokenizer, texts[0])[:48]
    short = [BOS, *passage, *passage[:16]]  # a passage, then its start again
    other = _ids(tokenizer, texts[2])[:40]
    joining = [BOS, *other, *other[:12]]
    long = [BOS]
    for text in texts[3:]:
        long += _ids(tokenizer, text)
        if len(long) > 600:
            break
    long = long[:600] + long[1:40]  # past the 512 window, then a repeat to look up

    def jobs() -> list[Job]:
        return [
            Job("short", short, 10),
            Job("long", long, 6),
            Job("joining", joining, 8, join_at=2),
        ]

    plain = drive(plain_generator(model), jobs())
    runner = SpeculativeRunner(
        model,
        source=PromptLookup(),
        speculation=SpeculationConfig(costed=False, max_rows=8),
        **runner_kwargs(),
    )
    spec = drive(runner, jobs())
    for name, want in plain.items():
        assert spec[name].tokens == want.tokens, name
        assert spec[name].all_tokens == want.all_tokens, name
    assert len(long) + 6 > 600
    stats = runner.speculation
    assert stats.drafted > 0 and stats.accepted > 0


def random_real_jobs(tokenizer: Any, seed: int, batch: int, **extra: Any) -> list[Job]:
    """`batch` rows from the start and, above one row, two joining while the others
    speculate; prompts are natural-text fragments cut at random (BOS first, the fragment's
    start repeated for prompt lookup to find). Above one row the first prompt ends a few
    tokens short of the window, so its output crosses it while speculating."""
    rng = random.Random(seed)
    corpus = [_ids(tokenizer, text) for text in passages()]
    everything = [t for ids in corpus for t in ids]
    jobs = []
    for i in range(batch if batch == 1 else batch + 2):
        if i == 0 and batch > 1:
            start = rng.randrange(len(everything) - WINDOW)
            body = everything[start : start + WINDOW - rng.randint(4, 8) - 20]
            prompt = [BOS, *body, *body[:20]]
        else:
            ids = corpus[rng.randrange(len(corpus))]
            start = rng.randrange(max(1, len(ids) - 60))
            body = ids[start : start + rng.randint(16, 60)]
            prompt = [BOS, *body, *body[: len(body) // 2]]
        join = 0 if i < batch else rng.randint(2, 5)
        jobs.append(Job(f"r{i}", prompt, rng.randint(12, 18), join_at=join, **extra))
    return jobs


@pytest.mark.parametrize("batch", [1, 4])
def test_real_gemma_random_prompts_greedy(gemma: tuple[Any, Any], batch: int) -> None:
    """Greedy: the tokens of speculation off (see check_greedy_identical)."""
    model, tokenizer = gemma
    seed = 31 + batch
    if batch > 1:
        crossing = random_real_jobs(tokenizer, seed, batch)[0]
        assert len(crossing.prompt) < WINDOW < len(crossing.prompt) + crossing.max_tokens
    check_greedy_identical(model, lambda: random_real_jobs(tokenizer, seed, batch))


def test_real_gemma_seeded_identical_with_rows_joining(gemma: tuple[Any, Any]) -> None:
    """Seeded rows (temperature 0.8, top-k 40) draw what they draw without speculation,
    with four rows, two joining mid-speculation and one crossing the window."""
    model, tokenizer = gemma

    def jobs() -> list[Job]:
        out = random_real_jobs(tokenizer, 7, 4)
        for i, job in enumerate(out):
            job.sampler = SeededSampler(SamplingSpec(temperature=0.8, seed=40 + i, top_k=40), VOCAB)
        return out

    check_oracle_identical(model, jobs)


def test_real_gemma_fused_prefill_identical(gemma: tuple[Any, Any]) -> None:
    """A 700-token prompt (past the 512 window) arriving while two rows decode, its chunks
    in the rows' forwards (servicer/engine/fused_prefill.py): the tokens of separate forwards,
    greedy and seeded, and their log-probabilities as exactly as the BLAS keeps a row's
    product apart from the batch's shape. OpenBLAS on AVX-512 does not (a small product takes
    another kernel): there mlx-lm's own log-probabilities move in the last bits when one more
    row joins the batch, and the fused ones may move as far, no farther."""
    import mlx.core as mx

    from servicer.engine import fused_prefill
    from servicer.engine.runner import BatchRunner

    model, tokenizer = gemma
    assert fused_prefill.enable_fused_prefill(model)
    everything = [t for text in passages() for t in _ids(tokenizer, text)]

    def jobs(joining: bool = True) -> list[Job]:
        out = [
            Job("a", [BOS, *everything[100:130]], 24),
            Job("b", [BOS, *everything[400:420]], 24),
            Job("long", [BOS, *everything[1000:1700]], 4, join_at=2),
        ]
        out[1].sampler = SeededSampler(SamplingSpec(temperature=0.8, seed=5, top_k=40), VOCAB)
        return out if joining else out[:2]

    def farthest(x: list[Any], y: list[Any]) -> float:
        return max(mx.abs(a - b).max().item() for a, b in zip(x, y, strict=True))

    plain = drive(plain_generator(model, prefill_step_size=96), jobs())
    two_rows = drive(plain_generator(model, prefill_step_size=96), jobs(joining=False))
    batch_noise = max(farthest(two_rows[n].logprobs, plain[n].logprobs) for n in two_rows)
    runner = BatchRunner(model, fuse_prefill=True, **{**runner_kwargs(), "prefill_step_size": 96})
    fused = drive(runner, jobs())
    assert runner.fused_steps >= 5
    for name, want in plain.items():
        assert fused[name].tokens == want.tokens, name
        moved = farthest(want.logprobs, fused[name].logprobs)
        assert moved <= 4 * batch_noise < 1e-3, (name, moved, batch_noise)
