"""A variable-length model (BERT, T5) as one AOTInductor package, as `compiler`
"aot" builds it: export with dynamic batch and lengths, compile with freezing,
load; then the loaded package against the eager model at a few shapes.

    python scripts/aot_package.py --models bert --device cpu --cache /tmp/aot --json aot.json

Run it twice with one --cache: the first compiles, the second only loads (the
build-time question of issue 16). Prints a line per model and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from opara_core import zoo
from opara_core.engine.compare import max_relative_error
from opara_core.engine.whole_model import WholeModelAOT
from opara_core.serving.varlen import aot_example, dynamic_dims

SHAPES = {1: [(1,), (16,), (300,), (512,)], 2: [(1, 1), (16, 16), (300, 100), (512, 128)]}


def measure(name: str, device: torch.device, cache: Path, max_batch: int) -> dict:
    entry = zoo.get(name)
    module = entry.build().to(device).eval()
    start = time.perf_counter()
    aot = WholeModelAOT(module, aot_example(entry, device), dynamic_dims(entry, max_batch), cache)
    seconds = time.perf_counter() - start
    errors = {}
    with torch.inference_mode():
        for lengths in SHAPES[len(entry.lengths)]:
            for batch in (1, 3):
                inputs = [t.to(device) for t in entry.at(lengths).example_inputs(batch, seed=7)]
                errors[f"{','.join(map(str, lengths))}x{batch}"] = max_relative_error(aot.runner(*inputs), module(*inputs))
    return {"model": name, "compiled": aot.compiled_now, "seconds": round(seconds, 2), "package": str(aot.path),
            "package_mb": round(aot.path.stat().st_size / 2**20, 1), "max_relative_error": errors}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert", help="comma-separated variable-length zoo models")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cache", type=Path, required=True, help="where the packages are kept")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in zoo.names() or not zoo.get(m).lengths]
    if unknown:
        parser.error(f"not variable-length zoo models: {unknown}")
    device = torch.device(args.device)
    rows = []
    for name in models:
        row = measure(name, device, args.cache, args.max_batch)
        print(f"{name}: {'compiled' if row['compiled'] else 'loaded'} in {row['seconds']:.1f} s, {row['package_mb']} MiB, "
              f"max relative error {max(row['max_relative_error'].values()):.2e}", flush=True)  # fmt: skip
        rows.append(row)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "command": " ".join(sys.argv)}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
