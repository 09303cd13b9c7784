"""The quantized KV cache's start check reads the model's real cache shapes: a group size that
does not divide them is an error naming --kv-group-size, and without the flag the worker picks
the largest of 64 and 32 that does."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import demo_config
from support import ServerThread, generate

from servicer.engine.parts import cache_head_sizes, kv_group_size
from servicer.messages import EngineStartupError
from servicer.model_files import ModelLoadError


def _phi3():
    """A tiny phi3: it derives its head size (hidden / heads = 96); no config field says it."""
    from mlx_lm.models import phi3

    args = phi3.ModelArgs(
        model_type="phi3",
        hidden_size=192,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=64,
    )
    return phi3.Model(args)


def test_the_group_is_picked_from_the_head_sizes():
    assert kv_group_size({256}, None) == 64
    assert kv_group_size({32}, None) == 32
    assert kv_group_size({96}, None) == 32
    assert kv_group_size({128, 192}, None) == 64  # keys and values of different sizes
    assert kv_group_size({256}, 128) == 128
    with pytest.raises(ModelLoadError, match="--kv-group-size 64 does not divide"):
        kv_group_size({96}, 64)
    with pytest.raises(ModelLoadError, match="not a multiple of 64 or 32"):
        kv_group_size({80}, None)


def test_a_derived_head_size_is_read_off_the_cache():
    model = _phi3()
    assert not hasattr(model.args, "head_dim")
    assert cache_head_sizes(model) == {96}
    assert kv_group_size(cache_head_sizes(model), None) == 32


def test_kv_bits_on_a_demo_model_starts_without_a_group_and_serves(demo_dir, prompts):
    config = replace(demo_config(demo_dir, kv_bits=8), engine_mode="thread")
    with ServerThread(config) as running, running.channel() as chan:
        outcome = generate(chan, prompts[0], max_tokens=4, ignore_eos=True)
        assert outcome.error is None and len(outcome.tokens) == 4


def test_a_group_that_does_not_divide_the_head_fails_startup_naming_the_flag(demo_dir):
    config = replace(demo_config(demo_dir, kv_bits=8, kv_group_size=64), engine_mode="thread")
    with (
        pytest.raises(EngineStartupError, match="--kv-group-size 64 does not divide"),
        ServerThread(config),
    ):
        pass
