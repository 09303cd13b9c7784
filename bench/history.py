"""The nightly's history and verdict: plain data in, plain data out (no MLX, no processes).

A history is a JSON-lines file, one record per night (see `bench/README.md`, nightly.py).
Every metric is also kept as a *speed ratio* to a same-run reference (the raw engine, and the
peer with --side-by-side), oriented so that higher is better for every metric:

- tok/s: ours ÷ reference;
- TTFT p50, TTFT p99, TPOT, E2E (times): reference ÷ ours.

1.0 means "as fast as the reference"; 0.5 means "half as fast". A ratio cancels most of the
machine's drift from night to night, since the reference ran minutes apart from ours on the
same machine.

The verdict compares tonight's ratios with the recent spread: the last `window` (7) records
of the same machine, model and mode (quick, full, or an ad-hoc run's settings) that have that
ratio. A ratio below the recent minimum * (1 - margin) is a regression; above the recent
maximum * (1 + margin) an improvement. Errors, failed runs and router vetoes are regressions
by themselves, whatever the history says. A night with no comparable history (the first night)
has no ratio verdicts.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 1
WINDOW = 7


@dataclass(frozen=True)
class Metric:
    label: str
    higher_is_better: bool  # of the raw value (tok/s); the ratio is always higher-is-better
    margin: float  # how far below the recent minimum a ratio may fall before it regresses


# The margins: how much worse than the worst of the recent nights a ratio may be, as a share of
# it. Set from the spread seen on the shared 2-core test machine: two back-to-back quick runs
# of one commit moved tok/s, TPOT and E2E ratios by up to 35 % while neighbours ran (ours is
# three processes, router and client included, and feels their load more than the raw engine
# does), by 5 % on a quiet machine; TTFT, one prefill per request, swings more, and its p99
# (the worst of a few dozen) most (38 % on the quiet one). A slower worker still shows: 3 ms
# more per step cut these ratios by 67-79 %. On a quiet dedicated machine `--margin 0.15`
# catches smaller regressions.
METRICS: dict[str, Metric] = {
    "tok_s": Metric("tok/s", True, 0.40),
    "ttft_p50": Metric("TTFT p50", False, 0.50),
    "ttft_p99": Metric("TTFT p99", False, 0.60),
    "tpot": Metric("TPOT", False, 0.40),
    "e2e": Metric("E2E", False, 0.40),
}


def speed_ratio(metric: str, ours: float | None, reference: float | None) -> float | None:
    """Ours as a fraction of the reference's speed (higher is better); None when unknown."""
    if ours is None or reference is None or ours <= 0 or reference <= 0:
        return None
    if METRICS[metric].higher_is_better:
        return ours / reference
    return reference / ours


def ratios(ours: dict[str, Any], reference: dict[str, Any]) -> dict[str, float | None]:
    return {name: speed_ratio(name, ours.get(name), reference.get(name)) for name in METRICS}


# --------------------------------------------------------------------------- reading, writing


def read_history(path: Path) -> list[dict[str, Any]]:
    """Every record in the file, oldest first. A line that is not a JSON object (a torn write,
    a hand edit) is skipped; fields this code does not know are kept and ignored."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One line, appended: the file is never rewritten, so a crash loses at most tonight."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        file.write(json.dumps(record, sort_keys=True) + "\n")


def machine_key(record: dict[str, Any]) -> str:
    m = record.get("machine") or {}
    parts = [m.get("cpu"), m.get("cores"), m.get("gpu"), m.get("memory_gib")]
    return " | ".join(str(p) for p in parts)


def mode(record: dict[str, Any]) -> str:
    """The record's mode: quick, full, or an ad-hoc run's "custom: SETTINGS" (a record from
    before modes has only `quick`)."""
    return record.get("mode") or ("quick" if record.get("quick") else "full")


def comparable(record: dict[str, Any], other: dict[str, Any]) -> bool:
    """Same machine, model and mode: the only records a night is judged by."""
    return (
        machine_key(record) == machine_key(other)
        and record.get("model") == other.get("model")
        and mode(record) == mode(other)
    )


def results_by_key(record: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """A record's results keyed by (scenario, concurrency); malformed entries skipped."""
    out = {}
    for result in record.get("results") or []:
        if not isinstance(result, dict):
            continue
        scenario, level = result.get("scenario"), result.get("concurrency")
        if isinstance(scenario, str) and isinstance(level, int):
            out[(scenario, level)] = result
    return out


def ratio_of(result: dict[str, Any], reference: str, metric: str) -> float | None:
    value = ((result.get("ratio") or {}).get(reference) or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) else None


# --------------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Row:
    """One line of the verdict table."""

    scenario: str
    concurrency: int
    metric: str  # a METRICS key, or "errors" for errors/failures/vetoes
    reference: str  # "raw", "smg"; "" for the errors row
    tonight: float | None
    value: float | None  # ours, raw (tok/s or ms); for "errors": errors + vetoes
    median: float | None = None
    low: float | None = None
    high: float | None = None
    nights: int = 0
    mark: str = "new"  # "new", "ok", "REGRESSION", "improved"
    note: str = ""

    @property
    def change(self) -> float | None:
        if self.tonight is None or not self.median:
            return None
        return self.tonight / self.median - 1


@dataclass(frozen=True)
class Verdict:
    rows: list[Row]
    nights: int  # comparable earlier records
    window: int

    @property
    def regressions(self) -> list[Row]:
        return [row for row in self.rows if row.mark == "REGRESSION"]

    @property
    def regressed(self) -> bool:
        return bool(self.regressions)

    def regressed_scenarios(self) -> list[str]:
        seen: dict[str, None] = {}
        for row in self.regressions:
            seen[f"{row.scenario} c={row.concurrency}"] = None
        return list(seen)


