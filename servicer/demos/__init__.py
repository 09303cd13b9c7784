"""The demo models: tiny checkpoints the project builds itself, offline and deterministically,
for the tests and the no-argument default (``demo:KIND``; ../shared/DESIGN.md, "Models for
tests and the default").

- ``common``: the model cache, atomic builds, the special tokens and the files every demo
  writes around its weights (no MLX: the handler side uses the cache helpers).
- ``text``: the text demos (llama, hybrid, gemma3), trained briefly on ``corpus.txt``.
- ``vision``: the vision-language demos' shared build and parts, and their families, one a
  module: ``qwen2_vl`` (the default), ``qwen2_5_vl``, ``gemma3``, ``mistral3``, ``llava``,
  ``pixtral``, ``llava_onevision``.

Built models are cached under ``MLX_GRPC_WORKER_CACHE`` (default ~/.cache/mlx-grpc-worker),
named by kind, seed and recipe version.
"""
