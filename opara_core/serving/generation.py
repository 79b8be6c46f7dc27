"""The decoupled Triton adapter for generative zoo models (gpt2): streams tokens.

`execute` only validates and enqueues each request and returns at once. A
background thread runs the iteration-level scheduler (opara_core.planning.
iteration): at every iteration boundary it admits waiting requests (one
batched prefill into their own KV-cache slots), runs one batched decoding step
for all active requests (models.gpt2.SlotDecoder), hands each new token to a
sender thread at once, and retires a finished request at once (max_tokens
reached, end_id generated, or its client cancelled). A request that cannot be
taken (queue full, too long) gets a clear error; a failed step fails only the
requests in it. The parameter `scheduling: request` selects the request-level
baseline; everything else is the same code.

Responses go out on `sender_threads` threads (`Responder`): a Python-backend
send is a blocking round trip to the server process, and one thread sending a
token to each of 32 requests in turn spent most of every iteration waiting;
and since a send costs the same round trip whatever it carries, a stream
whose sender is behind gets its waiting tokens in one response.
The loop's time per iteration (prefill, step, drain, respond) and the senders'
time are counted (`GenerationStats`), exported as Prometheus counters and
logged every `LOG_SECONDS` while busy (an idle model logs nothing).

Every response carries the stream's next tokens in `output_ids` (one, unless
its sender fell behind and `merge_tokens` is on: see Responder); the last is
an empty response flagged TRITONSERVER_RESPONSE_COMPLETE_FINAL (gRPC clients
see it with `enable_empty_final_response`).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from opara_core import parameters, zoo
from opara_core.engine import precision
from opara_core.engine.compare import max_relative_error
from opara_core.models.gpt2 import GPT2Logits, SlotDecoder
from opara_core.planning.iteration import Limits, Rejected, Scheduler, Sequence
from opara_core.serving import weights
from opara_core.serving.startup import model_log_format, ready_line
from opara_core.serving.triton_backend import StageClock, input_tensor, output_tensor, select_device

log = logging.getLogger(__name__)

OUTPUT = "output_ids"


_DEFAULT = parameters.defaults(parameters.GENERATION_GROUP)


@dataclass(frozen=True)
class GenerationSettings:
    """config.pbtxt parameters of a generation model: each field is the
    parameter of its name, declared (type, default, allowed values, help) in
    opara_core.parameters and checked there (docs/configuration.md). What needs
    more than one field (the limits, config_overrides, admit_every with the
    scheduling) is checked here, by `from_values`."""

    scheduling: str = _DEFAULT["scheduling"]
    max_active: int = _DEFAULT["max_active"]
    max_context: int = _DEFAULT["max_context"]
    kv_tokens: int = _DEFAULT["kv_tokens"]
    max_queue: int = _DEFAULT["max_queue"]
    config_overrides: str = _DEFAULT["config_overrides"]
    cuda_graphs: bool = _DEFAULT["cuda_graphs"]
    sender_threads: int = _DEFAULT["sender_threads"]
    switch_interval_us: int = _DEFAULT["switch_interval_us"]
    merge_tokens: bool = _DEFAULT["merge_tokens"]
    admit_every: int = _DEFAULT["admit_every"]

    def __post_init__(self) -> None:
        parameters.check_fields(self, parameters.GENERATION_GROUP)

    def limits(self) -> Limits:
        return Limits(
            max_active=self.max_active,
            kv_tokens=self.kv_tokens or self.max_active * self.max_context,
            max_context=self.max_context,
            max_queue=self.max_queue,
        )

    def overrides(self) -> dict[str, int | float]:
        """config_overrides as GPT2Config keyword arguments."""
        result = {}
        for item in filter(None, (part.strip() for part in self.config_overrides.split(","))):
            key, sep, value = item.partition("=")
            try:
                result[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
            except ValueError:
                raise ValueError(f"config_overrides: expected key=number, got {item!r}") from None
            if not sep:
                raise ValueError(f"config_overrides: expected key=number, got {item!r}")
        return result

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> GenerationSettings:
        """The settings of a generation model's parameters (strings: `parameters.strings(config)`)."""
        return cls.from_values(parameters.parse(parameters.GENERATION, params))

    @classmethod
    def from_values(cls, values: parameters.Values) -> GenerationSettings:
        settings = cls(**values.settings(parameters.GENERATION_GROUP))
        settings.limits()  # raises on impossible limits
        settings.overrides()
        Scheduler(settings.limits(), settings.scheduling, settings.admit_every)  # raises on an unknown mode or admit_every
        return settings


