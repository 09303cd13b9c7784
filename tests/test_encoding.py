"""Images encoded ahead of their admission, a vision-tower module at a time (engine/encoding.py):
the staged pass makes the single pass's features bit for bit, in finer pieces than the tower's
layers (a large attention split by query rows), a step with no budget left still advances one
piece, and a request is ready only once its images are through."""

from __future__ import annotations

import importlib.util

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from servicer.media import MediaPolicy
from servicer.messages import GenerationRequest, ImageInput
from servicer.vision_families import FAMILIES as VISION_FAMILIES

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlx_vlm") is None, reason="mlx-vlm (the vision extra) is absent"
)

FAMILIES = tuple(VISION_FAMILIES)


def _encoder_and_image(family: str, seed: int = 3):
    """The family's demo encoder (as the engine loads it) and one processed image."""
    import json

    from transformers import AutoTokenizer

    from servicer.demos.vision import demo_vlm_path
    from servicer.engine.model import load_model
    from servicer.engine.vision import VisionEncoder
    from servicer.images import ImagePreparer
    from servicer.vision_families import vision_spec

    model_dir = demo_vlm_path(family=family)
    config = json.loads((model_dir / "config.json").read_text())
    spec = vision_spec(config, AutoTokenizer.from_pretrained(str(model_dir)))
    assert spec is not None
    preparer = ImagePreparer(model_dir, spec, MediaPolicy())
    pixels = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    processed = preparer._process(0, Image.fromarray(pixels))
    preparer.close()
    loaded = load_model(model_dir, None)
    encoder = VisionEncoder.load(model_dir, loaded.model, 1 << 20)
    image = ImageInput(5, processed.tokens, processed.key, processed.pixel_values, processed.extra)
    run = list(processed.run) or [encoder.image_token_id] * processed.tokens
    return encoder, image, run


@pytest.mark.parametrize("family", FAMILIES)
def test_the_staged_pass_equals_the_single_pass_a_module_a_step(family, monkeypatch):
    import mlx.core as mx

    from servicer.engine import encoding
    from servicer.engine.encoding import StagedEncode

    monkeypatch.setattr(encoding, "ROW_ALIGN", 8)

    encoder, image, run = _encoder_and_image(family)
    single = encoder.lazy_features(image, run)
    mx.eval(single)
    # Attention calls of more than 8 query rows split into shares of 8 rows.
    staged = StagedEncode(encoder, image, run, piece=1)
    # Finer than a layer a step: each layer's norms, projections and MLP apart.
    assert len(staged._stages) > 3 * _layer_count(encoder.tower)
    split = [s for s in staged._stages if s.kind[0] == "attention"]
    if family == "qwen3_vl":  # 24 patches through its tower: shares of 8 rows
        assert split and all(s.kind[1][-2] <= 8 for s in split)
    calls = 0
    while not staged.done:
        staged.advance(0.0)  # no budget left: still one stage
        calls += 1
    assert calls == len(staged._stages)
    assert np.array_equal(np.array(staged.features), np.array(single))
    # The tower's own modules are back in place: the next pass builds as usual.
    assert not _recorders(encoder.tower)


def test_a_models_own_evals_wait_for_the_stages(monkeypatch):
    """mlx-vlm's Qwen3-VL evaluates its deepstack features while it builds the pass: done
    there, most of the tower would be computed in one step, outside any budget."""
    from servicer.engine.encoding import StagedEncode

    encoder, image, run = _encoder_and_image("qwen3_vl")
    calls, real = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *arrays: calls.append(1) or real(*arrays))
    staged = StagedEncode(encoder, image, run)
    assert not calls
    while not staged.done:
        staged.advance(0.0)
    assert len(calls) == len(staged._stages)  # the stages' own, one a stage
    assert mx.eval is not real  # the spy is back: nothing was left patched


def _layer_count(tower) -> int:
    """The tower's longest list of modules (its transformer layers)."""
    lists = [v for _, m in tower.named_modules() for v in m.values() if isinstance(v, list)]
    return max((len(v) for v in lists), default=0)


def _recorders(tower) -> list[str]:
    """Where a recording wrapper is still in place (an attribute or a list entry)."""
    from servicer.engine.encoding import _Recorder

    found = []
    for name, module in tower.named_modules():
        if any(isinstance(v, _Recorder) for v in vars(module).values()):
            found.append(name)
        for held in module.values():
            if isinstance(held, list) and any(isinstance(v, _Recorder) for v in held):
                found.append(name)
    return found


def _request(image: ImageInput, run: list[int]) -> GenerationRequest:
    prompt = [1, 2, 3, 4, 5, *run, 6, 7]
    return GenerationRequest(1, "r", prompt, 4, images=(image,))


