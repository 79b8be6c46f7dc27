"""Streaming generation over gRPC: one request's tokens as they arrive, or a
load of Poisson arrivals with time to first token and time per output token.

  python -m client generate --model gpt2 --ids 1,2,3 --max-tokens 16 [--end-id N]
  python -m client generate --model gpt2 --rate 4 --requests 64 [--prompt-len 4,64]
                            [--output-len 4,64] [--seed 0] [--json F] [--plot F.png]

A decoupled model answers each request with its tokens as they come (one per
response, or several when the server merged a slow stream's) and a last
empty response flagged final, which the client asks for with
`enable_empty_final_response` (without it, the end of a request is invisible).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from client.api import ClientError, admin_headers, describe, classify
from client import lengths
from client.inputs import InputError
from client.lengths import LengthSpec

OUTPUT = "output_ids"


def _inputs(ids: list[int], max_tokens: int, end_id: int | None) -> list:
    import tritonclient.grpc as grpcclient

    arrays = {"input_ids": np.asarray(ids, dtype=np.int64), "max_tokens": np.asarray([max_tokens], dtype=np.int32)}
    if end_id is not None:
        arrays["end_id"] = np.asarray([end_id], dtype=np.int64)
    tensors = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "INT32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _token_count(result) -> int:
    """Tokens in one streamed response: output_ids' shape, without decoding it."""
    outputs = [o for o in result.get_response().outputs if o.name == OUTPUT]
    return int(np.prod(outputs[0].shape)) if outputs else 0


def _is_final(result) -> bool:
    parameters = result.get_response().parameters
    return "triton_final_response" in parameters and parameters["triton_final_response"].bool_param


class TokenStream:
    """One generation request on its own gRPC stream.

    Each event lands in `events`: ("token", t, id), ("end", t, None) or
    ("error", t, message), with t from time.perf_counter(). One stream per
    request because tritonclient reports a streamed error without its request
    id, so on a shared stream an error could not be told apart.
    """

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        import tritonclient.grpc as grpcclient

        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.client = grpcclient.InferenceServerClient(url)
        try:
            self.client.start_stream(callback=self._callback, stream_timeout=timeout_s, headers=admin_headers("grpc", url) or None)
        except Exception as error:  # noqa: BLE001
            self.client.close()
            raise ClientError(f"cannot open a stream to {url}: {describe(error)}", classify(error)) from None

    def send(self, model: str, ids: list[int], max_tokens: int, end_id: int | None = None) -> TokenStream:
        self.client.async_stream_infer(model, _inputs(ids, max_tokens, end_id), enable_empty_final_response=True)
        return self

    def _callback(self, result, error) -> None:
        now = time.perf_counter()
        if error is not None:
            self.events.put(("error", now, describe(error)))
        elif _is_final(result):
            self.events.put(("end", now, None))
        else:
            for token in result.as_numpy(OUTPUT).reshape(-1).tolist():  # several when the server merged them
                self.events.put(("token", now, token))

    def close(self, cancel: bool = False) -> None:
        """End the stream; `cancel` cancels a request still generating."""
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)


def tokens(events: queue.SimpleQueue, timeout_s: float = 60.0) -> Iterator[tuple[float, int]]:
    """(arrival time, token) for one request until its final response; a
    server error or a silent stream raises ClientError."""
    while True:
        try:
            kind, when, value = events.get(timeout=timeout_s)
        except queue.Empty:
            raise ClientError(f"no response in {timeout_s:g} s", "timeout") from None
        if kind == "end":
            return
        if kind == "error":
            raise ClientError(value)
        yield when, value


def generate_once(url: str, model: str, ids: list[int], max_tokens: int, end_id: int | None, timeout_s: float) -> int:
    """Print tokens as they arrive, then time to first token and per token."""
    with TokenStream(url, timeout_s) as stream:
        start = time.perf_counter()
        stream.send(model, ids, max_tokens, end_id)
        times = []
        for when, token in tokens(stream.events, timeout_s):
            times.append(when)
            print(token, end=" ", flush=True)
        print()
    if times:
        per_token = (times[-1] - times[0]) / (len(times) - 1) * 1000 if len(times) > 1 else float("nan")
        print(f"{len(times)} tokens; first after {(times[0] - start) * 1000:.1f} ms, then {per_token:.2f} ms per token")
    return 0