def build_lm(entry: zoo.ZooModel, settings: GenerationSettings, weights_file: Path | None) -> torch.nn.Module:
    """The GPT2LMHeadModel to serve: seeded (optionally another configuration), or with user weights."""
    overrides = settings.overrides()
    if overrides:
        if weights_file is not None:
            raise ValueError("config_overrides and weights cannot be combined")
        module = small_gpt2(overrides)
    else:
        module = weights.load_module(entry, weights_file)
    if not isinstance(module, GPT2Logits):
        raise ValueError("generation needs a state_dict of the zoo model, not an exported program")
    return module.lm


def small_gpt2(overrides: dict[str, int | float]) -> GPT2Logits:
    """The zoo's GPT-2 with another configuration, seeded like the zoo."""
    from opara_core.models.gpt2 import gpt2_small

    torch.manual_seed(zoo.SEED)
    try:
        return GPT2Logits(gpt2_small(**overrides)).eval()
    except (TypeError, ValueError) as error:
        raise ValueError(f"config_overrides {overrides}: {error}") from None


def graph_buckets(max_active: int) -> tuple[int, ...]:
    """Active-batch sizes to capture: powers of two below max_active, and max_active."""
    return tuple(sorted({1 << i for i in range(max_active.bit_length()) if 1 << i < max_active} | {max_active}))


def step_spans(max_context: int) -> tuple[int, ...]:
    """Cache positions a decoding step's attention may read: powers of two
    from 64 below max_context, and max_context (a step of requests at 100
    positions reads 128 of a slot's 512, not all of them)."""
    return tuple(sorted({1 << i for i in range(6, max_context.bit_length()) if 1 << i < max_context} | {max_context}))


def prefill_shapes(max_active: int, max_context: int) -> tuple[tuple[int, int], ...]:
    """Prefill shapes to capture: up to 8 rows (graph_buckets), lengths in
    powers of two from 16 up to max_context, and max_context."""
    lengths = sorted({1 << i for i in range(4, max_context.bit_length()) if 1 << i < max_context} | {max_context})
    return tuple((rows, length) for rows in graph_buckets(min(8, max_active)) for length in lengths)


def make_decoder(lm: torch.nn.Module, settings: GenerationSettings, device: torch.device) -> SlotDecoder:
    """CUDA graphs per decoding bucket and prefill shape on a GPU (when
    enabled); eager elsewhere, or when the capture fails (logged; the model
    still serves)."""
    if device.type == "cuda" and settings.cuda_graphs:
        try:
            buckets, shapes = graph_buckets(settings.max_active), prefill_shapes(settings.max_active, settings.max_context)
            spans = step_spans(settings.max_context)
            return SlotDecoder(lm, settings.max_active, settings.max_context, device, buckets, capture=True, prefill_shapes=shapes, spans=spans)
        except Exception:  # noqa: BLE001 - serve eagerly rather than not at all
            log.exception("capturing the decoding step failed; decoding eagerly")
            torch.cuda.synchronize(device)
    return SlotDecoder(lm, settings.max_active, settings.max_context, device)


# the prompt a precision guard decodes (seeded ids, this many positions or max_context)
CHECK_PROMPT = 32


def decoder_in_precision(
    lm: torch.nn.Module, settings: GenerationSettings, device: torch.device, asked: str, tolerance: float | str
) -> tuple[SlotDecoder, str, precision.Accuracy | None, str]:
    """The decoder of `lm` (fp32, as written) in the precision `asked`
    (engine.precision: weights and KV cache in bf16 or fp16; tf32 while
    capturing), the precision it got, its accuracy and why it is not the one
    asked, if so. The guard: the decoder's next-token logits after a seeded
    prompt against the fp32 model's, held to `tolerance` (engine.precision.tolerance,
    "auto" from the error of the model itself run eagerly in that precision);
    beyond it, the decoder is made again in fp32."""
    used, why = precision.on_device(asked, device)
    served = copy.deepcopy(lm).to(precision.HALF[used]) if used in precision.HALF else lm
    with precision.numerics(used):
        decoder = make_decoder(served, settings, device)
    if used == precision.FP32:
        return decoder, used, None, why
    generator = torch.Generator().manual_seed(zoo.SEED)
    prompt = torch.randint(0, lm.config.vocab_size, (min(CHECK_PROMPT, settings.max_context),), generator=generator)
    ids = prompt[None].to(device)
    with torch.inference_mode():
        with precision.fp32_reference():
            want = lm.to(device)(ids).logits[0, -1].float()
        with precision.numerics(used):
            eager = served.to(device)(ids).logits[0, -1].float()
            got = decoder.next_logits(prompt.tolist())
    eager_error = max_relative_error(eager, want)
    accuracy = precision.Accuracy(max_relative_error(got, want), eager_error, precision.tolerance(used, tolerance, eager_error))
    if not accuracy.error <= accuracy.tolerance:
        reason = f"the decoder's logits differ from the fp32 model's by {accuracy.error:.2e} (relative), tolerance {accuracy.tolerance:.0e}; decoding in fp32"
        log.warning("precision %s: %s", used, reason)
        del decoder, served
        return make_decoder(lm, settings, device), precision.FP32, None, reason
    return decoder, used, accuracy, why


