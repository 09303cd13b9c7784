"""Qwen3.5-MoE's images (the tiny qwen3_5_moe demo: qwen3_5's prompt, processor, tower and
hybrid text stack, its MLPs routed and shared experts): the qwen3_vl tests on this family's
demo, through the real server and through the real smg router (media references). The image
follows the question in the worker's test: the hybrid demo heeds an image only near the end of
its prompt."""

from __future__ import annotations

import pytest
from test_images_qwen3_vl import (  # noqa: F401  (the tests run here on this family)
    stub,
    test_images_alone_batched_with_text_and_from_a_prefix_equal_mlx_vlm,
    test_through_the_router_answers_as_mlx_vlm_does,
    vlm_dir,
)


@pytest.fixture(scope="module")
def family() -> str:
    return "qwen3_5_moe"


@pytest.fixture(scope="module")
def image_last() -> bool:
    return True
