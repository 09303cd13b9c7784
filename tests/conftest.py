"""Shared fixtures: the demo model, greedy references from mlx-lm, one running worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support import ServerThread, slow

from servicer.demos.text import TEST_PROMPTS, demo_model_path
from servicer.engine import EngineConfig
from servicer.engine_config import SpeculationConfig
from servicer.model_files import ModelSpec
from servicer.server import ServerConfig

# Speculation that drafts at every step (not only where the engine measures that it pays).
DRAFT_EVERY_STEP = SpeculationConfig(costed=False)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    return demo_model_path()


KIND_MODEL_KINDS = ("llama", "gemma3")


def kind_model_kinds(*slow_kinds: str) -> pytest.MarkDecorator:
    """One test's `kind_model` kinds, those in `slow_kinds` only in make test-slow."""
    params = [slow(k, id=k) if k in slow_kinds else k for k in KIND_MODEL_KINDS]
    return pytest.mark.parametrize("kind_model", params, indirect=True)


@pytest.fixture(scope="module", params=KIND_MODEL_KINDS)
def kind_model(request) -> tuple[str, Any, Any]:
    """A demo kind whose attention fused prefill and row groups cover, loaded with its
    attention classes swapped: (kind, model, tokenizer)."""
    from mlx_lm import load

    from servicer.engine import fused_prefill

    model, tokenizer = load(str(demo_model_path(request.param)))
    assert fused_prefill.enable_fused_prefill(model)
    return request.param, model, tokenizer


class Reference:
    """Greedy continuations from mlx-lm's own single-sequence generator (the correctness bar)."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(model_dir))
        self._cache: dict[tuple, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def greedy(self, prompt: list[int], max_tokens: int, **processors: Any) -> list[int]:
        """Tokens mlx_lm.generate would produce at temperature 0, ignoring EOS, with mlx-lm's
        logits processors for `processors` (make_logits_processors' arguments)."""
        key = (tuple(prompt), max_tokens, tuple(sorted(processors.items())))
        if key not in self._cache:
            import mlx.core as mx
            from mlx_lm.generate import generate_step
            from mlx_lm.sample_utils import make_logits_processors

            steps = generate_step(
                mx.array(prompt),
                self.model,
                max_tokens=max_tokens,
                logits_processors=make_logits_processors(**processors) if processors else None,
            )
            self._cache[key] = [int(token) for token, _ in steps]
        return self._cache[key]


@pytest.fixture(scope="session")
def reference(demo_dir: Path) -> Reference:
    return Reference(demo_dir)


@pytest.fixture(scope="session")
def prompts(reference: Reference) -> list[list[int]]:
    return [reference.encode(text) for text in TEST_PROMPTS]


def demo_config(model_dir: Path, **engine: object) -> ServerConfig:
    return ServerConfig(
        model=ModelSpec(str(model_dir)),
        engine=EngineConfig(**engine),  # type: ignore[arg-type]
        port=0,
    )


@pytest.fixture(scope="session")
def server(demo_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(demo_config(demo_dir)) as running:
        yield running


@pytest.fixture(scope="session")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with server.channel() as chan:
        yield chan


SHARED_REAL_MODEL = (
    Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "real_model.sh"
)
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")


def build_real_model(model: str) -> Path:
    """A real model built offline by the shared tools beside the project (a minute or two the
    first time, from the package registry): skipped where the tools are absent, a failure
    where they are present but the build fails (a broken build must not pass as a skip)."""
    import os
    import subprocess

    if not SHARED_REAL_MODEL.is_file():
        pytest.skip(f"no real model: {SHARED_REAL_MODEL} is absent (../shared is not here)")
    import fcntl

    env = {**os.environ, "MODEL": model}
    # The tests run in parallel processes; the shared script does not lock its build itself.
    lock_path = Path.home() / ".cache" / "mlx-grpc-worker-real.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            built = subprocess.run(
                ["bash", str(SHARED_REAL_MODEL)],
                capture_output=True,
                text=True,
                timeout=900,
                env=env,
            )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the real model {model} did not build in 15 minutes")
    lines = built.stdout.strip().splitlines()
    if built.returncode != 0 or not lines or not Path(lines[-1]).is_dir():
        pytest.fail(
            f"the real model {model} could not be built (code {built.returncode}): "
            f"{built.stderr.strip()[-500:]}"
        )
    return Path(lines[-1])


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """google/gemma-3-270m (a base model)."""
    return build_real_model("gemma-3-270m")


@pytest.fixture(scope="session")
def real_chat_model_dir() -> Path:
    """HuggingFaceTB/SmolLM2-135M-Instruct (a chat model)."""
    return build_real_model("smollm2-135m-instruct")


def real_model_env() -> dict[str, str]:
    """A worker on the real model runs its matrix products with OpenBLAS where installed."""
    if not OPENBLAS.is_file():
        return {}
    return {"LD_PRELOAD": str(OPENBLAS), "OPENBLAS_NUM_THREADS": "1"}
