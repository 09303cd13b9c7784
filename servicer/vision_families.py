"""The vision-language families served with images: one entry each (`VisionFamily`), read by
the handlers (how a prompt holds an image, which path the router takes) and by the engine (how
the text model places an image's tokens). A family is its entry here and its tiny offline demo
build under `servicer.demos`; nothing else names it.

Handler side: no MLX here (the engine imports this table, not the other way round).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

VideoLayout = Literal["timestamped", "contiguous"]


@dataclass(frozen=True)
class VideoSpec:
    """How one video sits in a prompt of this model (Qwen-VL's): the chat template renders
    `anchor` for it; the worker replaces the whole anchor with the video's run, which is
    ("timestamped", Qwen3-VL's) per temporal patch of frames, `<t.t seconds>` as text then
    `start`, `video_token_id` x (h * w / merge**2), `end`; or ("contiguous", Qwen2.5-VL's)
    `start`, `video_token_id` x (t * h * w / merge**2), `end`. The layout also picks how
    frames are sampled (servicer/video.py: Qwen3-VL's processor or Qwen2-VL's)."""

    video_token_id: int
    anchor: tuple[int, ...]
    start: int
    end: int
    layout: VideoLayout
    merge: int


@dataclass(frozen=True)
class VisionSpec:
    """How one image sits in a prompt of this model: the chat template renders `anchor` for
    it; the model's processor replaces that with `before` + `image_token_id` x n + `after`
    (n: `tokens_per_image`, fixed by the model; None: from each image's patch grid, t * h * w
    / `merge`**2, as Qwen2-VL's). `router_processed`: the router processes this family's
    images itself and sends them as mm_inputs, their runs already in the prompt, filled with
    `image_token_id` or one of `placeholder_ids`."""

    family: str
    image_token_id: int
    anchor: tuple[int, ...]
    before: tuple[int, ...]
    after: tuple[int, ...]
    tokens_per_image: int | None
    merge: int = 1
    router_processed: bool = False
    placeholder_ids: tuple[int, ...] = ()
    # Pixtral's layout: the image in rows of `cell`-pixel tokens, each row ending in
    # `row_break`, the last in `row_end` (both part of the image's run); 0: no rows.
    cell: int = 0
    row_break: int = 0
    row_end: int = 0
    # The checkpoint's own processor expands the anchor, image by image: each image's run is
    # what it makes of `anchor_text` (tiles, row markers and all); `before`/`after` are empty.
    anchor_text: str | None = None
    # The processor class run in place of the checkpoint's own (None: its own), where that
    # one needs what the handler side lacks (a torch video processor, MLX): a transformers
    # class name, or "module:Class".
    processor_class: str | None = None
    video: VideoSpec | None = None  # None: no video for this family
    # A fix to that processor, "module:function" (None: none): the function takes the loaded
    # processor and returns it fixed. The handler applies it, and so do the tests' and the
    # bench's mlx-vlm references (`fixed`), where mlx-vlm's own processor is the one to fix.
    processor_fix: str | None = None

    def fixed(self, processor: Any) -> Any:
        """`processor` with `processor_fix` applied (as it is where there is none)."""
        return processor if self.processor_fix is None else _named(self.processor_fix)(processor)

    def run(self, n: int) -> list[int]:
        return [*self.before, *([self.image_token_id] * n), *self.after]

    def rows_run(self, height: int, width: int) -> tuple[int, ...]:
        """The run of an image `height` x `width` pixels as the processor sized it."""
        rows, cols = height // self.cell, width // self.cell
        if rows < 1 or cols < 1:
            raise ValueError(f"an image of {height}x{width} pixels makes no {self.cell}-pixel cell")
        run = [*([self.image_token_id] * cols), self.row_break] * rows
        run[-1] = self.row_end
        return tuple(run)

    def tokens(self, grid: Sequence[int] | None) -> int:
        """The placeholder tokens of an image with this patch grid (t, h, w)."""
        if self.tokens_per_image is not None:
            return self.tokens_per_image
        if grid is None or len(grid) != 3:
            raise ValueError("the model's processor gave no image_grid_thw (t, h, w)")
        t, h, w = (int(v) for v in grid)
        if min(t, h, w) < 1 or h % self.merge or w % self.merge:
            raise ValueError(f"the patch grid {(t, h, w)} does not fit a {self.merge}x merge")
        return t * h * w // self.merge**2


def _gemma3_spec(config: dict[str, Any], tokenizer: Any) -> VisionSpec | None:
    boi = _token_id(tokenizer, "<start_of_image>", config.get("boi_token_index"))
    eoi = _token_id(tokenizer, "<end_of_image>", config.get("eoi_token_index"))
    image = config.get("image_token_index")
    count = config.get("mm_tokens_per_image") or (config.get("text_config") or {}).get(
        "mm_tokens_per_image"
    )
    if not all(isinstance(v, int) for v in (boi, eoi, image, count)):
        return None
    gap = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
    return VisionSpec("gemma3", image, (boi,), (*gap, boi), (eoi, *gap), count)


def _qwen2_vl_spec(config: dict[str, Any], tokenizer: Any) -> VisionSpec | None:
    """`<|vision_start|><|image_pad|><|vision_end|>` per image, its pad repeated once per
    merged patch; the router may fill the runs with the config's vision_token_id instead."""
    start = _token_id(tokenizer, "<|vision_start|>", config.get("vision_start_token_id"))
    end = _token_id(tokenizer, "<|vision_end|>", config.get("vision_end_token_id"))
    image = config.get("image_token_id")
    if not isinstance(image, int):
        image = _token_id(tokenizer, "<|image_pad|>", None)
    merge = (config.get("vision_config") or {}).get("spatial_merge_size", 2)
    if not all(isinstance(v, int) for v in (start, end, image, merge)):
        return None
    pad = config.get("vision_token_id")
    others = (pad,) if isinstance(pad, int) and pad != image else ()
    family = config.get("model_type", "qwen2_vl")  # qwen2_5_vl: the same prompt and processor
    return VisionSpec(
        family, image, (start, image, end), (start,), (end,), None, merge, placeholder_ids=others
    )


def _glm4v_spec(config: dict[str, Any], tokenizer: Any) -> VisionSpec | None:
    """`<|begin_of_image|><|image|><|end_of_image|>` per image, its `<|image|>` repeated once
    per merged patch (Qwen2-VL's count)."""
    start = _token_id(tokenizer, "<|begin_of_image|>", config.get("image_start_token_id"))
    end = _token_id(tokenizer, "<|end_of_image|>", config.get("image_end_token_id"))
    image = _token_id(tokenizer, "<|image|>", config.get("image_token_id"))
    merge = (config.get("vision_config") or {}).get("spatial_merge_size", 2)
    if not all(isinstance(v, int) for v in (start, end, image, merge)):
        return None
    family = config.get("model_type", "glm4v")
    return VisionSpec(family, image, (start, image, end), (start,), (end,), None, merge)


def _glm4_text(text: dict[str, Any]) -> dict[str, Any]:
    """GLM-4V's text_config as mlx-lm's glm4 / glm4_moe model takes it: its head_dim spelled
    out, the rotary fields at the top and the mrope_section in rope_scaling (transformers 5
    writes them all in rope_parameters)."""
    kind = {"glm4v_text": "glm4", "glm4v_moe_text": "glm4_moe"}.get(text.get("model_type"))
    if kind is None:
        return text
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    fields = {name: rope[name] for name in ("rope_theta", "partial_rotary_factor") if name in rope}
    return {**fields, **text, "model_type": kind, "head_dim": head_dim, "rope_scaling": rope}


def _mistral3_spec(config: dict[str, Any], tokenizer: Any) -> VisionSpec | None:
    """`[IMG]` per image, replaced by the image's rows of `[IMG]`, each ending `[IMG_BREAK]`,
    the last `[IMG_END]`; a cell is a patch merged `spatial_merge_size` times a side (Pixtral's
    own layout: no merge, a cell a patch)."""
    image = config.get("image_token_index")
    row_break = _token_id(tokenizer, "[IMG_BREAK]", None)
    row_end = _token_id(tokenizer, "[IMG_END]", None)
    patch = (config.get("vision_config") or {}).get("patch_size")
    merge = config.get("spatial_merge_size", 1)
    if not all(isinstance(v, int) for v in (image, row_break, row_end, patch, merge)):
        return None
    return VisionSpec(
        config.get("model_type", "mistral3"),
        image,
        (image,),
        (),
        (),
        None,
        cell=patch * merge,
        row_break=row_break,
        row_end=row_end,
    )


def _llava_spec(config: dict[str, Any], _tokenizer: Any) -> VisionSpec | None:
    """`<image>` per image, repeated once per feature mlx-vlm's LLaVA makes of the vision
    tower's square input: a patch each, (image_size / patch_size)^2, plus CLIP's CLS token,
    less one for the "default" strategy (which drops the first); sizes default as mlx-vlm's."""
    image = config.get("image_token_index")
    vision = config.get("vision_config") or {}
    size, patch = vision.get("image_size", 336), vision.get("patch_size", 14)
    if not all(isinstance(v, int) and v > 0 for v in (image, size, patch)):
        return None
    cls = vision.get("model_type") != "siglip_vision_model"
    dropped = config.get("vision_feature_select_strategy", "default") == "default"
    count = (size // patch) ** 2 + cls - dropped
    return VisionSpec("llava", image, (image,), (), (), count)


def processor_spec(
    anchor: str,
    image_token: str,
    config_key: str = "image_token_id",
    processor_class: str | None = None,
    processor_fix: str | None = None,
) -> Callable[[dict[str, Any], Any], VisionSpec | None]:
    """The spec of a family whose processor expands the anchor text `anchor` itself (tiles,
    row markers, a size-dependent count): the anchor is its tokens, the image token is
    `image_token` (or the config's `config_key`), and each image's run is the processor's
    (transformers' `processor_class` in place of the checkpoint's own, where given; fixed by
    `processor_fix`, where given)."""

    def spec(config: dict[str, Any], tokenizer: Any) -> VisionSpec | None:
        image = _token_id(tokenizer, image_token, config.get(config_key))
        ids = tuple(tokenizer.encode(anchor, add_special_tokens=False))
        if image is None or not ids:
            return None
        family = config.get("model_type", "")
        return VisionSpec(
            family,
            image,
            ids,
            (),
            (),
            None,
            anchor_text=anchor,
            processor_class=processor_class,
            processor_fix=processor_fix,
        )

    return spec


def _named(where: str) -> Callable[..., Any]:
    """The function `where` names, "module:function"."""
    module, _, name = where.rpartition(":")
    return getattr(importlib.import_module(module), name)


def _token_id(tokenizer: Any, token: str, fallback: Any) -> int | None:
    found = tokenizer.convert_tokens_to_ids(token)
    if isinstance(found, int) and found != tokenizer.unk_token_id:
        return found
    return fallback if isinstance(fallback, int) else None


def _two_way_images(config: dict[str, Any]) -> str | None:
    """A Gemma 4 checkpoint whose image tokens attend to each other both ways (its text
    model's use_bidirectional_attention, "vision" in Google's): the worker's prefill is causal
    throughout, so its answers would not be the model's."""
    if (config.get("text_config") or {}).get("use_bidirectional_attention"):
        return (
            "images are not supported for this checkpoint: its image tokens attend both ways "
            "(text_config.use_bidirectional_attention), the worker's prefill is causal; "
            "serving text only"
        )
    return None


Positions = Literal["plain", "mrope"]


@dataclass(frozen=True)
class VisionFamily:
    """One family served with images.

    `spec`: its `VisionSpec` from config.json and the tokenizer (None: a checkpoint of the
    family this worker cannot place images in). `positions`: "plain" (the text model's own
    1-D positions) or "mrope" (multimodal RoPE, `engine/mrope.py`). `router_tensors`: smg 1.13
    processes this family's images itself and sends `mm_inputs` (docs/images.md, "The router's
    two paths"); otherwise it sends media references. `demo`: the module of its tiny build
    under `servicer.demos` (served by `--model demo:vlm:FAMILY` under a name holding the
    family's, which smg 1.13 matches some families by).

    `router_image_token`: how the router's copy of the tokenizer (GetModelInfo.tokenizer_path
    and GetTokenizer) spells the image token, where smg's own preprocessor looks it up under
    another name. smg 1.13's Qwen-VL spec anchors on the literal "<image>", which Qwen2-VL
    tokenizers spell "<|image_pad|>": without the respelled copy the router answers 400 to
    every image. Same ids, so the prompt the router sends is the checkpoint tokenizer's."""

    model_type: str
    spec: Callable[[dict[str, Any], Any], VisionSpec | None]
    demo: str
    positions: Positions = "plain"
    router_tensors: bool = False
    router_image_token: str | None = None
    # The model_type the router's copy of config.json (the same folder) names, where smg 1.13
    # would otherwise process the family's images itself, not as its processor does: under
    # another, it sends them as media references (docs/images.md).
    router_model_type: str | None = None
    # How the family's videos sit in a prompt (None: it serves no video): `VideoSpec`.
    video: VideoLayout | None = None
    # Why a checkpoint of the family is served as text only (None: it is not).
    refusal: Callable[[dict[str, Any]], str | None] | None = None
    # The checkpoint's text_config as mlx-lm's text model takes it: the worker builds its text
    # model from that (engine/model.py's text stack), where mlx-lm lacks its model_type or has
    # a module for it that cannot load mlx-vlm's weights.
    text_stack: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # A fix to mlx-vlm's model of the family, "module:function" (None: none): the function
    # takes the loaded model and config.json and returns the model fixed. The engine applies
    # it, and so do the tests' and the bench's mlx-vlm references (`fixed_model`).
    model_fix: str | None = None


_LFM2_VL = processor_spec(
    "<image>",
    "<image>",
    "image_token_index",
    "mlx_vlm.models.lfm2_vl.processing_lfm2_vl:Lfm2VlProcessor",
)

FAMILIES: dict[str, VisionFamily] = {
    family.model_type: family
    for family in (
        VisionFamily("gemma3", _gemma3_spec, "gemma3"),
        VisionFamily(
            "qwen2_vl", _qwen2_vl_spec, "qwen2_vl", "mrope", True, router_image_token="<image>"
        ),
        VisionFamily(
            "qwen2_5_vl",
            _qwen2_vl_spec,
            "qwen2_5_vl",
            "mrope",
            True,
            router_image_token="<image>",
            video="contiguous",
        ),
        VisionFamily("qwen3_vl", _qwen2_vl_spec, "qwen3_vl", "mrope", video="timestamped"),
        VisionFamily("qwen3_vl_moe", _qwen2_vl_spec, "qwen3_vl_moe", "mrope"),
        VisionFamily("qwen3_5", _qwen2_vl_spec, "qwen3_5", "mrope"),
        VisionFamily("qwen3_5_moe", _qwen2_vl_spec, "qwen3_5_moe", "mrope"),
        VisionFamily("mistral3", _mistral3_spec, "mistral3"),
        VisionFamily("llava", _llava_spec, "llava", router_tensors=True),
        VisionFamily("idefics3", processor_spec("<image>", "<image>"), "idefics3"),
        # SmolVLM's processor needs a torch video processor; Idefics3's expands its images
        # alike (the same tiles, markers and thumbnail) with its image processor.
        VisionFamily(
            "smolvlm",
            processor_spec("<image>", "<image>", processor_class="Idefics3Processor"),
            "smolvlm",
        ),
        VisionFamily("pixtral", _mistral3_spec, "pixtral"),
        # mlx-vlm's model with transformers' anyres packing, which its processor counts;
        # transformers' processor, not mlx-vlm's (AutoProcessor's once mlx-vlm is imported).
        VisionFamily(
            "llava_next",
            processor_spec("<image>", "<image>", "image_token_index", "LlavaNextProcessor"),
            "llava_next",
            router_model_type="anyres_vlm",  # smg's own LLaVA-NeXT expansion is not the model's
            model_fix="servicer.engine.anyres:fix",
        ),
        VisionFamily(
            "llava_onevision",
            processor_spec("<image>", "<image>", "image_token_index"),
            "llava_onevision",
        ),
        VisionFamily(
            "gemma4", processor_spec("<|image|>", "<|image|>"), "gemma4", refusal=_two_way_images
        ),
        VisionFamily("glm4v", _glm4v_spec, "glm4v", "mrope", text_stack=_glm4_text),
        VisionFamily("glm4v_moe", _glm4v_spec, "glm4v_moe", "mrope", text_stack=_glm4_text),
        # mlx-vlm's own processor computes with MLX: the same tiling in numpy and PIL.
        VisionFamily(
            "internvl_chat",
            processor_spec(
                "<image>",
                "<IMG_CONTEXT>",
                "image_token_index",
                "servicer.numpy_processors:DynamicTilesProcessor",
            ),
            "internvl_chat",
        ),
        VisionFamily(
            "aya_vision",
            processor_spec("<image>", "<|IMG_PATCH|>", "image_token_index"),
            "aya_vision",
        ),
        # mlx-vlm's own processor (numpy and PIL over transformers' torch-only one), run
        # without MLX (servicer.vlm_modules); older LFM2-VL checkpoints say "lfm2-vl".
        VisionFamily("lfm2_vl", _LFM2_VL, "lfm2_vl"),
        VisionFamily("lfm2-vl", _LFM2_VL, "lfm2_vl_dashed"),
        # mlx-vlm's own processor computes with MLX: the same patches in numpy and PIL.
        # mlx-lm 0.32's kimi_vl leaves mlx-vlm's latent attention weights (kv_b_proj)
        # unsplit: its deepseek_v3, built from text_config, splits them.
        VisionFamily(
            "kimi_vl",
            processor_spec(
                "<|media_pad|>",
                "<|media_pad|>",
                "media_placeholder_token_id",
                "servicer.numpy_processors:NativePatchesProcessor",
            ),
            "kimi_vl",
            text_stack=dict,  # text_config as it is
        ),
        # mlx-vlm's own processor (numpy and PIL over transformers' torchvision-only one), run
        # without MLX, with the global tile it leaves out for a tiled image while its prompt
        # expansion writes that tile's <|patch|> run (Llama 4's processors make it).
        VisionFamily(
            "llama4",
            processor_spec(
                "<|image|>",
                "<|patch|>",
                "image_token_index",
                "mlx_vlm.models.llama4.processing_llama4:Llama4Processor",
                "servicer.numpy_processors:with_global_tile",
            ),
            "llama4",
        ),
    )
}
SERVED_FAMILIES = tuple(FAMILIES)


def rope_spans(image: Any) -> list[tuple[int, int, tuple[int, int, int]]]:
    """The blocks of an `ImageInput`'s media tokens in its prompt, for multimodal RoPE:
    (offset, length, its patch grid (t, h, w)) each (engine/mrope.py's `rope_index`)."""
    if image.spans:
        return [(image.offset + at, n, (t, h, w)) for at, n, t, h, w in image.spans]
    for name, value in image.extra:
        if name == "image_grid_thw" and len(value.data) == 24:
            t, h, w = (int.from_bytes(value.data[i : i + 8], "little") for i in (0, 8, 16))
            return [(image.offset, image.length, (t, h, w))]
    raise ValueError("an image of this model needs its image_grid_thw (t, h, w)")


def family_of(config: dict[str, Any]) -> VisionFamily | None:
    """The served family of a checkpoint with a vision tower (None: a text model, or a family
    not served with images)."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    return FAMILIES.get(config.get("model_type", ""))


def fixed_model(config: dict[str, Any], model: Any) -> Any:
    """mlx-vlm's `model` of the checkpoint (config.json `config`) with its family's
    `model_fix` applied (as it is where there is none)."""
    family = family_of(config)
    return (
        model
        if family is None or family.model_fix is None
        else _named(family.model_fix)(model, config)
    )


def text_stack_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's text_config as mlx-lm's text model takes it (None: it has none)."""
    text = config.get("text_config")
    family = FAMILIES.get(config.get("model_type", ""))
    if not isinstance(text, dict) or family is None or family.text_stack is None:
        return text if isinstance(text, dict) else None
    return family.text_stack(text)


def text_stack_only(config: dict[str, Any]) -> bool:
    """Whether the worker builds the checkpoint's text model from its text_config alone."""
    family = FAMILIES.get(config.get("model_type", ""))
    return family is not None and family.text_stack is not None


def vision_spec(config: dict[str, Any], tokenizer: Any) -> VisionSpec | None:
    """The spec of a vision-language checkpoint this worker can serve images for (None: a
    text model, or a family it cannot; `vision_refusal` says why)."""
    family = family_of(config)
    spec = family.spec(config, tokenizer) if family is not None else None
    if spec is None:
        return None
    return replace(
        spec, router_processed=family.router_tensors, video=_video(family, config, tokenizer)
    )


def _video(family: VisionFamily, config: dict[str, Any], tokenizer: Any) -> VideoSpec | None:
    """The family's `VideoSpec` for this checkpoint: its video token between its vision
    start and end tokens (Qwen-VL's), or None where it has no video layout or lacks them."""
    start = _token_id(tokenizer, "<|vision_start|>", config.get("vision_start_token_id"))
    end = _token_id(tokenizer, "<|vision_end|>", config.get("vision_end_token_id"))
    video = _token_id(tokenizer, "<|video_pad|>", config.get("video_token_id"))
    merge = (config.get("vision_config") or {}).get("spatial_merge_size", 2)
    if family.video is None or not all(isinstance(v, int) for v in (start, end, video, merge)):
        return None
    return VideoSpec(video, (start, video, end), start, end, family.video, merge)


def vision_refusal(config: dict[str, Any]) -> str | None:
    """Why a checkpoint with a vision tower is served as text only (None: it is not)."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    served = family_of(config)
    if served is None:
        family = config.get("model_type", "")
        return f"images are not supported for model type {family!r} yet; serving text only"
    if served.refusal is not None and (why := served.refusal(config)) is not None:
        return why
    if importlib.util.find_spec("mlx_vlm") is None:
        return "serving images needs mlx-vlm (pip install 'mlx-grpc-worker[vision]')"
    return None
