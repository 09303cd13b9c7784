"""The vision rows of the family matrix: the vision-language families the worker serves images
for (the registry's: gemma3, mistral3, llava, the qwen2 and qwen3 families, ...), served by the
real worker, against mlx-vlm.

Each family's tiny demo checkpoint (`servicer.demos.vision.demo_vlm_path`, built offline, cached)
is served by `python -m servicer --protocols vllm --prompt-cache-block 4` (bench/families.py's
worker launcher and supervision); the prompt is the chat template's, one anchor per image, the
images `data:` media references (tests/test_images.py's `image_request`). Each answer must
equal mlx-vlm's single-sequence greedy tokens (`mlx_vlm.generate.generate_step`, prompt and
pixels from mlx-vlm's own processor) up to the end of sequence where the worker stops, and its
`prompt_tokens` the processor's expanded prompt. Cells:

- alone: three images of different sizes, one request at a time;
- batched: three image requests (the images with other questions) and a text request at once;
- prefix: a new image and question, the same again (a hit past the image: `cached_tokens` >
  the image's end), then the same image with another question (`cached_tokens` reported);
- kv8: `--kv-bits 8`, the alone and batched requests, against mlx-vlm on its own 8-bit
  QuantizedKVCache from the first token in each plain or chunked KVCache layer (as the worker
  quantizes: its chunked-attention layers keep a plain KV cache, which within one chunk is
  what a ChunkedKVCache is; sliding-window layers stay full precision) in the group size the
  worker logs;
- ngram: `--speculate ngram` (the shipped default; the other cells run `--speculate off`), the
  alone and batched requests for longer answers; drafted and accepted tokens from its metrics.

A cell is exact, near-tie (the first difference where mlx-vlm's top two logits are within
families.MARGIN), wrong (the request and first differing position), no-hit, refused (the worker
would not start: its reason), error, hang, memory or skipped (with the reason).

Usage: python bench/vision_families.py [--only gemma3,llava] [--cells alone,kv8]
       [--timeout 180] [--json OUT] [--markdown OUT]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import importlib.util
import io
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
from families import Cell, Worker, compare, supervise
from vision_census import census
from vision_census import markdown as census_markdown

from servicer.vision_families import FAMILIES as VISION_FAMILIES

FAMILIES = tuple(VISION_FAMILIES)
CELLS = ("alone", "batched", "prefix", "kv8", "ngram")
BLOCK = "4"
NEW_TOKENS = 16
NGRAM_TOKENS = 64
IMAGES = ((1, (64, 48)), (2, (112, 84)), (3, (30, 90)))  # (seed, (width, height))
QUESTIONS = ("What do bees make?", "Describe a quiet place.", "Tell me about the sea and the sky.")
TEXT = "Hello there, tell me a story."
PREFIX_IMAGE = (4, (84, 56))
PREFIX_QUESTIONS = ("Describe a quiet place and the sea.", "Describe a bee.")


@dataclass(frozen=True)
class Job:
    question: str
    images: tuple[tuple[int, tuple[int, int]], ...] = ()
    max_tokens: int = NEW_TOKENS

    @property
    def label(self) -> str:
        pictures = ", ".join(f"image {seed} {w}x{h}" for seed, (w, h) in self.images)
        return f"{pictures or 'text'}: {self.question!r}"


def png(seed: int, size: tuple[int, int]) -> bytes:
    """tests/test_images.py's png: random pixels of this size, PNG-encoded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class Reference:
    """mlx-vlm's model and processor for one checkpoint, and its greedy answers; both with the
    fixes the registry names (`VisionSpec.processor_fix`, `VisionFamily.model_fix`), as the
    worker's are."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_vlm import load

        from servicer.vision_families import fixed_model, vision_spec

        self.model, self.processor = load(str(model_dir))
        config = json.loads((model_dir / "config.json").read_text())
        self.model = fixed_model(config, self.model)
        spec = vision_spec(config, self.processor.tokenizer)
        self.processor = spec.fixed(self.processor) if spec is not None else self.processor
        self.image_token = config.get("image_token_index", config.get("image_token_id"))
        generation = model_dir / "generation_config.json"
        extra = json.loads(generation.read_text()) if generation.exists() else {}
        found = [c.get("eos_token_id") for c in (config, config.get("text_config", {}), extra)]
        self.eos = {e for f in found for e in (f if isinstance(f, list) else [f]) if e is not None}
        self.done: dict[tuple[Job, int | None], dict[str, Any]] = {}

    def chat(self, job: Job) -> str:
        content = [{"type": "image"}] * len(job.images) + [{"type": "text", "text": job.question}]
        messages = [{"role": "user", "content": content}]
        tokenizer = self.processor.tokenizer
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def router_ids(self, job: Job) -> list[int]:
        """The prompt as the router sends it: the template rendered, one anchor per image."""
        return list(self.processor.tokenizer.encode(self.chat(job), add_special_tokens=False))

    def inputs(self, job: Job) -> tuple[Any, Any, dict[str, Any]]:
        """The expanded prompt, the pixel values and the model's other image inputs, as
        mlx-vlm's processor makes them (a text job: the router's ids as they are)."""
        import mlx.core as mx
        import numpy as np
        from PIL import Image

        if not job.images:
            return mx.array([self.router_ids(job)]), None, {}
        pictures = [Image.open(io.BytesIO(png(*image))).convert("RGB") for image in job.images]
        text = self.chat(job)
        try:
            out = self.processor(
                text=text, images=pictures, return_tensors="np", add_special_tokens=False
            )
        except TypeError:  # llava's processor hands its keywords to the image processor
            out = self.processor(text=text, images=pictures)
        extra = {
            k: np.asarray(v).tolist() if k == "image_sizes" else mx.array(np.asarray(v))
            for k, v in out.items()
            if k not in ("input_ids", "attention_mask", "pixel_values")
        }
        pixels = mx.array(np.asarray(out["pixel_values"]))
        return mx.array(np.asarray(out["input_ids"])), pixels, extra

    def greedy(self, job: Job, kv_group_size: int | None = None) -> dict[str, Any]:
        """mlx-vlm's greedy tokens up to its first EOS (kept), the top-2 logit gaps, the
        expanded prompt's length and its image's end; with `kv_group_size`, on 8-bit
        QuantizedKVCache layers from the first token."""
        if (job, kv_group_size) in self.done:
            return self.done[(job, kv_group_size)]
        import mlx.core as mx
        import numpy as np
        from mlx_vlm.generate import generate_step
        from mlx_vlm.models.cache import (
            ChunkedKVCache,
            KVCache,
            QuantizedKVCache,
            make_prompt_cache,
        )

        ids, pixels, extra = self.inputs(job)
        cache = None
        if kv_group_size is not None:
            cache = make_prompt_cache(self.model.language_model)
            plain = (KVCache, ChunkedKVCache)  # no prompt here fills a chunk
            cache = [QuantizedKVCache(kv_group_size, 8) if type(c) in plain else c for c in cache]
        steps = generate_step(
            ids, self.model, pixels, mx.ones_like(ids), max_tokens=job.max_tokens,
            temperature=0.0, prompt_cache=cache, **extra,
        )  # fmt: skip
        tokens, margins = [], []
        for token, logprobs in steps:
            top = np.sort(np.array(logprobs.astype(mx.float32)).reshape(-1))[-2:]
            tokens.append(int(token))
            margins.append(float(top[1] - top[0]))
            if tokens[-1] in self.eos:
                break
        flat = ids[0].tolist()
        marks = [i for i, t in enumerate(flat) if t == self.image_token]
        found = {"tokens": tokens, "margins": margins, "prompt": flat}
        self.done[(job, kv_group_size)] = {**found, "image_end": marks[-1] + 1 if marks else 0}
        return self.done[(job, kv_group_size)]


_ids = iter(range(1_000_000))


def ask(port: int, ids: list[int], job: Job, timeout: float) -> dict[str, Any]:
    """One greedy request on the vLLM face, its images as `data:` media references (as
    tests/test_images.py's image_request)."""
    import grpc

    from servicer.proto import vllm_engine_pb2 as vpb
    from servicer.proto import vllm_engine_pb2_grpc as vgrpc

    urls = ["data:image/png;base64," + base64.b64encode(png(*i)).decode() for i in job.images]
    request = vpb.GenerateRequest(
        request_id=f"vision-families-{next(_ids)}",
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=job.max_tokens),
        media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=1, url=u) for u in urls]),
        stream=False,
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            (response,) = list(vgrpc.VllmEngineStub(channel).Generate(request, timeout=timeout))
        except grpc.RpcError as error:
            return {"error": f"{error.code().name}: {error.details()}"}
    done = response.complete
    return dict(tokens=list(done.output_ids), cached=done.cached_tokens, prompt=done.prompt_tokens)


