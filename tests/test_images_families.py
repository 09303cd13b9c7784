"""Every served vision-language family (servicer.vision_families.SERVED_FAMILIES: a new entry
gets these tests with no edit here), on its tiny demo, against mlx-vlm's own greedy generation
(vlm_support.Reference: the prompt expanded and the pixels made by mlx-vlm's processor):

- through the real worker (vLLM face, `data:` media references): two images of different
  sizes alone, each answer mlx-vlm's, `prompt_tokens` the processor's expansion, and the two
  answers differ; two images and a text request batched, each its own answer; the first again,
  a prefix hit past the image with the same answer;
- through the real smg router (`--protocols vllm`), what the worker gets is the family's path
  (media references, or the router's own mm_inputs where the registry says `router_tensors`)
  and the chat answer is mlx-vlm's decoded text.

One worker a family (module-scoped), serving both. What a family needs that the others do not
(a served name smg routes it by, the image after the question, ...) is `QUIRKS`; the tests of
one family's own paths are in tests/test_images_family_specifics.py and the older files."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from conftest import demo_config
from support import SMG, ServerThread, slow
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import Reference, chat_through_a_router, reference, what_the_worker_gets

from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.server import ModelSpec
from servicer.vision_families import FAMILIES, SERVED_FAMILIES

# mlx-vlm's Kimi-VL processor reads pixels with Pillow's deprecated getdata.
pytestmark = [needs_vlm, pytest.mark.filterwarnings("ignore:Image.Image.getdata")]

Image = tuple[int, tuple[int, int]]  # (seed, (width, height)): png(seed, size)


@dataclass(frozen=True)
class Quirks:
    """What one family's tests need: `served_name` (None: `--model demo:vlm:FAMILY`'s, which
    holds the family's name), `image_last` (the image after the question: a demo that heeds
    an image only near the end of its prompt; the router renders the image first all the
    same), the images asked alone (two sizes its demo answers differently) and batched, and
    whether mlx-vlm takes two images of different sizes in one prompt (`two_in_one`), and the
    image asked through the router (`routed`)."""

    served_name: str | None = None
    image_last: bool = False
    alone: tuple[Image, Image] = ((80, (64, 48)), (81, (30, 90)))
    batched: tuple[Image, Image] = ((90, (64, 64)), (91, (96, 40)))
    two_in_one: bool = True
    routed: Image = (46, (64, 48))


QUIRKS = {
    # smg processes a LLaVA itself under a name with a LLaVA version it has a processor for
    # (plain "llava" finds none and answers 400): the router's mm_inputs path.
    "llava": Quirks(served_name="llava-1.5-demo"),
    # Under a name holding "llava" smg refuses LLaVA-OneVision's images itself (400).
    "llava_onevision": Quirks(served_name="demo-model"),
    # mlx-vlm's Gemma 4 processor sizes each image its own way: no batch of two.
    "gemma4": Quirks(
        served_name="demo-model", batched=((90, (64, 48)), (91, (56, 56))), two_in_one=False
    ),
    "kimi_vl": Quirks(
        alone=((80, (120, 90)), (81, (60, 150))), batched=((90, (84, 84)), (91, (150, 60)))
    ),
    # Idefics3's and SmolVLM's demos: 2x2 and 2x1 tiles, each and the whole image.
    "idefics3": Quirks(alone=((2, (112, 84)), (3, (30, 90)))),
    "smolvlm": Quirks(alone=((2, (112, 84)), (3, (30, 90)))),
    "glm4v_moe": Quirks(alone=((2, (112, 84)), (3, (30, 90)))),
    "lfm2_vl": Quirks(alone=((80, (64, 48)), (81, (20, 20)))),
    "lfm2-vl": Quirks(alone=((80, (64, 48)), (81, (20, 20)))),
    "pixtral": Quirks(batched=((90, (64, 48)), (91, (96, 64)))),
    # Llama 4's demo: through the router too an image of 3x1 tiles and the global tile.
    "llama4": Quirks(routed=(46, (30, 90))),
    "qwen3_5": Quirks(image_last=True),
    "qwen3_5_moe": Quirks(image_last=True),
}
TWO_IN_ONE: tuple[Image, Image] = ((4, (84, 56)), (3, (30, 90)))
QUESTION, OTHER, TEXT = "What do bees make?", "Describe a quiet place.", "Hello there."


def quirks(family: str) -> Quirks:
    return QUIRKS.get(family, Quirks())


def ref(family: str) -> Reference:
    return reference(family, quirks(family).image_last)


EVERY_FAMILY = [pytest.param(family, id=family) for family in SERVED_FAMILIES]
# Families whose batched and prefix paths other files check in `make test` (the dashed
# LFM2-VL: lfm2_vl's processor and tower, here): their batched, prefix and two-in-a-prompt cases
# here are `make test-slow`'s (two in a prompt is in `make test` elsewhere for qwen2_vl and
# llava only).
COVERED_ELSEWHERE = {
    "gemma3": "test_images.py",
    "qwen2_vl": "test_images_qwen2.py",
    "qwen2_5_vl": "test_images_qwen2_5.py",
    "mistral3": "test_images_mistral3.py",
    "llava": "test_images_llava.py",
    "lfm2-vl": "lfm2_vl's cases here",
}
FAST_WHERE_NOT_COVERED = [
    slow(family, id=family) if family in COVERED_ELSEWHERE else pytest.param(family, id=family)
    for family in SERVED_FAMILIES
]


@pytest.fixture(scope="module")
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def worker(family) -> Iterator[ServerThread]:
    """The family's demo on the vLLM face (blocks of 4 for short prompts), under the served
    name the router is to route it by."""
    vlm_dir = ref(family).vlm_dir
    name = quirks(family).served_name or f"mlx-grpc-worker-demo-vlm-{family}"
    config = demo_config(vlm_dir, prompt_cache_block=4)
    config = dataclasses.replace(config, protocols=("vllm",), model=ModelSpec(str(vlm_dir), name))
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def stub(worker) -> Iterator[vgrpc.VllmEngineStub]:
    with worker.channel() as channel:
        yield vgrpc.VllmEngineStub(channel)


def asked(family: str, question: str, images: list[Image]):
    """The worker's request for the chat (the router's prompt, `data:` references)."""
    raws = [png(*image) for image in images]
    prompt = ref(family).router_ids(question, len(raws))
    return image_request(prompt, [data_url(raw) for raw in raws]), raws


@pytest.mark.parametrize("family", EVERY_FAMILY, indirect=True)
def test_two_images_of_different_sizes_answer_as_mlx_vlm_does(family, stub):
    answers = []
    for image in quirks(family).alone:
        job, raws = asked(family, QUESTION, [image])
        done = complete(stub, job)
        want = ref(family).answer(QUESTION, raws)
        assert done.prompt_tokens == len(want.prompt) > len(job.tokenized.input_ids)
        assert list(done.output_ids) == want.tokens
        answers.append(want.tokens)
    assert answers[0] != answers[1]  # the image counts


@pytest.mark.parametrize(
    "family", [f for f in FAST_WHERE_NOT_COVERED if quirks(f.values[0]).two_in_one], indirect=True
)
def test_two_images_in_one_prompt_answer_as_mlx_vlm_does(family, stub):
    """The second image's placeholders and positions follow the first's."""
    job, raws = asked(family, QUESTION, list(TWO_IN_ONE))
    done = complete(stub, job)
    want = ref(family).answer(QUESTION, raws)
    assert done.prompt_tokens == len(want.prompt)
    assert list(done.output_ids) == want.tokens


@pytest.mark.parametrize("family", FAST_WHERE_NOT_COVERED, indirect=True)
def test_images_batched_with_text_and_a_prefix_hit_past_the_image(family, stub):
    """Two image requests and a text one at once, each its own single-sequence answer; the
    first again reuses its prompt past the image."""
    jobs, wants = [], []
    for image in [*quirks(family).batched, None]:
        job, raws = asked(family, OTHER if image else TEXT, [image] if image else [])
        jobs.append(job)
        wants.append(ref(family).answer(OTHER if image else TEXT, raws))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    assert [list(a.output_ids) for a in answers] == [w.tokens for w in wants]
    assert [a.prompt_tokens for a in answers] == [len(w.prompt) for w in wants]
    again = complete(stub, jobs[0])
    assert again.cached_tokens > ref(family).image_end(wants[0].prompt)
    assert list(again.output_ids) == wants[0].tokens


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
@pytest.mark.parametrize("family", EVERY_FAMILY, indirect=True)
def test_through_the_router_answers_as_mlx_vlm_does(family, worker, tmp_path):
    """The chat through smg: the worker gets the image on the family's path (a media
    reference, one anchor in the prompt; or the router's own mm_inputs, its run already in
    the prompt) and the answer is mlx-vlm's, decoded as the router does."""
    raw = png(*quirks(family).routed)
    with what_the_worker_gets(worker) as sent:
        response = chat_through_a_router(worker, tmp_path / "smg.log", QUESTION, data_url(raw))
    assert response.status_code == 200, response.text
    if FAMILIES[family].router_tensors:
        assert len(sent) == 1 and sent[0][0] == 0 and sent[0][1] > 0  # mm_inputs
    else:
        assert sent == [(1, 0)]  # one media reference, no mm_inputs
    routed = reference(family)  # the image first, as the router renders the chat
    want = routed.answer(QUESTION, [raw])
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == routed.text(want.tokens)
    usage = {"prompt_tokens": len(want.prompt), "completion_tokens": len(want.tokens)}
    assert reply["usage"] == reply["usage"] | usage
