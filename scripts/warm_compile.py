"""How long the whole-model compile takes to start, cold and warm: `torch.compile`
with and without Inductor's freezing, and the saved Inductor artifact, which
bound a variable-length model's warm build (issue 16).

    python scripts/warm_compile.py --models bert --device cpu --json out/warm_compile.json

For each model and setting, two fresh processes share one empty cache directory
(Inductor's, Triton's and the artifact's): the first starts cold, the second
warm. Each builds the model and makes its first call at 2 x 40 tokens (T5: 40
encoder, 16 decoder), which is where the compile or the load happens:
"freezing" and "no-freezing" compile it as the served graph does
(`torch.compile(dynamic=True)` under `inference_mode`; on a CPU without mkldnn
weight prepacking, as the tests compile it), "saved" builds
`engine.whole_model.WholeModelSaved` (export, `standalone_compile` and save when
cold; a load when warm). It reports the seconds, Inductor's FX-graph-cache and
AOTAutograd-cache counters (with freezing on, torch bypasses AOTAutograd's
cache, so a warm start traces the model again) and the largest of torch's own
compile timers (`dynamo_timed` sections, seconds summed; they nest). Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("freezing", "no-freezing", "saved")
TIMERS = 6  # the largest compile timers reported per start


def child(model: str, device: str, setting: str, cache: Path) -> dict:
    """One start: build, compile (or load), first call; the report as a dict."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    from opara_core import zoo
    from opara_core.engine.whole_model import WholeModelSaved
    from opara_core.serving.varlen import dynamic_dims, export_example

    entry = zoo.get(model)
    started = time.perf_counter()
    module = entry.build().to(device).eval()
    lengths = (40, 16)[: len(entry.lengths)]
    inputs = [t.to(device) for t in entry.at(lengths).example_inputs(2)]
    built = time.perf_counter() - started
    config = {"freezing": setting == "freezing"}
    if device == "cpu":
        config["cpp.weight_prepack"] = False
    started = time.perf_counter()
    with torch._inductor.config.patch(config), torch.inference_mode():
        if setting == "saved":
            run = WholeModelSaved(module, export_example(entry, torch.device(device)), dynamic_dims(entry, 32), cache / "saved").runner
        else:
            run = torch.compile(module, dynamic=True)
        run(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
    first_call = time.perf_counter() - started
    timers = sorted(((name, round(sum(seconds), 2)) for name, seconds in compilation_time_metrics.items()), key=lambda t: -t[1])
    caches = {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k}
    return {"build_s": round(built, 2), "first_call_s": round(first_call, 2), "timers_s": dict(timers[:TIMERS]), "caches": caches}


def start(model: str, device: str, setting: str, cache: Path) -> dict:
    """`child` in a fresh process whose caches live under `cache`."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = [sys.executable, __file__, "--child", model, "--device", device, "--settings", setting, "--cache", str(cache)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{model} ({device}, {setting}) failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert", help="comma-separated: bert, t5")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated: {', '.join(SETTINGS)}")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    if unknown := [s for s in settings if s not in SETTINGS]:
        parser.error(f"--settings takes {', '.join(SETTINGS)}, not {', '.join(unknown)}")
    if args.child:
        print(json.dumps(child(args.child, args.device, settings[0], args.cache)))
        return 0
    rows = []
    print("| model | setting | start | first call s | largest compile timers s | caches |")
    print("|---|---|---|---:|---|---|")
    for model in args.models.split(","):
        for setting in settings:
            with tempfile.TemporaryDirectory(prefix="warm_compile_") as cache:
                for which in ("cold", "warm"):
                    report = start(model, args.device, setting, Path(cache))
                    rows.append({"model": model, "setting": setting, "start": which, **report})
                    timers = ", ".join(f"{name} {seconds:.1f}" for name, seconds in report["timers_s"].items())
                    caches = ", ".join(f"{k} {v}" for k, v in sorted(report["caches"].items()))
                    print(f"| {model} | {setting} | {which} | {report['first_call_s']:.1f} | {timers} | {caches} |", flush=True)
    if args.json:
        import torch

        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                         "command": " ".join(sys.argv), "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
