"""A validating reverse proxy on the public HTTP port, in front of tritonserver's
own HTTP port (which then listens on loopback only).

Why: Triton 2.51's HTTP front end allocates a request's tensors from the
shapes it declares before anything checks them against the data sent, so one
small JSON request that declares a huge shape ends the server with
std::bad_alloc (SIGABRT), every model with it. Model code never sees such a
request. The guard reads each inference request (up to a size the model can
use), checks every input's declared shape against the data it carries and
against the model's config (`max_batch_size`, `dims`, fetched once per model
from Triton's loopback API), and answers a request that fails with HTTP 400
(413 for a body above the model's size) in Triton's own `{"error": ...}` form.
Everything else passes through unchanged: method, path, query, headers (the
admin key included), body, status and response body (streamed).

It also serves `GET /metrics` (Prometheus text): requests refused by reason,
and the server restarts the launcher reports in its status file.

One guard is several worker processes on one port (SO_REUSEPORT: the kernel
hands each connection to one of them; `--workers`, by default one per four
usable CPUs, at most four): a single Python process held GoogLeNet's HTTP
throughput at 0.67-0.70 of unguarded Triton on a 16-core H200 host. The
workers count refusals in shared memory, so /metrics on any of them reports
the guard's totals.

CLI (the launcher starts it): `python -m opara_core.serving.http_guard
--listen HOST:PORT --upstream 127.0.0.1:PORT [--status-file FILE] [--workers N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import aiohttp
import uvloop
from aiohttp import web
from yarl import URL

from opara_core.cpus import usable_cpus
from opara_core.serving.guard_metrics import metrics_text
from opara_core.serving.launcher import MAX_GUARD_WORKERS, die_with_parent
from opara_core.serving.nginx_guard import BODY_LIMIT

log = logging.getLogger(__name__)

# bytes per element; BYTES has none (each element is a 4-byte length, then the bytes)
ELEMENT_BYTES = {
    "BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FP16": 2, "BF16": 2,
    "INT32": 4, "UINT32": 4, "FP32": 4, "INT64": 8, "UINT64": 8, "FP64": 8, "BYTES": None,
}  # fmt: skip
HEADER_LIMIT = 1 << 20  # bytes of JSON beside the tensors (names, shapes, parameters)
JSON_BYTES_PER_VALUE = 32  # the longest JSON text of one number, separator and spaces included
OTHER_BODY_LIMIT = 1 << 20  # bytes: bodies of every request that is not an inference
OPEN_BODY_LIMIT = BODY_LIMIT  # bytes: an inference whose model sets no bound (an open dim, BYTES, unknown); nginx's too
MAX_INPUTS = 256
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
}  # fmt: skip
LIMITS_KEY = web.AppKey("limits", dict)
STATE_KEY = web.AppKey("state", object)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REASONS = ("invalid", "json", "size", "unavailable")  # why the guard answered a request itself (/metrics)


class Refused(Exception):
    """A request the guard does not pass on: HTTP `status` with `message`."""

    def __init__(self, message: str, status: int = 400, reason: str = "invalid"):
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class ModelLimits:
    """What a model accepts, from its config: `max_batch_size` (0: no batch
    dimension) and each input's datatype and dims (-1: any size)."""

    name: str
    max_batch_size: int
    inputs: dict[str, tuple[str, tuple[int, ...]]]

    @classmethod
    def from_config(cls, config: dict) -> "ModelLimits":
        inputs = {}
        for tensor in config.get("input", []):
            datatype = str(tensor.get("data_type", "")).removeprefix("TYPE_").replace("STRING", "BYTES")
            inputs[tensor["name"]] = (datatype, tuple(int(d) for d in tensor.get("dims", [])))
        return cls(str(config.get("name", "")), int(config.get("max_batch_size", 0)), inputs)

    def max_elements(self) -> int | None:
        """Elements of the largest valid request, all inputs (None: a dim is open)."""
        total = 0
        for _, dims in self.inputs.values():
            if any(d < 0 for d in dims):
                return None
            total += max(self.max_batch_size, 1) * math.prod(dims)
        return total

    def body_limit(self, binary: bool) -> int:
        """Bytes of the largest body a valid request can have."""
        if binary:
            sizes = [ELEMENT_BYTES.get(datatype) for datatype, _ in self.inputs.values()]
            if any(size is None for size in sizes):
                return OPEN_BODY_LIMIT
            total = 0
            for (datatype, dims), size in zip(self.inputs.values(), sizes):
                if any(d < 0 for d in dims):
                    return OPEN_BODY_LIMIT
                total += max(self.max_batch_size, 1) * math.prod(dims) * size
            return HEADER_LIMIT + total
        elements = self.max_elements()
        return OPEN_BODY_LIMIT if elements is None else HEADER_LIMIT + JSON_BYTES_PER_VALUE * elements

    def check_shape(self, name: str, shape: list[int]) -> None:
        """The shape fits the config (Triton's own words, so clients see the
        same errors with and without the guard)."""
        if name not in self.inputs:
            return  # Triton names unknown inputs itself, with no allocation first
        dims = self.inputs[name][1]
        batched = self.max_batch_size > 0
        expected = ([-1] if batched else []) + list(dims)
        if len(shape) != len(expected) or any(e >= 0 and s != e for s, e in zip(shape, expected)):
            raise Refused(
                f"unexpected shape for input '{name}' for model '{self.name}'. "
                f"Expected [{','.join(map(str, expected))}], got [{','.join(map(str, shape))}]"
            )
        if batched and shape[0] > self.max_batch_size:
            raise Refused(
                f"input '{name}': inference request batch-size {shape[0]} must be <= {self.max_batch_size} "
                f"for '{self.name}'"
            )


