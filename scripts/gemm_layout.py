"""Which weight layout cuBLAS runs fastest for a model's linear layers.

`python scripts/gemm_layout.py --models bert,t5 --batch 1,8,32 --json out/gemm_layout.json`

Run 10's kernel profile (docs/benchmarks.md) found BERT's batch-32 gap to
torch.compile in one GEMM: compile ran the feed-forward down-projection as
cuBLAS's `nn` kernel, fused lanes' segments as the `tn` one (they take the
weight [N, K] as an input and multiply by its transpose), 0.44 ms slower.
Freezing folds weights in as constants (it may store them transposed) and
Inductor moves the bias into the next kernel (`mm`, not `addmm`). This script
times each linear layer's GEMM, at the shapes the model really runs (recorded
with forward hooks, one eager call per batch; layers reading one tensor are
also timed merged, as the `merge_linears` pass runs them), four ways:
`addmm(b, x, w.t())` (what segments run today), `addmm(b, x, wt)` with `wt` the
transposed weight stored contiguous, and `mm` of each; each inside one CUDA
graph of 20 calls, median of 7 replays. What it says did not carry over to the
model: a fusion pass that stored weights transposed where this measured them
faster made BERT slower in every column on the H100 (docs/benchmarks.md run 11;
repeated calls on one weight keep it in L2, the model reads it once), and was
reverted. Read it as a per-GEMM hint, not a verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from opara_core import zoo

CALLS = 20
REPEATS = 7
VARIANTS = ("addmm w.t()", "addmm wt", "mm w.t()", "mm wt")


def linear_shapes(name: str, batch: int, device: torch.device | str = "cuda") -> list[dict[str, Any]]:
    """(M, K, N) of every linear layer in one eager call at `batch`, counted,
    plus each group of layers that read one tensor, merged (N summed)."""
    entry = zoo.get(name)
    module = entry.build().to(device).eval()
    seen: list[tuple[torch.Tensor, int, int, int]] = []  # (input, M, K, N); inputs kept alive, so no two share an id

    def hook(layer: torch.nn.Linear, args: tuple, _output: Any) -> None:
        x = args[0]
        seen.append((x, x.numel() // x.shape[-1], layer.in_features, layer.out_features))

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, torch.nn.Linear)]
    with torch.inference_mode():
        module(*(t.to(device) for t in entry.example_inputs(batch, seed=0)))
    for handle in handles:
        handle.remove()
    counts: dict[tuple[int, int, int], int] = defaultdict(int)
    groups: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for x, m, k, n in seen:
        counts[(m, k, n)] += 1
        groups[id(x)].append((m, k, n))
    for members in groups.values():
        if len(members) > 1 and len({(m, k) for m, k, _ in members}) == 1:
            m, k, _ = members[0]
            counts[(m, k, sum(n for *_, n in members))] += 1
    return [{"M": m, "K": k, "N": n, "uses": uses} for (m, k, n), uses in sorted(counts.items())]


def replay_us(call: Callable[[], Any]) -> float:
    """Microseconds per call: CALLS calls captured in one CUDA graph."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(samples)


def time_shape(m: int, k: int, n: int) -> dict[str, float]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=generator)
    w = torch.randn(n, k, device="cuda", generator=generator)
    b = torch.randn(n, device="cuda", generator=generator)
    wt = w.t().contiguous()
    calls = {
        "addmm w.t()": lambda: torch.addmm(b, x, w.t()),
        "addmm wt": lambda: torch.addmm(b, x, wt),
        "mm w.t()": lambda: torch.mm(x, w.t()),
        "mm wt": lambda: torch.mm(x, wt),
    }
    return {label: replay_us(call) for label, call in calls.items()}


def table(rows: list[dict[str, Any]]) -> str:
    head = ["model", "batch", "M", "K", "N", "uses", *(f"{v} us" for v in VARIANTS), "addmm wt / w.t()"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["batch"], r["M"], r["K"], r["N"], r["uses"], *(f"{r['us'][v]:.1f}" for v in VARIANTS)]
        cells.append(f"{r['us']['addmm wt'] / r['us']['addmm w.t()']:.3f}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,t5")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        jobs = [(zoo.get(m).name, int(b)) for m in args.models.split(",") for b in args.batch.split(",")]
    except (KeyError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the GEMM layout benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for name, batch in jobs:
        for shape in linear_shapes(name, batch):
            rows.append({"model": name, "batch": batch, **shape, "us": time_shape(shape["M"], shape["K"], shape["N"])})
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, fp32 (matmul TF32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'})")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
