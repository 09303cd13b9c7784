"""Everything an engine builds from its model before it can step: the weights, sampling,
the admission guard's limits, the prefix cache and the BatchGenerator (engine thread only)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from ..faults import FaultPlan
from ..messages import Admission, ModelInfo
from .constraints import GrammarFactory
from .lockstep import Lockstep
from .memory import device_memory_bytes, measure, weights_bytes
from .model import LoadedModel, load_model, log_blas_hint
from .prefix_cache import PrefixCache
from .sampling import SamplingFactory


@dataclass(frozen=True)
class EngineConfig:
    adapter_path: str | None = None
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    # A burst that is still arriving while nothing generates is admitted together:
    # wait while new requests keep coming `coalesce_quiet_s` apart, at most `coalesce_max_s`.
    coalesce_quiet_s: float = 0.002
    coalesce_max_s: float = 0.010
    warmup: bool = True
    # Prompt-prefix reuse: entries kept, and their bytes (None: a quarter of max_kv_memory,
    # at most 1 GiB). 0 entries turns it off.
    prompt_cache_size: int = 64
    prompt_cache_bytes: int | None = None
    # KV and recurrent state the running requests may reserve (None: half the device's
    # memory less the weights). A request that cannot fit alone is refused; one that cannot
    # fit beside the others waits.
    max_kv_memory: int | None = None
    # The engine's own random stream for unseeded sampling (None: a fresh random seed).
    sampling_seed: int | None = None
    # One model over several processes: rank 0 plans every step and shares the plan.
    lockstep: Lockstep | None = None
    faults: FaultPlan | None = None  # testing only


@dataclass
class EngineParts:
    """What the engine steps with, built once on its thread."""

    loaded: LoadedModel
    sampling: SamplingFactory
    admission: Admission
    prefix: PrefixCache | None
    has_thinking: bool


def build_parts(config: EngineConfig, info: ModelInfo) -> EngineParts:
    """Load the model `info` describes and build everything around it."""
    lockstep = config.lockstep
    log_blas_hint()
    if config.faults is not None:
        config.faults.before_load()
    group = lockstep.group if lockstep is not None else None
    loaded = load_model(Path(info.model_dir), config.adapter_path, group)
    seed = config.sampling_seed
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    if lockstep is not None:
        seed = lockstep.shared_seed(seed)
    tokenizer = loaded.tokenizer
    eos = info.eos_token_ids[0] if info.eos_token_ids else 0
    sampling = SamplingFactory(
        info.vocab_size,
        GrammarFactory(tokenizer._tokenizer, info.vocab_size, eos),
        seed,
        think_start=tokenizer.think_start_tokens,
        think_end=tokenizer.think_end_tokens,
    )
    admission = _admission(config, loaded)
    return EngineParts(
        loaded,
        sampling,
        admission,
        _prefix_cache(config, admission),
        bool(tokenizer.think_start_tokens and tokenizer.think_end_tokens),
    )


def _admission(config: EngineConfig, loaded: LoadedModel) -> Admission:
    limit = config.max_kv_memory
    if limit is None:
        limit = max(device_memory_bytes() // 2 - weights_bytes(loaded.model), 64 << 20)
    return Admission(measure(loaded.model), limit)


def _prefix_cache(config: EngineConfig, admission: Admission) -> PrefixCache | None:
    if config.prompt_cache_size <= 0:
        return None
    max_bytes = config.prompt_cache_bytes
    if max_bytes is None:
        # Ranks must evict alike, so a distributed engine does not size it per machine.
        shared = config.lockstep is not None
        max_bytes = 1 << 30 if shared else min(admission.limit_bytes // 4, 1 << 30)
    return PrefixCache(config.prompt_cache_size, max_bytes)


def new_generator(config: EngineConfig, parts: EngineParts, stream: mx.Stream) -> BatchGenerator:
    return BatchGenerator(
        parts.loaded.model,
        completion_batch_size=config.completion_batch_size,
        prefill_batch_size=config.prefill_batch_size,
        prefill_step_size=config.prefill_step_size,
        stream=stream,
    )


def warm_up(generator: BatchGenerator, token: int) -> None:
    """One short request through the whole path, so the first real one pays no JIT."""
    (uid,) = generator.insert([[token] * 4], max_tokens=[2])
    for _ in range(16):
        _, responses = generator.next()
        if any(r.uid == uid and r.finish_reason for r in responses):
            return
    generator.remove([uid])
