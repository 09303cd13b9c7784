"""The engine's settings: plain data that crosses to the engine process (no MLX here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .faults import FaultPlan

if TYPE_CHECKING:
    from .engine.lockstep import Lockstep

DEFAULT_PREFILL_STEP = 2048  # prompt tokens per row a prefill step takes at most (a full chunk)
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes, and so what --kv-bits accepts


@dataclass(frozen=True)
class EngineConfig:
    adapter_path: str | None = None
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    # While rows decode, a step prefills only what fits this stall (0: full chunks always),
    # widened up to this factor while prompts queue up (1: never).
    max_prefill_stall_ms: float = 50.0
    max_prefill_stall_widen: float = 4.0
    # A burst that is still arriving while nothing generates is admitted together:
    # wait while new requests keep coming `coalesce_quiet_s` apart, at most `coalesce_max_s`.
    coalesce_quiet_s: float = 0.002
    coalesce_max_s: float = 0.010
    warmup: bool = True
    # Prompt-prefix reuse: blocks kept in RAM, and their bytes (None: a quarter of
    # max_kv_memory, at most 1 GiB). 0 blocks turns it off.
    prompt_cache_size: int = 65536
    prompt_cache_bytes: int | None = None
    prompt_cache_block: int = 256  # tokens per block
    # Tokens between snapshots of recurrent and sliding-window state (None: chosen from the
    # model so that they take at most about a quarter of a prompt's KV bytes).
    prompt_cache_snapshot_interval: int | None = None
    prompt_cache_dir: str | None = None  # the disk tier's directory (None: no disk tier)
    prompt_cache_disk_bytes: int = 32 << 30
    # KV and recurrent state the running requests may reserve (None: half the device's
    # memory less the weights). A request that cannot fit alone is refused; one that cannot
    # fit beside the others waits.
    max_kv_memory: int | None = None
    # The attention layers' KV cache quantized to this many bits (None: the model's dtype), in
    # groups of `kv_group_size` values along each token's vector.
    kv_bits: int | None = None
    kv_group_size: int | None = None  # None: the largest of 64 and 32 that fits the model
    # Speculative decoding: "ngram" (prompt lookup, the default), "draft" (with `draft_model`,
    # a path or demo:KIND), or None (off); drafts of up to `speculate_k` tokens a row, none
    # while more than `speculate_max_batch` rows are in the batch, and none where the engine
    # measures that drafting does not pay. Off where the model's caches cannot roll back,
    # and with `lockstep` (one model over several processes).
    speculate: str | None = "ngram"
    draft_model: str | None = None
    speculate_k: int = 4
    speculate_max_batch: int = 4
    speculate_costed: bool = True  # tests turn the measured choice off to draft every step
    # The engine's own random stream for unseeded sampling (None: a fresh random seed).
    sampling_seed: int | None = None
    # One model over several processes: rank 0 plans every step and shares the plan.
    lockstep: Lockstep | None = None  # in-process engines only
    # A step (with its plan and hand-off) running longer than max(this, 8x the longest step
    # so far) is a stall: the worker fails every request and exits (0: no watchdog).
    step_timeout_s: float = 120.0
    faults: FaultPlan | None = None  # testing only
