"""How fast does a saved Inductor segment load, and can it load faster? (GPU for
the replay times; the rest runs on the CPU too.)

NASNet's warm build loads 441-446 Inductor artifacts at a fixed ~15-22 ms each
(docs/benchmarks.md runs 30, 34 and 35), 6.8-9.6 s of a build the issue wants
under 10 s. This probe compiles NASNet-like cells (`dynamic_batch_probe.cell`)
with `torch._inductor.standalone_compile` at one batch size, twice each: as
segment_compiler saves them today and with `aot=True` (a bundled callable that
needs nothing from Inductor's caches), in one Inductor cache directory, as a
cold build leaves it. Then, each in a new process on that cache, as a warm
build loads them:

- `public`: `CompiledArtifact.load` (segment_compiler's load until run 35): it
  writes every entry of the artifact into Inductor's caches again
  (`load_cache_artifacts`), then looks the compiled graph up there;
- `lookup`: the same files, only the lookup (`segment_compiler.load_from_cache`,
  what a warm build does since run 35), the cache entries being there already;
- `aot`: the `aot=True` artifacts through `CompiledArtifact.load`.

For each artifact: its load seconds, its first call's seconds (work a loader
defers lands there), its answer against the eager cell and, on a GPU, the
median replay time of 20 calls in one CUDA graph.

    python scripts/artifact_load_probe.py --out probe/ --cells 30    # ~2-3 minutes on an H200

Prints a table and writes OUT/artifact_load_probe.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opara_core.engine.segment_compiler import load_from_cache  # noqa: E402

MODES = ("public", "lookup", "aot")


def _cells():
    """scripts/dynamic_batch_probe.py: the cell, its inputs and its graph."""
    name = "dynamic_batch_probe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def compile_artifacts(folder: Path, device: str, cells: int, batch: int) -> dict[str, float]:
    """`c{cell}.bin` (as segment_compiler saves) and `a{cell}.bin` (aot=True),
    and one warm-up cell of each kind; returns each artifact's compile seconds."""
    probe = _cells()
    folder.mkdir(parents=True, exist_ok=True)
    seconds = {}
    for variant in range(cells + 1):  # the last: the warm-up cell, whose first load pays the imports
        inputs = probe.example_inputs(batch, device)
        graph = probe.static_graph(variant, inputs)
        for prefix, aot in (("c", False), ("a", True)):
            name = f"{prefix}{variant}" if variant < cells else f"w{prefix}"
            start = time.perf_counter()
            with torch.inference_mode():
                artifact = torch._inductor.standalone_compile(graph, inputs, dynamic_shapes="from_example_inputs", aot=aot)
            artifact.save(path=str(folder / f"{name}.bin"), format="binary")
            seconds[name] = round(time.perf_counter() - start, 3)
    return seconds


def load_and_run(folder: Path, device: str, batch: int, mode: str) -> dict:
    """In a new process: load every artifact of `mode`, call it once, check it
    against the eager cell and time its replays on a GPU."""
    probe = _cells()
    prefix = "a" if mode == "aot" else "c"
    load = load_from_cache if mode == "lookup" else (lambda path: torch._inductor.CompiledArtifact.load(path=str(path), format="binary"))
    with torch.inference_mode():
        torch._inductor.CompiledArtifact.load(path=str(folder / f"w{prefix}.bin"), format="binary")(*probe.example_inputs(batch, device))
    result = {}
    for path in sorted(folder.glob(f"{prefix}[0-9]*.bin")):
        variant = int(path.stem[1:])
        inputs = probe.example_inputs(batch, device)
        start = time.perf_counter()
        compiled = load(path)
        loaded = time.perf_counter()
        with torch.inference_mode():
            got = compiled(*inputs)[0]
            if device == "cuda":
                torch.cuda.synchronize()
            called = time.perf_counter()
            want = probe.cell(variant)(*inputs)[0]
            entry = {"load_s": round(loaded - start, 5), "first_call_s": round(called - loaded, 5), "relative_error": ((got - want).abs().max() / want.abs().max()).item()}
            if device == "cuda":
                entry["replay_ms"] = round(probe.replay_ms(compiled, inputs), 5)
        result[path.stem] = entry
    return result


def table(result: dict) -> str:
    lines = ["| mode | artifacts | load ms (mean) | first call ms (mean) | replay ms (mean) | worst relative error |", "|---|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        runs = result["modes"].get(mode)
        if not isinstance(runs, dict):
            lines.append(f"| {mode} | failed: {str(runs)[:200]} | | | | |")
            continue
        mean = lambda key: statistics.mean(r[key] for r in runs.values()) if runs and all(key in r for r in runs.values()) else float("nan")  # noqa: E731
        lines.append(
            f"| {mode} | {len(runs)} | {1e3 * mean('load_s'):.2f} | {1e3 * mean('first_call_s'):.2f} | {mean('replay_ms'):.4f} | "
            f"{max(r['relative_error'] for r in runs.values()):.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cells", type=int, default=30, help="distinct cells, each compiled twice (as today and with aot=True)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error("--batch must be at least 2 (Inductor specializes a dimension of size 1)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = args.out / "artifacts"
    if args.child:
        print(json.dumps(load_and_run(folder, device, args.batch, args.child)))
        return 0
    probe = _cells()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(args.out / "inductor")}
    with probe.inductor_cache(env["TORCHINDUCTOR_CACHE_DIR"]):  # the cache the loading processes read, as a cold build leaves it
        compiled = compile_artifacts(folder, device, args.cells, args.batch)
    modes = {}
    for mode in MODES:
        command = [sys.executable, __file__, "--out", str(args.out), "--batch", str(args.batch), "--child", mode]
        child = subprocess.run(command, env=env, capture_output=True, text=True)
        modes[mode] = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else f"exit {child.returncode}: {child.stderr[-2000:]}"
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__, "cells": args.cells,
              "batch": args.batch, "compile_s": compiled, "modes": modes}  # fmt: skip
    (args.out / "artifact_load_probe.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0 if all(isinstance(m, dict) for m in modes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