# --- the load generator -----------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    """Poisson arrivals at `rate` requests/s; prompt lengths drawn uniformly
    from the inclusive range, output lengths from theirs or from a seeded
    length distribution (client.lengths: a long tail is where request-level
    batching waits longest), all from `seed`."""

    model: str
    url: str
    rate: float
    requests: int
    prompt_len: tuple[int, int] = (4, 64)
    output_len: tuple[int, int] | LengthSpec = (4, 64)
    seed: int = 0
    vocab: int = 50257
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.rate > 0 or self.requests < 1:
            raise ValueError("--rate must be > 0 and --requests >= 1")
        for name in ("prompt_len", "output_len"):
            if isinstance(getattr(self, name), LengthSpec):
                continue
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"--{name.replace('_', '-')} must be LOW,HIGH with 1 <= LOW <= HIGH")


@dataclass
class Outcome:
    """One request of a load run (times in seconds from its send)."""

    prompt_len: int
    max_tokens: int
    tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    error: str | None = None
    lag_s: float = 0.0  # how late it was sent against its planned arrival (the load generator's own delay)

    @property
    def normalized_latency_s(self) -> float | None:
        """Orca's normalized latency: the whole request's time (waiting and
        prefill included, unlike TPOT) per generated token."""
        return self.latency_s / self.tokens if self.latency_s is not None and self.tokens else None


@dataclass
class LoadResult:
    config: dict
    outcomes: list[Outcome] = field(default_factory=list)
    duration_s: float = 0.0

    def summary(self) -> dict:
        good = [o for o in self.outcomes if o.error is None]
        ttft = [o.ttft_s for o in good if o.ttft_s is not None]
        tpot = [o.tpot_s for o in good if o.tpot_s is not None]
        normalized = [o.normalized_latency_s for o in good if o.normalized_latency_s is not None]

        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q) * 1000) if values else None

        return {
            "requests": len(self.outcomes),
            "errors": len(self.outcomes) - len(good),
            "duration_s": self.duration_s,
            "requests_per_s": len(good) / self.duration_s if self.duration_s else 0.0,
            "tokens_per_s": sum(o.tokens for o in good) / self.duration_s if self.duration_s else 0.0,
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99),
            "norm_latency_p50_ms": pct(normalized, 50),
            "norm_latency_p99_ms": pct(normalized, 99),
            "send_lag_p99_ms": pct([o.lag_s for o in self.outcomes], 99),
        }


def plan_load(config: LoadConfig) -> list[tuple[float, list[int], int]]:
    """(send time from the start, prompt, max_tokens) per request, seeded."""
    rng = np.random.default_rng(config.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / config.rate, config.requests))
    spec = config.output_len if isinstance(config.output_len, LengthSpec) else None
    outputs = spec.lengths(config.requests) if spec else None
    plan = []
    for i, at in enumerate(arrivals):
        length = int(rng.integers(config.prompt_len[0], config.prompt_len[1] + 1))
        prompt = rng.integers(0, config.vocab, length).tolist()
        max_tokens = int(outputs[i]) if spec else int(rng.integers(config.output_len[0], config.output_len[1] + 1))
        plan.append((float(at), prompt, max_tokens))
    return plan


def run_load(config: LoadConfig, stop: threading.Event | None = None) -> LoadResult:
    """Send the planned requests at their arrival times; collect per-request timings.

    All requests share one gRPC channel and one asyncio event loop (each on
    its own stream of that channel, so an error belongs to its request). The
    first version opened a client, a channel and a callback thread per
    request: on the H100 at 48 requests/s and more it sent 1-3 s late
    (docs/benchmarks.md, generation's third run), and every token's arrival
    time waited for the GIL among hundreds of threads. A request not sent by
    the time `stop` is set is left out.
    """
    return asyncio.run(_run_load(config, stop))


async def _run_load(config: LoadConfig, stop: threading.Event | None) -> LoadResult:
    import tritonclient.grpc.aio as grpcaio

    result = LoadResult(config=asdict(config))
    client = grpcaio.InferenceServerClient(config.url)
    start = time.perf_counter()
    try:
        tasks = [asyncio.create_task(_one_request(client, config, start, *planned, stop)) for planned in plan_load(config)]
        sent = [done for done in await asyncio.gather(*tasks) if done is not None]
    finally:
        await client.close()
    result.outcomes = [outcome for _, outcome in sent]
    # from the first send to the last token received
    ends = [sent_at + o.latency_s for sent_at, o in sent if o.latency_s is not None]
    result.duration_s = (max(ends) if ends else time.perf_counter()) - start
    return result


async def _one_request(client, config: LoadConfig, start: float, at: float, prompt: list[int], max_tokens: int, stop: threading.Event | None) -> tuple[float, Outcome] | None:
    """One planned request on its own stream: (send time, outcome), or None if
    `stop` came first. The stream stays open until the final response."""
    delay = start + at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if stop is not None and stop.is_set():
        return None
    finished = asyncio.Event()

    async def request():
        yield {
            "model_name": config.model,
            "inputs": _inputs(prompt, max_tokens, None),
            "parameters": {"triton_enable_empty_final_response": True},
        }
        await finished.wait()  # closing the request side early would end the stream

    sent_at = time.perf_counter()
    outcome = Outcome(len(prompt), max_tokens, lag_s=sent_at - (start + at))
    times: list[float] = []
    responses = client.stream_infer(request(), headers=admin_headers("grpc", config.url) or None)
    try:
        while True:
            try:
                response, error = await asyncio.wait_for(anext(responses), config.timeout_s)
            except asyncio.TimeoutError:
                raise ClientError(f"no response in {config.timeout_s:g} s", "timeout") from None
            now = time.perf_counter()
            if error is not None:
                raise ClientError(describe(error))
            if _is_final(response):
                break
            times += [now] * _token_count(response)
    except StopAsyncIteration:
        outcome.error = "the stream ended before the final response"
    except ClientError as error:
        outcome.error = str(error)
    except Exception as error:  # noqa: BLE001 - gRPC's own errors: this request failed, the others go on
        outcome.error = describe(error)
    finally:
        finished.set()
        if outcome.error is not None:
            responses.cancel()
    outcome.tokens = len(times)
    if times:
        outcome.ttft_s = times[0] - sent_at
        outcome.latency_s = times[-1] - sent_at
        if len(times) > 1:
            outcome.tpot_s = (times[-1] - times[0]) / (len(times) - 1)
    return sent_at, outcome


def format_summary(summary: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    return (
        f"{summary['requests']} requests ({summary['errors']} errors) in {summary['duration_s']:.1f} s: "
        f"{summary['requests_per_s']:.2f} req/s, {summary['tokens_per_s']:.1f} tokens/s; "
        f"TTFT p50 {ms(summary['ttft_p50_ms'])} ms, p99 {ms(summary['ttft_p99_ms'])} ms; "
        f"TPOT p50 {ms(summary['tpot_p50_ms'])} ms, p99 {ms(summary['tpot_p99_ms'])} ms; "
        f"latency per token p50 {ms(summary['norm_latency_p50_ms'])} ms, p99 {ms(summary['norm_latency_p99_ms'])} ms"
    )


def write_json(path: Path, result: LoadResult) -> None:
    payload = {"config": result.config, "summary": result.summary(), "requests": [asdict(o) for o in result.outcomes]}
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def plot_load(result: LoadResult, path: Path) -> None:
    """Distributions of time to first token and time per output token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, name, values in (
        (axes[0], "time to first token (ms)", [o.ttft_s * 1000 for o in result.outcomes if o.ttft_s is not None]),
        (axes[1], "time per output token (ms)", [o.tpot_s * 1000 for o in result.outcomes if o.tpot_s is not None]),
    ):
        if values:
            ordered = np.sort(values)
            axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered))
        axis.set_xlabel(name)
        axis.set_ylabel("fraction of requests")
        axis.grid(True, alpha=0.3)
    config = result.config
    figure.suptitle(f"{config['model']}: {config['rate']:g} req/s Poisson, {config['requests']} requests")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# --- the command line: python -m client generate ------------------------------------------------


