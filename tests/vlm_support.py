"""What the tests of one vision-language family share: the demo checkpoint served on the vLLM
face, mlx-vlm's own model and processor for it, and its chat prompts as the router sends them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import demo_config
from support import ServerThread

from servicer.proto import vllm_engine_pb2_grpc as vgrpc


@contextmanager
def served(vlm_dir: Path) -> Iterator[vgrpc.VllmEngineStub]:
    """The worker on `vlm_dir`'s checkpoint (vLLM face; blocks of 4 for short prompts)."""
    config = dataclasses.replace(demo_config(vlm_dir, prompt_cache_block=4), protocols=("vllm",))
    with ServerThread(config) as running, running.channel() as channel:
        yield vgrpc.VllmEngineStub(channel)


@functools.cache
def loaded(path: str):
    """mlx-vlm's model and processor of the checkpoint (loaded once a test session)."""
    from mlx_vlm import load

    return load(path)


def chat_text(vlm_dir: Path, question: str, images: int) -> str:
    """The chat template rendered: `images` image parts, then the question."""
    _, processor = loaded(str(vlm_dir))
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    return processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def router_ids(vlm_dir: Path, question: str, images: int = 1) -> list[int]:
    """The prompt as the router sends it: one unexpanded anchor per image."""
    _, processor = loaded(str(vlm_dir))
    text = chat_text(vlm_dir, question, images)
    return list(processor.tokenizer.encode(text, add_special_tokens=False))


def processed_chat(vlm_dir: Path, question: str, raws: list[bytes]) -> tuple[object, dict]:
    """mlx-vlm's model, and its processor's output for the chat with `raws` as the images."""
    import io

    from PIL import Image

    model, processor = loaded(str(vlm_dir))
    text = chat_text(vlm_dir, question, len(raws))
    pictures = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in raws]
    out = processor(
        text=text, images=pictures or None, return_tensors="np", add_special_tokens=False
    )
    return model, out


def routed_image_chat(router, question: str, url: str, max_tokens: int = 12):
    """A greedy OpenAI chat through the router (a `support.Router` serving its model): one
    image_url part, then the question; the HTTP response."""
    content = [{"type": "image_url", "image_url": {"url": url}}]
    content.append({"type": "text", "text": question})
    messages = [{"role": "user", "content": content}]
    body = {"model": router.wait_until_serving(), "messages": messages}
    body |= {"max_tokens": max_tokens, "temperature": 0}
    return router.client.post("/v1/chat/completions", json=body)
