"""python -m client: send a request, or measure latency over a concurrency sweep.

  python -m client infer --model M --protocol grpc|http --url HOST:PORT [--input FILE.npy] [--batch B] [--classes K]
                         [--shared-memory none|system|cuda]
  python -m client bench --model M --protocol grpc|http --url HOST:PORT --concurrency 1,2,4
                         (--requests N | --duration S) [--batch B] [--shared-memory none|system|cuda]
                         [--json F] [--csv F] [--plot F.png]
                         [--lengths lognormal:mean=50,cap=512,seed=1 | fixed:N | file:PATH] [--parameter KEY=VALUE]
                         (--lengths: variable-length models get seeded random lengths; see client/lengths.py)
  python -m client generate --model gpt2 --url HOST:PORT --ids 1,2,3 --max-tokens N [--end-id ID]
  python -m client generate --model gpt2 --url HOST:PORT --rate R --requests N [--json F] [--plot F.png]
                            (streams tokens over gRPC; see client/generate.py)

Exit status: 0 on success, 1 when a request failed or the server cannot be
reached (a bench with errors still writes its rows), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import numpy as np

from client import bench, lengths
from client.api import PROTOCOLS, Client, ClientError, SharedMemoryRegions, check_shared_memory, result_arrays
from client.cli import INTERRUPTED, UsageError, run_main, server_url, unreachable
from client.inputs import TensorInfo, load_inputs, random_inputs
from opara_core.cli_helpers import Parser, config_from_args, positive_int, positive_int_list


def _parser() -> Parser:
    parser = Parser(prog="python -m client", description="Triton client: one request, or a latency sweep")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", required=True)
        p.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
        p.add_argument("--url", help="HOST:PORT (default localhost:8001 for grpc, localhost:8000 for http)")
        p.add_argument(
            "--batch", type=positive_int, default=None, help="rows per request (default 1, or the batch of --input)"
        )
        p.add_argument(
            "--input",
            action="append",
            default=[],
            metavar="FILE.npy",
            help="real data: FILE.npy (one-input model), NAME=FILE.npy or FILE.npz; repeatable; "
            "other inputs get random data",
        )
        p.add_argument(
            "--timeout", type=float, default=60.0, metavar="S", help="per-request timeout in seconds (default 60)"
        )
        p.add_argument(
            "--shared-memory",
            choices=bench.SHARED_MEMORY_MODES,
            default="none",
            help="none: tensors in the message; system: /dev/shm regions (client on the server's host); "
            "cuda: GPU memory shared by CUDA IPC (client on the server's GPU host)",
        )

    infer = sub.add_parser("infer", help="send one request and summarise the outputs")
    common(infer)
    infer.add_argument(
        "--classes",
        type=int,
        default=5,
        metavar="K",
        help="top K classes of each class-score output, by Triton's classification extension (default 5; 0: the "
        "tensors; with --shared-memory the outputs always come back whole)",
    )

    run = sub.add_parser("bench", help="closed-loop latency and throughput at each concurrency")
    common(run)
    run.add_argument("--concurrency", type=positive_int_list, required=True, help="levels, e.g. 1,2,4")
    amount = run.add_mutually_exclusive_group(required=True)
    amount.add_argument("--requests", type=positive_int, help="measured requests per concurrency level")
    amount.add_argument("--duration", type=float, metavar="S", help="measured seconds per concurrency level")
    run.add_argument(
        "--lengths",
        metavar="SPEC",
        help="variable-length models: seeded request lengths, lognormal:mean=50,cap=512,seed=1 | fixed:N | file:PATH",
    )
    run.add_argument(
        "--parameter", action="append", default=[], metavar="KEY=VALUE", help="a request parameter sent with every request (repeatable)"
    )
    run.add_argument(
        "--warmup", type=int, default=2, help="unmeasured requests per worker before each level (default 2)"
    )
    run.add_argument("--json", type=Path, help="write {model, protocol, results: [rows]} here")
    run.add_argument("--csv", type=Path, help="write the rows here")
    run.add_argument("--plot", type=Path, help="PNG: latency percentiles and throughput against concurrency")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    from client.generate import add_arguments

    add_arguments(sub.add_parser("generate", help="stream generated tokens over gRPC, or a Poisson load of them"))
    return parser


def infer(args: argparse.Namespace) -> int:
    url = server_url(args.url, args.protocol)
    check_shared_memory(args.shared_memory)
    with Client(url, args.protocol, args.timeout) as client, ExitStack() as regions:
        try:
            info = client.model_info(args.model)
            arrays = load_inputs(info, args.input, args.batch) if args.input else random_inputs(info, args.batch or 1)
            batch = next(iter(arrays.values())).shape[0] if info.batching else 1
            shm, classes = None, {t.name: args.classes if class_scores(t) else 0 for t in info.outputs}
            if args.shared_memory != "none":  # Triton's classification extension cannot write into a region
                outputs = {t.name: (t.dtype, info.full_shape(t, batch)) for t in info.outputs}
                shm = regions.enter_context(SharedMemoryRegions(client, arrays, outputs, args.shared_memory))
                classes = dict.fromkeys(classes, 0)
            request = client.request(args.model, arrays, shm, class_count=None if shm else classes)
            start = time.perf_counter()
            result = client.infer(request)
            elapsed_ms = (time.perf_counter() - start) * 1000
            outputs = result_arrays(request, result, [t.name for t in info.outputs])
        except ClientError as error:
            raise unreachable(error, url, args.protocol) from None
    shapes = ", ".join(f"{name} {list(a.shape)}" for name, a in arrays.items())
    memory = "" if args.shared_memory == "none" else f", {args.shared_memory} shared memory"
    print(f"{args.model} over {args.protocol} at {url}{memory}: {elapsed_ms:.1f} ms; inputs {shapes}")
    for tensor in info.outputs:
        array = outputs[tensor.name]
        if classes[tensor.name]:
            print(summarize_classes(tensor.name, array, f"{tensor.dtype} {list(info.full_shape(tensor, batch))}"))
        else:
            print(summarize_output(tensor.name, array))
    return 0


def class_scores(tensor: TensorInfo) -> bool:
    """Whether an output looks like class scores: a float vector per row."""
    return tensor.dtype.kind == "f" and len(tensor.shape) == 1 and tensor.shape[0] >= 5


def summarize_output(name: str, array: np.ndarray) -> str:
    """Shape and value range."""
    line = f"{name}: {array.dtype} {list(array.shape)}"
    if array.size and array.dtype.kind in "fiub":
        values = array.astype(np.float64)
        line += f"  min {values.min():.4g}  mean {values.mean():.4g}  max {values.max():.4g}"
    return line


def summarize_classes(name: str, array: np.ndarray, described: str, rows_shown: int = 4) -> str:
    """The top classes Triton's classification extension returned for each
    row: BYTES entries "score:index" (":label" where the model has labels),
    best first."""
    rows = array.reshape(-1, array.shape[-1]) if array.ndim else array.reshape(1, 1)
    lines = [f"{name}: {described} (top {rows.shape[1]} per row from Triton's classification extension)"]
    for index, row in enumerate(rows[:rows_shown]):
        parts = [(entry.decode() if isinstance(entry, bytes) else str(entry)).split(":") for entry in row]
        top = ", ".join(f"{p[1]}{' ' + p[2] if len(p) > 2 else ''} ({float(p[0]):.3f})" for p in parts)
        lines.append(f"  row {index} top-{len(parts)}: {top}")
    if len(rows) > rows_shown:
        lines.append(f"  ... {len(rows) - rows_shown} more rows")
    return "\n".join(lines)


def request_parameter(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--parameter {text!r}: give KEY=VALUE")
    return key, value


def run_bench(args: argparse.Namespace) -> int:
    url = server_url(args.url, args.protocol)
    try:
        config = config_from_args(
            bench.BenchConfig,
            args,
            url=url,
            duration_s=args.duration,
            timeout_s=args.timeout,
            input_files=tuple(args.input),
            progress=not args.no_progress,
            parameters=tuple(request_parameter(p) for p in args.parameter),
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    amount = f"{args.requests} requests" if args.requests else f"{args.duration:g} s"
    batch = args.batch or ("from --input" if args.input else 1)
    shapes = f", lengths {lengths.parse(args.lengths).describe()}" if args.lengths else ""
    print(
        f"{args.model} over {args.protocol} at {url}: batch {batch}{shapes}, shared memory {config.shared_memory}, "
        f"{amount} per level, concurrency {','.join(map(str, config.concurrency))}",
        flush=True,
    )
    try:
        result = bench.run(config, stop=INTERRUPTED)
    except ClientError as error:
        if INTERRUPTED.is_set():  # the interrupt surfaced as a failed call
            raise KeyboardInterrupt from None
        raise unreachable(error, url, args.protocol) from None
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt
    print(bench.format_table(result.rows))
    if args.json:
        bench.write_json(args.json, result)
    if args.csv:
        bench.write_csv(args.csv, result.rows)
    if args.plot:
        from client.plots import plot_bench

        title = f"{args.model} over {args.protocol}, batch {result.batch}, shared memory {config.shared_memory}"
        plot_bench([asdict(row) for row in result.rows], args.plot, title)
    for path in (args.json, args.csv, args.plot):
        if path:
            print(f"wrote {path}")
    if result.errors:
        total = sum(row.requests for row in result.rows)
        print(f"error: {result.errors} of {total} requests failed: {'; '.join(result.error_messages)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}")
    if args.command == "infer" and args.classes < 0:
        raise UsageError(f"--classes must be >= 0, got {args.classes}")
    if args.command == "generate":
        from client.generate import main as generate

        return generate(args, INTERRUPTED)
    return infer(args) if args.command == "infer" else run_bench(args)


if __name__ == "__main__":
    sys.exit(run_main(main))