def judge_ratio(
    tonight: float | None, recent: Sequence[float], margin: float
) -> tuple[str, float | None, float | None, float | None]:
    """(mark, median, low, high) of one ratio against its recent values."""
    if not recent:
        return "new", None, None, None
    median, low, high = statistics.median(recent), min(recent), max(recent)
    if tonight is None:
        return "REGRESSION", median, low, high  # it had a value before: the run failed
    if tonight < low * (1 - margin):
        return "REGRESSION", median, low, high
    if tonight > high * (1 + margin):
        return "improved", median, low, high
    return "ok", median, low, high


def verdict(
    tonight: dict[str, Any],
    history: Iterable[dict[str, Any]],
    *,
    window: int = WINDOW,
    margins: dict[str, float] | None = None,
) -> Verdict:
    """Judge tonight's record against the last `window` comparable records in `history`
    (which must not hold tonight's). `margins` overrides METRICS' per-metric margins."""
    margin_of = {name: metric.margin for name, metric in METRICS.items()} | (margins or {})
    earlier = [r for r in history if comparable(tonight, r)][-window:]
    earlier_results = [results_by_key(r) for r in earlier]
    rows: list[Row] = []
    for (scenario, level), result in results_by_key(tonight).items():
        ours = result.get("ours") or {}
        errors = int(ours.get("errors") or 0)
        vetoes = int(ours.get("vetoes") or 0)
        failed = ours.get("failed")
        problems = []
        if failed:
            first = str(failed).strip().splitlines()[0] if str(failed).strip() else "?"
            problems.append(f"failed: {first[:160]}")
        if errors:
            problems.append(f"{errors} errors")
        if vetoes:
            problems.append(f"{vetoes} router vetoes")
        rows.append(
            Row(
                scenario,
                level,
                "errors",
                "",
                None,
                float(errors + vetoes),
                mark="REGRESSION" if problems else "ok",
                note="; ".join(problems) or "no errors, no vetoes",
            )
        )
        references = sorted((result.get("ratio") or {}).keys(), key=lambda r: (r != "raw", r))
        for reference in references:
            for metric in METRICS:
                now = ratio_of(result, reference, metric)
                recent = [
                    value
                    for past in earlier_results
                    if (scenario, level) in past
                    and (value := ratio_of(past[(scenario, level)], reference, metric)) is not None
                ]
                mark, median, low, high = judge_ratio(now, recent, margin_of[metric])
                if now is None and not recent:
                    continue
                rows.append(
                    Row(
                        scenario,
                        level,
                        metric,
                        reference,
                        now,
                        ours.get(metric),
                        median,
                        low,
                        high,
                        len(recent),
                        mark,
                        f"below {low * (1 - margin_of[metric]):.3f}"
                        if mark == "REGRESSION" and low is not None
                        else "",
                    )
                )
    rows.sort(key=lambda row: (scenario_order(row.scenario), row.concurrency))
    return Verdict(rows, len(earlier), window)


def scenario_order(scenario: str) -> tuple[int, ...]:
    """D(100,100) before D(1000,100): by the numbers in the name."""
    digits = "".join(c if c.isdigit() else " " for c in scenario)
    return tuple(int(n) for n in digits.split())


# --------------------------------------------------------------------------- the table


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADERS = [
    "scenario",
    "conc",
    "metric",
    "ours",
    "vs",
    "tonight",
    "recent median",
    "recent range",
    "n",
    "change",
    "verdict",
]


def verdict_cells(v: Verdict) -> list[list[str]]:
    """The verdict table's rows as strings (HEADERS' columns), for the terminal and the page."""
    cells = []
    for row in v.rows:
        if row.metric == "errors":
            blank = [""] * 7
            mark = f"{row.mark} ({row.note})"
            cells.append([row.scenario, str(row.concurrency), "errors+vetoes", *blank, mark])
            cells[-1][3] = _num(row.value, 0)
            continue
        change = row.change
        cells.append(
            [
                row.scenario,
                str(row.concurrency),
                METRICS[row.metric].label,
                _num(row.value, 1),
                row.reference,
                _num(row.tonight),
                _num(row.median),
                "-" if row.low is None else f"{row.low:.3f}-{row.high:.3f}",
                str(row.nights),
                "-" if change is None else f"{change:+.0%}",
                row.mark + (f" ({row.note})" if row.note else ""),
            ]
        )
    return cells


def verdict_table(v: Verdict) -> str:
    cells = [HEADERS, *verdict_cells(v)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEADERS))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def verdict_summary(v: Verdict) -> str:
    """The one-paragraph answer: regression or not, and where."""
    if v.regressed:
        names = ", ".join(v.regressed_scenarios())
        what = sorted(
            {METRICS[r.metric].label if r.metric in METRICS else r.note for r in v.regressions}
        )
        return f"REGRESSION in {names}: {'; '.join(what)}"
    if v.nights == 0:
        return (
            "no regression: first night for this machine, model and mode "
            "(no history to compare with; tonight's record starts it)"
        )
    improved = sorted({f"{r.scenario} c={r.concurrency}" for r in v.rows if r.mark == "improved"})
    text = f"no regression against the last {v.nights} comparable night(s)"
    if improved:
        text += f"; improved: {', '.join(improved)}"
    return text
