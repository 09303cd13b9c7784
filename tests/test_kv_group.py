"""The quantized KV cache's start check reads the model's real cache shapes: a group size that
does not divide them is an error naming --kv-group-size, and without the flag the worker picks
the largest of 64 and 32 that does."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import demo_config
from support import ROOT, ServerThread, generate

from servicer.engine.cache_kinds import check_quantization, make_row_cache
from servicer.engine.parts import cache_head_sizes, kv_group_size
from servicer.engine.quantized_kv import DequantizingRowCache, QuantizedRowCache
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


def _tiny(model_type: str, **config):
    """An mlx-lm model of `model_type` built from a config dict (random weights)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes({"model_type": model_type, **config})
    return model_class(args_class.from_dict({"model_type": model_type, **config}))


def test_a_model_without_attention_kv_takes_kv_bits_whatever_its_head_dim():
    """mamba2's `head_dim` is an SSM head (16 here): no layer is quantized, so nothing to refuse."""
    from mlx_lm.models.cache import make_prompt_cache

    model = _tiny(
        "mamba2",
        num_heads=8,
        head_dim=16,
        vocab_size=64,
        hidden_size=128,
        intermediate_size=128,
        state_size=32,
        num_hidden_layers=1,
        layer_norm_epsilon=1e-4,
        conv_kernel=3,
        n_groups=4,
        use_bias=False,
        use_conv_bias=False,
        tie_word_embeddings=True,
        time_step_limit=[0.01, 10.0],
        time_step_rank="auto",
        expand=1,
    )
    assert cache_head_sizes(model) == set()
    check_quantization(model, 8, kv_group_size(set(), None))
    rows = make_row_cache(model, 8, 64)
    assert [type(c) for c in rows] == [type(c) for c in make_prompt_cache(model)]


def _stablelm():
    return _tiny(
        "stablelm",
        vocab_size=64,
        hidden_size=128,
        num_attention_heads=4,
        num_hidden_layers=1,
        num_key_value_heads=2,
        partial_rotary_factor=1.0,
        intermediate_size=64,
        layer_norm_eps=0.01,
        rope_theta=10000,
        use_qkv_bias=False,
    )


def test_an_attention_that_cannot_take_quantized_kv_gets_dequantized_arrays_and_the_reason():
    """stablelm casts its keys (`keys.astype`): a quantized cache's tuples fail there. The start
    check says so, and the dequantizing kind (stored quantized, handed back as plain arrays)
    serves it instead."""
    model = _stablelm()
    assert cache_head_sizes(model) == {32}
    why = check_quantization(model, 8, 32)
    assert why is not None
    assert "stablelm model does not run on quantized keys and values" in why
    assert "astype" in why
    rows = make_row_cache(model, 8, 32, dequantize=True)
    assert [type(c) for c in rows] == [DequantizingRowCache]
    assert not hasattr(rows[0], "bits") and (rows[0].kv_bits, rows[0].kv_group_size) == (8, 32)


def test_a_model_that_runs_on_neither_quantized_kind_is_refused_with_both_reasons():
    """A model that reads its cache's buffer as an array after the update (a quantized cache
    keeps tuples there, whichever kind) is refused, naming what failed."""
    import mlx.nn as nn

    class ReadsTheBuffer(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        @property
        def layers(self):
            return self.model.layers

        def __call__(self, inputs, cache=None):
            out = self.model(inputs, cache=cache)
            return out + sum(c.keys.sum() for c in cache)  # the buffer as an array

    model = ReadsTheBuffer(_stablelm())
    with pytest.raises(ValueError, match="does not run on a quantized KV cache") as refused:
        check_quantization(model, 8, 32)
    assert "astype" in str(refused.value)
    assert "nor on one that hands back dequantized keys and values" in str(refused.value)


def test_a_config_head_dim_of_another_layer_kind_does_not_refuse_kv_bits():
    """gemma4_text's `head_dim` (32) is its sliding layers'; the global layers, the ones
    --kv-bits quantizes, hold 64 (`global_head_dim`). The group comes from those, and
    nothing refuses the model over the config's field: what makes it take the dequantizing
    kind is named (its attention does not take quantized tuples)."""
    config = json.loads((ROOT / "bench" / "families" / "configs" / "gemma4_text.json").read_text())
    config.pop("families")
    model = _tiny(**config)
    assert model.args.head_dim == 32
    assert cache_head_sizes(model) == {64}
    group = kv_group_size(cache_head_sizes(model), None)
    assert group == 64
    rows = make_row_cache(model, 8, group)  # refused over head_dim 32 before
    assert sum(isinstance(c, QuantizedRowCache) for c in rows) == 1
    why = check_quantization(model, 8, group)  # served dequantized: its attention cannot
    assert why is not None and "does not run on quantized keys and values" in why
    assert "head_dim" not in why
