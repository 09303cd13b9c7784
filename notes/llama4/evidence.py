"""mlx-vlm 0.7.10's Llama4 processor: tiles made vs <|patch|> tokens in the prompt it writes."""
import mlx.core as mx
import numpy as np
from PIL import Image
from mlx_vlm.models.llama4.processing_llama4 import Llama4ImageProcessor, Llama4Processor

for size, max_patches in ((336, 16), (56, 16)):
    ip = Llama4ImageProcessor(size=size, max_patches=max_patches)
    per_tile = (size // 14) ** 2 // 4
    for w, h in ((64, 48), (112, 84), (84, 56), (30, 90), (1920, 1080), (640, 480), (480, 640), (1000, 500)):
        img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
        out = ip.preprocess([img])
        tiles = out["pixel_values"].shape[0]
        ratio = out["aspect_ratios"][0]
        run = Llama4Processor._prompt_split_image(None, ratio, per_tile)
        patches = run.count("<|patch|>")
        print(f"tile {size} max_patches {max_patches} image {w}x{h}: aspect {ratio}, tiles {tiles} -> "
              f"features {tiles * per_tile}, <|patch|> tokens {patches}"
              + ("   MISMATCH" if patches != tiles * per_tile else ""))
