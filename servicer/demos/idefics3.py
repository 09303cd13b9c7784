"""The ``idefics3`` family of the demo vision-language model (``servicer.demos.vision``).

Idefics3: a SigLIP vision tower that sees an image as tiles plus the whole image, a connector
(pixel shuffle, then a linear projection) and a llama text model. Built from the ``llama``
text demo (``servicer.demos.text``), nothing trained here:

- the language model is the text demo's trained weights, under mlx-vlm's Idefics3 names
  (``language_model.embed_tokens``, ``language_model.layers.N``, ``language_model.norm``,
  ``language_model.lm_head``: no ``model.`` level, the output head its own, a copy of the
  tied embedding), with ``text_config.model_type`` "llama": mlx-vlm runs it with its Idefics3
  text stack, and the worker with mlx-lm's llama model (``servicer.engine.model``'s text
  stack; mlx-lm has no Idefics3 model type), both plain 1-D RoPE: the text demo exactly.
- the tokenizer is the text demo's with Idefics3's image tokens appended as special tokens
  (``<fake_token_around_image>``, ``<image>``, ``<global-img>``, ``<end_of_utterance>`` and a
  ``<row_R_col_C>`` per tile of the largest grid) and embedding rows for them drawn at the
  trained rows' scale. The chat template renders ``<image>`` (``IMAGE_ANCHOR``) per image
  part; the processor (transformers' Idefics3Processor, mlx-vlm's alike) resizes the image's
  longest edge to ``LONGEST_EDGE`` pixels, rounds both sides up to whole ``TILE``-pixel tiles
  and expands the anchor into ``image_sequence(rows, cols)``: per tile
  ``<fake_token_around_image><row_R_col_C>`` and ``IMAGE_SEQ_LEN`` image tokens, a newline
  per row, then the whole image shrunk to one tile,
  ``<fake_token_around_image><global-img>`` and its image tokens, and a closing
  ``<fake_token_around_image>``. Every test image makes 2x1 to 2x2 tiles.
- the vision tower is a tiny SigLIP (28-pixel tiles, 7-pixel patches: 4x4 patches a tile,
  shuffled 2x2 into 4 image tokens), random from a seeded numpy generator; the connector's
  projection is scaled so that the image tokens enter the language model at the text
  embeddings' RMS: the image shifts the continuation without drowning the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
IMAGE_ANCHOR = IMAGE_TOKEN  # what the chat template renders for one image, unexpanded

TILE = 28  # the side of a tile and of the whole image's thumbnail (max_image_size)
LONGEST_EDGE = 2 * TILE  # an image's longest edge is resized to this: at most 2x2 tiles
PATCH_SIZE = 7
SCALE_FACTOR = 2  # the connector's pixel shuffle: 2x2 patches one image token
IMAGE_SEQ_LEN = (TILE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 4 image tokens a tile
MAX_TILES = LONGEST_EDGE // TILE  # rows and columns of the largest grid
ROW_TOKENS = tuple(f"<row_{r + 1}_col_{c + 1}>" for r in range(MAX_TILES) for c in range(MAX_TILES))
# Appended after the text demo's vocabulary, in this order: ids 512, 513, ...
VISION_TOKENS = (FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN, END_OF_UTTERANCE, *ROW_TOKENS)

VISION_CONFIG = parts.tower_config(
    "idefics3_vision", TILE, PATCH_SIZE, heads={}, rest={"layer_norm_eps": 1e-6}
)


def image_sequence(rows: int, cols: int) -> str:
    """What the processor puts in place of one anchor for a `rows` x `cols` grid of tiles
    (0 x 0: an image no larger than a tile, seen whole only)."""
    tile = IMAGE_TOKEN * IMAGE_SEQ_LEN
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{tile}{FAKE_TOKEN}"
    if rows == cols == 0:
        return whole
    grid = "".join(
        "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{whole}"


def tile_processor_files(image_processor: str, processor: str) -> dict[str, dict[str, Any]]:
    """The image processor's and processor's configs (Idefics3's, and SmolVLM's, which
    differ only in these class names) for the demo's sizes."""
    return {
        "preprocessor_config.json": parts.image_processor_config(
            image_processor,
            processor,
            {"size": {"longest_edge": LONGEST_EDGE}, "resample": 1},  # Lanczos
            mean=(0.5, 0.5, 0.5),  # SigLIP's: pixels to [-1, 1]
            std=(0.5, 0.5, 0.5),
            more={
                "do_image_splitting": True,
                "max_image_size": {"longest_edge": TILE},
                "do_pad": True,
            },
        ),
        "processor_config.json": {"processor_class": processor, "image_seq_len": IMAGE_SEQ_LEN},
    }


class Idefics3(Family):
    model_type = "idefics3"
    architecture = "Idefics3ForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    vision_tokens = VISION_TOKENS
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    # tokens_per_image: IMAGE_SEQ_LEN per tile and for the whole image, plus their markers.
    vision_model_type = "idefics3_vision"
    tokenizer_fields = {
        "extra_special_tokens": {
            "image_token": IMAGE_TOKEN,
            "fake_image_token": FAKE_TOKEN,
            "global_image_token": GLOBAL_TOKEN,
            "end_of_utterance_token": END_OF_UTTERANCE,
        },
    }
    processor_files = tile_processor_files("Idefics3ImageProcessor", "Idefics3Processor")

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        hidden, heads = text_config["hidden_size"], text_config["num_attention_heads"]
        if text_config.get("head_dim", hidden // heads) * heads != hidden:
            raise ValueError("mlx-vlm's Idefics3 text stack needs head_dim = hidden_size / heads")
        # The output head is its own tensor (mlx-vlm's Idefics3 text stack always has one).
        text_fields = {"model_type": "llama", "vocab_size": vocab_size}
        text_fields |= {"tie_word_embeddings": False}
        vision = {**VISION_CONFIG, "model_type": self.vision_model_type}
        fields = {"image_token_id": ids[IMAGE_TOKEN], "scale_factor": SCALE_FACTOR}
        config = parts.nested_config(text_config, text_fields, vision, fields, ids, vocab_size)
        return {**config, "tie_word_embeddings": False}

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random SigLIP and connector weights, shaped as mlx-vlm's Idefics3 holds them.

        Linear layers get N(0, 1/fan_in) weights and small biases, so every activation stays
        near unit scale; the connector's projection (of LayerNorm-ed, shuffled patches: unit
        scale) is scaled so the image tokens come out with RMS `feature_rms`."""
        vision = config["vision_config"]
        width = vision["hidden_size"]
        hidden = config["text_config"]["hidden_size"]
        tower = "vision_model"
        out = parts.siglip_tower(rng, tower, vision)  # pixels in [-1, 1]
        shuffled = width * config["scale_factor"] ** 2
        out |= parts.random_linear(
            rng, "connector.modality_projection.proj", hidden, shuffled, feature_rms, bias=False
        )
        return out

    def saved_weights(self, weights: dict) -> dict:
        """mlx-vlm's Idefics3 names: the text model's without their ``model.`` level, and
        its own output head (the tied embedding, copied)."""
        out = {}
        for name, value in weights.items():
            out[name.replace("language_model.model.", "language_model.", 1)] = value
        out["language_model.lm_head.weight"] = out["language_model.embed_tokens.weight"]
        return out


FAMILY = Idefics3()