@dataclass
class Stream:
    """A request being served: its scheduler entry, prompt and response sender."""

    sequence: Sequence
    prompt: list[int]
    sender: object
    request: object


@dataclass(frozen=True)
class Gone:
    """A note from a sender thread to the loop: this request's client went away."""

    key: int


class Responder:
    """Sends the responses of open streams on `threads` threads.

    Each stream belongs to thread `key % threads`, which sends its tokens, its
    final response and probes it for cancellation: so a stream's responses go
    out in order, and no probe reaches a stream after its final response (the
    server frees the response factory a probe would ask). The loop only puts
    work on queues; `drain` waits until everything put so far is sent. A send
    that fails, or a probe that finds the client gone, is reported through
    `report(Gone(key))`.

    With `merge`, a thread takes everything queued for it at once and sends
    each stream's tokens in one response: one token per response while the
    senders keep up, the tokens generated meanwhile when they fall behind (as
    vLLM's output collector merges a slow consumer's deltas). A Python-backend
    send costs a round trip to the server whatever it carries, so this lets the
    decoding loop run at the GPU's pace instead of the transport's.
    """

    CANCEL_CHECK_S = 0.05  # every is_cancelled() is an IPC round trip to the server:
    PROBES_PER_CHECK = 8  # at most this many per thread and check (hundreds may be waiting)

    def __init__(self, pb_utils, threads: int, report: Callable[[Gone], None], merge: bool = True) -> None:
        self._pb = pb_utils
        self._report = report
        self.merge = merge
        self._queues = [queue.SimpleQueue() for _ in range(threads)]
        self._pending = 0
        self._idle = threading.Condition()
        # per thread, written only by that thread: seconds sending and probing, responses and tokens sent
        self.stats = [{"send": 0.0, "probe": 0.0, "responses": 0, "tokens": 0} for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"generation-send-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def open(self, stream: Stream) -> None:
        self._put(stream.sequence.key, ("open", stream))

    def token(self, key: int, token: int) -> None:
        self._put(key, ("token", key, token))

    def close(self, key: int) -> None:
        """The final (empty) response; the stream is done."""
        self._put(key, ("close", key))

    def fail(self, key: int, message: str, code) -> None:
        """A final error response; the stream is done."""
        self._put(key, ("fail", key, message, code))

    def drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def stop(self) -> None:
        """Send what is queued, then end the threads."""
        for work in self._queues:
            work.put(None)
        for thread in self._threads:
            thread.join(30)

    def _put(self, key: int, item: tuple) -> None:
        with self._idle:
            self._pending += 1
        self._queues[key % len(self._queues)].put(item)

    def _run(self, index: int) -> None:
        work, stats = self._queues[index], self.stats[index]
        streams: dict[int, Stream] = {}
        gone: set[int] = set()
        to_probe: deque[int] = deque()  # this thread's open streams, in probing order
        next_probe = time.monotonic() + self.CANCEL_CHECK_S
        stopping = False
        while not stopping:
            try:
                items = [work.get(timeout=max(0.0, next_probe - time.monotonic()))]
            except queue.Empty:
                items = []
            while self.merge and items and items[-1] is not None:  # everything queued so far goes out together
                try:
                    items.append(work.get_nowait())
                except queue.Empty:
                    break
            if items and items[-1] is None:
                stopping = True
                items.pop()
            if items:
                started = time.perf_counter()
                try:
                    self._handle_all(items, streams, gone, to_probe, stats)
                except Exception:  # noqa: BLE001 - keep the thread (and drain) alive
                    log.exception("sending a response failed")
                finally:
                    stats["send"] += time.perf_counter() - started
                    with self._idle:
                        self._pending -= len(items)
                        if not self._pending:
                            self._idle.notify_all()
            if time.monotonic() >= next_probe:
                started = time.perf_counter()
                self._probe(streams, gone, to_probe)
                stats["probe"] += time.perf_counter() - started
                next_probe = time.monotonic() + self.CANCEL_CHECK_S

    def _probe(self, streams: dict[int, Stream], gone: set[int], to_probe: deque[int]) -> None:
        """Ask up to PROBES_PER_CHECK open streams, round robin, whether their client went away."""
        probed = 0
        for _ in range(len(to_probe)):
            if probed == self.PROBES_PER_CHECK:
                return
            key = to_probe.popleft()
            if key not in streams or key in gone:
                continue  # closed since, or already reported: dropped from the order
            probed += 1
            if _is_cancelled(streams[key]):
                gone.add(key)
                self._report(Gone(key))
            else:
                to_probe.append(key)

    def _handle_all(self, items: list[tuple], streams: dict[int, Stream], gone: set[int], to_probe: deque[int], stats: dict) -> None:
        """Handle items in order, except that a stream's tokens wait (merged)
        until its final response or the end of the batch."""
        waiting: dict[int, list[int]] = {}  # key -> tokens not sent yet, in order
        for item in items:
            kind = item[0]
            if kind == "open":
                stream = item[1]
                streams[stream.sequence.key] = stream
                to_probe.append(stream.sequence.key)
                continue
            key = item[1]
            if kind == "token":
                waiting.setdefault(key, []).append(item[2])
                if not self.merge:
                    self._send_tokens(key, waiting.pop(key), streams, gone, stats)
                continue
            if key in waiting:  # the stream's last tokens before its final response
                self._send_tokens(key, waiting.pop(key), streams, gone, stats)
            self._finish(item, streams, gone, stats)
        for key, tokens in waiting.items():
            self._send_tokens(key, tokens, streams, gone, stats)

    def _send_tokens(self, key: int, tokens: list[int], streams: dict[int, Stream], gone: set[int], stats: dict) -> None:
        if key in gone or key not in streams:
            return
        # through DLPack, never Tensor(name, ndarray): the stub's numpy bridge
        # sends zero bytes for numpy 2 arrays (see triton_backend.input_tensor)
        tensor = output_tensor(self._pb, OUTPUT, torch.tensor(tokens, dtype=torch.int64))
        try:
            streams[key].sender.send(self._pb.InferenceResponse(output_tensors=[tensor]))
        except Exception as error:  # noqa: BLE001 - the client is gone: retire it
            log.info("request %d: sending failed (%s); retiring it", key, error)
            gone.add(key)
            self._report(Gone(key))
            return
        stats["responses"] += 1
        stats["tokens"] += len(tokens)

    def _finish(self, item: tuple, streams: dict[int, Stream], gone: set[int], stats: dict) -> None:
        """A stream's final response: empty, or carrying its error."""
        key = item[1]
        stream = streams.pop(key, None)
        gone.discard(key)
        if stream is None:
            return
        if item[0] == "close":
            send_final(self._pb, stream.sender)
        else:
            send_error(self._pb, stream.sender, item[2], item[3])
        stats["responses"] += 1


class LoopClock(StageClock):
    """The loop thread's seconds by stage: prefill (the admitted requests'
    batched prefill), step (the decoding step, tokens on the host), drain
    (merge_tokens false only: waiting for the senders to finish the previous
    iteration's responses),
    respond (handing tokens and final responses to the senders, retiring)."""

    STAGES = ("prefill", "step", "drain", "respond")


@dataclass
class GenerationStats:
    """What the loop did, for the metrics and the log: iterations, decoded
    rows (requests per step, summed), prefilled requests, and its clock.
    Written by the loop thread only."""

    iterations: int = 0
    rows: int = 0
    prefills: int = 0
    clock: LoopClock = field(default_factory=LoopClock)


class Generator:
    """The scheduler loop around a SlotDecoder; `submit` may be called from any thread."""

    def __init__(self, pb_utils, decoder: SlotDecoder, settings: GenerationSettings, vocab: int) -> None:
        self._pb = pb_utils
        self.decoder = decoder
        self.vocab = vocab
        self.scheduler = Scheduler(settings.limits(), settings.scheduling, settings.admit_every)
        self.streams: dict[int, Stream] = {}
        self.stats = GenerationStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.responder = Responder(pb_utils, settings.sender_threads, self._inbox.put, merge=settings.merge_tokens)
        self._keys = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(30)
        self.responder.stop()

    def submit(self, request) -> None:
        """Validate one request and queue it (or answer it with its error)."""
        sender = request.get_response_sender()
        try:
            prompt, max_tokens, end_id = self._parse(request)
            sequence = Sequence(next(self._keys), len(prompt), max_tokens, end_id)
            self.scheduler.check(sequence)  # reads only the limits: safe beside the loop thread
        except Rejected as error:
            send_error(self._pb, sender, str(error), self._pb.TritonError.INVALID_ARG)
            return
        self._inbox.put(Stream(sequence, prompt, sender, request))

    def _parse(self, request) -> tuple[list[int], int, int | None]:
        tensors = {t.name(): input_tensor(t).cpu() for t in request.inputs()}
        ids = tensors.get("input_ids")
        if ids is None or tensors.get("max_tokens") is None:
            raise Rejected("input_ids and max_tokens are required")
        ids = ids.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            bad = int(((ids < 0) | (ids >= self.vocab)).nonzero()[0])
            raise Rejected(f"input 'input_ids': value {int(ids[bad])} at position {bad} is outside [0, {self.vocab})")
        max_tokens = int(tensors["max_tokens"].reshape(-1)[0])
        end_id = tensors.get("end_id")
        if end_id is not None:
            end_id = int(end_id.reshape(-1)[0])
            if not 0 <= end_id < self.vocab:
                raise Rejected(f"input 'end_id': {end_id} is outside [0, {self.vocab})")
        return ids.tolist(), max_tokens, end_id

    # --- the loop thread: the only one that touches the scheduler, the decoder and `streams`

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._take_inbox(block=self.scheduler.idle)
            if self._stop.is_set():
                break
            try:
                self._iteration()
            except Exception:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("a generation step failed; failing its %d requests", len(self.scheduler.active))
                for key in list(self.scheduler.active):
                    self.scheduler.cancel(key)
                for sequence in self.scheduler.retire():
                    self.streams.pop(sequence.key)
                    self.responder.fail(sequence.key, "generation failed inside the model; see the server log", self._pb.TritonError.INTERNAL)
        for key in self.streams:
            self.responder.fail(key, "the model is shutting down", self._pb.TritonError.UNAVAILABLE)
        self.streams.clear()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, Gone):
                self._cancel(item.key)
            else:
                try:
                    self.scheduler.submit(item.sequence)
                    self.streams[item.sequence.key] = item
                    self.responder.open(item)
                except Rejected as error:  # overloaded: worth retrying later
                    send_error(self._pb, item.sender, str(error), self._pb.TritonError.UNAVAILABLE)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, key: int) -> None:
        """A client went away: a waiting request is dropped now, an active one at the next retire."""
        if key not in self.streams:
            return  # already finished
        self.scheduler.cancel(key)
        if key not in self.scheduler.active:
            self.streams.pop(key)
            self.responder.close(key)

    def _iteration(self) -> None:
        stats, clock = self.stats, self.stats.clock
        clock.restart()
        self._retire()
        admitted = self.scheduler.admit()
        if admitted:
            tokens = self.decoder.prefill_many([s.slot for s in admitted], [self.streams[s.key].prompt for s in admitted])
            clock.lap("prefill")
            self._emit(admitted, tokens)
            self._retire()
            clock.lap("respond")
            stats.prefills += len(admitted)
        batch = self.scheduler.step_batch()
        if batch:
            tokens = self.decoder.step([s.slot for s in batch], [s.generated[-1] for s in batch], [s.length - 1 for s in batch])
            clock.lap("step")
            if not self.responder.merge:
                self.responder.drain()  # one token per response: at most one iteration's in flight
            clock.lap("drain")
            self._emit(batch, tokens)
            self._retire()
            clock.lap("respond")
            stats.rows += len(batch)
        stats.iterations += 1

    def _emit(self, sequences: list[Sequence], tokens: list[int]) -> None:
        for sequence, token in zip(sequences, tokens):
            self.scheduler.record(sequence.key, token)
            self.responder.token(sequence.key, token)

    def _retire(self) -> None:
        for sequence in self.scheduler.retire():
            self.streams.pop(sequence.key)
            if sequence.cancelled:
                log.info("request %d cancelled after %d tokens", sequence.key, len(sequence.generated))
            self.responder.close(sequence.key)


