"""`make bench`: served tokens/s against the raw engine, bursts, and cancel-and-reuse.

    python bench/bench.py                    # full suite on the demo model
    python bench/bench.py --quick            # shorter: levels 1, 8, 32 and short runs
    python bench/bench.py --side-by-side     # also smg-grpc-servicer's MLX servicer
    python bench/bench.py --model DIR --levels 1,4,16

For every concurrency level: the raw mlx-lm BatchGenerator loop (bench/raw.py, its own
process) sets the ceiling and the request count; each worker is started on the same model,
warmed up, and driven over gRPC by that many closed-loop clients with the same prompts, in
pairs of short runs that alternate raw and workers. Then, on a fresh worker each: a
staggered burst, cancel-and-reuse and prefix reuse; then speculative decoding on its
setups (bench/speculation.py), the quantized KV cache (bench/kv_quant.py), and the vLLM
face against the MLX face through the smg router (bench/faces.py; `--model real`: both real
models, Gemma and the SmolLM2 chat model). Only one of
the processes being measured runs at a time (the others idle on their input or are stopped
with SIGSTOP). `--only PARTS` runs some parts alone.
Prints the tables, writes JSON and a PNG under bench/results/, and (full runs) rewrites the
generated block of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import prefix
import render_run
import report
from arrival import long_prompt_arrival
from load import Client, Sampling, burst_summary, summarize_bursts
from workers import (
    BENCH,
    REAL_MODEL_SCRIPT,
    BatchConfig,
    Worker,
    add_common_args,
    free_port,
    log,
    model_or_demo,
    our_worker,
    parse_levels,
    raw_process,
    resolve_model,
    smg_servicer_python,
    smg_worker,
)
from workload import (
    STEAL_LIMIT,
    LevelStats,
    Shape,
    StealMeter,
    counted_runs,
    disturbed,
    model_vocab_size,
)

RESULTS = BENCH / "results"
PARTS = (
    "sweep",
    "burst",
    "cancel",
    "prefix",
    "arrival",
    "long-prompt",
    "speculation",
    "kv-quant",
    "faces",
)


def _steal_note(stats: LevelStats) -> str:
    share = stats.extra.get("steal_share")
    return f", hypervisor steal {share:.0%}" if share is not None and share >= 0.005 else ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--levels", type=parse_levels, help="concurrency levels, e.g. 1,8,32 (default 1,8,32,64)"
    )
    parser.add_argument("--quick", action="store_true", help="levels 1,8,32 and short runs")
    add_common_args(
        parser, "also run smg-grpc-servicer's MLX servicer (installed into bench/.venv-smg)"
    )
    parser.add_argument(
        "--requests-per-client",
        type=int,
        help="at least this many requests per client in each run (default 2)",
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        help="at least this long each run takes on the raw engine (default 4; quick 2)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="pairs of runs per level (raw, then each worker on the same prompts); the "
        "median pair ratio and the best undisturbed run are reported (default 5; quick 2)",
    )
    parser.add_argument(
        "--extra-rounds",
        type=int,
        default=3,
        help="pairs per level that may be added when the hypervisor took more than "
        f"{STEAL_LIMIT * 100:.0f}%% of the CPU during one (default 3)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--completion-batch-size", type=int, default=32)
    parser.add_argument("--prefill-batch-size", type=int, default=8)
    parser.add_argument(
        "--sampling",
        choices=["router", "minimal"],
        default="router",
        help="router: temperature 0 plus the router's defaults top_p=1, repetition_penalty=1 "
        "(what a worker gets in production); minimal: temperature 0 only",
    )
    parser.add_argument(
        "--skip",
        default="",
        help=f"comma-separated parts to leave out: {', '.join(PARTS)}",
    )
    parser.add_argument("--only", help="comma-separated parts to run (the others are left out)")
    parser.add_argument(
        "--long-prompt-cases",
        default="2:8000,8:8000,2:16000,8:16000",
        help="part long-prompt: streams:prompt tokens, comma-separated (on the real model)",
    )
    for part, flags in (("budget", "--max-prefill-stall-ms 0"), ("cache", "--prompt-cache-size 0")):
        help = f"the sweep also measures our worker with {flags}, in the same run"
        parser.add_argument(f"--sweep-{part}-off", action="store_true", help=help)
    parser.add_argument("--device-note", help="free text about the machine, kept in the report")
    parser.add_argument(
        "--results-md",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rewrite bench/RESULTS.md (default: yes, except with --quick)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where JSON and PNG go")
    args = parser.parse_args(argv)
    if args.levels is None:
        args.levels = [1, 8, 32] if args.quick else [1, 8, 32, 64]
    if args.requests_per_client is None:
        args.requests_per_client = 2
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.min_seconds is None:
        args.min_seconds = 2.0 if args.quick else 4.0
    args.worker_flags = shlex.split(args.worker_flags)
    args.model_spec = args.model  # as given: `real` means both real models to faces
    args.model = resolve_model(args.model)
    args.skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    if args.only:
        only = {part.strip() for part in args.only.split(",") if part.strip()}
        if not only:
            parser.error(f"--only {args.only!r} names no part; parts: {', '.join(PARTS)}")
        if only - set(PARTS):
            parser.error(f"unknown parts in --only: {', '.join(sorted(only - set(PARTS)))}")
        args.skip |= set(PARTS) - only
    if args.results_md is None:
        args.results_md = not args.quick and not args.skip  # only a full run
    unknown = args.skip - set(PARTS)
    if unknown:
        parser.error(f"unknown parts in --skip: {', '.join(sorted(unknown))}")
    return args


class Suite:
    """One run: the settings, the workers to measure, and everything measured so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = model_or_demo(args.model)
        self.model_name = self.model.name
        if args.model is None:
            self.model_name = f"demo llama, 2 layers, d=128 ({self.model.name})"
        self.vocab_size = model_vocab_size(self.model)
        self.shape = Shape(args.prompt_tokens, args.max_tokens)
        self.batch = BatchConfig(args.completion_batch_size, args.prefill_batch_size)
        self.sampling = Sampling(args.sampling)
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = args.out / "logs" / self.stamp
        self.smg_python: Path | None = None
        if args.side_by_side:
            self.smg_python = smg_servicer_python(args.smg_version)
        quick = args.quick
        self.burst = dict(clients=4, per_client=4, stagger_s=0.3, max_tokens=64)
        self.burst["repeats"] = 2 if quick else 5
        self.cancel = dict(repeats=3 if quick else 5, cancel_after=10, long_tokens=2048)
        self.cancel["max_tokens"] = 64
        self.prefix_settings = dict(repeats=3, prefix_tokens=prefix.SYSTEM_TOKENS)
        self.prefix_settings.update(suffix_tokens=prefix.TURN_TOKENS, max_tokens=prefix.MAX_TOKENS)
        self.prefix_settings.update(
            shared_tokens=prefix.SHARED_TOKENS, conversations=prefix.CONVERSATIONS
        )
        self.arrival = {"streams": [1, 4, 16], "prompt_tokens": [1000, 4000]}
        self.run: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "command": " ".join(["bench/bench.py", *sys.argv[1:]]),
            "machine": report.machine_info(args.device_note),
            "settings": {
                "model": str(self.model),
                "model_name": self.model_name,
                "levels": args.levels,
                "shape": asdict(self.shape),
                "batch": asdict(self.batch),
                "sampling": args.sampling,
                "worker_flags": args.worker_flags,
                "requests_per_client": args.requests_per_client,
                "min_seconds": args.min_seconds,
                "repeats": args.repeats,
                "extra_rounds": args.extra_rounds,
                "steal_limit": STEAL_LIMIT,
                "burst": self.burst,
                "cancel": self.cancel,
                "prefix": self.prefix_settings,
                "arrival": self.arrival,
            },
            "sweep": {report.RAW: [], "ours": []},
            **{part: {} for part in ("burst", "cancel", "prefix", "prefix_disk")},
            **{part: {} for part in ("prefix_bytes", "prefix_chat", "arrival")},
            "failures": [],
        }
        if self.smg_python is not None:
            self.run["sweep"]["smg"] = []
        if args.sweep_budget_off:
            self.run["sweep"]["ours_off"] = []
        if args.sweep_cache_off:
            self.run["sweep"]["ours_nocache"] = []

    # ----- workers -----

    def workers(self, tag: str) -> list[tuple[str, Worker]]:
        flags = self.args.worker_flags
        found = [("ours", our_worker(self.model, self.batch, self.log_dir, tag, flags))]
        if "ours_off" in self.run["sweep"]:
            off = [*flags, "--max-prefill-stall-ms", "0"]
            found.append(
                ("ours_off", our_worker(self.model, self.batch, self.log_dir, f"{tag}-off", off))
            )
        if "ours_nocache" in self.run["sweep"]:
            nocache = [*flags, "--prompt-cache-size", "0"]
            worker = our_worker(self.model, self.batch, self.log_dir, f"{tag}-nocache", nocache)
            found.append(("ours_nocache", worker))
        if self.smg_python is not None:
            found.append(
                ("smg", smg_worker(self.smg_python, self.model, self.batch, self.log_dir, tag))
            )
        return found

    def client(self, worker: Worker) -> Client:
        return Client(worker.address, self.vocab_size, self.sampling)

    # ----- the parts -----

    def sweep(self) -> None:
        """Every level: pairs of short runs, raw then each worker, on the same prompts.

        One raw engine process and one process per worker stay up for the whole level and
        take turns (the others are stopped with SIGSTOP, or idle on their input), so each
        worker run is compared with a raw run seconds before it: on a shared machine whose
        speed drifts from minute to minute, that comparison holds where one minutes apart
        does not. A pair in which the hypervisor took more than STEAL_LIMIT of the CPU (on
        any side) is run again, at most `extra_rounds` times per level; disturbed pairs stay
        in the report but count only when no clean one exists."""
        for level in self.args.levels:
            try:
                rounds = self._sweep_level(level)
            except RuntimeError as exc:
                self.fail(f"concurrency {level}: {exc}")
                continue
            for name, measured in rounds.items():
                if measured:
                    counted = counted_runs(measured, lambda stats: stats.extra["disturbed"])
                    best = max(counted, key=lambda stats: stats.tokens_per_s)
                    best.extra["rounds"] = [
                        {
                            "tokens_per_s": s.tokens_per_s,
                            "ratio": s.extra.get("ratio_to_round_raw"),
                            "steal_share": s.extra.get("steal_share"),
                            "disturbed": s.extra["disturbed"],
                        }
                        for s in measured
                    ]
                    best.extra["errors_all_rounds"] = sum(s.errors for s in measured)
                    self.run["sweep"][name].append(asdict(best))

    def _sweep_level(self, level: int) -> dict[str, list[LevelStats]]:
        rounds: dict[str, list[LevelStats]] = {name: [] for name in self.run["sweep"]}
        with contextlib.ExitStack() as stack:
            raw = stack.enter_context(raw_process(self.model, self.batch))
            # The calibration run warms the raw engine up and sets the requests per run:
            # at least `requests_per_client` per client and `min_seconds` of work.
            calibration = raw.run(
                level,
                self.shape,
                warm_up=True,
                min_requests=level * self.args.requests_per_client,
                min_seconds=self.args.min_seconds,
                seed="calibration",
            )
            requests = calibration.requests
            log(f"c={level}: runs of {requests} requests (raw {calibration.seconds:.1f} s)")
            workers = [
                (name, stack.enter_context(worker)) for name, worker in self.workers(f"c{level}")
            ]
            for _, worker in workers:
                asyncio.run(self._warm_up(worker, level))
                worker.pause()
            clean = tried = 0
            while clean < self.args.repeats and tried < self.args.repeats + self.args.extra_rounds:
                tried += 1
                stats = raw.run(level, self.shape, requests=requests, seed=tried)
                log(
                    f"c={level} pair {tried}: raw {stats.tokens_per_s:.0f} tok/s"
                    f"{_steal_note(stats)}"
                )
                measured = [stats]
                for name, worker in workers:
                    worker.resume()
                    try:
                        served = asyncio.run(self.served_level(worker, level, requests, tried))
                    finally:
                        worker.pause()
                    ratio = served.tokens_per_s / stats.tokens_per_s if stats.tokens_per_s else 0
                    served.extra["ratio_to_round_raw"] = ratio
                    measured.append(served)
                    rounds[name].append(served)
                    log(
                        f"c={level} pair {tried}: {report.LABELS[name]} "
                        f"{served.tokens_per_s:.0f} tok/s ({ratio:.2f} of raw), "
                        f"{served.errors} errors, client CPU {served.extra['client_cpu']:.2f} "
                        f"cores{_steal_note(served)}"
                    )
                rounds[report.RAW].append(stats)
                calm = not any(disturbed(s.extra.get("steal_share")) for s in measured)
                for each in measured:
                    each.extra["disturbed"] = not calm
                if calm:
                    clean += 1
                else:
                    log(f"c={level} pair {tried}: disturbed by the hypervisor; it does not count")
            for _, worker in workers:
                worker.resume()
        return rounds

    async def _warm_up(self, worker: Worker, level: int) -> None:
        async with self.client(worker) as client:
            await client.warm_up(level, self.shape)

    async def served_level(
        self, worker: Worker, level: int, requests: int, seed: int
    ) -> LevelStats:
        async with self.client(worker) as client:
            cpu, start, steal = worker.cpu_seconds(), time.perf_counter(), StealMeter()
            records, client_cpu = await client.closed_loop(level, requests, self.shape, seed)
            worker_cpu = (worker.cpu_seconds() - cpu) / (time.perf_counter() - start)
            steal_share = steal.share()
        return LevelStats.from_records(
            level,
            records,
            expected_tokens=self.shape.max_tokens,
            client_cpu=client_cpu,
            worker_cpu=worker_cpu,
            steal_share=steal_share,
        )

    def burst_and_cancel(self) -> None:
        """The parts that each take a fresh worker: burst, and cancel and reuse."""
        for name, worker in self.workers("burst-cancel"):
            try:
                with worker:
                    asyncio.run(self.burst_and_cancel_on(name, worker))
            except RuntimeError as exc:
                self.fail(f"{report.LABELS[name]} burst/cancel: {exc}")

    async def burst_and_cancel_on(self, name: str, worker: Worker) -> None:
        label = report.LABELS[name]
        async with self.client(worker) as client:
            await client.warm_up(self.burst["clients"], self.shape)
            if "burst" not in self.args.skip:
                shape = Shape(self.shape.prompt_tokens, self.burst["max_tokens"])
                bursts = []
                for k in range(1, self.burst["repeats"] + 1):
                    steal = StealMeter()
                    records = await client.staggered_burst(
                        self.burst["clients"],
                        self.burst["per_client"],
                        self.burst["stagger_s"],
                        shape,
                        seed=f"burst-{k}",
                    )
                    bursts.append(burst_summary(records, shape.max_tokens, steal.share()))
                    await asyncio.sleep(0.5)  # let the last streams' ends settle
                burst = summarize_bursts(bursts)
                self.run["burst"][name] = burst
                log(
                    f"burst: {label} TTFT max ÷ p50 median {burst['max_over_p50']:.2f} over "
                    f"{len(bursts)} bursts ("
                    + ", ".join(f"{b['max_over_p50']:.2f}" for b in bursts)
                    + ")"
                )
            if "cancel" not in self.args.skip:
                cancel = await client.cancel_and_reuse(
                    self.cancel["repeats"],
                    Shape(self.shape.prompt_tokens, self.cancel["max_tokens"]),
                    self.cancel["cancel_after"],
                    self.cancel["long_tokens"],
                    seed="cancel",
                )
                self.run["cancel"][name] = cancel
                log(f"cancel and reuse: {label} follow-up ÷ idle {cancel['ratio']:.2f}")

    def prefixes(self) -> None:
        """Prefix reuse on the llama and hybrid demos (or the model given), on fresh workers:
        a shared system prompt's hit against cold for each worker; ours also after a restart
        on the same directory, and the bytes 16 conversations sharing a prompt hold."""
        for kind, model in prefix.model_dirs(self.args.model).items():
            for name, worker in self._model_workers(model, f"prefix-{kind}"):
                try:
                    with worker:
                        result = asyncio.run(self._on(worker, prefix.hit_and_cold, kind))
                    self.run["prefix"].setdefault(kind, {})[name] = result
                    log(f"prefix {kind}: {report.LABELS[name]} hit ÷ cold {result['ratio']:.3f}")
                except RuntimeError as exc:
                    self.fail(f"{report.LABELS[name]} prefix reuse on {kind}: {exc}")
            try:
                self.run["prefix_disk"][kind] = self._disk_restart(model, kind)
                self.run["prefix_bytes"][kind] = self._shared_bytes(model, kind)
                self.run["prefix_chat"][kind] = self._second_conversation(model, kind)
            except RuntimeError as exc:
                self.fail(f"prefix store on {kind}: {exc}")

    def _model_workers(self, model: Path, tag: str) -> list[tuple[str, Worker]]:
        found = [("ours", our_worker(model, self.batch, self.log_dir, tag, self.args.worker_flags))]
        if self.smg_python is not None:
            found.append(("smg", smg_worker(self.smg_python, model, self.batch, self.log_dir, tag)))
        return found

    async def _on(self, worker: Worker, part: Any, seed: str) -> dict[str, Any]:
        async with self.client(worker) as client:
            await client.warm_up(2, self.shape)
            return await part(client, seed)

    def _disk_restart(self, model: Path, kind: str) -> dict[str, Any]:
        directory = Path(tempfile.mkdtemp(prefix="bench-prompt-cache-"))
        flags = [*self.args.worker_flags, "--prompt-cache-dir", str(directory)]
        port = free_port()

        def start() -> Worker:
            worker = our_worker(model, self.batch, self.log_dir, f"disk-{kind}", flags)
            worker.command[worker.command.index("--port") + 1] = str(port)
            worker.port = port
            return worker.start()

        try:
            result = asyncio.run(prefix.disk_restart(start, self.client, f"disk-{kind}"))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        log(f"prefix {kind}: disk hit after a restart ÷ cold {result['ratio'] or 0:.3f}")
        return result

    def _second_conversation(self, model: Path, kind: str) -> dict[str, Any]:
        """Ours with a snapshot interval as long as a real hybrid's automatic one."""
        flags = [*self.args.worker_flags]
        flags += ["--prompt-cache-snapshot-interval", str(prefix.LONG_INTERVAL)]
        worker = our_worker(model, self.batch, self.log_dir, f"chat-{kind}", flags)
        with worker:
            result = asyncio.run(
                self._on(worker, lambda c, s: prefix.second_conversation(c, model, s), kind)
            )
        log(f"prefix {kind}: second conversation ÷ cold {result['ratio'] or 0:.3f}")
        return result

    def _shared_bytes(self, model: Path, kind: str) -> dict[str, Any]:
        metrics_port = free_port()
        flags = [*self.args.worker_flags, "--metrics-port", str(metrics_port)]
        worker = our_worker(model, self.batch, self.log_dir, f"bytes-{kind}", flags)
        with worker:

            async def measure() -> dict[str, Any]:
                async with self.client(worker) as client:
                    return await prefix.shared_conversations(client, metrics_port, kind)

            result = asyncio.run(measure())
        log(f"prefix {kind}: 16 conversations ÷ one, bytes {result['ratio'] or 0:.2f}")
        return result

    def speculation(self) -> None:
        """Speculative decoding: the demo llama and the target, or the model given with
        --model on code, a passage then its start, and prose (bench/speculation.py)."""
        import speculation

        quick = self.args.quick
        levels = (1, 16) if quick else speculation.LEVELS
        rounds = 1 if quick else speculation.ROUNDS
        try:
            model = None if self.args.model is None else str(self.args.model)
            self.run["speculation"] = speculation.run_part(
                levels, rounds, self.smg_python, self.log_dir, model=model
            )
        except RuntimeError as exc:
            self.fail(f"speculation: {exc}")

    def long_prompt(self) -> None:
        """A long prompt beside decoding streams on the real model (or --model), ours with its
        defaults, without the budget and without the prompt cache, and the peer with
        --side-by-side (bench/long_prompt.py); skipped with a note where ../shared is absent."""
        import long_prompt

        model = self.args.model
        if model is None:
            if not REAL_MODEL_SCRIPT.exists():
                log(f"long-prompt: skipped ({REAL_MODEL_SCRIPT} is absent; or pass --model)")
                return
            model = resolve_model("real")
        assert model is not None
        cases = long_prompt.parse_cases(self.args.long_prompt_cases)
        try:
            found = long_prompt.run_part(model, cases, self.log_dir, self.smg_python)
        except RuntimeError as exc:
            self.fail(f"long-prompt: {exc}")
            return
        self.run["long_prompt"] = found
        print(long_prompt.render(found))

    def kv_quant(self) -> None:
        """The quantized KV cache's bytes, admission, speed and fidelity (bench/kv_quant.py)."""
        import kv_quant

        try:
            self.run["kv_quant"] = kv_quant.run_part(self.args.quick, self.log_dir)
        except RuntimeError as exc:
            self.fail(f"kv-quant: {exc}")

    def faces(self) -> None:
        """The vLLM face against the MLX face through the smg router (bench/faces.py): the
        model given (`real`: Gemma and the SmolLM2 chat model), or the demo model."""
        import faces

        spec = self.args.model_spec
        model = spec if spec in (None, "real") else str(self.args.model)
        rounds = 2 if self.args.quick else faces.ROUNDS
        try:
            found = faces.run_part(
                [model], self.log_dir, rounds=rounds, flags=self.args.worker_flags
            )
        except RuntimeError as exc:
            self.fail(f"faces: {exc}")
            return
        self.run["faces"] = found
        for failure in found["failures"]:
            self.fail(f"faces: {failure}")

    def arrivals(self) -> None:
        """Long prompt arrival, on a fresh worker each: ours, ours without the prefill budget,
        and smg-grpc-servicer with --side-by-side."""
        off = [*self.args.worker_flags, "--max-prefill-stall-ms", "0"]
        workers = [*self.workers("arrival")]
        workers.insert(
            1, ("ours_off", our_worker(self.model, self.batch, self.log_dir, "off", off))
        )
        for name, worker in workers:
            try:
                with worker:
                    self.run["arrival"][name] = asyncio.run(self._arrivals_on(name, worker))
            except RuntimeError as exc:
                self.fail(f"{report.LABELS[name]} long prompt arrival: {exc}")

    async def _arrivals_on(self, name: str, worker: Worker) -> list[dict[str, Any]]:
        cases = []
        async with self.client(worker) as client:
            await client.warm_up(4, self.shape)
            for streams in self.arrival["streams"]:
                for tokens in self.arrival["prompt_tokens"]:
                    seed = f"arrival-{streams}-{tokens}"
                    case = await long_prompt_arrival(client, streams, tokens, seed)
                    cases.append(case)
                    log(
                        f"arrival: {report.LABELS[name]} {streams} streams + {tokens} tokens: "
                        f"gap max {case['gap_max_during_ms'] or 0:.0f} ms, "
                        f"TTFT {case['ttft_ms'] or 0:.0f} ms"
                    )
        return cases

    def fail(self, message: str) -> None:
        log(f"FAILED {message}")
        self.run["failures"].append(message)

    # ----- output -----

    def finish(self) -> int:
        out: Path = self.args.out
        self.run["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        json_path = out / f"bench-{self.stamp}.json"
        png_path = out / f"bench-{self.stamp}.png"
        report.write_json(self.run, json_path)
        print(render_run.render(self.run))
        if self.run["failures"]:
            print("\nFailures:\n" + "\n".join(f"- {f}" for f in self.run["failures"]))
        print(f"\nJSON: {json_path}")
        if report.plot(self.run, png_path):
            print(f"plot: {png_path}")
        else:
            print("plot: skipped (no sweep, or matplotlib is not installed)")
        arrival_png = out / f"bench-{self.stamp}-arrival.png"
        if report.plot_arrival(self.run, arrival_png):
            print(f"arrival plot: {arrival_png}")
        if self.args.results_md:
            report.update_results_md(render_run.render(self.run))
            print(f"updated {report.RESULTS_MD}")
        return 1 if self.run["failures"] else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    suite = Suite(args)
    log(f"model {suite.model}; levels {args.levels}; log files in {suite.log_dir}")
    if "sweep" not in args.skip:
        suite.sweep()
    if not {"burst", "cancel"} <= args.skip:
        suite.burst_and_cancel()
    if "prefix" not in args.skip:
        suite.prefixes()
    if "arrival" not in args.skip:
        suite.arrivals()
    if "long-prompt" not in args.skip:
        suite.long_prompt()
    if "speculation" not in args.skip:
        suite.speculation()
    if "kv-quant" not in args.skip:
        suite.kv_quant()
    if "faces" not in args.skip:
        suite.faces()
    return suite.finish()


if __name__ == "__main__":
    sys.exit(main())