def check_inference(body: bytes, header_length: int | None, limits: ModelLimits | None) -> None:
    """Raise Refused unless every input's declared shape matches the data it
    carries (and, with `limits`, the model's config). `header_length` is the
    Inference-Header-Content-Length of a binary-tensor body."""
    if header_length is not None and not 0 < header_length <= len(body):
        raise Refused(f"inference header size should be in range (0, {len(body)}], got: {header_length}")
    header_bytes = body if header_length is None else body[:header_length]
    try:
        request = json.loads(header_bytes)
    except (ValueError, RecursionError) as error:
        message = str(error) if not isinstance(error, RecursionError) else "nested too deeply"
        raise Refused(f"failed to parse the request JSON buffer: {message}", reason="json") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise Refused("the request must be a JSON object with a list of 'inputs'", reason="json")
    inputs = request["inputs"]
    if len(inputs) > MAX_INPUTS:
        raise Refused(f"{len(inputs)} inputs, more than {MAX_INPUTS}")
    binary_total = 0
    for position, tensor in enumerate(inputs):
        binary_total += _check_input(position, tensor, limits)
    if header_length is not None and binary_total != len(body) - header_length:
        raise Refused(
            f"the inputs declare {binary_total} bytes of binary data, the body carries {len(body) - header_length}"
        )
    _check_outputs(request.get("outputs"))


def _check_input(position: int, tensor, limits: ModelLimits | None) -> int:
    """Check one input; its binary_data_size (0 for JSON data or shared memory)."""
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise Refused(f"input {position} must be an object with a 'name'")
    name = tensor["name"]
    shape, datatype = tensor.get("shape"), tensor.get("datatype")
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        raise Refused(f"input '{name}': 'shape' must be a list of integers")
    if any(d < 0 for d in shape):
        raise Refused(f"input '{name}': shape {shape} has a negative dimension")
    if datatype not in ELEMENT_BYTES:
        raise Refused(f"input '{name}': unknown datatype {datatype!r}")
    if limits is not None:
        limits.check_shape(name, shape)
    elements = math.prod(shape)
    parameters = tensor.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise Refused(f"input '{name}': 'parameters' must be an object")
    size = ELEMENT_BYTES[datatype]
    if "shared_memory_region" in parameters:
        return 0  # Triton checks the region's registered size against the shape
    if "binary_data_size" in parameters:
        declared = parameters["binary_data_size"]
        if type(declared) is not int or declared < 0:
            raise Refused(f"input '{name}': binary_data_size must be a non-negative integer")
        if "data" in tensor:
            raise Refused(f"input '{name}' has both 'data' and binary_data_size")
        wanted = 4 * elements if size is None else elements * size  # BYTES: at least the lengths
        if (size is None and declared < wanted) or (size is not None and declared != wanted):
            raise Refused(
                f"input '{name}': shape {shape} of {datatype} needs {wanted} bytes, binary_data_size is {declared}"
            )
        return declared
    if "data" not in tensor:
        raise Refused(f"input '{name}' has no data")
    count = _leaves(tensor["data"], name)
    if count != elements:
        raise Refused(f"input '{name}': shape {shape} needs {elements} values, its data has {count}")
    return 0


