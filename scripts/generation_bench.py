"""Generation benchmark: iteration-level against request-level scheduling of gpt2.

    python scripts/generation_bench.py --rates 1,2,4,8,16,32 --requests 200 --json out/generation.json --plot out/generation.png

Starts tritonserver through the project's launcher on a repository holding two
copies of gpt2 (GPT-2 small, seeded weights): `gpt2` with iteration-level
scheduling and `gpt2_request` with the request-level baseline, same slots,
context and queue. For each scheduling and each arrival rate it runs the
client's Poisson load generator (seeded prompt and output lengths, one gRPC
stream per request) and records time to first token and time per output token
(p50, p99), requests/s and tokens/s. Prints a markdown table and, for each
scheduling, the highest rate whose p99 time per output token stays within
--tpot-bound-ms; then a lone request's TTFT (128-token prompt) and TPOT.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from client.generate import LoadConfig, TokenStream, run_load, tokens
from opara_core.serving.launcher import ADMIN_KEY_ENV, DEFAULT_MODEL_REPOSITORY, ServerConfig, TritonServer, free_port

MODELS = {"iteration": "gpt2", "request": "gpt2_request"}


def make_repository(root: Path, parameters: dict[str, str]) -> Path:
    repository = root / "models"
    for scheduling, name in MODELS.items():
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / "gpt2", repository / name)
        config = repository / name / "config.pbtxt"
        text = config.read_text().replace('name: "gpt2"', f'name: "{name}"')
        # later entries of the parameters map replace earlier ones
        for key, value in {**parameters, "scheduling": scheduling}.items():
            text += f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        config.write_text(text)
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
        "| scheduling | rate (req/s) | requests | errors | req/s | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [r["scheduling"], f"{r['rate']:g}", r["requests"], r["errors"], f"{r['requests_per_s']:.2f}", f"{r['tokens_per_s']:.0f}"]
        cells += ["-" if r[k] is None else f"{r[k]:.1f}" for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def best_under_bound(rows: list[dict], scheduling: str, bound_ms: float) -> dict | None:
    """The row of the highest achieved req/s whose p99 TPOT is within the bound, without errors."""
    ok = [r for r in rows if r["scheduling"] == scheduling and not r["errors"] and r["tpot_p99_ms"] is not None and r["tpot_p99_ms"] <= bound_ms]
    return max(ok, key=lambda r: r["requests_per_s"], default=None)


def plot(rows: list[dict], path: Path, bound_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for scheduling in MODELS:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1,2,4,8,16,32", help="arrival rates, requests/s")
    parser.add_argument("--requests", type=int, default=200, help="requests per rate")
    parser.add_argument("--prompt-len", default="4,128")
    parser.add_argument("--output-len", default="4,256")
    parser.add_argument("--max-active", default="32")
    parser.add_argument("--max-context", default="512")
    parser.add_argument("--max-queue", default="1024")
    parser.add_argument("--tpot-bound-ms", type=float, default=20.0, help="the p99 TPOT bound for the throughput comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-overrides", default="", help="GPT2Config fields for a smoke run, e.g. n_layer=2,n_embd=128,n_head=4")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--log", type=Path, help="where the server log goes")
    args = parser.parse_args()
    prompt_len = tuple(int(v) for v in args.prompt_len.split(","))
    output_len = tuple(int(v) for v in args.output_len.split(","))
    work = Path(tempfile.mkdtemp(prefix="generation_bench_"))
    parameters = {"max_active": args.max_active, "max_context": args.max_context, "max_queue": args.max_queue}
    if args.config_overrides:
        parameters["config_overrides"] = args.config_overrides
    repository = make_repository(work, parameters)
    config = ServerConfig(
        model_repository=repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        admin_key=os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(32),
    )  # fmt: skip
    rows, lone = [], []
    server = TritonServer(config, args.log or work / "server.log").start()
    try:
        server.wait_ready(timeout_s=900)
        for model in MODELS.values():
            lone.append(lone_request(server.grpc_url, model, 128, 64))
            print(json.dumps(lone[-1]), flush=True)
        for scheduling, model in MODELS.items():
            for rate in (float(r) for r in args.rates.split(",")):
                load = LoadConfig(
                    model=model, url=server.grpc_url, rate=rate, requests=args.requests,
                    prompt_len=prompt_len, output_len=output_len, seed=args.seed,
                )  # fmt: skip
                rows.append({"scheduling": scheduling, "rate": rate, **run_load(load).summary()})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    print()
    print(table(rows))
    for scheduling in MODELS:
        best = best_under_bound(rows, scheduling, args.tpot_bound_ms)
        print(f"{scheduling}: " + (f"{best['requests_per_s']:.2f} req/s at p99 TPOT {best['tpot_p99_ms']:.1f} ms (rate {best['rate']:g})" if best else f"no rate within p99 TPOT {args.tpot_bound_ms:g} ms"))
    for entry in lone:
        print(f"lone request on {entry['model']}: TTFT {entry['ttft_ms']:.1f} ms (128-token prompt), TPOT {entry['tpot_ms']:.2f} ms")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "parameters": parameters}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "lone": lone}, indent=1))
    if args.plot:
        plot(rows, args.plot, args.tpot_bound_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