def served(args: Sequence[str], work: Callable[[int], Any], timeout: float) -> Any:
    """`work(port)` against a worker started with `args`, supervised as bench/families.py's
    cells are: its result and the worker's log, or a Cell when the worker would not start or
    did not finish."""
    deadline = time.monotonic() + timeout
    worker = Worker(args).start()
    try:
        stop = supervise([worker], worker.ready.is_set, deadline)
        if stop is not None:
            return stop
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(out=work(worker.port)), daemon=True)
        thread.start()
        stop = supervise([worker], lambda: not thread.is_alive(), deadline)
        if stop is not None:
            return stop
        if "out" not in box:
            return Cell("error", "the bench's requests raised (see the log above)")
        return box["out"], worker.lines
    finally:
        worker.kill()


def check(ref: Reference, jobs: Sequence[Job], got: list[dict[str, Any]], kv: int | None) -> Cell:
    """The worker's answers against mlx-vlm's (families.compare, the request named)."""
    wants = [ref.greedy(job, kv) for job in jobs]
    for job, result, want in zip(jobs, got, wants, strict=True):
        if "error" not in result and result["prompt"] != len(want["prompt"]):
            says = f"prompt_tokens {result['prompt']}, the processor's {len(want['prompt'])}"
            return Cell("wrong", f"{job.label}: {says}")
    cell = compare(got, wants, [w["prompt"] for w in wants])
    cell.detail = re.sub(r"^prompt (\d+)", lambda m: jobs[int(m[1])].label, cell.detail)
    cell.extra["requests"] = len(jobs)
    return cell


