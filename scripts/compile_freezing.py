"""torch.compile with and without Inductor's freezing, default and max-autotune mode.

`python scripts/compile_freezing.py --models deepfm --batch 1 --json out.json`

Fused lanes compile segments whose weights are inputs (no freezing). Where
torch.compile's max-autotune beat segments compiled with the same options
(DeepFM at batch 1, docs/benchmarks.md run 13), this tells whether freezing,
the mode, or both make the difference: each variant compiled fresh, replayed
from a CUDA graph and timed as the bench times its columns.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from opara_core import zoo
from opara_core.bench import compiled_graph, graph_call, rotating_inputs, time_calls

VARIANTS = [(mode, freezing) for mode in ("default", "max-autotune-no-cudagraphs") for freezing in (True, False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="deepfm")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        print("error: compile_freezing needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    rows = []
    print("| model | batch | mode | freezing | median ms | p99 ms | compile s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        entry = zoo.get(name)
        module = entry.build().to(device).eval()
        for batch in (int(b) for b in args.batch.split(",")):
            inputs = rotating_inputs(entry, batch, device)
            for mode, freezing in VARIANTS:
                start = time.perf_counter()
                captured = compiled_graph(module, inputs, mode, freezing=freezing)  # compile, warm-up, capture
                seconds = time.perf_counter() - start
                with torch.inference_mode():
                    timing = time_calls(graph_call(captured, inputs))
                rows.append({"model": name, "batch": batch, "mode": mode, "freezing": freezing, "median_ms": timing.median_ms, "p99_ms": timing.p99_ms, "compile_s": seconds})
                print(f"| {name} | {batch} | {mode} | {freezing} | {timing.median_ms:.3f} | {timing.p99_ms:.3f} | {seconds:.0f} |", flush=True)
                del captured
                if args.json:
                    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
                    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
