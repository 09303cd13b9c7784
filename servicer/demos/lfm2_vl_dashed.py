"""The ``lfm2-vl`` family of the demo vision-language model (``servicer.demos.vision``).

LFM2-VL checkpoints made before transformers named the model type "lfm2_vl" say "lfm2-vl"
(mlx-vlm maps one to the other; mlx-lm has a module for this one, which loads the text model
and drops the vision weights). So this family is the ``servicer.demos.lfm2_vl`` build, tokens,
sizes and weights included, under the dashed model type: the worker's text model is mlx-lm's
own "lfm2-vl" model here, mlx-lm's lfm2 built from text_config there.
"""

from __future__ import annotations

from .lfm2_vl import Lfm2Vl


class Lfm2VlDashed(Lfm2Vl):
    model_type = "lfm2-vl"
    recipe_version = "v1"


FAMILY = Lfm2VlDashed()