def one_by_one(port: int, ref: Reference, jobs: Sequence[Job], timeout: float) -> list:
    return [ask(port, ref.router_ids(job), job, timeout) for job in jobs]


def at_once(port: int, ref: Reference, jobs: Sequence[Job], timeout: float) -> list:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: ask(port, ref.router_ids(job), job, timeout), jobs))


def mixed(port: int, ref: Reference, jobs: Sequence[Job], timeout: float) -> list:
    """all_jobs' alone and batched requests: three one at a time, then four at once."""
    return one_by_one(port, ref, jobs[:3], timeout) + at_once(port, ref, jobs[3:], timeout)


def all_jobs(tokens: int = NEW_TOKENS) -> dict[str, list[Job]]:
    """alone: question i with image i; batched: question i + 1 with image i, and a text one."""
    batched = zip(QUESTIONS[1:] + QUESTIONS[:1], IMAGES, strict=True)
    first, other = (Job(q, (PREFIX_IMAGE,)) for q in PREFIX_QUESTIONS)
    return {
        "alone": [Job(q, (i,), tokens) for q, i in zip(QUESTIONS, IMAGES, strict=True)],
        "batched": [Job(q, (i,), tokens) for q, i in batched] + [Job(TEXT, (), tokens)],
        "prefix": [first, first, other],
    }


