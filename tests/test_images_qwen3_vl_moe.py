"""Qwen3-VL-MoE's images (the tiny qwen3_vl_moe demo: qwen3_vl's prompt, multimodal RoPE and
deepstack over a mixture-of-experts text stack): the qwen3_vl tests on this family's demo,
through the real server and through the real smg router (media references)."""

from __future__ import annotations

import pytest
from test_images_qwen3_vl import (  # noqa: F401  (the tests run here on this family)
    image_last,
    stub,
    test_images_alone_batched_with_text_and_from_a_prefix_equal_mlx_vlm,
    test_through_the_router_answers_as_mlx_vlm_does,
    vlm_dir,
)


@pytest.fixture(scope="module")
def family() -> str:
    return "qwen3_vl_moe"
