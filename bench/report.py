"""Reporting a benchmark run: tables, JSON, a PNG plot and bench/RESULTS.md.

A run is one JSON-able dict (see bench.py): machine, settings, and per worker the sweep
levels, the burst and the cancel-and-reuse numbers. Everything here reads only that dict,
so a saved JSON can be re-rendered (`python bench/render_run.py results/bench-....json`).
"""

from __future__ import annotations

import html
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import history
from workload import counted_runs, disturbed

BENCH = Path(__file__).resolve().parent
RESULTS_MD = BENCH / "RESULTS.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

RAW = "raw"
LABELS = {
    RAW: "raw BatchGenerator",
    "ours": "mlx-grpc-worker",
    "ours_off": "mlx-grpc-worker, budget off",
    "ours_nocache": "mlx-grpc-worker, prompt cache off",
    "smg": "smg-grpc-servicer",
}
COLORS = {
    RAW: "#555555",
    "ours": "#1f77b4",
    "ours_off": "#9ecae1",
    "ours_nocache": "#2ca02c",
    "smg": "#d62728",
}

Run = dict[str, Any]


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _os_name() -> str:
    try:
        text = Path("/etc/os-release").read_text()
        match = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', text, re.MULTILINE)
        if match:
            return f"{match.group(1)} ({platform.system()} {platform.release()})"
    except OSError:
        pass
    return platform.platform()


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu() -> str:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if done.returncode == 0 and done.stdout.strip():
            return ", ".join(done.stdout.strip().splitlines())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "Apple GPU (Metal, in the chip)" if platform.system() == "Darwin" else "none"


def _memory_gib() -> int:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError):
        return 0


def machine_info(note: str | None = None) -> dict[str, Any]:
    import mlx.core as mx

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "gpu": _gpu(),
        "memory_gib": _memory_gib(),
        "os": _os_name(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "grpcio": version("grpcio"),
        "mlx_device": str(mx.default_device()),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "note": note,
    }


