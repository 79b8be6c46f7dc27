"""Variable-length serving benchmark: BERT (and T5) with seeded request lengths,
four batch schedulers, several concurrencies, one server.

    python scripts/varlen_bench.py --models bert --json $OUT/varlen_bench.json --log $OUT/varlen_server.log

Starts tritonserver through the project's launcher on a copy of the selected
models, waits until they are built (on a GPU: one set of CUDA graphs per
sequence bucket, the cost table timed from their replays), then:

1. checks the server against the eager model on the CPU (fp32): a few requests
   of mixed lengths sent at once, each compared with the model run on it alone;
2. times a lone 16-token request at concurrency 1 (Triton's compute time);
3. for each scheduler (padded: every request padded to the largest bucket;
   single: no batching, every request alone; greedy: one sub-batch per
   sequence bucket; dp: TurboTransformers' DP) and each concurrency, runs
   `client.bench` over gRPC with the seeded lengths, the scheduler chosen by
   the request parameter `scheduler`, so all four share one server and one set
   of graphs; first, at each concurrency, the same requests against the
   model's no-op floor (`<model>_floor`, made from its config as
   serving_bench's: what Triton's Python backend costs with no model work),
   which no scheduler can serve faster (unless `--no-floor`).

Where each level's time went, per `execute`, from the model's own metrics:
the stages of `execute` (validate: read and check the requests; stage:
schedule, pad and queue every sub-batch; run: wait for the GPU; respond),
the sub-batches run (opara_batches_total by "shape x batch" cell) and what
those cells cost by the model's cost table (the GPU time the scheduler
expected), so a gap between `run` + `stage` and the table is overhead.

Prints markdown tables and writes JSON after every row (rows, the models' build
reports with their cost tables from the server log, the check's errors, meta),
so a run cut short keeps what it measured. `--precision
bf16` serves every model in bf16 (a `--set MODEL:precision=P` wins for its
model); meta and the line above the table say each model's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from client import bench
from client.api import Client
from client.inputs import random_inputs
from client.lengths import parse as parse_lengths
from opara_core import zoo
from opara_core.planning import batching
from opara_core.serving.launcher import ServerConfig, TritonServer, free_port
from opara_core.serving.triton_backend import ServingMetrics, StageClock
from serving_bench import FLOOR_SUFFIX, PRECISION, add_floor_model, batch_counts, copy_model, execute_counters, precision_title

SCHEDULERS = ("padded", "single", "greedy", "dp")


def make_repository(
    models: list[str], root: Path, overrides: dict[str, dict[str, str]], queue_delay_us: int | None, instances: int = 1, floor: bool = True
) -> Path:
    """Copies of the models; `overrides[model]` replaces (or adds) config
    parameters; `instances` model instances each (stub processes, each with its
    own graphs: one's host work overlaps the other's replays); with `floor`
    each model's no-op floor beside it, made from its config.

    Every shape is built at load (`capture` "load") unless an override says
    otherwise: with "first_use" a level pays the builds of the shapes it is the
    first to need, and the levels run one after another (padded, single, greedy,
    dp), so the comparison would favour the later ones (T5 on first use, run 14:
    greedy's stage 3.3 ms per execute against the DP's 0.8)."""
    repository = root / "models"
    for name in models:
        copy_model(repository, name, instances, queue_delay_us, {"capture": "load", **overrides.get(name, {})})
        if floor:
            add_floor_model(repository, name)
    return repository


def check_against_eager(server: TritonServer, model: str, lengths: list[int]) -> list[float]:
    """Relative error of each request's answer against the fp32 eager model on
    the CPU run on that request alone; the requests are sent at once."""
    import torch

    with Client(server.grpc_url) as control:
        info = control.model_info(model)
    requests = [random_inputs(info, 1, seed=900 + k, length=n) for k, n in enumerate(lengths)]

    def send(arrays: dict[str, np.ndarray]) -> np.ndarray:
        with Client(server.grpc_url) as client:
            request = client.request(model, arrays)
            return client.infer(request).as_numpy(info.outputs[0].name)

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(send, requests))
    module = zoo.get(model).build()
    errors = []
    with torch.inference_mode():
        for arrays, answer in zip(requests, answers):
            expected = module(*(torch.from_numpy(arrays[s.name]) for s in zoo.get(model).inputs)).numpy()
            if answer.shape != expected.shape:
                errors.append(float("inf"))
                continue
            errors.append(float(np.abs(answer - expected).max() / max(np.abs(expected).max(), 1e-12)))
    return errors


def cell_counts(metrics_url: str, model: str) -> dict[str, float]:
    """opara_batches_total of the model by bucket: for variable lengths, "shape x batch" cells."""
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    pattern = rf'^opara_batches_total\{{(?=[^}}]*model="{model}")[^}}]*bucket="([^"]+)"[^}}]*\}} (\S+)$'
    return {bucket: float(value) for bucket, value in re.findall(pattern, text, re.M)}


def model_reports(log: str) -> dict[str, str]:
    """Each model's build report (runner, shapes, memory, cost table), from the
    one line it logs when ready (the report's lines joined by "; ")."""
    return {model: "\n".join(details.split("; ")) for model, details in re.findall(r"model (\w+) ready on [^\n|]*\| ([^\n]*)", log)}


def cost_table(report: str) -> dict[str, float]:
    """The cost table of a model's build report: ms per "shape x batch" cell."""
    lines = report.splitlines()
    header = next((k for k, line in enumerate(lines) if line.strip().startswith("shape \\ batch")), None)
    if header is None:
        return {}
    batches = lines[header].split()[3:]
    costs = {}
    for line in lines[header + 1 :]:
        fields = line.split()
        if len(fields) != len(batches) + 2 or fields[1] not in ("m", "s", "c"):  # the report's tags
            break
        costs.update({f"{fields[0]}x{b}": float(ms) for b, ms in zip(batches, fields[2:])})
    return costs


def predicted(costs: dict[str, float], lengths: str, sizes: tuple[int, ...] = (1, 8, 16, 24), draws: int = 400) -> dict[str, dict[int, dict[str, float]]]:
    """What the cost table predicts: per scheduler and batch size n, the mean GPU ms of
    an execute of n requests with lengths drawn from `lengths` (seeded), and its sub-batches."""
    if not costs:
        return {}
    cells = {(tuple(int(n) for n in label.rpartition("x")[0].split(",")), int(label.rpartition("x")[2])): ms for label, ms in costs.items()}
    shapes = sorted({shape for shape, _ in cells})
    axes = tuple(tuple(sorted({shape[a] for shape in shapes})) for a in range(len(shapes[0])))
    table = batching.CostTable(axes, tuple(sorted({b for _, b in cells})), cells)
    drawn = parse_lengths(lengths).lengths(draws * max(sizes))
    result: dict[str, dict[int, dict[str, float]]] = {}
    for name, scheduler in batching.SCHEDULERS.items():
        for n in sizes:
            # one variable axis: the drawn length; more axes (T5): the same length on each, capped at its limit
            batches = [[tuple(min(int(x), limit) for limit in table.limits) for x in drawn[k * n : (k + 1) * n]] for k in range(draws)]
            groups = [scheduler(batch, table) for batch in batches]
            result.setdefault(name, {})[n] = {
                "gpu_ms": round(sum(batching.total_cost(g, table) for g in groups) / draws, 3),
                "sub_batches": round(sum(map(len, groups)) / draws, 2),
            }
    return result


def print_prediction(model: str, prediction: dict[str, dict[int, dict[str, float]]], lengths: str) -> None:
    print(f"\n{model}: what the cost table predicts, GPU ms per execute of n requests of {lengths} (mean of 400 draws; sub-batches)")
    for name, by_size in prediction.items():
        print(f"  {name:>7}: " + ", ".join(f"n={n} {v['gpu_ms']:.2f} ms ({v['sub_batches']})" for n, v in by_size.items()))


def counters(server: TritonServer, model: str) -> tuple[tuple[int, int], dict[str, float], dict[str, float]]:
    """Triton's (inferences, executions), the model's execute seconds by stage and its cell counts,
    once the model's metrics of the level before have been pushed (every FLUSH_SECONDS)."""
    time.sleep(ServingMetrics.FLUSH_SECONDS + 0.2)
    return batch_counts(server.http_url, model), execute_counters(server.metrics_url).get(model, {}), cell_counts(server.metrics_url, model)


def measure(server: TritonServer, model: str, scheduler: str, concurrency: int, lengths: str, duration_s: float, warmup: int, costs: dict[str, float]) -> dict:
    """One level; `scheduler` "floor": the same requests to the model's floor (no stages, no cells)."""
    served = model + FLOOR_SUFFIX if scheduler == "floor" else model
    config = bench.BenchConfig(
        model=served, url=server.grpc_url, protocol="grpc", concurrency=(concurrency,), duration_s=duration_s,
        warmup=warmup, timeout_s=600, lengths=lengths, parameters=() if served != model else (("scheduler", scheduler),), progress=False,
    )  # fmt: skip
    before = counters(server, served)
    result = bench.run(config)
    after = counters(server, served)
    executions = after[0][1] - before[0][1]
    row = asdict(result.rows[0])
    row["mean_batch"] = round((after[0][0] - before[0][0]) / executions, 2) if executions else None
    row["error_messages"] = list(result.error_messages)
    if executions and served == model:
        # the level's warm-up requests are in these counts too: per execute, they change little
        row["execute_ms"] = {stage: round((after[1].get(stage, 0) - before[1].get(stage, 0)) * 1e3 / executions, 3) for stage in StageClock.STAGES}
        cells = {cell: after[2][cell] - before[2].get(cell, 0) for cell in after[2] if after[2][cell] > before[2].get(cell, 0)}
        row["cells"] = cells
        row["sub_batches_per_execute"] = round(sum(cells.values()) / executions, 2)
        known = cells and all(c in costs for c in cells)
        row["table_ms_per_execute"] = round(sum(n * costs[c] for c, n in cells.items()) / executions, 3) if known else None
    return {"model": model, "scheduler": scheduler, **row}


def breakdown(rows: list[dict]) -> str:
    """Where each level's `execute` time went, ms per execute."""
    lines = [
        "| model | scheduler | conc | mean batch | sub-batches | table GPU ms | " + " | ".join(StageClock.STAGES) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(StageClock.STAGES),
    ]
    for r in rows:
        stages = r.get("execute_ms") or {}
        cells = [r["model"], r["scheduler"], r["concurrency"], r.get("mean_batch") or "-", r.get("sub_batches_per_execute", "-")]
        cells += ["-" if r.get("table_ms_per_execute") is None else f"{r['table_ms_per_execute']:.2f}"]
        cells += [f"{stages[k]:.2f}" if k in stages else "-" for k in StageClock.STAGES]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    """Per model and concurrency: req/s of the floor and of each scheduler, the
    DP's against padding, greedy grouping and the floor, and the floor against
    padding: the most any scheduler could gain over padding on this host."""
    rps = {(r["model"], r["concurrency"], r["scheduler"]): r["throughput_rps"] for r in rows if r.get("throughput_rps")}
    names = [n for n in ("floor", *SCHEDULERS) if any(key[2] == n for key in rps)]
    pairs = [("dp", "padded"), ("dp", "greedy"), ("dp", "floor"), ("floor", "padded")]
    lines = ["| model | conc | " + " | ".join(names) + " | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " |", "|---|---|" + "---|" * (len(names) + len(pairs))]
    for model, concurrency in dict.fromkeys(key[:2] for key in rps):
        got = {n: rps.get((model, concurrency, n)) for n in (*names, *(n for pair in pairs for n in pair))}
        cells = [model, concurrency, *("-" if got[n] is None else f"{got[n]:.1f}" for n in names)]
        cells += ["-" if got[a] is None or got[b] is None else f"{got[a] / got[b]:.2f}x" for a, b in pairs]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = [
        "| model | scheduler | conc | req/s | p50 ms | p99 ms | mean ms | server infer ms | server queue ms | mean batch | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["model"], r["scheduler"], r["concurrency"], f"{r['throughput_rps']:.1f}"]
        cells += ["-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("p50_ms", "p99_ms", "mean_ms", "server_compute_infer_ms", "server_queue_ms")]
        cells += [r.get("mean_batch") or "-", r["errors"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def config_overrides(args: argparse.Namespace, models: list[str]) -> dict[str, dict[str, str]]:
    """Each model's parameters to set: --precision for every model, then its --set ones (a model's own wins)."""
    overrides: dict[str, dict[str, str]] = {model: {"precision": args.precision} for model in models} if args.precision else {}
    for item in args.set:
        model, _, assignment = item.partition(":")
        key, sep, value = assignment.partition("=")
        if not sep or model not in models:
            raise SystemExit(f"--set {item!r}: give MODEL:KEY=VALUE for one of {models}")
        overrides.setdefault(model, {})[key] = value
    return overrides


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert", help="comma-separated: bert, t5")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS))
    parser.add_argument("--lengths", default="lognormal:mean=50,cap=512,seed=1", help="client.lengths SPEC")
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured requests per worker before each level")
    parser.add_argument(
        "--set", action="append", default=[], metavar="MODEL:KEY=VALUE",
        help="a config parameter of a model, e.g. t5:capture=first_use or bert:policy=sequential (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--precision", choices=PRECISION.choices, default=None,
        help="the precision parameter of every model (docs/precision.md; default: the configs' own; a --set MODEL:precision=P wins)",
    )  # fmt: skip
    parser.add_argument("--queue-delay-us", type=int, default=None, help="max_queue_delay_microseconds (default: the config's)")
    parser.add_argument("--instances", type=int, default=1, help="model instances per model (instance_group count; default 1)")
    parser.add_argument("--no-floor", action="store_true", help="no floor model, no floor levels")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log", type=Path, help="where the server log goes")
    parser.add_argument("--predict", type=Path, metavar="JSON", help="only print what the cost tables of an earlier run's JSON predict for --lengths")
    return parser


def precisions_title(overrides: dict[str, dict[str, str]], models: list[str]) -> str:
    """precision_title per model: a --set may give one model another precision."""
    return "; ".join(f"{model} {precision_title(overrides.get(model, {}).get('precision'))}" for model in models)


def main() -> int:
    args = argument_parser().parse_args()
    if args.predict:
        meta = json.loads(args.predict.read_text())["meta"]
        # a JSON from before --precision: its overrides say which model had one, if any
        print(precisions_title(meta.get("overrides", {}), list(meta["reports"])))
        for model, report in meta["reports"].items():
            print_prediction(model, predicted(cost_table(report), args.lengths), args.lengths)
        return 0
    models = [zoo.get(m).name for m in args.models.split(",")]
    overrides = config_overrides(args, models)
    work = Path(tempfile.mkdtemp(prefix="varlen_bench_"))
    if args.instances < 1:
        raise SystemExit(f"--instances must be at least 1, got {args.instances}")
    repository = make_repository(models, work, overrides, args.queue_delay_us, args.instances, floor=not args.no_floor)
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    log_path = args.log or work / "server.log"
    rows: list[dict] = []
    meta: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "lengths": args.lengths,
        "duration_s": args.duration,
        "overrides": overrides,
        "precision": {model: overrides.get(model, {}).get("precision") for model in models},  # None: the config's own
        "instances": args.instances,
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    levels = ([] if args.no_floor else ["floor"]) + args.schedulers.split(",")
    started = time.perf_counter()
    server = TritonServer(config, log_path).start()
    try:
        server.wait_ready(timeout_s=1200)
        meta["load_seconds"] = round(time.perf_counter() - started, 1)
        print(f"server ready with {models} in {meta['load_seconds']:.0f} s", flush=True)
        meta["check_relative_error"], meta["lone_16_tokens"] = {}, {}
        meta["reports"] = reports = model_reports(log_path.read_text(errors="replace"))
        for model in models:
            costs = cost_table(reports.get(model, ""))
            meta.setdefault("table_prediction", {})[model] = predicted(costs, args.lengths)
            errors = check_against_eager(server, model, [16, 50, 300, 7])
            meta["check_relative_error"][model] = errors
            print(f"{model}: relative error against eager fp32 on the CPU, lengths 16/50/300/7: {errors}", flush=True)
            lone = measure(server, model, "dp", 1, "fixed:16", args.duration, args.warmup, costs)
            lone["scheduler"] = "dp, lone 16 tokens"
            meta["lone_16_tokens"][model] = lone
            print(f"{model}: a lone 16-token request: p50 {lone['p50_ms']:.3f} ms, server compute {lone['server_compute_infer_ms']:.3f} ms, "
                  f"ms per execute {lone.get('execute_ms')}, cells {lone.get('cells')}", flush=True)  # fmt: skip
            for scheduler in levels:
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    rows.append(measure(server, model, scheduler, concurrency, args.lengths, args.duration, args.warmup, costs))
                    print(json.dumps(rows[-1]), flush=True)
                    save()
    finally:
        server.stop()
        meta["reports"] = model_reports(log_path.read_text(errors="replace"))
        save()
        if args.json:
            print(f"wrote {args.json}")
    for model, report in meta["reports"].items():
        print(f"\n{model}:\n{report}")
    print()
    print(precisions_title(overrides, models))
    print(table(rows))
    print()
    print(ratios(rows))
    print()
    print(breakdown([*meta.get("lone_16_tokens", {}).values(), *rows]))
    for model, prediction in meta.get("table_prediction", {}).items():
        print_prediction(model, prediction, args.lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