def worker_args(model_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--protocols", "vllm", "--prompt-cache-block", BLOCK, *extra]


def noted(cell: Cell, note: str, **extra: Any) -> Cell:
    cell.detail = f"{cell.detail}; {note}" if cell.detail else note
    cell.extra.update(extra)
    return cell


def base_cells(ref: Reference, model_dir: Path, cells: Sequence[str], timeout: float) -> dict:
    """alone, batched and prefix on one worker (`--speculate off`)."""
    jobs = all_jobs()
    wanted = [c for c in jobs if c in cells]

    def work(port: int) -> dict[str, list]:
        send = {"alone": one_by_one, "batched": at_once, "prefix": one_by_one}
        return {c: send[c](port, ref, jobs[c], timeout) for c in wanted}

    found = served(worker_args(model_dir, "--speculate", "off"), work, timeout)
    if isinstance(found, Cell):
        return dict.fromkeys(wanted, found)
    out = {c: check(ref, jobs[c], found[0][c], None) for c in wanted}
    if "prefix" in out and out["prefix"].status != "error":
        end = ref.greedy(jobs["prefix"][0])["image_end"]
        cached = [r["cached"] for r in found[0]["prefix"]]
        note = f"cached_tokens {cached} (cold, again, another question); the image ends at {end}"
        noted(out["prefix"], note, cached_tokens=cached, image_end=end)
        if out["prefix"].status == "exact" and not cached[1] > end:
            out["prefix"].status = "no-hit"
    return out


KV_LINE = re.compile(r"KV cache quantized: 8 bits, groups of (\d+), .*\((\w+)\)")


def kv8_cell(ref: Reference, model_dir: Path, timeout: float) -> Cell:
    """`--kv-bits 8` against mlx-vlm on QuantizedKVCache layers in the group the worker logs."""
    jobs = all_jobs()["alone"] + all_jobs()["batched"]
    args = worker_args(model_dir, "--speculate", "off", "--kv-bits", "8")
    found = served(args, lambda port: mixed(port, ref, jobs, timeout), timeout)
    if isinstance(found, Cell):
        return found
    got, lines = found
    logged = next((m for line in lines if (m := KV_LINE.search(line))), None)
    if logged is None:
        return Cell("error", "the worker logged no quantized KV cache")
    group, kind = int(logged[1]), logged[2]
    if kind != "QuantizedRowCache":
        return Cell("skipped", f"the worker dequantizes for attention ({kind}): no reference")
    cell = check(ref, jobs, got, group)
    plain = sum(r.get("tokens") == ref.greedy(j)["tokens"] for j, r in zip(jobs, got, strict=True))
    note = (
        f"worker {kind}, reference mlx-vlm QuantizedKVCache(8 bits, groups of {group}) from the "
        f"first token; {plain} of {len(jobs)} answers also equal the unquantized reference"
    )
    return noted(cell, note, group=group, worker_cache=kind, equal_unquantized=plain)


def ngram_cell(ref: Reference, model_dir: Path, timeout: float) -> Cell:
    from servicer.sysinfo import free_port

    metrics = free_port()
    jobs = all_jobs(NGRAM_TOKENS)["alone"] + all_jobs(NGRAM_TOKENS)["batched"]

    def work(port: int) -> tuple[list, dict[str, float]]:
        got = mixed(port, ref, jobs, timeout)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as page:
            text = page.read().decode()
        found = re.finditer(r"^mlx_worker_speculation_(\w+?)(?:_total)? (\S+)$", text, re.M)
        return got, {m[1]: float(m[2]) for m in found}

    args = worker_args(model_dir, "--speculate", "ngram", "--metrics-port", str(metrics))
    found = served(args, work, timeout)
    if isinstance(found, Cell):
        return found
    (got, figures), _ = found
    drafted, accepted = (int(figures.get(k, 0)) for k in ("drafted_tokens", "accepted_tokens"))
    note = f"drafted {drafted} tokens, accepted {accepted}"
    return noted(check(ref, jobs, got, None), note, drafted=drafted, accepted=accepted)


def run_family(family: str, cells: Sequence[str], timeout: float) -> dict[str, Any]:
    from servicer.demos.vision import demo_vlm_path

    started = time.monotonic()
    if importlib.util.find_spec("mlx_vlm") is None:
        reason = "mlx-vlm is not installed (the vision extra)"
        return {"cells": {c: Cell("skipped", reason).as_dict() for c in cells}}
    model_dir = demo_vlm_path(family=family)
    ref = Reference(model_dir)
    found = base_cells(ref, model_dir, cells, timeout)
    if "kv8" in cells:
        found["kv8"] = kv8_cell(ref, model_dir, timeout)
    if "ngram" in cells:
        found["ngram"] = ngram_cell(ref, model_dir, timeout)
    jobs = all_jobs()  # question i with image i (alone) and with image i - 1 (batched)
    answers = [[ref.greedy(job)["tokens"] for job in jobs[c][:3]] for c in ("alone", "batched")]
    changed = sum(answers[0][i] != answers[1][(i - 1) % 3] for i in range(3))
    summary = " ".join(f"{c}={found[c].status}" for c in cells)
    print(f"[vision-families] {family}: {summary} ({time.monotonic() - started:.0f} s)", flush=True)
    return {
        "model": model_dir.name,
        "image_changes_answer": f"{changed}/3",
        "cells": {c: found[c].as_dict() for c in cells},
    }


def versions() -> str:
    import importlib.metadata as meta

    command = ["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"]
    commit = subprocess.run(command, capture_output=True, text=True).stdout.strip() or "?"
    return f"commit {commit}, " + ", ".join(
        f"{p} {meta.version(p)}" for p in ("mlx-vlm", "mlx-lm", "mlx")
    )


def markdown(results: dict[str, Any], cells: Sequence[str]) -> str:
    lines = [
        f"{versions()}, {time.strftime('%Y-%m-%d')}, `make vision-families` "
        f"(the tiny demo checkpoints, `--prompt-cache-block {BLOCK}`).",
        "",
        "| family | " + " | ".join(cells) + " | another image, another answer |",
        "|---|" + "---|" * (len(cells) + 1),
    ]
    for family, result in results.items():
        row = [result["cells"].get(c, {}).get("status", "-") for c in cells]
        row.append(result.get("image_changes_answer", "-"))
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    lines += [
        "",
        f"Counts: {counts(results, cells)}. The last column: of three questions, how many",
    ]
    lines += ["mlx-vlm answers differently with another image.", "", "Each cell:", ""]
    for family, result in results.items():
        for cell in cells:
            entry = result["cells"].get(cell, {})
            if entry:
                lines.append(
                    f"- {family} / {cell}: **{entry['status']}** {entry['detail']}".rstrip()
                )
    return "\n".join(lines) + "\n"


def counts(results: dict[str, Any], cells: Sequence[str]) -> str:
    found = [r["cells"].get(c, {}).get("status", "-") for r in results.values() for c in cells]
    return ", ".join(f"{n} {status}" for status, n in Counter(found).most_common())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--only", help=f"comma-separated families of {','.join(FAMILIES)}")
    parser.add_argument("--cells", default=",".join(CELLS), help=f"subset of {','.join(CELLS)}")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per worker")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    args = parser.parse_args(argv)
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    names = [n.strip() for n in (args.only or ",".join(FAMILIES)).split(",") if n.strip()]
    if bad := [c for c in cells if c not in CELLS] + [n for n in names if n not in FAMILIES]:
        raise SystemExit(f"unknown {bad}; cells: {list(CELLS)}, families: {list(FAMILIES)}")
    results: dict[str, Any] = {}
    at_start = census()
    for family in names:
        results[family] = run_family(family, cells, args.timeout)
        payload = {"versions": versions(), "cells": cells, "results": results}
        payload["at_start"] = [dataclasses.asdict(d) for d in at_start]
        if args.json:
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
        if args.markdown:
            args.markdown.write_text(markdown(results, cells) + "\n" + census_markdown(at_start))
    print(markdown(results, cells) + "\n" + census_markdown(at_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