class GenerationMetrics:
    """The generator's counts as Prometheus counters beside Triton's, and a
    log line every `LOG_SECONDS` while it is busy (none while it is idle: `worked`).

    opara_generation_seconds_total{model,stage}: the loop thread's seconds in
    prefill, step, drain and respond (LoopClock), and the sender
    threads' seconds in send and probe (summed over the threads);
    opara_generation_events_total{model,kind}: iterations, rows (decoded
    rows: requests per step, summed), prefills (requests prefilled),
    responses sent and the tokens they carried. Each push is an IPC round
    trip to the server, so a timer thread pushes the increments every
    `FLUSH_SECONDS`.
    """

    FLUSH_SECONDS = 0.5
    LOG_SECONDS = 10.0

    def __init__(self, pb_utils, model: str, generator: Generator) -> None:
        kind = pb_utils.MetricFamily.COUNTER
        # a MetricFamily must outlive its Metrics: keep both
        self._families = {
            "seconds": pb_utils.MetricFamily(
                name="opara_generation_seconds_total", description="Seconds of the generation loop and its senders, by stage", kind=kind
            ),
            "events": pb_utils.MetricFamily(
                name="opara_generation_events_total", description="Iterations, decoded rows, prefills and responses of the generation loop", kind=kind
            ),
        }
        self._model = model
        self._generator = generator
        self._metrics: dict[str, object] = {}
        self._pushed = dict.fromkeys(totals(generator), 0.0)
        self._logged = (time.monotonic(), totals(generator))
        self._stopped = threading.Event()
        self._timer = threading.Thread(target=self._run, name=f"{model}-metrics", daemon=True)
        self._timer.start()

    def close(self) -> None:
        self._stopped.set()
        self._timer.join(timeout=5)
        self._push(totals(self._generator))

    def _run(self) -> None:
        while not self._stopped.wait(self.FLUSH_SECONDS):
            now = totals(self._generator)
            self._push(now)
            since, before = self._logged
            if time.monotonic() - since >= self.LOG_SECONDS:
                if worked(before, now):
                    log.info("%s: %s", self._model, summary(before, now, time.monotonic() - since))
                self._logged = (time.monotonic(), now)

    def _push(self, now: dict[str, float]) -> None:
        for name, value in now.items():
            if name not in self._metrics:
                family, label = name.split(":")
                self._metrics[name] = self._families[family].Metric(
                    labels={"model": self._model, "stage" if family == "seconds" else "kind": label}
                )
            if value > self._pushed[name]:
                self._metrics[name].increment(value - self._pushed[name])
                self._pushed[name] = value