def _id_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids like 1,2,3, got {text!r}")
    return values


def _range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH like 4,64, got {text!r}") from None
    return low, high


def output_lengths(text: str) -> tuple[int, int] | LengthSpec:
    """--output-len: LOW,HIGH (uniform) or a length SPEC of client.lengths."""
    if ":" not in text:
        return _range(text)
    try:
        return lengths.parse(text)
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--url", default="localhost:8001", help="gRPC HOST:PORT (default localhost:8001)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S", help="longest wait for the next token (default 60)")
    one = parser.add_argument_group("one request")
    one.add_argument("--ids", type=_id_list, help="prompt token ids, e.g. 1,2,3")
    one.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    one.add_argument("--end-id", type=int, help="stop after generating this id")
    load = parser.add_argument_group("load (Poisson arrivals)")
    load.add_argument("--rate", type=float, help="requests per second")
    load.add_argument("--requests", type=int, default=64, help="requests to send (default 64)")
    load.add_argument("--prompt-len", type=_range, default=(4, 64), help="LOW,HIGH prompt tokens (default 4,64)")
    load.add_argument(
        "--output-len", type=output_lengths, default=(4, 64),
        help="LOW,HIGH generated tokens (default 4,64), or a SPEC such as lognormal:mean=64,cap=384,seed=1",
    )  # fmt: skip
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--json", type=Path, help="write the summary and every request's timings here")
    load.add_argument("--plot", type=Path, help="PNG: distributions of TTFT and TPOT")


def main(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Exit 0 on success, 1 when a request failed (raised as ClientError)."""
    from client.api import parse_url
    from client.cli import UsageError

    if (args.ids is None) == (args.rate is None):
        raise UsageError("give either --ids (one request) or --rate (a load)")
    try:
        url = parse_url(args.url, "grpc")
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.ids is not None:
        if args.max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        return generate_once(url, args.model, args.ids, args.max_tokens, args.end_id, args.timeout)
    try:
        config = LoadConfig(
            model=args.model, url=url, rate=args.rate, requests=args.requests, prompt_len=args.prompt_len,
            output_len=args.output_len, seed=args.seed, timeout_s=args.timeout,
        )  # fmt: skip
    except ValueError as error:
        raise UsageError(str(error)) from None
    result = run_load(config, stop)
    summary = result.summary()
    print(format_summary(summary))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        plot_load(result, args.plot)
        print(f"wrote {args.plot}")
    if summary["errors"]:
        first = next(o.error for o in result.outcomes if o.error)
        raise ClientError(f"{summary['errors']} of {summary['requests']} requests failed: {first}")
    return 0
