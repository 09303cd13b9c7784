"""GLM-4.5V-style images (the glm4v_moe family: GLM-4V's prompt, processor and vision tower
with a mixture-of-experts text stack, its partial multimodal RoPE in half-split pairs):
tests/test_images_glm4v.py's checks (images of different sizes alone and two in a prompt,
batched with text, from a cached prefix, and through the real smg router, media references:
smg 1.13 has no spec for GLM-4V) on the glm4v_moe demo."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import SMG
from test_images import needs_vlm
from test_images_glm4v import (
    check_batched_with_text_and_a_prefix_hit,
    check_images_alone,
    check_through_the_router,
    vlm_dir_of,
)
from vlm_support import served

from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = needs_vlm
FAMILY = "glm4v_moe"


@pytest.fixture(scope="module")
def vlm_dir():
    return vlm_dir_of(FAMILY)


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def test_images_alone_and_two_in_a_prompt_answer_as_mlx_vlm_does(stub, vlm_dir):
    check_images_alone(stub, vlm_dir)


def test_images_batched_with_text_and_from_a_cached_prefix(stub, vlm_dir):
    check_batched_with_text_and_a_prefix_hit(stub, vlm_dir)


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_as_media_references_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    check_through_the_router(vlm_dir, tmp_path, FAMILY)
