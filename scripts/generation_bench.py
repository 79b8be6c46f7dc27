"""Generation benchmark: iteration-level against request-level scheduling of gpt2.

    python scripts/generation_bench.py --rates 1,2,4,8,16,32 --requests 200 --json out/generation.json --plot out/generation.png
    python scripts/generation_bench.py --request-rates 8,10,12 --iteration-rates 16,32,64 --tpot-bound-ms 20,10

Starts tritonserver through the project's launcher on a repository holding two
copies of gpt2 (GPT-2 small, seeded weights): `gpt2` with iteration-level
scheduling and `gpt2_request` with the request-level baseline, same slots,
context and queue. For each scheduling and each arrival rate it runs the
client's Poisson load generator (seeded prompt and output lengths, one gRPC
stream per request on one channel) and records time to first token and time per output token
(p50, p99), latency per generated token (Orca's normalized latency: the
whole request's time, waiting included, over its tokens), requests/s and
tokens/s, and, from the model's own counters
(opara_generation_*_total, scraped before and after each rate), where the
generation loop spent its time per iteration. Prints a markdown table of each,
and for each scheduling and each --tpot-bound-ms the highest rate whose p99
time per output token stays within it (the issue's comparison): among the
rates it sustained (p99 TTFT within --ttft-bound-ms: TPOT alone leaves the
queueing out, so an overloaded rate passes any TPOT bound) and among all;
the same for p99 latency per token (Orca's); then a lone request's TTFT
(128-token prompt) and TPOT. `--precision bf16` serves both copies in bf16;
meta and the line above the table say which.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from client.generate import LoadConfig, TokenStream, output_lengths, run_load, tokens
from opara_core.parameters import get as get_parameter
from opara_core.serving import model_config
from opara_core.serving.launcher import ADMIN_KEY_ENV, DEFAULT_MODEL_REPOSITORY, ServerConfig, TritonServer, free_port

MODELS = {"iteration": "gpt2", "request": "gpt2_request"}
FLUSH_WAIT_S = 0.5  # GenerationMetrics.FLUSH_SECONDS (not imported: it would import torch)
PRECISION = get_parameter("precision")  # --precision's choices, and what a config without the parameter gets


def make_repository(root: Path, parameters: dict[str, str]) -> Path:
    repository = root / "models"
    for scheduling, name in MODELS.items():
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / "gpt2", repository / name)
        path = repository / name / "config.pbtxt"
        config = model_config.read(path)
        config.name = name
        for key, value in {**parameters, "scheduling": scheduling}.items():
            config.parameters[key].string_value = value
        model_config.write(path, config)
    return repository


def lone_request(url: str, model: str, prompt_len: int, max_tokens: int, repeats: int = 5) -> dict:
    """Median TTFT and TPOT of one request at a time (after one warm-up)."""
    ttfts, tpots = [], []
    for i in range(repeats + 1):
        with TokenStream(url) as stream:
            sent = time.perf_counter()
            stream.send(model, [(7 * j + i) % 50000 for j in range(prompt_len)], max_tokens)
            times = [when for when, _ in tokens(stream.events)]
        if i:
            ttfts.append(times[0] - sent)
            tpots.append((times[-1] - times[0]) / (len(times) - 1))
    ttfts.sort(), tpots.sort()
    return {"model": model, "prompt_len": prompt_len, "ttft_ms": ttfts[len(ttfts) // 2] * 1000, "tpot_ms": tpots[len(tpots) // 2] * 1000}


def table(rows: list[dict]) -> str:
    lines = [
        "| scheduling | rate (req/s) | requests | errors | req/s | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) "
        "| latency/token p50 (ms) | latency/token p99 (ms) | client send lag p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [r["scheduling"], f"{r['rate']:g}", r["requests"], r["errors"], f"{r['requests_per_s']:.2f}", f"{r['tokens_per_s']:.0f}"]
        cells += ["-" if r.get(k) is None else f"{r[k]:.1f}" for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "norm_latency_p50_ms", "norm_latency_p99_ms", "send_lag_p99_ms")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def loop_counters(metrics_url: str) -> dict[str, dict[str, float]]:
    """Per model: opara_generation_seconds_total by stage and opara_generation_events_total by kind."""
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    counters: dict[str, dict[str, float]] = {}
    for family, labels, value in re.findall(r"^opara_generation_(seconds|events)_total\{(.*)\} (\S+)$", text, re.M):
        named = dict(re.findall(r'(\w+)="(\w*)"', labels))
        counters.setdefault(named["model"], {})[f"{family}:{named.get('stage') or named.get('kind')}"] = float(value)
    return counters


def loop_breakdown(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """The loop's work between two scrapes: iterations/s, mean batch, ms per iteration by stage, sender ms per response."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    iterations = delta.get("events:iterations", 0.0)
    if not iterations:
        return {}
    row = {"iterations_per_s": iterations / wall_s, "mean_batch": delta["events:rows"] / iterations, "prefills": delta["events:prefills"]}
    for stage in ("prefill", "step", "drain", "respond"):
        row[f"{stage}_ms"] = delta[f"seconds:{stage}"] / iterations * 1000
    row["send_ms_per_response"] = delta["seconds:send"] / max(delta["events:responses"], 1) * 1000
    row["tokens_per_response"] = delta.get("events:tokens", 0.0) / max(delta["events:responses"], 1)
    row["probe_s"] = delta["seconds:probe"]
    return row


