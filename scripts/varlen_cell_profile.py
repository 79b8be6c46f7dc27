"""Where a variable-length model's small cells spend their time, and whether
another way of compiling or another GEMM library makes them faster.

    python scripts/varlen_cell_profile.py --model bert --json out/cells.json --parts dynamic,static,autotune

Each variant is captured as one CUDA graph per cell, checked against the eager
model (max relative error) and timed (CUDA events); the first cell of the list
is also profiled kernel by kernel (scripts/kernel_profile.py's tables):

- dynamic: the served graph (`engine.whole_model`: one `torch.compile` with
  dynamic sizes and freezing, its GEMMs through the skinny GEMM op, its
  attention through the short-attention op), every cell captured from it, with
  cuBLAS and with cuBLASLt (`torch.backends.cuda.preferred_blas_library`);
  dynamic-no-attention: without the attention op; dynamic-plain: without
  either op (Inductor's own graph); saved: the saved Inductor artifact
  (`engine.whole_model.WholeModelSaved`: exported, weights not frozen, its
  linear layers swapped for the skinny GEMM op, the attention op), compiled afresh;
- static: `torch.compile` at each of the first three cells' fixed shapes, both libraries;
- autotune: `max-autotune-no-cudagraphs` at the first cell (Inductor's Triton
  GEMM templates against the library's), if `--budget` leaves 200 s for it.
"""
import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_profile  # noqa: E402
from opara_core import zoo  # noqa: E402
from opara_core.bench import compiled_graph, profile_replays  # noqa: E402
from opara_core.engine.capture import capture_module, time_replays  # noqa: E402
from opara_core.engine.compare import max_relative_error  # noqa: E402
from opara_core.engine.whole_model import WholeModelInductor, WholeModelSaved  # noqa: E402
from opara_core.serving.varlen import aot_example, dynamic_dims  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", default="bert", choices=("bert", "t5"))
parser.add_argument("--parts", default="dynamic,static,autotune", help="of dynamic, dynamic-no-attention, dynamic-plain, saved, static, autotune")
parser.add_argument("--blas", default="cublas,cublaslt", help="the libraries the dynamic parts are captured with")
parser.add_argument("--budget", type=float, default=400.0, help="seconds; later parts are skipped when too few are left")
parser.add_argument("--json", type=Path, default=Path("out/cells.json"), help="results; kernel traces go beside it")
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING)
kernel_profile.TOP = 14
OUT = args.json.parent
OUT.mkdir(parents=True, exist_ok=True)
deadline = time.monotonic() + args.budget
res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": [], "profiles": {}}


def save():
    args.json.write_text(json.dumps(res, indent=1))


dev = torch.device("cuda")
base = zoo.get(args.model)
module = base.build().to(dev).eval()
SHAPES = [((16,), 1), ((16,), 2), ((32,), 1), ((64,), 4), ((128,), 1), ((16,), 8), ((512,), 8)]
if base.name == "t5":
    SHAPES = [((16, 16), 1), ((32, 16), 1), ((128, 32), 1), ((64, 16), 4)]


def inputs(shape, batch, seed=3):
    return [t.to(dev) for t in base.at(shape).example_inputs(batch, seed=seed)]


def error(captured, shape, batch):
    x = inputs(shape, batch, seed=5)
    with torch.inference_mode():
        for s, v in zip(captured.inputs, x):
            s.copy_(v)
        captured.replay()
        torch.cuda.synchronize()
        return max_relative_error(tuple(t.clone() for t in captured.outputs), module(*x))


def record(variant, shape, batch, captured, profile=False):
    label = f"{','.join(map(str, shape))}x{batch}"
    ms = time_replays(captured, seconds=0.1)
    row = {"variant": variant, "cell": label, "ms": round(ms, 4), "err": error(captured, shape, batch)}
    res["rows"].append(row)
    print(f"{variant:28s} {label:10s} {ms:8.4f} ms  err {row['err']:.2e}", flush=True)
    if profile:
        replays = profile_replays(captured, 5, OUT / f"{variant.replace('/', '_')}_{label}.trace.json")
        summary = kernel_profile.replay_summary(replays[2])
        summary["heaviest"] = kernel_profile.heaviest(replays)
        res["profiles"][f"{variant} {label}"] = summary
        print(json.dumps({k: v for k, v in summary.items() if k != "heaviest"}), flush=True)
        kernel_profile.print_heaviest(f"{variant} {label}", summary["heaviest"])
        (OUT / f"{variant.replace('/', '_')}_{label}.trace.json").unlink()
    save()


def blas(name):
    torch.backends.cuda.preferred_blas_library(name)


PARTS = args.parts.split(",")
LIBRARIES = args.blas.split(",")
# 1. the served graph: one dynamic whole-model compile (its GEMMs through the skinny
# GEMM op, its attention through the short-attention op; without one or both; or the
# saved artifact), every cell captured from it
WHOLE = {"dynamic": (True, True), "dynamic-no-attention": (True, False), "dynamic-plain": (False, False), "saved": None}


def whole_model(part):
    if part == "saved":  # compiled afresh into a directory of its own (the compile's seconds are reported)
        return WholeModelSaved(module, aot_example(base, dev), dynamic_dims(base, 32), Path(tempfile.mkdtemp(prefix="saved_")))
    skinny, attention = WHOLE[part]
    return WholeModelInductor(module, skinny_gemms=skinny, short_attention=attention)


for part in WHOLE:
    if part not in PARTS:
        continue
    start = time.perf_counter()
    whole = whole_model(part)
    pool = torch.cuda.graph_pool_handle()
    keep = []
    for shape, batch in SHAPES:
        for lib in LIBRARIES:
            blas(lib)
            cap = whole.capture(inputs(shape, batch), pool)
            keep.append(cap)
            record(f"{part}/{lib}", shape, batch, cap, profile=(shape, batch) == SHAPES[0])
    blas("cublas")
    res[f"{part}_compile_s"] = round(time.perf_counter() - start, 1)
    del keep, whole
    torch.cuda.synchronize()
    torch._dynamo.reset()

# 2. static shapes at the small cells, default mode (as the engine's fused segments)
for shape, batch in SHAPES[:3] if "static" in PARTS else []:
    if time.monotonic() > deadline - 60:
        break
    torch._dynamo.reset()
    start = time.perf_counter()
    with torch._inductor.config.patch(freezing=True), torch.inference_mode():
        compiled = torch.compile(module, dynamic=False)
        x = inputs(shape, batch)
        compiled(*x)
        for lib in ("cublas", "cublaslt"):
            blas(lib)
            cap = capture_module(compiled, [t.clone() for t in x], torch.cuda.graph_pool_handle())
            record(f"static/{lib}", shape, batch, cap, profile=(shape, batch) == SHAPES[0])
    blas("cublas")
    res.setdefault("static_compile_s", {})[f"{shape}x{batch}"] = round(time.perf_counter() - start, 1)
    del cap, compiled

# 3. max-autotune (GEMM templates against cuBLAS) at the smallest cell
if "autotune" in PARTS and time.monotonic() < deadline - 200:
    shape, batch = SHAPES[0]
    notes = []  # the bench's max-autotune column, at this one cell
    cap = compiled_graph(module, [inputs(shape, batch)], "max-autotune-no-cudagraphs", notes)
    res["autotune_compile"] = notes
    with torch.inference_mode():
        record("static-autotune/cublas", shape, batch, cap, profile=True)
save()
print("done", flush=True)
