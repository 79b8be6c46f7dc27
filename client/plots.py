"""Plots of bench and perf_analyzer results, written as PNG files.

Uses matplotlib's object API with a plain `Figure` (rendered by Agg), so no
pyplot state, no display and no backend switch happen anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure

PERCENTILE_STYLES = (("p50_ms", "p50", "-"), ("p90_ms", "p90", "--"), ("p99_ms", "p99", ":"))


def plot_bench(rows: Sequence[dict], path: Path, title: str) -> Path:
    """Latency percentiles (left) and throughput (right) against concurrency.
    `rows` are bench rows as dicts (as in the JSON file)."""
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    latency, throughput = fig.subplots(1, 2)
    concurrency = [r["concurrency"] for r in rows]
    for key, label, style in PERCENTILE_STYLES:
        points = [(c, r[key]) for c, r in zip(concurrency, rows) if r.get(key) is not None]
        if points:
            latency.plot(*zip(*points), style, marker="o", label=label)
    latency.set(xlabel="concurrency (requests in flight)", ylabel="latency (ms)", title="client latency")
    latency.set_ylim(bottom=0)
    latency.legend()
    throughput.plot(concurrency, [r["throughput_rps"] for r in rows], "-", marker="o", color="tab:green")
    throughput.set(xlabel="concurrency (requests in flight)", ylabel="requests / s", title="throughput")
    throughput.set_ylim(bottom=0)
    for axes in (latency, throughput):
        axes.set_xticks(concurrency)
        axes.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_latency_vs_throughput(series: Sequence[dict], path: Path, title: str) -> Path:
    """`latency_vs_throughput` saved as a PNG file."""
    latency_vs_throughput(series, title).savefig(path, dpi=110)
    return Path(path)


def latency_vs_throughput(series: Sequence[dict], title: str) -> Figure:
    """One latency-vs-throughput chart for several tools or runs.

    Each series is {"label": str, "points": [{"concurrency", "throughput", "p50_ms", "p99_ms"}]},
    throughput in inferences/s. Points are joined in throughput order (a line
    that runs left to right, even where more concurrency gave less throughput);
    p50 is drawn solid and p99 dashed, in the series' colour; each p50 point is
    labelled with its concurrency, on the side that keeps the label inside.
    """
    fig = Figure(figsize=(7.5, 5), layout="constrained")
    axes = fig.subplots()
    every = [p for s in series for p in s["points"]]
    right = max((p["throughput"] for p in every), default=1.0) or 1.0
    for index, s in enumerate(series):
        color = f"C{index}"
        points = sorted(s["points"], key=lambda p: (p["throughput"], p["concurrency"]))
        x = [p["throughput"] for p in points]
        for key, style, suffix in (("p50_ms", "-", "p50"), ("p99_ms", "--", "p99")):
            axes.plot(x, [p[key] for p in points], style, marker="o", color=color, label=f"{s['label']} {suffix}")
        for p in points:
            near_right = p["throughput"] > 0.85 * right
            axes.annotate(
                f"c={p['concurrency']}",
                (p["throughput"], p["p50_ms"]),
                textcoords="offset points",
                xytext=(-5 if near_right else 5, -11),
                ha="right" if near_right else "left",
                fontsize=8,
                color=color,
            )
    axes.set(xlabel="throughput (inferences / s)", ylabel="latency (ms)", title=title)
    axes.set_xlim(0, right * 1.08)
    axes.set_ylim(0, max((p["p99_ms"] for p in every), default=1.0) * 1.1)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    return fig
