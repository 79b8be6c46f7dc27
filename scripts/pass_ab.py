"""A fusion pass measured before it joins the fused-lanes graphs: the bench run
twice on one GPU, one process after the other, as the engine is and with PASSES
appended to `build.INDUCTOR_PASSES` and `build.INDUCTOR_CUDNN_PASSES` (the
graphs Inductor compiles for fused lanes and the whole-model graph); with
`--remove`, a pass already there measured against the engine without it.
Prints each (model, batch, column) with both medians and their ratio, and
writes JSON with both runs' rows. Everything after `--` goes to
`python -m opara_core.bench`.

    python scripts/pass_ab.py --passes depthwise_convs --json ab.json -- \\
        --models nasnet --batch 8,32 --columns "compile,fused sequential,fused opara,auto" --no-plan-capture

(Runs 24 and 25 in docs/benchmarks.md did this with untracked patch scripts.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def changed_passes(passes: list[str], remove: bool, bench_args: list[str]) -> int:
    """In this process: the bench with `passes` added to the fused-lanes graphs
    (or, with `remove`, taken out of them)."""
    from opara_core import bench
    from opara_core.engine import build

    if remove:
        build.INDUCTOR_PASSES = tuple(p for p in build.INDUCTOR_PASSES if p not in passes)
        build.INDUCTOR_CUDNN_PASSES = tuple(p for p in build.INDUCTOR_CUDNN_PASSES if p not in passes)
    else:
        build.INDUCTOR_PASSES += tuple(p for p in passes if p not in build.INDUCTOR_PASSES)
        build.INDUCTOR_CUDNN_PASSES += tuple(p for p in passes if p not in build.INDUCTOR_CUDNN_PASSES)
    return bench.main(bench_args)


def compare(without: list[dict], with_: list[dict]) -> list[dict]:
    """One entry per (model, batch, column) that both runs timed."""
    before = {(r["model"], r["batch"]): r for r in without}
    found = []
    for row in with_:
        old = before.get((row["model"], row["batch"]))
        if old is None:
            continue
        for column, timing in row["timings"].items():
            if timing is not None and old["timings"].get(column) is not None:
                a, b = old["timings"][column]["median_ms"], timing["median_ms"]
                found.append({"model": row["model"], "batch": row["batch"], "column": column, "without_ms": a, "with_ms": b, "ratio": b / a})
    return found


def table(found: list[dict], passes: list[str]) -> str:
    lines = [f"| model | batch | column | without ms | with {'+'.join(passes)} ms | with / without |", "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {f['model']} | {f['batch']} | {f['column']} | {f['without_ms']:.3f} | {f['with_ms']:.3f} | {f['ratio']:.3f} |" for f in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", required=True, help="fusion passes to add (with --remove: to take out), comma-separated (engine.fusion.PASSES)")
    parser.add_argument("--remove", action="store_true", help="measure passes already in the fused-lanes graphs against the engine without them")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one bench run with the passes, in this process
    args = parser.parse_args(ours)
    from opara_core.engine.fusion import PASSES

    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    unknown = [p for p in passes if p not in PASSES]
    if not passes or unknown:
        print(f"error: --passes: unknown {unknown or 'none given'}; the passes are {', '.join(PASSES)}", file=sys.stderr)
        return 2
    from opara_core.engine import build

    present = [p for p in passes if p in build.INDUCTOR_PASSES or p in build.INDUCTOR_CUDNN_PASSES]
    if args.remove and len(present) < len(passes):
        print(f"error: --remove: {sorted(set(passes) - set(present))} in neither fused-lanes graph's passes: {', '.join(build.INDUCTOR_CUDNN_PASSES)}", file=sys.stderr)
        return 2
    if not args.remove and all(p in build.INDUCTOR_PASSES and p in build.INDUCTOR_CUDNN_PASSES for p in passes):
        print(f"error: {', '.join(passes)} already in both fused-lanes graphs' passes: measure with --remove", file=sys.stderr)
        return 2
    if args.child:
        return changed_passes(passes, args.remove, bench_args)
    if "--json" in bench_args:
        print("error: give --json before `--` (this script writes both runs' rows)", file=sys.stderr)
        return 2
    runs = {}
    with tempfile.TemporaryDirectory(prefix="pass-ab-") as tmp:
        # each run's rows beside --json as the bench writes them, so that a run cut short keeps what it measured
        folder, stem = (args.json.parent, args.json.stem) if args.json else (Path(tmp), "ab")
        changed = ["--passes", ",".join(passes), "--child", *(["--remove"] if args.remove else [])]
        for name, extra in ((("with", []), ("without", changed)) if args.remove else (("without", []), ("with", changed))):
            out = folder / f"{stem}.{name}.json"
            command = [sys.executable, "-m", "opara_core.bench"] if not extra else [sys.executable, __file__, *extra, "--"]
            code = subprocess.call([*command, *bench_args, "--json", str(out)], cwd=ROOT)
            if code != 0 or not out.exists():
                print(f"error: the bench {name} {'+'.join(passes)} exited {code}", file=sys.stderr)
                return code or 1
            runs[name] = json.loads(out.read_text())["rows"]
    found = compare(runs["without"], runs["with"])
    print(table(found, passes))
    if args.json:
        args.json.write_text(json.dumps({"passes": passes, "bench_args": bench_args, "compared": found, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
