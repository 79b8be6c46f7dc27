"""The decoupled Triton adapter for generative zoo models (gpt2): streams tokens.

`execute` only validates and enqueues each request and returns at once. A
background thread runs the iteration-level scheduler (opara_core.planning.
iteration): at every iteration boundary it admits waiting requests (prefill
into their own KV-cache slot), runs one batched decoding step for all active
requests (models.gpt2.SlotDecoder), sends each new token to its client at
once, and retires a finished request at once (max_tokens reached, end_id
generated, or its client cancelled). A request that cannot be taken (queue
full, too long) gets a clear error; a failed step fails only the requests in
it. The parameter `scheduling: request` selects the request-level baseline.

Every response carries one token in `output_ids`; the last is an empty
response flagged TRITONSERVER_RESPONSE_COMPLETE_FINAL (gRPC clients see it
with `enable_empty_final_response`).
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from opara_core import zoo
from opara_core.models.gpt2 import GPT2Logits, SlotDecoder
from opara_core.planning.iteration import ITERATION, Limits, Rejected, Scheduler, Sequence
from opara_core.serving import weights
from opara_core.serving.startup import ready_line
from opara_core.serving.triton_backend import input_tensor, parameters, select_device

log = logging.getLogger(__name__)

OUTPUT = "output_ids"


@dataclass(frozen=True)
class GenerationSettings:
    """config.pbtxt parameters of a generation model.

    scheduling: "iteration" (Orca) or "request" (the baseline); max_active:
    requests per decoding step (cache slots); max_context: positions per
    slot (prompt + generated); kv_tokens: positions all admitted requests may
    reserve together (0: max_active * max_context); max_queue: waiting
    requests before new ones are refused; config_overrides: "key=value,..."
    GPT2Config fields that replace the zoo's GPT-2 small configuration (empty:
    none; the tests serve a small GPT-2 this way, since GPT-2 small generates
    too slowly for CI on a shared two-core CPU), with weights from the zoo seed;
    cuda_graphs: 1 (default) captures the decoding step as one CUDA graph per
    active-batch bucket (powers of two up to max_active) on a GPU instance, 0 runs it eagerly.
    """

    scheduling: str = ITERATION
    max_active: int = 8
    max_context: int = 256
    kv_tokens: int = 0
    max_queue: int = 64
    config_overrides: str = ""
    cuda_graphs: int = 1

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
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(params) - set(known) - {"weights"})
        if unknown:
            raise ValueError(f"unknown parameters {unknown}; known: {sorted([*known, 'weights'])}")
        values = {}
        for key, text in params.items():
            if key == "weights":
                continue
            try:
                values[key] = text.strip() if known[key] == "str" else int(text)
            except ValueError:
                raise ValueError(f"parameter {key} has an invalid value {text!r}") from None
        settings = cls(**values)
        settings.limits()  # raises on impossible limits
        settings.overrides()
        Scheduler(settings.limits(), settings.scheduling)  # raises on an unknown mode
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


def make_decoder(lm: torch.nn.Module, settings: GenerationSettings, device: torch.device) -> SlotDecoder:
    """CUDA graphs per bucket on a GPU (when enabled); eager elsewhere, or
    when the capture fails (logged; the model still serves)."""
    if device.type == "cuda" and settings.cuda_graphs:
        try:
            return SlotDecoder(lm, settings.max_active, settings.max_context, device, graph_buckets(settings.max_active), capture=True)
        except Exception:  # noqa: BLE001 - serve eagerly rather than not at all
            log.exception("capturing the decoding step failed; decoding eagerly")
            torch.cuda.synchronize(device)
    return SlotDecoder(lm, settings.max_active, settings.max_context, device)


@dataclass
class Stream:
    """A request being served: its scheduler entry, prompt and response sender."""

    sequence: Sequence
    prompt: list[int]
    sender: object
    request: object


class Generator:
    """The scheduler loop around a SlotDecoder; `submit` may be called from any thread."""

    CANCEL_CHECK_S = 0.05  # every is_cancelled() is an IPC round trip to the server

    def __init__(self, pb_utils, decoder: SlotDecoder, settings: GenerationSettings, vocab: int) -> None:
        self._pb = pb_utils
        self.decoder = decoder
        self.vocab = vocab
        self.scheduler = Scheduler(settings.limits(), settings.scheduling)
        self.streams: dict[int, Stream] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._stop = threading.Event()
        self._last_cancel_check = 0.0
        self._thread = threading.Thread(target=self._loop, name="generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(30)

    def submit(self, request) -> None:
        """Validate one request and queue it (or answer it with its error)."""
        sender = request.get_response_sender()
        try:
            prompt, max_tokens, end_id = self._parse(request)
            sequence = Sequence(next(self._keys), len(prompt), max_tokens, end_id)
            self.scheduler.check(sequence)  # reads only the limits: safe beside the loop thread
        except Rejected as error:
            self._fail(sender, str(error), self._pb.TritonError.INVALID_ARG)
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

    # --- the loop thread: the only one that touches the scheduler and the decoder

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
                    stream = self.streams.pop(sequence.key)
                    self._fail(stream.sender, "generation failed inside the model; see the server log", self._pb.TritonError.INTERNAL)
        for stream in self.streams.values():
            self._fail(stream.sender, "the model is shutting down", self._pb.TritonError.UNAVAILABLE)
        self.streams.clear()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            try:
                self.scheduler.submit(item.sequence)
                self.streams[item.sequence.key] = item
            except Rejected as error:  # overloaded: worth retrying later
                self._fail(item.sender, str(error), self._pb.TritonError.UNAVAILABLE)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _iteration(self) -> None:
        self._check_cancelled()
        self._retire()
        for sequence in self.scheduler.admit():
            token = self.decoder.prefill(sequence.slot, self.streams[sequence.key].prompt)
            self._emit(sequence, token)
        self._retire()
        batch = self.scheduler.step_batch()
        if batch:
            tokens = self.decoder.step(
                [s.slot for s in batch], [s.generated[-1] for s in batch], [s.length - 1 for s in batch]
            )
            for sequence, token in zip(batch, tokens):
                self._emit(sequence, token)
            self._retire()

    def _emit(self, sequence: Sequence, token: int) -> None:
        self.scheduler.record(sequence.key, token)
        tensor = self._pb.Tensor.from_dlpack(OUTPUT, torch.tensor([token], dtype=torch.int64))
        try:
            self.streams[sequence.key].sender.send(self._pb.InferenceResponse(output_tensors=[tensor]))
        except Exception as error:  # noqa: BLE001 - the client is gone: retire it
            log.info("request %d: sending failed (%s); retiring it", sequence.key, error)
            self.scheduler.cancel(sequence.key)

    def _retire(self) -> None:
        for sequence in self.scheduler.retire():
            stream = self.streams.pop(sequence.key)
            if sequence.cancelled:
                log.info("request %d cancelled after %d tokens", sequence.key, len(sequence.generated))
            self._close(stream.sender)

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_check < self.CANCEL_CHECK_S:
            return
        self._last_cancel_check = now
        for key, stream in list(self.streams.items()):
            if _is_cancelled(stream):
                self.scheduler.cancel(key)
                if key not in self.scheduler.active:  # it was waiting: dropped at once
                    self.streams.pop(key)
                    self._close(stream.sender)

    def _close(self, sender) -> None:
        try:
            sender.send(flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as error:  # noqa: BLE001 - a cancelled request's sender may be closed
            log.debug("final response not sent: %s", error)

    def _fail(self, sender, message: str, code) -> None:
        response = self._pb.InferenceResponse(output_tensors=[], error=self._pb.TritonError(message, code))
        try:
            sender.send(response, flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
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
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        config = json.loads(args["model_config"])
        name = args["model_name"]
        try:
            entry = zoo.get(self.zoo_name or name)
            if not pb_utils.using_decoupled_model_transaction_policy(config):
                raise ValueError("a generation model needs model_transaction_policy { decoupled: true }")
            params = parameters(config)
            settings = GenerationSettings.from_parameters(params)
            version_dir = Path(args["model_repository"]) / args["model_version"]
            weights_file = weights.weights_path(version_dir, params["weights"]) if params.get("weights") else None
            lm = build_lm(entry, settings, weights_file)
        except (KeyError, ValueError) as error:
            raise pb_utils.TritonModelException(f"model {name}: {error}") from None
        device = select_device(args)
        decoder = make_decoder(lm, settings, device)
        decoder.prefill(0, [0, 1])  # warm-up; the slot is overwritten by its first request
        decoder.step([0], [2], [2])
        self.generator = Generator(pb_utils, decoder, settings, lm.config.vocab_size)
        self.generator.start()
        graphs = [b.size for b in decoder.buckets if b.graph is not None]
        built = f"decoding step as CUDA graphs, {len(graphs)} buckets" if graphs else "eager decoding step"
        details = [
            f"{settings.scheduling} scheduling",
            f"{settings.max_active} slots x {settings.max_context} positions ({decoder.cache_bytes / 2**20:.0f} MiB of KV cache)",
            f"graph buckets {graphs}" if graphs else "no CUDA graphs",
        ]
        log.info("%s", ready_line(name, str(device), time.monotonic() - started, built, details))

    def execute(self, requests: list) -> None:
        for request in requests:
            self.generator.submit(request)
        return None

    def finalize(self) -> None:
        started = time.monotonic()
        self.generator.stop()
        log.info("generation loop stopped in %.2f s", time.monotonic() - started)
