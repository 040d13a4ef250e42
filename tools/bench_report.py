"""The report of tools/bench_serving.py: percentiles, the per-server summary of a run,
and the side-by-side table (A, B, A/B)."""
from __future__ import annotations

import math

from bench_client import RequestResult

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(math.floor(pos))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """Mean, median, p99 and max in milliseconds; None each when there is nothing to measure."""
    ms = [v * 1000.0 for v in values]
    if not ms:
        return {"mean": None, "median": None, "p99": None, "max": None}
    return {"mean": sum(ms) / len(ms), "median": percentile(ms, 50), "p99": percentile(ms, 99),
            "max": max(ms)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Aggregate metrics over the completed requests of one or more rounds lasting `duration` s."""
    done = [r for r in results if r.ok]
    with_usage = [r for r in done if r.completion_tokens is not None]
    out_tokens = sum(r.completion_tokens for r in with_usage)
    in_tokens = sum(r.prompt_tokens or 0 for r in with_usage)
    cached = [r.cached_tokens for r in with_usage if r.cached_tokens is not None]
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "no_usage": len(done) - len(with_usage), "duration_s": duration,
        "prompt_tokens": in_tokens, "completion_tokens": out_tokens,
        "cached_tokens": sum(cached) if cached else None,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "ttft_cold_ms": stats_ms([r.ttft for r in done if r.warm is False]),
        "ttft_warm_ms": stats_ms([r.ttft for r in done if r.warm]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([g for r in done for g in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in done]),
    }


ROWS = [("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
        ("no_usage", "no usage in reply", "{:.0f}"), ("duration_s", "duration (s)", "{:.2f}"),
        ("prompt_tokens", "prompt tokens (usage)", "{:.0f}"),
        ("completion_tokens", "completion tokens (usage)", "{:.0f}"),
        ("cached_tokens", "cached prompt tokens", "{:.0f}"),
        ("request_throughput", "requests/s", "{:.3f}"),
        ("output_throughput", "output tokens/s", "{:.2f}"),
        ("total_throughput", "total tokens/s", "{:.2f}"),
        ("worker_busy_share", "worker busy / wall (/metrics)", "{:.3f}"),
        ("server_cache_hit_rate", "cached / prompt tokens (/metrics)", "{:.3f}")]
ROWS += [(f"server_tier_hit_rate.{t}", f"  of which from {t} (/metrics)", "{:.3f}") for t in ("pool", "host", "disk")]
ROWS += [(f"cpu_s.{p}", f"CPU s, {p}", "{:.1f}") for p in ("worker", "scheduler", "frontend", "client")]
ROWS += [(f"{m}_ms.{s}", f"{m.upper()} {s} (ms)", "{:.2f}")
         for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "median", "p99")]
# TTFT split by cache hit (warm: at least half the prompt was cached); "-" where the server
# reports no cached_tokens or no request fell on that side.
_AFTER_TTFT = ROWS.index(("ttft_ms.p99", "TTFT p99 (ms)", "{:.2f}")) + 1
ROWS[_AFTER_TTFT:_AFTER_TTFT] = [("ttft_ms.max", "TTFT max (ms)", "{:.2f}")] + [(f"ttft_{k}_ms.{s}", f"TTFT {k} {s} (ms)", "{:.2f}")
                                 for k in ("cold", "warm") for s in ("mean", "median")]


def lookup(summary: dict, key: str):
    for part in key.split("."):
        summary = summary.get(part) if isinstance(summary, dict) else None
    return summary


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def format_table(summaries: dict[str, dict]) -> str:
    names = list(summaries)
    headers = ["metric"] + names + (["A/B"] if len(names) == 2 else [])
    rows = []
    for key, label, fmt in ROWS:
        values = [lookup(summaries[n], key) for n in names]
        cells = [fmt.format(v) if isinstance(v, (int, float)) else "-" for v in values]
        if len(names) == 2:
            r = ratio(*values)
            cells.append(f"{r:.3f}" if r is not None else "-")
        rows.append([label] + cells)
    widths = [max(len(str(row[i])) for row in rows + [headers]) for i in range(len(headers))]
    line = lambda row: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                 for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([line(headers), "-" * (sum(widths) + 2 * len(widths) - 2)] + [line(r) for r in rows])