def totals(generator: Generator) -> dict[str, float]:
    """The generator's counts so far, as "family:label" -> value (safe to read from any thread)."""
    stats, senders = generator.stats, generator.responder.stats
    values = {f"seconds:{stage}": spent for stage, spent in list(stats.clock.seconds.items())}
    for name in ("send", "probe"):
        values[f"seconds:{name}"] = sum(s[name] for s in senders)
    values.update({"events:iterations": stats.iterations, "events:rows": stats.rows, "events:prefills": stats.prefills})
    for name in ("responses", "tokens"):
        values[f"events:{name}"] = sum(s[name] for s in senders)
    return values


def worked(before: dict[str, float], after: dict[str, float]) -> bool:
    """Whether the generator did anything between two `totals`: prefilled, decoded
    or sent something. Not its iterations: an idle loop still counts one each time
    its wait for a request times out, and the senders' probing time grows too."""
    return any(after[name] > before[name] for name in ("events:prefills", "events:rows", "events:responses"))


def summary(before: dict[str, float], after: dict[str, float], wall_s: float) -> str:
    """One line on what the loop did between two `totals`: its time per iteration by stage."""
    delta = {name: after[name] - before[name] for name in after}
    iterations = max(delta["events:iterations"], 1)
    stages = ", ".join(f"{stage} {delta[f'seconds:{stage}'] / iterations * 1000:.2f}" for stage in LoopClock.STAGES)
    per_response = delta["seconds:send"] / max(delta["events:responses"], 1) * 1000
    return (
        f"{wall_s:.1f} s: {delta['events:iterations']:.0f} iterations, mean batch {delta['events:rows'] / iterations:.1f}, "
        f"{delta['events:prefills']:.0f} prefills; ms per iteration: {stages}; "
        f"senders: {delta['events:responses']:.0f} responses ({delta['events:tokens']:.0f} tokens), {per_response:.3f} ms each, "
        f"probing {delta['seconds:probe']:.2f} s"
    )