def test_a_request_is_ready_once_its_images_are_encoded_ahead():
    from servicer.engine.encoding import ImageEncodes

    encoder, image, run = _encoder_and_image("gemma3", seed=4)
    request = _request(image, run)
    encodes = ImageEncodes(encoder, lambda request: 0)
    assert not encodes.ready(request)
    steps = 0
    while not encodes.ready(request):
        encodes.advance([request], 0.0)
        steps += 1
    assert steps >= 3  # a stage a step
    assert encoder.encoded == 1
    ahead = encoder.features(image, run)  # handed over, not computed again
    assert encoder.encoded == 1
    fresh = encoder.lazy_features(image, run)
    assert np.array_equal(np.array(ahead), np.array(fresh))
    # A prefix past the image needs no encode at all.
    other = _request(_encoder_and_image("gemma3", seed=5)[1], run)
    assert ImageEncodes(encoder, lambda request: len(request.prompt)).ready(other)


def test_an_encode_for_a_request_that_left_the_line_is_dropped():
    from servicer.engine.encoding import ImageEncodes

    encoder, image, run = _encoder_and_image("gemma3", seed=6)
    request = _request(image, run)
    encodes = ImageEncodes(encoder, lambda request: 0)
    encodes.advance([request], 0.0)
    encodes.forget_all_but([])
    assert encodes._running is None
    encodes.advance([request], None)  # no bound: to the end at once
    assert encodes.ready(request)
    encodes.forget_all_but([])
    assert not encoder._ahead  # nobody waits for it; the cache may still hold it


def test_an_image_that_fails_to_encode_fails_its_request_alone_within_the_step():
    """The failure comes back from the encoder's share of the step, naming its request; the
    request behind it is encoded on, and nothing is left to encode again at admission."""
    from servicer.engine.encoding import ImageEncodes
    from servicer.messages import Tensor

    encoder, image, run = _encoder_and_image("gemma3", seed=7)
    broken = ImageInput(5, image.length, b"broken", Tensor("float32", (1, 2), b"\0" * 8))
    request = _request(broken, run)
    fine = GenerationRequest(2, "r2", request.prompt, 4, images=(image,))
    encodes = ImageEncodes(encoder, lambda request: 0)
    failed = encodes.advance([request, fine], None)
    assert [(r.ticket, "vision encoder failed" in why) for r, why in failed] == [(1, True)]
    assert encodes.ready(fine) and not encodes.pending([fine])


def test_a_prefix_lookup_that_fails_skips_that_request_and_encodes_the_next():
    from servicer.engine.encoding import ImageEncodes

    encoder, image, run = _encoder_and_image("gemma3", seed=8)
    failing, fine = _request(image, run), _request(_encoder_and_image("gemma3", 9)[1], run)
    fine = GenerationRequest(2, "r2", fine.prompt, 4, images=fine.images)

    def reusable(request: GenerationRequest) -> int:
        if request.ticket == 1:
            raise OSError("the prefix store's lookup failed")
        return 0

    encodes = ImageEncodes(encoder, reusable)
    encodes.advance([failing, fine], None)
    assert encodes.ready(fine)


def test_a_waiting_image_request_is_looked_up_once_a_step():
    """The scheduler's estimate, its readiness and the encoder's share read one lookup of the
    prefix store per request per step (`PrefixLookups`); the next step looks again."""
    from servicer.admission import Admission, MemoryModel
    from servicer.engine.encoding import ImageEncodes
    from servicer.engine.planner import PrefixLookups
    from servicer.engine.scheduler import BatchView, Scheduler
    from servicer.engine_config import EngineConfig

    encoder, image, run = _encoder_and_image("gemma3", seed=10)
    request = _request(image, run)
    looked: list[int] = []

    class Store:
        def match(self, request):
            looked.append(request.ticket)
            return type("Match", (), {"length": 0})()

    lookups = PrefixLookups(Store(), EngineConfig())
    encodes = ImageEncodes(encoder, lookups)
    room = Admission(MemoryModel(((1, None),), 0, allocation_step=1), limit_bytes=1 << 40)
    scheduler = Scheduler(room, reusable=lookups, ready=encodes.ready)
    for step in range(2):
        lookups.new_step()
        scheduler.enqueue([request] if step == 0 else [])
        scheduler.schedule(BatchView(rows=1, first_tokens_due=False, decode_step_s=0.01))
        encodes.pending(scheduler.waiting_requests())
        encodes.advance(scheduler.waiting_requests(), 0.0)
        assert looked == [1] * (step + 1)


def test_an_attention_traced_in_a_compiled_function_is_computed_with_it(monkeypatch):
    """A compiled function's trace records placeholder shares: evaluating them is skipped (a
    stage of another kind would raise), and the function's own output is right."""
    from servicer.engine import encoding

    monkeypatch.setattr(encoding, "ROW_ALIGN", 8)
    q, k, v = (mx.random.normal((1, 2, 64, 8), key=mx.random.key(i)) for i in range(3))
    attend = mx.compile(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3)
    sink = []
    with encoding.lazy_pass(None, sink, piece=1):
        inside = attend(q, k, v)
        assert len(sink) == 8  # the trace's placeholders, 8 shares of 8 rows
        outside = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert len(sink) == 16
    for stage in sink:
        encoding.evaluate(stage)
    with pytest.raises(RuntimeError):
        encoding.evaluate(encoding._Stage(("Linear",), sink[0].arrays))
    assert np.array_equal(np.array(inside), np.array(expected))
    assert np.array_equal(np.array(outside), np.array(expected))
