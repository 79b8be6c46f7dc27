"""How long the whole-model compile takes to start, cold and warm, with and without
Inductor's freezing: what bounds a variable-length model's warm build (issue 16).

    python scripts/warm_compile.py --models bert --device cpu --json out/warm_compile.json

For each model and setting, two fresh processes share one empty cache directory
(Inductor's and Triton's): the first starts cold, the second warm. Each builds the
model, compiles it as the served graph does (`torch.compile(dynamic=True)` under
`inference_mode`; on a CPU without mkldnn weight prepacking, as the tests compile
it) and times its first call at 2 x 40 tokens (T5: 40 encoder, 16 decoder), which
is where Dynamo, AOTAutograd and Inductor run. It reports the seconds, Inductor's
FX-graph-cache and AOTAutograd-cache counters (with freezing on, torch bypasses
AOTAutograd's cache, so a warm start traces the model again), and the cumulative
seconds of the stages in the child's profile. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# function names in torch's compile stack -> the stage they stand for (cumulative seconds;
# each includes the ones below it but Dynamo, which is reported without AOTAutograd)
STAGES = {
    "_compile_inner": "dynamo",
    "aot_module_simplified": "aot_autograd",
    "aot_dispatch_base_graph": "aot_trace",
    "_freeze": "freezing",
    "compile_fx_inner": "inductor",
}


def child(model: str, device: str, freezing: bool) -> dict:
    """One start: build, compile, first call; the report as a dict."""
    import torch
    from torch._dynamo.utils import counters

    from opara_core import zoo

    entry = zoo.get(model)
    started = time.perf_counter()
    module = entry.build().to(device).eval()
    lengths = (40, 16)[: len(entry.lengths)]
    inputs = [t.to(device) for t in entry.at(lengths).example_inputs(2)]
    built = time.perf_counter() - started
    config = {"freezing": freezing}
    if device == "cpu":
        config["cpp.weight_prepack"] = False
    compiled = torch.compile(module, dynamic=True)
    profile = cProfile.Profile()
    started = time.perf_counter()
    with torch._inductor.config.patch(config), torch.inference_mode():
        profile.enable()
        compiled(*inputs)
        profile.disable()
        if device == "cuda":
            torch.cuda.synchronize()
    first_call = time.perf_counter() - started
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, primitive, tottime, cumtime, callers)}
    stages = {stage: 0.0 for stage in STAGES.values()}
    for (_, _, name), (_, _, _, cumulative, _) in stats.items():
        if name in STAGES:
            stages[STAGES[name]] = max(stages[STAGES[name]], round(cumulative, 2))
    stages["dynamo"] = round(stages["dynamo"] - stages["aot_autograd"], 2)  # Dynamo's own: it calls AOTAutograd
    caches = {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k}
    return {"build_s": round(built, 2), "first_call_s": round(first_call, 2), "stages_s": stages, "caches": caches}


def start(model: str, device: str, freezing: bool, cache: Path) -> dict:
    """`child` in a fresh process whose caches live under `cache`."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = [sys.executable, __file__, "--child", model, "--device", device, *(["--freezing"] if freezing else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{model} ({device}, freezing {freezing}) failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert", help="comma-separated: bert, t5")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--settings", default="freezing,no-freezing", help="comma-separated: freezing, no-freezing")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--freezing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.device, args.freezing)))
        return 0
    rows = []
    print("| model | setting | start | first call s | Dynamo | AOTAutograd (its trace) | freezing | Inductor | caches |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for model in args.models.split(","):
        for setting in args.settings.split(","):
            if setting not in ("freezing", "no-freezing"):
                parser.error(f"--settings takes freezing and no-freezing, not {setting!r}")
            with tempfile.TemporaryDirectory(prefix="warm_compile_") as cache:
                for which in ("cold", "warm"):
                    report = start(model, args.device, setting == "freezing", Path(cache))
                    rows.append({"model": model, "setting": setting, "start": which, **report})
                    s = report["stages_s"]
                    caches = ", ".join(f"{k} {v}" for k, v in sorted(report["caches"].items()))
                    print(f"| {model} | {setting} | {which} | {report['first_call_s']:.1f} | {s['dynamo']:.1f} | {s['aot_autograd']:.1f} ({s['aot_trace']:.1f}) "
                          f"| {s['freezing']:.1f} | {s['inductor']:.1f} | {caches} |", flush=True)  # fmt: skip
    if args.json:
        import torch

        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                         "command": " ".join(sys.argv), "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