def send_final(pb_utils, sender) -> None:
    """The final (empty) response of a request."""
    try:
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as error:  # noqa: BLE001 - a cancelled request's sender may be closed
        log.debug("final response not sent: %s", error)


def send_error(pb_utils, sender, message: str, code) -> None:
    """A request's final response, carrying an error."""
    response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))
    try:
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as error:  # noqa: BLE001
        log.debug("error response not sent: %s", error)


def _is_cancelled(stream: Stream) -> bool:
    """Triton 2.51's response sender and request both answer is_cancelled()."""
    probe = getattr(stream.sender, "is_cancelled", None) or stream.request.is_cancelled
    try:
        return bool(probe())
    except Exception:  # noqa: BLE001 - an unreachable request counts as gone
        return True


class GenerationModel:
    """Base class for the model.py of a decoupled generation model."""

    zoo_name: str = ""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        started = time.monotonic()
        logging.basicConfig(level=logging.INFO, format=model_log_format(args["model_name"]))
        config = json.loads(args["model_config"])
        name = args["model_name"]
        try:
            entry = zoo.get(self.zoo_name or name)
            if not pb_utils.using_decoupled_model_transaction_policy(config):
                raise ValueError("a generation model needs model_transaction_policy { decoupled: true }")
            values = parameters.parse(parameters.GENERATION, parameters.strings(config))
            settings = GenerationSettings.from_values(values)
            version_dir = Path(args["model_repository"]) / args["model_version"]
            weights_file = weights.weights_path(version_dir, values["weights"]) if values["weights"] else None
            lm = build_lm(entry, settings, weights_file)
        except (KeyError, ValueError) as error:
            raise pb_utils.TritonModelException(f"model {name}: {error}") from None
        if settings.switch_interval_us:
            sys.setswitchinterval(settings.switch_interval_us * 1e-6)
        device = select_device(args)
        asked = values["precision"]
        decoder, used, accuracy, why = decoder_in_precision(lm, settings, device, asked, values["precision_tolerance"])
        decoder.prefill(0, [0, 1])  # warm-up; the slot is overwritten by its first request
        decoder.step([0], [2], [2])
        self.generator = Generator(pb_utils, decoder, settings, lm.config.vocab_size)
        self.metrics = GenerationMetrics(pb_utils, name, self.generator)
        self.generator.start()
        graphs = [b.shape for b in decoder.buckets if b.graph is not None]
        prefills = sum(b.graph is not None for b in decoder.prefill_buckets)
        built = f"decoding step as CUDA graphs, {len(graphs)} (rows, span) shapes, prefill in {prefills} shapes" if graphs else "eager decoding step"
        rows, spans = sorted({r for r, _ in graphs}), sorted({s for _, s in graphs})
        details = [
            f"precision {used}" + (f": {precision.describe({0: accuracy})}" if accuracy else "") + (f" (asked {asked}: {why})" if why else ""),
            f"{settings.scheduling} scheduling",
            f"{settings.max_active} slots x {settings.max_context} positions ({decoder.cache_bytes / 2**20:.0f} MiB of KV cache)",
            f"graph rows {rows} x spans {spans}" if graphs else "no CUDA graphs",
            f"{settings.sender_threads} sender threads",
            f"thread switch interval {sys.getswitchinterval() * 1e6:.0f} us",
            "tokens merged into a response while its senders are behind" if settings.merge_tokens else "one token per response",
            f"admission every {settings.admit_every} iterations while generating" if settings.admit_every > 1 else "admission at every iteration",
        ]
        log.info("%s", ready_line(name, str(device), time.monotonic() - started, built, details))

    def execute(self, requests: list) -> None:
        for request in requests:
            self.generator.submit(request)
        return None

    def finalize(self) -> None:
        started = time.monotonic()
        self.generator.stop()
        self.metrics.close()
        log.info("generation loop stopped in %.2f s", time.monotonic() - started)