def loop_table(rows: list[dict]) -> str:
    lines = [
        "| scheduling | rate (req/s) | iterations/s | mean batch | prefill (ms/it) | step (ms/it) | drain (ms/it) | respond (ms/it) "
        "| send (ms/response) | tokens/response |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        loop = r.get("loop") or {}
        if not loop:
            continue
        cells = [r["scheduling"], f"{r['rate']:g}", f"{loop['iterations_per_s']:.0f}", f"{loop['mean_batch']:.1f}"]
        cells += [f"{loop[k]:.2f}" for k in ("prefill_ms", "step_ms", "drain_ms", "respond_ms")] + [f"{loop['send_ms_per_response']:.3f}"]
        cells.append(f"{loop.get('tokens_per_response', 0):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_under_bound(rows: list[dict], scheduling: str, bound_ms: float, metric: str = "tpot_p99_ms", ttft_bound_ms: float | None = None) -> dict | None:
    """The row of the highest achieved req/s whose `metric` (p99 TPOT; or p99
    latency per token, Orca's normalized latency) is within the bound, without
    errors, and, with `ttft_bound_ms`, whose p99 time to first token is within
    that: TPOT leaves out the wait before the first token, so an overloaded
    rate (its queue growing for the whole run) passes any TPOT bound, and its
    req/s is only the rate at which a backlog drains."""
    ok = [
        r for r in rows
        if r["scheduling"] == scheduling and not r["errors"] and r.get(metric) is not None and r[metric] <= bound_ms
        and (ttft_bound_ms is None or (r.get("ttft_p99_ms") is not None and r["ttft_p99_ms"] <= ttft_bound_ms))
    ]  # fmt: skip
    return max(ok, key=lambda r: r["requests_per_s"], default=None)


def plot(rows: list[dict], path: Path, bound_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for scheduling in sorted({r["scheduling"] for r in rows}):
        mine = [r for r in rows if r["scheduling"] == scheduling]
        axes[0].plot([r["requests_per_s"] for r in mine], [r["tpot_p99_ms"] for r in mine], "o-", label=scheduling)
        axes[1].plot([r["rate"] for r in mine], [r["ttft_p99_ms"] for r in mine], "o-", label=scheduling)
    axes[0].axhline(bound_ms, color="grey", linestyle="--", linewidth=1)
    axes[0].set_xlabel("achieved requests/s")
    axes[0].set_ylabel("p99 time per output token (ms)")
    axes[1].set_xlabel("arrival rate (requests/s)")
    axes[1].set_ylabel("p99 time to first token (ms)")
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def served_parameters(args: argparse.Namespace) -> dict[str, str]:
    """The parameters set in both models' configs (scheduling aside); precision only where --precision gives one."""
    parameters = {
        "max_active": args.max_active, "max_context": args.max_context, "max_queue": args.max_queue, "sender_threads": args.sender_threads,
        "switch_interval_us": args.switch_interval_us, "merge_tokens": args.merge_tokens,
        "admit_every": args.admit_every,
    }  # fmt: skip
    if args.config_overrides:
        parameters["config_overrides"] = args.config_overrides
    if args.precision:
        parameters["precision"] = args.precision
    return parameters


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1,2,4,8,16,32", help="arrival rates, requests/s")
    parser.add_argument("--iteration-rates", help="rates for iteration-level scheduling (default: --rates)")
    parser.add_argument("--request-rates", help="rates for the request-level baseline (default: --rates)")
    parser.add_argument("--schedulings", default="iteration,request", help="which to run, of iteration,request")
    parser.add_argument("--requests", type=int, default=200, help="requests per rate")
    parser.add_argument("--prompt-len", default="4,128")
    parser.add_argument("--output-len", type=output_lengths, default=(4, 256), help="LOW,HIGH or a length SPEC (client.lengths)")
    parser.add_argument("--max-active", default="32")
    parser.add_argument("--max-context", default="512")
    parser.add_argument("--max-queue", default="1024")
    parser.add_argument("--tpot-bound-ms", default="20", help="p99 TPOT bounds for the throughput comparison, e.g. 20,10")
    parser.add_argument(
        "--ttft-bound-ms", type=float, default=2000.0,
        help="with the TPOT bound, a rate counts as sustained only if its p99 TTFT is within this (an overloaded queue shows there)",
    )  # fmt: skip
    parser.add_argument("--merge-tokens", default="true", choices=("true", "false"), help="the model's merge_tokens parameter (false: one token per response)")
    parser.add_argument("--admit-every", default="4", help="the model's admit_every parameter (iterations between admissions while generating)")
    parser.add_argument("--sender-threads", default="2", help="the model's sender_threads parameter")
    parser.add_argument("--switch-interval-us", default="0", help="the model's switch_interval_us parameter (0: Python's 5 ms)")
    parser.add_argument(
        "--precision", choices=PRECISION.choices, default=None,
        help="the models' precision parameter (docs/precision.md: the language model and its KV cache; default: the config's own)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-overrides", default="", help="GPT2Config fields for a smoke run, e.g. n_layer=2,n_embd=128,n_head=4")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--log", type=Path, help="where the server log goes")
    return parser


def main() -> int:
    parser = argument_parser()
    args = parser.parse_args()
    schedulings = [name for name in args.schedulings.split(",") if name]
    if not schedulings or set(schedulings) - set(MODELS):
        parser.error(f"--schedulings: expected names from {list(MODELS)}, got {args.schedulings!r}")
    rates = {
        scheduling: [float(r) for r in (getattr(args, f"{scheduling}_rates") or args.rates).split(",")] for scheduling in schedulings
    }
    bounds = [float(b) for b in args.tpot_bound_ms.split(",")]
    prompt_len = tuple(int(v) for v in args.prompt_len.split(","))
    work = Path(tempfile.mkdtemp(prefix="generation_bench_"))
    parameters = served_parameters(args)
    repository = make_repository(work, parameters)
    config = ServerConfig(
        model_repository=repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        admin_key=os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(32),
    )  # fmt: skip
    rows, lone = [], []

    def save() -> None:
        """The JSON so far: written after every row, so that a run cut short keeps what it measured."""
        if args.json:
            meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "parameters": parameters, "precision": args.precision}
            args.json.write_text(json.dumps({"meta": meta, "rows": rows, "lone": lone}, indent=1))

    server = TritonServer(config, args.log or work / "server.log").start()
    try:
        server.wait_ready(timeout_s=900)
        for scheduling in schedulings:
            lone.append(lone_request(server.grpc_url, MODELS[scheduling], 128, 64))
            print(json.dumps(lone[-1]), flush=True)
            save()
        for scheduling in schedulings:
            model = MODELS[scheduling]
            for rate in rates[scheduling]:
                load = LoadConfig(
                    model=model, url=server.grpc_url, rate=rate, requests=args.requests,
                    prompt_len=prompt_len, output_len=args.output_len, seed=args.seed,
                )  # fmt: skip
                before = loop_counters(server.metrics_url).get(model, {})
                result = run_load(load)
                time.sleep(2 * FLUSH_WAIT_S)  # the model pushes its counters every 0.5 s
                loop = loop_breakdown(before, loop_counters(server.metrics_url).get(model, {}), result.duration_s)
                rows.append({"scheduling": scheduling, "rate": rate, **result.summary(), "loop": loop})
                print(json.dumps(rows[-1]), flush=True)
                save()
    finally:
        server.stop()
    print()
    print(f"precision: {args.precision}" if args.precision else f"precision: the config's own (default {PRECISION.default})")
    print(table(rows))
    print()
    print(loop_table(rows))
    print()
    comparisons = (
        ("tpot_p99_ms", f"p99 TPOT, sustained (p99 TTFT <= {args.ttft_bound_ms:g} ms)", args.ttft_bound_ms),
        ("tpot_p99_ms", "p99 TPOT, any rate (overloaded ones included)", None),
        ("norm_latency_p99_ms", "p99 latency per token (Orca's normalized latency)", None),
    )
    for metric, label, ttft_bound in comparisons:
        for bound in bounds:
            for scheduling in schedulings:
                best = best_under_bound(rows, scheduling, bound, metric, ttft_bound)
                found = f"{best['requests_per_s']:.2f} req/s at {best[metric]:.1f} ms (rate {best['rate']:g})" if best else "no rate within it"
                print(f"{label} <= {bound:g} ms, {scheduling}: {found}")
    for entry in lone:
        print(f"lone request on {entry['model']}: TTFT {entry['ttft_ms']:.1f} ms (128-token prompt), TPOT {entry['tpot_ms']:.2f} ms")
    save()
    if args.plot:
        plot(rows, args.plot, bounds[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
