"""What the tests of the vision-language families share: the demo checkpoint served on the vLLM
face, mlx-vlm's own model and processor for it, its chat prompts as the router sends them, and
mlx-vlm's greedy answers for any family (`Reference`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import demo_config
from support import Router, ServerThread

from servicer.proto import vllm_engine_pb2_grpc as vgrpc


@contextmanager
def served(vlm_dir: Path) -> Iterator[vgrpc.VllmEngineStub]:
    """The worker on `vlm_dir`'s checkpoint (vLLM face; blocks of 4 for short prompts)."""
    config = dataclasses.replace(demo_config(vlm_dir, prompt_cache_block=4), protocols=("vllm",))
    with ServerThread(config) as running, running.channel() as channel:
        yield vgrpc.VllmEngineStub(channel)


@functools.cache
def loaded(path: str):
    """mlx-vlm's model and processor of the checkpoint (loaded once a test session), with the
    fixes the registry names (`VisionSpec.processor_fix`, `VisionFamily.model_fix`), as the
    worker's are: mlx-vlm's own where they leave out or misplace what the model makes."""
    import json

    from mlx_vlm import load

    from servicer.vision_families import fixed_model, vision_spec

    model, processor = load(path)
    config = json.loads((Path(path) / "config.json").read_text())
    spec = vision_spec(config, processor.tokenizer)
    return fixed_model(config, model), spec.fixed(processor) if spec is not None else processor


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


@contextmanager
def what_the_worker_gets(running: ServerThread) -> Iterator[list[tuple[int, int]]]:
    """Each image request the worker prepares, recorded while the block runs: (media
    references, mm_inputs bytes)."""
    preparer = running.server.servicer.images  # type: ignore[union-attr]
    prepare = preparer.prepare
    sent: list[tuple[int, int]] = []

    async def spy(request, *known):
        sent.append((len(request.media_refs.items), request.mm_inputs.ByteSize()))
        return await prepare(request, *known)

    preparer.prepare = spy
    try:
        yield sent
    finally:
        preparer.prepare = prepare


def routed_image_chat(router, question: str, url: str, max_tokens: int = 12):
    """A greedy OpenAI chat through the router (a `support.Router` serving its model): one
    image_url part, then the question; the HTTP response."""
    content = [{"type": "image_url", "image_url": {"url": url}}]
    content.append({"type": "text", "text": question})
    messages = [{"role": "user", "content": content}]
    body = {"model": router.wait_until_serving(), "messages": messages}
    body |= {"max_tokens": max_tokens, "temperature": 0}
    return router.client.post("/v1/chat/completions", json=body)


def chat_through_a_router(running: ServerThread, log_path: Path, question: str, url: str):
    """`routed_image_chat` through a real smg router started in front of `running` (and
    closed after); the HTTP response."""
    router = Router([running.address], log_path)
    try:
        return routed_image_chat(router, question, url)
    finally:
        router.close()


@dataclasses.dataclass(frozen=True)
class Answer:
    """mlx-vlm's greedy answer: its tokens up to the first end of sequence (kept: the worker
    stops there too), and the prompt its processor expanded."""

    tokens: list[int]
    prompt: list[int]


class Reference:
    """mlx-vlm's own greedy generation on one family's checkpoint, any family: the chat
    template renders the prompt (the images before the question, or after it with
    `image_last`), mlx-vlm's processor expands it and makes the pixels and the model's other
    image inputs, and `generate_step` answers."""

    def __init__(self, vlm_dir: Path, image_last: bool = False) -> None:
        import json

        from transformers import AutoTokenizer

        from servicer.vision_families import vision_spec

        self.vlm_dir = Path(vlm_dir)
        self.image_last = image_last
        self.model, self.processor = loaded(str(vlm_dir))
        config = json.loads((self.vlm_dir / "config.json").read_text())
        self.tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir))
        self.spec = vision_spec(config, self.tokenizer)
        generation = self.vlm_dir / "generation_config.json"
        extra = json.loads(generation.read_text()) if generation.exists() else {}
        found = [c.get("eos_token_id") for c in (config, config.get("text_config") or {}, extra)]
        found.append(self.tokenizer.eos_token_id)
        self.eos = {e for f in found for e in (f if isinstance(f, list) else [f]) if e is not None}

    def chat(self, question: str, images: int) -> str:
        pictures, words = [{"type": "image"}] * images, [{"type": "text", "text": question}]
        content = words + pictures if self.image_last else pictures + words
        return self.processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    def router_ids(self, question: str, images: int = 1) -> list[int]:
        """The prompt as the router sends it: one unexpanded anchor per image."""
        text = self.chat(question, images)
        return list(self.processor.tokenizer.encode(text, add_special_tokens=False))

    def inputs(self, question: str, raws: list[bytes]) -> tuple[list[int], object, dict]:
        """The expanded prompt, the pixels and the model's other image inputs, as mlx-vlm's
        processor makes them (no image: the router's ids as they are, as some processors
        take no text without an image)."""
        import io

        import mlx.core as mx
        import numpy as np
        from PIL import Image

        if not raws:
            return self.router_ids(question, 0), None, {}
        pictures = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in raws]
        text = self.chat(question, len(raws))
        try:
            out = self.processor(
                text=text, images=pictures, return_tensors="np", add_special_tokens=False
            )
        except TypeError:  # LLaVA's processors hand every keyword to the image processor
            out = self.processor(text=text, images=pictures)
        extra = {}
        for key, value in out.items():
            if key in ("input_ids", "attention_mask", "pixel_values"):
                continue
            if key == "image_sizes":
                extra[key] = np.asarray(value).tolist()
            elif isinstance(value, int):  # InternVL's image_token_index
                extra[key] = value
            else:
                extra[key] = mx.array(np.asarray(value))
        ids = np.asarray(out["input_ids"])[0].tolist()
        return ids, mx.array(np.asarray(out["pixel_values"])), extra

    @functools.cache  # noqa: B019  (one Reference a family, kept for the session)
    def _answer(self, question: str, raws: tuple[bytes, ...], n: int) -> Answer:
        import mlx.core as mx
        from mlx_vlm.generate import generate_step

        prompt, pixels, extra = self.inputs(question, list(raws))
        ids = mx.array([prompt])
        steps = generate_step(ids, self.model, pixels, mx.ones_like(ids), max_tokens=n, **extra)
        tokens: list[int] = []
        for token, _ in steps:
            tokens.append(int(token))
            if tokens[-1] in self.eos:
                break
        return Answer(tokens, prompt)

    def answer(self, question: str, raws: list[bytes], n: int = 12) -> Answer:
        return self._answer(question, tuple(raws), n)

    def text(self, tokens: list[int]) -> str:
        """The answer as the router decodes it."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def image_end(self, prompt: list[int]) -> int:
        """Just past the last image token of an expanded prompt."""
        image = self.spec.image_token_id if self.spec is not None else None
        return len(prompt) - prompt[::-1].index(image)


@functools.cache
def reference(family: str, image_last: bool = False) -> Reference:
    """The family's demo checkpoint's Reference (one a test session)."""
    from servicer.demos.vision import demo_vlm_path

    return Reference(demo_vlm_path(family=family), image_last)
