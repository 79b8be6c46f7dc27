"""One-kernel segments in ATen against Inductor: replays and warm build (GPU).

`segment_compiler.MIN_KERNELS_TO_COMPILE` decides which fused-lanes segments
Inductor compiles: 1 compiles every segment (the engine today), 2 leaves
segments of one kernel to their ATen operator (nothing to fuse there; NASNet's
warm build loads ~430 artifacts, about half its segments one kernel:
docs/benchmarks.md run 36). This runs, for one threshold, in a cache directory
of its own and each step in a new process with the threshold set:

1. the bench's fused-lanes columns and `auto` at the given batch sizes (their
   replays; the segments compiled on the way);
2. the serving build of all buckets three times (`--build-only`): the first
   compiles what step 1 did not need, the second and third are warm builds.

Run it once per threshold (side by side on two GPUs, or one after the other),
then `--report` the two JSON files:

    python scripts/segment_threshold_ab.py nasnet --threshold 1 --cache /tmp/ab/t1 --json ab1.json
    python scripts/segment_threshold_ab.py nasnet --threshold 2 --cache /tmp/ab/t2 --json ab2.json
    python scripts/segment_threshold_ab.py --report ab1.json ab2.json

A cut run started again reuses what its cache directory holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = "fused sequential,fused opara,fused opara cudnn,auto"
CHILD = "--child"


def child(threshold: int, bench_args: list[str]) -> int:
    """In this process: the bench with the threshold set."""
    sys.path.insert(0, str(ROOT))
    from opara_core import bench
    from opara_core.engine import segment_compiler

    segment_compiler.MIN_KERNELS_TO_COMPILE = threshold
    return bench.main(bench_args)


def _run(threshold: int, cache: Path, bench_args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPARA_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    command = [sys.executable, __file__, CHILD, str(threshold), *bench_args]
    return subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, timeout=3600)


def measure(model: str, threshold: int, batches: str, cache: Path, rows_json: Path) -> dict:
    """Steps 1 and 2 (module docstring); the result as written to --json."""
    cache.mkdir(parents=True, exist_ok=True)
    bench = _run(threshold, cache, ["--models", model, "--batch", batches, "--columns", COLUMNS, "--cache-dir", str(cache), "--no-plan-capture", "--json", str(rows_json)])
    if bench.returncode != 0:
        raise RuntimeError(f"the bench with threshold {threshold} failed (exit {bench.returncode}); its log is above")
    builds = []
    for _ in range(3):
        build = _run(threshold, cache, ["--build-only", model])
        if build.returncode != 0:
            raise RuntimeError(f"a serving build with threshold {threshold} failed (exit {build.returncode}); its log is above")
        builds.append(json.loads(build.stdout.strip().splitlines()[-1]))
    return {"model": model, "threshold": threshold, "bench": json.loads(rows_json.read_text()), "builds": builds}


def build_total(report: dict) -> float:
    """The bench's build seconds (tracing excluded): opara_core.bench._build_total."""
    return sum(v for k, v in report["seconds"].items() if k in ("fusion", "profile", "plan+capture", "capture"))


def table(results: list[dict]) -> str:
    """Per threshold: the warm builds' seconds and what they loaded, then each
    (batch, column)'s median replay in ms."""
    lines = ["| threshold | warm build s | second warm s | segments loaded (warm) |", "|---:|---:|---:|---|"]
    for result in results:
        _, warm, again = result["builds"]
        lines.append(f"| {result['threshold']} | {build_total(warm):.1f} | {build_total(again):.1f} | {warm['inductor']} |")
    timings: dict[tuple[int, str], dict[int, float]] = {}
    for result in results:
        for row in result["bench"]["rows"]:  # the bench's JSON as it wrote it
            for column, timing in row["timings"].items():
                if timing is not None:
                    timings.setdefault((row["batch"], column), {})[result["threshold"]] = timing["median_ms"]
    thresholds = [r["threshold"] for r in results]
    lines += ["", "| batch | column | " + " | ".join(f"ms, threshold {t}" for t in thresholds) + " |", "|---:|---|" + "---:|" * len(thresholds)]
    for (batch, column), by in sorted(timings.items()):
        lines.append(f"| {batch} | {column} | " + " | ".join(f"{by[t]:.3f}" if t in by else "-" for t in thresholds) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD]:
        return child(int(argv[1]), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--threshold", type=int, help="segment_compiler.MIN_KERNELS_TO_COMPILE for this run (1 or more)")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--cache", type=Path, help="this threshold's cache directory (kept: a run started again reuses it)")
    parser.add_argument("--json", type=Path, help="where this run's result goes")
    parser.add_argument("--report", type=Path, nargs="+", help="no run: the table of these results")
    args = parser.parse_args(argv)
    if args.report:
        print(table([json.loads(path.read_text()) for path in args.report]))
        return 0
    if not args.model or args.threshold is None or args.threshold < 1 or not args.cache or not args.json:
        parser.error("a run needs MODEL, --threshold (1 or more), --cache and --json")
    try:
        result = measure(args.model, args.threshold, args.batch, args.cache, args.json.with_suffix(".rows.json"))
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    args.json.write_text(json.dumps(result, indent=1))
    print(table([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
