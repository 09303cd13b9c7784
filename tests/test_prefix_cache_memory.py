"""Engine-side check: a kept prefix holds its own rows only, not the batch it came from.

mlx-lm hands a finished row's cache out as lazy slices of the whole batch's buffers; stored as
they are, each kept block would keep every row of that batch alive (seen: 270 MB of MLX memory
held by entries that reported 2 MB).
"""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from servicer.engine.prefix.store import CacheLayout, PrefixStore


def test_a_stored_finished_cache_does_not_pin_its_batch(reference, prompts):
    gc.collect()
    baseline = mx.get_active_memory()
    store = PrefixStore(CacheLayout.of(reference.model), 64, 64, max_bytes=1 << 30)
    generator = BatchGenerator(reference.model, completion_batch_size=16, prefill_batch_size=16)
    batch = [prompts[i % len(prompts)] * 20 for i in range(16)]  # ~100-token prompts
    generator.insert(batch, max_tokens=[2] + [40] * 15)
    stored = 0
    while stored == 0 or len(generator._generation_batch):
        _, responses = generator.next()
        for response in responses:
            if response.finish_reason and stored == 0:
                store.keep(response.all_tokens, response.prompt_cache, snapshot=True)
                stored = 1
    generator.close()
    del generator, responses, response
    gc.collect()
    held = mx.get_active_memory() - baseline
    assert store.index.ram_blocks >= 1
    assert held < 2 * store.index.ram_bytes + (1 << 20), (held, store.index.ram_bytes)
