"""The ``smolvlm`` family of the demo vision-language model (``servicer.demos.vision``).

SmolVLM and SmolVLM2: Idefics3's architecture under another model type (mlx-vlm's SmolVLM is
its Idefics3 model; transformers' SmolVLM processor expands an image's anchor into the same
tiles, row markers and whole-image thumbnail). So this family is the ``servicer.demos.idefics3``
build, tokens, sizes and weights included, with SmolVLM's model type, vision model type and
processor class names:

- the language model is the ``llama`` text demo's trained weights under mlx-vlm's Idefics3
  names, ``text_config.model_type`` "llama" (mlx-lm's llama model in the worker);
- the tokenizer is the text demo's with the image tokens appended; the processor resizes an
  image's longest edge to 56 pixels and cuts it into 28-pixel tiles (2x1 to 2x2 for the test
  images) plus the whole image, 4 image tokens each;
- the vision tower is a tiny SigLIP, random from a seeded numpy generator.
"""

from __future__ import annotations

from .idefics3 import Idefics3, tile_processor_files


class SmolVLM(Idefics3):
    model_type = "smolvlm"
    architecture = "SmolVLMForConditionalGeneration"
    recipe_version = "v1"
    vision_model_type = "smolvlm_vision"
    processor_files = tile_processor_files("SmolVLMImageProcessor", "SmolVLMProcessor")


FAMILY = SmolVLM()