# --------------------------------------------------------------------------- tables


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(headers), *[[_fmt(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _workers(run: Run) -> list[str]:
    names = ("ours", "ours_off", "ours_nocache", "smg")
    return [name for name in names if name in run["sweep"]]


def _ratio(value: float | None, ceiling: float | None) -> float | None:
    return value / ceiling if value and ceiling else None


def _by_level(levels: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {level["concurrency"]: level for level in levels}


def _counted_rounds(level: dict[str, Any]) -> list[dict[str, Any]]:
    rounds = level.get("extra", {}).get("rounds", [])
    return counted_runs(rounds, lambda r: bool(r.get("disturbed")))


def _median_round_ratio(level: dict[str, Any]) -> float | None:
    """The median over pairs of served ÷ the raw run just before it: on a noisy machine
    this drifts less than the ratio of the two best runs, which may come minutes apart."""
    ratios = sorted(r["ratio"] for r in _counted_rounds(level) if r.get("ratio"))
    if not ratios:
        return None
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2


def headline_table(run: Run) -> str:
    raw = _by_level(run["sweep"].get(RAW, []))
    workers = _workers(run)
    headers = ["concurrency", "raw tok/s"]
    for name in workers:
        headers += [f"{LABELS[name]} tok/s", "÷ raw (median pair)", "÷ raw (best runs)"]
    rows = []
    for concurrency in run["settings"]["levels"]:
        ceiling = raw.get(concurrency, {}).get("tokens_per_s")
        row: list[Any] = [concurrency, ceiling]
        for name in workers:
            level = _by_level(run["sweep"][name]).get(concurrency, {})
            served = level.get("tokens_per_s")
            row += [served, _fmt(_median_round_ratio(level), 2), _fmt(_ratio(served, ceiling), 2)]
        rows.append(row)
    return markdown_table(headers, rows)


def _rounds(rounds: list[dict[str, Any]]) -> str:
    parts = []
    for r in rounds:
        notes = [f"{r['ratio']:.2f}"] if r.get("ratio") else []
        if r.get("disturbed") and r.get("steal_share") is not None:
            notes.append(f"steal {r['steal_share']:.0%}")
        text = f"{r['tokens_per_s']:.0f}" + (f" ({', '.join(notes)})" if notes else "")
        parts.append(f"~~{text}~~" if r.get("disturbed") else text)
    return " / ".join(parts)


def keyed_table(lead: Sequence[str], columns: str, rows: Sequence[tuple[list, dict]]) -> str:
    """A table whose cells after the `lead` ones are keys of each row's dict. `columns` is
    "header=key:digits | ..." (digits 1 when left out)."""
    spec = []
    for column in columns.split(" | "):
        header, _, key = column.partition("=")
        key, _, digits = key.partition(":")
        spec.append((header, key, int(digits or 1)))
    headers = [*lead, *(header for header, _, _ in spec)]
    cells = [[*first, *(_fmt(data.get(key), d) for _, key, d in spec)] for first, data in rows]
    return markdown_table(headers, cells)


def sweep_table(run: Run) -> str:
    raw = _by_level(run["sweep"].get(RAW, []))
    rows = []
    for concurrency in run["settings"]["levels"]:
        ceiling = raw.get(concurrency, {}).get("tokens_per_s")
        for name in (RAW, *_workers(run)):
            level = _by_level(run["sweep"].get(name, [])).get(concurrency)
            if level is None:
                continue
            extra = level.get("extra", {})
            data = {
                **level,
                **extra,
                "errors": extra.get("errors_all_rounds", level["errors"]),
                "pairs": _rounds(extra.get("rounds", [])),
            }
            served = level["tokens_per_s"]
            lead = [concurrency, LABELS[name], served, _fmt(_ratio(served, ceiling), 2)]
            rows.append((lead, data))
    columns = (
        "TTFT p50 ms=ttft_p50_ms | TTFT p90 ms=ttft_p90_ms | ITL p50 ms=itl_p50_ms:2 | "
        "ITL p99 ms=itl_p99_ms:2 | requests=requests | errors=errors | "
        "each pair: tok/s (÷ its raw)=pairs | client CPU=client_cpu:2 | worker CPU=worker_cpu:2"
    )
    return keyed_table(["conc", "worker", "tok/s", "÷ raw"], columns, rows)


def burst_table(run: Run) -> str:
    rows = []
    for name, burst in run.get("burst", {}).items():
        each = []
        for b in burst.get("bursts", [burst]):
            text = _fmt(b["max_over_p50"], 2)
            if disturbed(b.get("steal_share")):
                text = f"{text} (steal {b['steal_share']:.0%})"
            each.append(text)
        rows.append(([LABELS[name]], {**burst, "each": " / ".join(each)}))
    columns = (
        "TTFT p50 ms=ttft_p50_ms | TTFT p90 ms=ttft_p90_ms | TTFT max ms=ttft_max_ms | "
        "max ÷ p50=max_over_p50:2 | each burst: max ÷ p50=each | errors=errors"
    )
    return keyed_table(["worker"], columns, rows)


def cancel_table(run: Run) -> str:
    rows = [([LABELS[name]], cancel) for name, cancel in run.get("cancel", {}).items()]
    columns = (
        "idle latency ms=idle_latency_ms | after cancel ms=follow_up_latency_ms | ratio=ratio:2 "
        "| idle TTFT ms=idle_ttft_ms | after cancel TTFT ms=follow_up_ttft_ms | errors=errors"
    )
    return keyed_table(["worker"], columns, rows)


def prefix_table(run: Run) -> str:
    rows = [
        ([kind, LABELS[name]], prefix)
        for kind, workers in run.get("prefix", {}).items()
        if isinstance(workers, dict) and "ratio" not in workers
        for name, prefix in workers.items()
    ]
    columns = "cold TTFT ms=cold_ttft_ms | TTFT on a hit ms=hit_ttft_ms | hit ÷ cold=ratio:3"
    columns += " | cached tokens=hit_cached_tokens | errors=errors"
    return keyed_table(["model", "worker"], columns, rows)


def prefix_store_table(run: Run) -> str:
    rows = []
    for kind, disk in run.get("prefix_disk", {}).items():
        shared = run.get("prefix_bytes", {}).get(kind, {})
        chat = run.get("prefix_chat", {}).get(kind, {})
        tokens = f"{chat.get('second_cached_tokens')} / {chat.get('system_message_tokens')}"
        data = {**shared, **disk, "bytes_ratio": shared.get("ratio"), "chat_tokens": tokens}
        rows.append(([kind], {**data, "chat_ratio": chat.get("ratio")}))
    columns = (
        "cold TTFT ms=cold_ttft_ms | disk hit after a restart ms=disk_hit_ttft_ms | "
        "disk hit ÷ cold=ratio:3 | cached tokens=hit_cached_tokens | "
        "one conversation, bytes=one_bytes | 16 sharing its prompt, bytes=many_bytes | "
        "16 ÷ one=bytes_ratio:2 | 2nd chat conversation ÷ cold (interval 4096)=chat_ratio:3 | "
        "its cached tokens / system message=chat_tokens"
    )
    return keyed_table(["model"], columns, rows)


def arrival_table(run: Run) -> str:
    cases = run.get("arrival", {}).items()
    rows = [([LABELS[name]], case) for name, found in cases for case in found]
    columns = (
        "streams=streams | arriving tokens=prompt_tokens | gap p50 before ms=gap_p50_before_ms "
        "| gap p99 during ms=gap_p99_during_ms | gap max during ms=gap_max_during_ms | "
        "arrival TTFT ms=ttft_ms | errors=errors"
    )
    return keyed_table(["worker"], columns, rows)


def pyplot() -> Any:
    """matplotlib's pyplot without a display, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_arrival(run: Run, path: Path, streams: int = 4, tokens: int = 4000) -> bool:
    """The running streams' gaps over time around one arrival, a line per worker."""
    cases = {
        name: case
        for name, found in run.get("arrival", {}).items()
        for case in found
        if case["streams"] == streams and case["prompt_tokens"] == tokens
    }
    plt = pyplot()
    if not cases or plt is None:
        return False
    fig, axis = plt.subplots(figsize=(9, 4))
    for name, case in cases.items():
        times = [t for t, _ in case["timeline"]]
        gaps = [g for _, g in case["timeline"]]
        axis.plot(times, gaps, ".", color=COLORS[name], label=LABELS[name], alpha=0.7)
        if case["ttft_ms"]:
            axis.axvline(case["ttft_ms"] / 1000, color=COLORS[name], linestyle=":")
    axis.axvline(0, color="black", linewidth=0.8)
    axis.set_yscale("log")
    axis.set_xlabel(f"seconds since a {tokens}-token prompt arrived (dotted: its first token)")
    axis.set_ylabel("gap between a stream's chunks, ms")
    axis.set_title(f"{streams} running streams while a long prompt arrives")
    axis.grid(True, alpha=0.3)
    axis.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine_line(run: Run) -> str:
    m = run["machine"]
    line = (
        f"{m['cpu']}, {m['cores']} cores, {m['os']}; Python {m['python']}, "
        f"mlx {m['mlx']} ({m['mlx_device']}), mlx-lm {m['mlx_lm']}, grpcio {m['grpcio']}; "
        f"load average (1, 5, 15 min) {'/'.join(str(x) for x in m['load_average'])} at start"
    )
    if m.get("load_average_end"):
        line += f", {'/'.join(str(x) for x in m['load_average_end'])} at the end"
    if m.get("note"):
        line += f". {m['note']}"
    return line


def _parts(s: dict[str, Any]) -> dict[str, tuple[Callable[[], str], Callable[[Run], str]]]:
    """The parts after the sweep, by their key in a run: a title (from the settings) and
    a table."""
    shape, burst, cancel = s["shape"], s.get("burst", {}), s.get("cancel", {})
    prefix = s.get("prefix", {})
    return {
        "burst": (
            lambda: (
                f"### Staggered burst ({burst['clients']} clients {burst['stagger_s']} s "
                f"apart, {burst['per_client']} requests each back to back, {burst['max_tokens']} "
                f"new tokens; {burst.get('repeats', 1)} bursts per worker, the one with the median "
                "max ÷ p50 shown)"
            ),
            burst_table,
        ),
        "cancel": (
            lambda: (
                f"### Cancel and reuse (a stream cancelled after {cancel['cancel_after']} "
                f"tokens, then a {shape['prompt_tokens']}+{cancel['max_tokens']}-token request; "
                f"median of {cancel['repeats']})"
            ),
            cancel_table,
        ),
        "prefix": (
            lambda: (
                f"### Prefix reuse (a {prefix['prefix_tokens']}-token system prompt with a "
                f"{prefix['suffix_tokens']}-token turn, then the same system prompt with a new "
                f"turn, against a new system prompt; median of {prefix['repeats']})"
            ),
            prefix_table,
        ),
        "prefix_disk": (
            lambda: (
                "### Prefix store (ours): the same system prompt after a restart on the "
                "same --prompt-cache-dir, and the RAM bytes of 16 conversations sharing a "
                f"{prefix.get('shared_tokens', 1024)}-token prompt against one"
            ),
            prefix_store_table,
        ),
        "arrival": (
            lambda: (
                "### Long prompt arrival (k streams decoding, then one long prompt "
                "arrives; the streams' gaps between chunks before it and while it prefills, and "
                "its TTFT)"
            ),
            arrival_table,
        ),
    }


Sections = dict[str, tuple[Callable[[], str], Callable[[Run], str]]]


def render(run: Run, sections: Sections | None = None) -> str:
    """The whole report as markdown (what the terminal shows and RESULTS.md holds); `sections`:
    the parts whose modules render their own tables (bench/render_run.py has them), by key."""
    s = run["settings"]
    shape = s["shape"]
    parts = [
        f"Run {run['date']} (`{run['command']}`), model `{s['model_name']}`",
        "",
        f"Machine: {machine_line(run)}",
        "",
        *(
            [f"Our worker ran with `{' '.join(s['worker_flags'])}`.", ""]
            if s.get("worker_flags")
            else []
        ),
        f"### Sweep: output tokens/s, served ÷ raw ({shape['prompt_tokens']}-token prompts, "
        f"{shape['max_tokens']} new tokens, ignore_eos, temperature 0, sampling "
        f"`{s['sampling']}`, completion batch {s['batch']['completion_batch_size']}, "
        f"prefill batch {s['batch']['prefill_batch_size']}; {s.get('repeats', 1)} pairs of "
        "runs per level the hypervisor left alone, each a raw run and then each worker's on "
        "the same prompts)",
        "",
        headline_table(run),
        "",
        sweep_table(run),
    ]
    struck = any(
        r.get("disturbed")
        for levels in run["sweep"].values()
        for level in levels
        for r in level.get("extra", {}).get("rounds", [])
    )
    if struck:
        limit = s.get("steal_limit", 0.05)
        parts += [
            "",
            f"Struck-through pairs: the hypervisor took more than {limit:.0%} of the "
            "machine's CPU time (/proc/stat steal) while they ran, on the raw side or a "
            "worker's; they were run again and count only when no clean pair exists.",
        ]
    cached = {
        LABELS[name]: sum(level.get("cached_tokens", 0) for level in run["sweep"][name])
        for name in _workers(run)
    }
    if any(cached.values()):
        parts += [
            "",
            "Prompt tokens the workers reported as reused from a prompt cache (the random "
            "prompts share a first token now and then, so a few per level are expected): "
            + ", ".join(f"{name} {count}" for name, count in cached.items()),
        ]
    for key, (title, table) in {**_parts(s), **(sections or {})}.items():
        if run.get(key):
            parts += ["", title(), "", table(run)]
    return "\n".join(parts)


# --------------------------------------------------------------------------- files


def write_json(run: Run, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=2) + "\n")


def save_json(directory: Path, stem: str, data: Any) -> Path:
    """`data` as directory/STEM-STAMP.json (a part run alone); prints where it went."""
    path = directory / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    print(f"JSON: {path}")
    return path


def plot(run: Run, path: Path) -> bool:
    """Tokens/s and TTFT p50 against concurrency; False when matplotlib is missing or
    there is no sweep to draw."""
    plt = pyplot()
    if not any(run["sweep"].values()) or plt is None:
        return False
    import matplotlib.ticker

    levels = run["settings"]["levels"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in (RAW, *_workers(run)):
        points = _by_level(run["sweep"].get(name, []))
        xs = [c for c in levels if c in points]
        style = {"color": COLORS[name], "marker": "o", "label": LABELS[name]}
        if name == RAW:
            style["linestyle"] = "--"
        left.plot(xs, [points[c]["tokens_per_s"] for c in xs], **style)
        ttft = [(c, points[c]["ttft_p50_ms"]) for c in xs if points[c]["ttft_p50_ms"]]
        right.plot([c for c, _ in ttft], [v for _, v in ttft], **style)
    for axis, title, unit in (
        (left, "Output tokens/s", "tokens/s"),
        (right, "Time to first token, p50", "ms"),
    ):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    right.set_yscale("log")
    right.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    fig.suptitle(f"{run['settings']['model_name']} on {run['machine']['cpu']} ({run['date']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- the nightly

TREND_NIGHTS = 30  # nights a trend picture shows


def trend_pictures(
    records: list[dict[str, Any]], verdict: history.Verdict, out: Path
) -> list[Path]:
    """One PNG per metric: top, ours' speed ratio to the raw engine per night (the judged
    number); bottom, ours' own value. One line per scenario and level; tonight (the last
    record) ringed, its regressions crossed in red."""
    plt = pyplot()
    if plt is None:
        return []
    records = records[-TREND_NIGHTS:]
    keys = sorted(
        {k for r in records for k in history.results_by_key(r)},
        key=lambda k: (history.scenario_order(k[0]), k[1]),
    )
    bad = {(r.scenario, r.concurrency, r.metric) for r in verdict.regressions}
    bad_all = {(r.scenario, r.concurrency) for r in verdict.regressions if r.metric == "errors"}
    labels = [str(r.get("date", "?"))[5:16].replace("T", " ") for r in records]
    x = list(range(len(records)))
    paths = []
    for name, metric in history.METRICS.items():
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
        for key in keys:
            results = [history.results_by_key(r).get(key) or {} for r in records]
            ratio = [history.ratio_of(res, "raw", name) for res in results]
            value = [(res.get("ours") or {}).get(name) for res in results]
            label = f"{key[0]} c={key[1]}"
            (line,) = top.plot(x, [v if v is not None else float("nan") for v in ratio], "o-")
            line.set_label(label)
            bottom.plot(
                x,
                [v if v is not None else float("nan") for v in value],
                "o-",
                color=line.get_color(),
            )
            last = len(records) - 1
            for axis, series in ((top, ratio), (bottom, value)):
                if series and series[-1] is not None:
                    axis.plot(
                        [last], [series[-1]], "o", ms=13, mfc="none", mec=line.get_color(), mew=2
                    )
            flagged = (key[0], key[1], name) in bad or key in bad_all
            if flagged and ratio and ratio[-1] is not None:
                top.plot([last], [ratio[-1]], "x", ms=16, mew=3, color="red")
        for axis in (top, bottom):
            axis.axvline(len(records) - 1, color="grey", ls="--", lw=1)
            axis.grid(alpha=0.3)
            axis.set_ylim(bottom=0)  # from zero: a change looks as big as it is
        top.set_ylabel("speed ÷ raw engine\n(higher is better)")
        unit = "tokens/s" if metric.higher_is_better else "ms"
        bottom.set_ylabel(f"ours, {unit}")
        top.set_title(f"{metric.label}: nightly trend (tonight ringed, regressions crossed)")
        top.legend(fontsize=8, loc="best")
        bottom.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
        fig.tight_layout()
        path = out / f"trend-{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def html_page(
    record: dict[str, Any],
    verdict: history.Verdict,
    summary: str,
    trends: list[Path],
    out: Path,
    history_path: Path,
    numbers: str = "",
) -> Path:
    """index.html: the verdict, each system's numbers (a markdown table), the trend pictures,
    and links to genai-bench's plots."""
    e = html.escape
    rows = []
    for row, cells in zip(verdict.rows, history.verdict_cells(verdict), strict=True):
        colour = {"REGRESSION": "#fdd", "improved": "#dfd"}.get(row.mark, "")
        tds = "".join(f"<td>{e(c)}</td>" for c in cells)
        rows.append(f'<tr style="background:{colour}">{tds}</tr>')
    head = "".join(f"<th>{e(h)}</th>" for h in history.HEADERS)
    plots = sorted(p for p in out.rglob("*.png") if p not in trends)
    # genai-bench's plot names have spaces: quote them in the links.
    names = [str(p.relative_to(out)) for p in plots]
    links = "".join(f'<li><a href="{e(quote(n))}">{e(n)}</a></li>' for n in names)
    links = links or "<li>genai-bench wrote no plots</li>"
    images = "".join(
        f'<p><a href="{e(p.name)}"><img src="{e(p.name)}" style="max-width:100%"></a></p>'
        for p in trends
    )
    m = record["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in record["versions"].items() if v)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>mlx-grpc-worker nightly {e(record["date"])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:90%}}</style></head><body>
<h1>Nightly {e(record["date"])}: {e(summary)}</h1>
<p>Commit {e(str(record.get("commit")))}{" (dirty)" if record.get("dirty") else ""};
model {e(record["model"])}; {e(history.mode(record))} run;
{e(str(m.get("cpu")))}, {m.get("cores")} cores, GPU {e(str(m.get("gpu")))},
{m.get("memory_gib")} GiB; {e(versions)}.</p>
<p>Ratios are ours' speed ÷ the reference's (higher is better: tok/s ours ÷ reference, times
reference ÷ ours), judged against the last {verdict.window} nights of this machine, model and
mode ({verdict.nights} found). History: <code>{e(str(history_path))}</code>;
this night: <a href="record.json">record.json</a>, <a href="verdict.md">verdict.md</a>.</p>
<table><tr>{head}</tr>{"".join(rows)}</table>
<h2>Numbers</h2><pre>{e(numbers)}</pre>
<h2>Trends</h2>{images}
<h2>Tonight's genai-bench plots</h2><ul>{links}</ul>
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path


def update_results_md(markdown: str, path: Path = RESULTS_MD) -> None:
    """Replace the generated block of RESULTS.md (between the markers) with a run's
    `markdown`, keeping the rest."""
    block = f"{BEGIN}\n{markdown}\n{END}"
    if path.exists():
        text = path.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            path.write_text(head + block + tail)
            return
        path.write_text(text.rstrip() + "\n\n" + block + "\n")
        return
    path.write_text(f"# Benchmark results\n\n{block}\n")


def exit_now(code: int) -> None:
    """End a bench that ran MLX in its own process (as the worker's processes end): the
    interpreter's teardown races MLX's stream threads, which may still release arrays, and
    aborts the process now and then (`terminate called without an active exception`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
