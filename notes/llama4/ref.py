import sys; sys.path.insert(0, "/work/wt-llama4/bench")
import _checkout  # noqa
from pathlib import Path
from vision_families import Reference, Job
from servicer.demos.vision import demo_vlm_path
ref = Reference(demo_vlm_path(family="llama4"))
for images in (((1, (64, 48)),), ((3, (30, 90)),)):
    for attempt in range(3):
        ref.done.clear()
        job = Job("What do bees make?", images)
        out = ref.greedy(job)
        print(images, attempt, "prompt", len(out["prompt"]), "tokens", out["tokens"])
text = ref.greedy(Job("What do bees make?"))
print("text", text["tokens"])
