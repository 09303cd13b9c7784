"""The ``gemma3`` family of the demo vision-language model (``servicer.demos.vision``).

Built from the ``gemma3`` text demo (``servicer.demos.text``), nothing trained here:

- the language model is the text demo's trained weights as they are, under
  ``language_model.`` (mlx-vlm's Gemma 3 text stack is mlx-lm's ``gemma3_text``), so greedy
  text is the text demo's. The checkpoint also loads with ``mlx_lm.load``: mlx-lm's
  ``gemma3`` model type drops the vision tower and the projector and runs the text model.
- the tokenizer is the text demo's with Gemma 3's image tokens appended as special tokens
  (``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>``) and embedding rows for
  them drawn at the trained rows' scale. The chat template renders ``<start_of_image>``
  (``IMAGE_ANCHOR``) per image part, as Gemma 3's own does; mlx-vlm's processor expands it
  into ``IMAGE_SEQUENCE``, ``MM_TOKENS_PER_IMAGE`` image tokens between blank lines.
- the vision tower is a tiny SigLIP (56-pixel images, 14-pixel patches: 4x4 patches,
  average-pooled 2x2 into 4 image tokens), random from a seeded numpy generator; the
  projector (``mm_soft_emb_norm``, ``mm_input_projection_weight``) is scaled so that the
  image tokens enter the language model at the (scaled) text embeddings' RMS: the image
  shifts the continuation without drowning the prompt. Few image tokens on purpose: the
  text demo's sliding-window layer sees 16 tokens, and an image then leaves room in it for
  the words around it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
# Appended after the text demo's vocabulary, in this order: ids 512, 513, 514.
VISION_TOKENS = (BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN)
# What the chat template renders for one image, unexpanded (Gemma 3's own anchor).
IMAGE_ANCHOR = BOI_TOKEN

IMAGE_SIZE = 56  # every image is resized to this square
PATCH_SIZE = 14
MM_TOKENS_PER_IMAGE = 4  # (IMAGE_SIZE / PATCH_SIZE)^2 = 16 patches, pooled 2x2
# What the processor puts in place of each anchor: N image tokens between blank lines.
IMAGE_SEQUENCE = f"\n\n{BOI_TOKEN}{IMAGE_TOKEN * MM_TOKENS_PER_IMAGE}{EOI_TOKEN}\n\n"

VISION_CONFIG = parts.tower_config(
    "siglip_vision_model",
    IMAGE_SIZE,
    PATCH_SIZE,
    heads={},
    rest={"layer_norm_eps": 1e-6, "vision_use_head": False},
)


class Gemma3(Family):
    model_type = "gemma3"
    architecture = "Gemma3ForConditionalGeneration"
    text_kind = "gemma3"
    recipe_version = "v1"
    vision_tokens = VISION_TOKENS
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    tokens_per_image = MM_TOKENS_PER_IMAGE
    # The processor reads these tokens (and their ids) as the tokenizer's attributes.
    tokenizer_fields = {
        "extra_special_tokens": {
            "boi_token": BOI_TOKEN,
            "eoi_token": EOI_TOKEN,
            "image_token": IMAGE_TOKEN,
        },
    }
    processor_files = {
        "preprocessor_config.json": parts.image_processor_config(
            "Gemma3ImageProcessor",
            "Gemma3Processor",
            {"size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 2},  # bilinear
            mean=(0.5, 0.5, 0.5),  # SigLIP's: pixels to [-1, 1]
            std=(0.5, 0.5, 0.5),
            more={"do_pan_and_scan": False, "image_seq_length": MM_TOKENS_PER_IMAGE},
        ),
        # mlx-vlm's Gemma3Processor reads image_seq_length here (default 256).
        "processor_config.json": {
            "processor_class": "Gemma3Processor",
            "image_seq_length": MM_TOKENS_PER_IMAGE,
        },
    }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        side = math.isqrt(MM_TOKENS_PER_IMAGE)
        patches = IMAGE_SIZE // PATCH_SIZE
        if side * side != MM_TOKENS_PER_IMAGE or patches % side:
            raise ValueError("the patches per side must pool evenly into sqrt(N) tokens per side")
        text_fields = {
            "vocab_size": vocab_size,
            # mlx-lm's gemma3_text reads the global layers' base from rope_theta,
            # mlx-vlm's from rope_global_base_freq.
            "rope_global_base_freq": text_config["rope_theta"],
            "mm_tokens_per_image": MM_TOKENS_PER_IMAGE,
        }
        fields = {
            "mm_tokens_per_image": MM_TOKENS_PER_IMAGE,
            "boi_token_index": ids[BOI_TOKEN],
            "eoi_token_index": ids[EOI_TOKEN],
            "image_token_index": ids[IMAGE_TOKEN],
            # mlx-vlm divides the image features by sqrt(hidden_size) (the language model then
            # multiplies every input embedding by it), and mlx-lm sizes the vocabulary by the
            # top-level vocab_size: both default to the real model's.
            "hidden_size": text_config["hidden_size"],
        }
        return parts.nested_config(text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size)

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random SigLIP and projector weights, shaped as mlx-vlm's Gemma 3 holds them.

        Linear layers get N(0, 1/fan_in) weights and small biases, so every activation stays
        near unit scale; the projector (after its RMSNorm, unit scale) is scaled so the image
        tokens come out with RMS `feature_rms` * sqrt(hidden): the text embeddings' RMS once
        scaled by Gemma's sqrt(hidden), as the language model takes them in (mlx-vlm divides
        the image tokens by sqrt(hidden) and then scales every input embedding by it).
        """
        import numpy as np

        vision = config["vision_config"]
        width = vision["hidden_size"]
        tower = "vision_tower.vision_model"
        out = parts.siglip_tower(rng, tower, vision)  # pixels in [-1, 1]
        # Gemma's RMSNorm scales by 1 + weight: zeros are the unit norm.
        out["multi_modal_projector.mm_soft_emb_norm.weight"] = np.zeros(width)
        hidden = config["text_config"]["hidden_size"]
        out["multi_modal_projector.mm_input_projection_weight"] = rng.standard_normal(
            (width, hidden)
        ) * (feature_rms * math.sqrt(hidden / width))
        return out


FAMILY = Gemma3()