def _leaves(data, name: str) -> int:
    """How many scalars a JSON `data` holds, however it nests (no recursion)."""
    count, stack = 0, [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            raise Refused(f"input '{name}': data holds an object")
        else:
            count += 1
    return count


def _check_outputs(outputs) -> None:
    if outputs is None:
        return
    if not isinstance(outputs, list) or len(outputs) > MAX_INPUTS:
        raise Refused(f"'outputs' must be a list of at most {MAX_INPUTS} objects")
    for output in outputs:
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise Refused("each output must be an object with a 'name'")
        parameters = output.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise Refused(f"output '{output['name']}': 'parameters' must be an object")
        classes = parameters.get("classification")
        if classes is not None and (type(classes) is not int or not 0 <= classes <= 1 << 16):
            raise Refused(f"output '{output['name']}': classification must be an integer in [0, 65536]")


# --- the proxy --------------------------------------------------------------------------------


class Refusals:
    """Requests refused, by reason, in memory shared by every worker of one
    guard (made before the workers fork)."""

    def __init__(self) -> None:
        self._counts = multiprocessing.get_context("fork").Array("q", len(REASONS))

    def add(self, reason: str) -> None:
        with self._counts.get_lock():
            self._counts[REASONS.index(reason)] += 1

    def items(self) -> list[tuple[str, int]]:
        """(reason, count) of every reason counted at least once."""
        with self._counts.get_lock():
            return [(reason, count) for reason, count in zip(REASONS, self._counts[:]) if count]


@dataclass
class GuardState:
    """The counters and the upstream session of one guard worker."""

    upstream: str
    status_file: Path | None
    session: aiohttp.ClientSession | None = None
    refused: Refusals = field(default_factory=Refusals)
    limits: dict[str, ModelLimits] = field(default_factory=dict)
    active: int = 0  # requests being handled


def _model_of(path: str) -> tuple[str, str] | None:
    """(model, action) of `/v2/models/<model>[/versions/<v>]/<action>`."""
    parts = path.split("/")
    if len(parts) < 5 or parts[:3] != ["", "v2", "models"]:
        return None
    if len(parts) == 7 and parts[4] == "versions":
        return parts[3], parts[6]
    return (parts[3], parts[4]) if len(parts) == 5 else None


async def _limits(state: GuardState, model: str) -> ModelLimits | None:
    """The model's limits from Triton's config API (cached; None: unknown model)."""
    if model in state.limits:
        return state.limits[model]
    async with state.session.get(f"http://{state.upstream}/v2/models/{quote(model, safe='')}/config") as response:
        if response.status != 200:
            return None
        limits = ModelLimits.from_config(await response.json(content_type=None))
    state.limits[model] = limits
    return limits


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refused as soon as it passes `limit` bytes (chunked too)."""
    if request.content_length is not None and request.content_length > limit:
        raise Refused(f"a request body of {request.content_length} bytes is larger than the {limit} bytes allowed", 413, "size")
    chunks, total = [], 0
    async for chunk in request.content.iter_any():
        total += len(chunk)
        if total > limit:
            raise Refused(f"a request body of more than {limit} bytes is larger than allowed", 413, "size")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip or deflate body, inflated to at most `limit` bytes."""
    if encoding not in ("gzip", "deflate"):
        raise Refused(f"unsupported Content-Encoding {encoding!r}")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    cap = limit + 1
    try:
        plain = inflater.decompress(body, cap)
    except zlib.error as error:
        raise Refused(f"the {encoding} body cannot be decoded: {error}") from None
    if len(plain) >= cap or inflater.unconsumed_tail:
        raise Refused(f"the decoded body is larger than the {limit} bytes allowed", 413, "size")
    return plain


async def handle(request: web.Request) -> web.StreamResponse:
    state: GuardState = request.app[STATE_KEY]
    state.active += 1
    try:
        return await _handle(request, state)
    finally:
        state.active -= 1


async def _handle(request: web.Request, state: GuardState) -> web.StreamResponse:
    try:
        if request.method == "GET" and request.path == "/metrics":
            return web.Response(text=guard_metrics_text(state), content_type="text/plain", charset="utf-8")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if request.method == "POST" and ("infer" in request.raw_path.lower() or "infer" in request.path.lower()):
            target = _model_of(request.path)
            limits = None if target is None else await _limits(state, target[0])
            header_length = request.headers.get("Inference-Header-Content-Length")
            limit = OPEN_BODY_LIMIT if limits is None else limits.body_limit(binary=header_length is not None)
            body = await _read_body(request, limit)
            encoding = request.headers.get("Content-Encoding", "").strip().lower()
            if encoding not in ("", "identity"):
                body = _decode(body, encoding, limit)
                headers = {k: v for k, v in headers.items() if k.lower() != "content-encoding"}
            # an unknown model still gets the shape-against-data check: Triton
            # may route a path the guard does not parse
            check_inference(body, _header_length(header_length), limits)
        else:
            body = await _read_body(request, OTHER_BODY_LIMIT)
            _check_nesting(body)
        return await _forward(request, state, headers, body)
    except Refused as refused:
        state.refused.add(refused.reason)
        log.debug("refused %s %s: %s", request.method, request.path, refused)
        return web.json_response({"error": str(refused)}, status=refused.status)
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
        state.limits.clear()  # the server may come back with another repository
        state.refused.add("unavailable")
        return web.json_response({"error": f"the inference server is unavailable ({type(error).__name__})"}, status=503)


def _check_nesting(body: bytes) -> None:
    """Refuse JSON nested deeper than Python's parser goes (about 1,000 levels):
    Triton's parser overflows its stack on a few hundred thousand, on every
    endpoint that reads JSON (generate, the repository and settings APIs).
    A body that is not JSON is Triton's to refuse."""
    if body:
        try:
            json.loads(body)
        except RecursionError:
            raise Refused("failed to parse the request JSON buffer: nested too deeply", reason="json") from None
        except ValueError:
            pass


def _header_length(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise Refused(f"Inference-Header-Content-Length {value!r} is not a number") from None


async def _forward(request: web.Request, state: GuardState, headers: dict, body: bytes) -> web.StreamResponse:
    url = URL(f"http://{state.upstream}{request.raw_path}", encoded=True)
    if not any(k.lower() == "accept-encoding" for k in headers):
        # else aiohttp asks for gzip itself, and Triton's compressed answer would
        # reach a client that never asked for it (curl printed gzip bytes)
        headers = {**headers, "Accept-Encoding": "identity"}
    async with state.session.request(request.method, url, headers=headers, data=body or None) as upstream:
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        if "text/event-stream" not in upstream.headers.get("Content-Type", ""):
            return web.Response(status=upstream.status, headers=out_headers, body=await upstream.read())
        response = web.StreamResponse(status=upstream.status, headers=out_headers)
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


def guard_metrics_text(state: GuardState) -> str:
    """Prometheus text: refusals by reason, and the launcher's restarts (its status file)."""
    status = {}
    if state.status_file is not None:
        try:
            status = json.loads(state.status_file.read_text())
        except (OSError, ValueError):
            status = {}
    return metrics_text(dict(state.refused.items()), status.get("restarts", {}))


def make_app(upstream: str, status_file: Path | None = None, refused: Refusals | None = None) -> web.Application:
    # the body is read by `_read_body` with per-model limits, not aiohttp's 1 MiB default
    app = web.Application(client_max_size=0, handler_args={"max_field_size": 16384, "max_line_size": 16384})
    state = GuardState(upstream, status_file, refused=refused or Refusals())
    app[STATE_KEY] = state

    async def session(app: web.Application):
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        state.session = aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, connect=5))
        yield
        await state.session.close()

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def default_workers() -> int:
    """One worker per four usable CPUs, at most four: the rest are Triton's and its models'."""
    return max(1, min(4, usable_cpus() // 4))


def _workers(value: str) -> int:
    workers = int(value)
    if not 1 <= workers <= MAX_GUARD_WORKERS:
        raise argparse.ArgumentTypeError(f"workers must be 1 to {MAX_GUARD_WORKERS}, got {workers}")
    return workers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opara_core.serving.http_guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to serve")
    parser.add_argument("--upstream", required=True, help="tritonserver's HTTP HOST:PORT (loopback)")
    parser.add_argument("--status-file", type=Path, help="the launcher's status (restarts), for /metrics")
    parser.add_argument("--workers", type=_workers, default=None, help="worker processes (default: one per four usable CPUs, at most 4)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    workers = args.workers or default_workers()
    # held back until `serve` handles them: a stop asked for during the start still drains
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    listening = _listen(args.listen)  # the first worker's, bound before any other: a port in use fails here
    refused = Refusals()
    children = []
    for _ in range(workers - 1):  # forked before any event loop or thread exists
        pid = os.fork()
        if pid == 0:
            die_with_parent()
            listening.close()
            code = 0
            try:
                uvloop.run(serve(make_app(args.upstream, args.status_file, refused), _listen(args.listen)))
            except BaseException:  # noqa: BLE001 - a worker reports and exits; the parent sees it
                log.exception("guard worker %d failed", os.getpid())
                code = 1
            os._exit(code)
        children.append(pid)
    log.info("guarding %s with %d worker(s)", args.listen, workers)
    return uvloop.run(serve(make_app(args.upstream, args.status_file, refused), listening, children))


def _listen(address: str) -> socket.socket:
    """A listening socket of this worker's own on `address`, shared with the
    other workers through SO_REUSEPORT: the kernel spreads connections over
    the workers evenly (one socket accepted by all would wake them all and
    leave the connections to whichever came first)."""
    return socket.create_server(_host_port(address), backlog=1024, reuse_port=True)


async def serve(app: web.Application, listening: socket.socket, children: list[int] | None = None, shutdown_timeout_s: float = 60.0) -> int:
    """Serve on `listening` until SIGTERM or SIGINT, then close it at once and
    let the requests in flight finish. Unlike aiohttp's run_app, a second
    signal changes nothing (run_app would drop the requests in flight). The
    first worker (with the others' `children` pids) passes its signal on to
    them, waits for them, and stops them all, exiting 1, when one of them dies
    on its own: the launcher then starts the guard again."""
    children = children or []
    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout_s, access_log=None)
    await runner.setup()
    await web.SockSite(runner, listening).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop.set)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    lost = [] if not children else [asyncio.create_task(_lost_worker(children, stop))]
    await stop.wait()
    for site in list(runner.sites):
        await site.stop()  # the port closes at once
    listening.close()
    died = bool(lost) and lost[0].done()
    for task in lost:
        task.cancel()
    for pid in children:
        _signal(pid, signal.SIGTERM)
    # aiohttp's own shutdown stops reading request bodies, so a request whose
    # body was still arriving would hang: wait for a quiet moment first
    state, quiet_since, deadline = app[STATE_KEY], loop.time(), loop.time() + shutdown_timeout_s
    while loop.time() < deadline and loop.time() - quiet_since < 0.5:
        if state.active:
            quiet_since = loop.time()
        await asyncio.sleep(0.05)
    await runner.cleanup()
    for pid in children:
        await _reap(pid, deadline + 5)
    return 1 if died else 0


async def _lost_worker(children: list[int], stop: asyncio.Event) -> None:
    """Return (and stop the guard) once a worker has exited by itself."""
    while True:
        for pid in children:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                log.error("guard worker %d exited (%s); stopping the guard", pid, os.waitstatus_to_exitcode(status))
                children.remove(pid)
                stop.set()
                return
        await asyncio.sleep(0.5)


async def _reap(pid: int, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if loop.time() > deadline:
            _signal(pid, signal.SIGKILL)
        await asyncio.sleep(0.05)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
