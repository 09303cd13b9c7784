"""SmolVLM's images: tests/test_images_idefics3.py's checks (tiled images alone, batched with
text, from a cached prefix, and through the real smg router, media references: smg 1.13 does
not know the family) on the SmolVLM demo, whose processor on the worker is transformers'
Idefics3Processor (SmolVLM's own needs a torch video processor)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import SMG
from test_images import needs_vlm
from test_images_idefics3 import (
    check_batched_with_text_and_a_prefix_hit,
    check_through_the_router,
    check_tiled_images_alone,
    vlm_dir_of,
)
from vlm_support import served

from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = needs_vlm


@pytest.fixture(scope="module")
def vlm_dir():
    return vlm_dir_of("smolvlm")


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def test_tiled_images_alone_answer_as_mlx_vlm_does(stub, vlm_dir):
    check_tiled_images_alone(stub, vlm_dir)


def test_tiled_images_batched_with_text_and_from_a_cached_prefix(stub, vlm_dir):
    check_batched_with_text_and_a_prefix_hit(stub, vlm_dir)


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    check_through_the_router(vlm_dir, tmp_path)
