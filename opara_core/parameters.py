"""Every config.pbtxt parameter a model accepts, declared once; the one parser.

Each `Parameter` below is the whole declaration of one parameter (or of a key
family such as `length_buckets.<axis>`): its type, default, allowed values,
one line of help, the kinds of model that accept it and its environment
override where it has one. The adapters read their parameters through `parse`
(one boolean spelling, `true`/`false`; an unknown key or a bad value is a load
error of one line naming it); `EngineSettings`, `VarLenSettings` and
`GenerationSettings` take their defaults from here and check their values
here; docs/configuration.md is generated from here:

    python -m opara_core.parameters --markdown > docs/configuration.md

No torch, nothing done at import: the engine, the adapters and that command
all import it. Checks that need the model (lengths, id ranges, gpt2's limits)
stay with the adapter that has the model; a Parameter holds what is true of
the value alone.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from opara_core.planning import batching, iteration, policies

# the kinds of model (each model.py subclasses one adapter)
BATCH = "batch"
VARLEN = "variable-length"
GENERATION = "generation"
KINDS = {
    BATCH: "fixed-shape models served in batches: model.py subclasses `opara_core.serving.triton_backend.OparaModel`",
    VARLEN: "variable-length models (one runner per shape bucket): model.py subclasses `opara_core.serving.varlen.VarLenModel`",
    GENERATION: "decoupled generation models (tokens streamed): model.py subclasses `opara_core.serving.generation.GenerationModel`",
}
SERVED = (BATCH, VARLEN)  # the kinds the batch adapter serves (a variable-length model is one, with more parameters)
EVERY = (BATCH, VARLEN, GENERATION)

# who reads a parameter: the settings dataclass its value goes into, or the code that checks it
ENGINE = "engine"  # opara_core.engine.build.EngineSettings
ADAPTER = "adapter"  # the adapter itself (weights, transport, threads)
TRITON = "triton"  # Triton's Python backend
MODEL = "model"  # checked against the zoo model: it must say what the model says
VARLEN_GROUP = "varlen"  # opara_core.serving.varlen.VarLenSettings
GENERATION_GROUP = "generation"  # opara_core.serving.generation.GenerationSettings

TRUE, FALSE = "true", "false"
TYPES = ("boolean", "integer", "number", "integers", "choice", "text")


class ParameterError(ValueError):
    """A parameter the model does not accept, or a value it does not allow: one line."""


@dataclass(frozen=True)
class Parameter:
    """One parameter, or a key family `prefix.<member>` (`length_buckets.<axis>`).

    type: "boolean" (true/false), "integer", "number", "integers" (comma-separated),
    "choice" (one of `choices`) or "text"; minimum: the least integer or number
    (each one, for "integers"); words: named values allowed besides the type's
    (torch_threads' "auto"); retired: {value: why it was removed and what to use};
    requires: a boolean parameter that must be true when this boolean is;
    shown_default: the default as the docs say it, where it is not a value.
    """

    name: str
    type: str
    default: Any
    help: str
    kinds: tuple[str, ...]
    group: str
    choices: tuple[str, ...] = ()
    minimum: int | float | None = None
    words: tuple[str, ...] = ()
    env: str = ""
    requires: str = ""
    retired: tuple[tuple[str, str], ...] = ()
    shown_default: str = ""

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise TypeError(f"parameter {self.name}: unknown type {self.type!r}")
        if (self.type == "choice") != bool(self.choices):
            raise TypeError(f"parameter {self.name}: choices go with the type choice, and only with it")

    @property
    def family(self) -> str:
        """The prefix of a key family (`length_buckets`), "" for a plain key."""
        return self.name.split(".<", 1)[0] if ".<" in self.name else ""

    def matches(self, key: str) -> bool:
        if self.family:
            return key.startswith(self.family + ".") and len(key) > len(self.family) + 1
        return key == self.name

    def allowed(self) -> str:
        """The allowed values, in words (errors and docs say them the same way)."""
        least = f" >= {self.minimum:g}" if self.minimum is not None else ""
        text = {
            "boolean": f"{TRUE} (with {self.requires} {TRUE}), {FALSE}" if self.requires else f"{TRUE}, {FALSE}",
            "integer": f"an integer{least}",
            "number": f"a number{least}",
            "integers": f"comma-separated integers{least}",
            "choice": ", ".join(self.choices),
            "text": "any text",
        }[self.type]
        return ", ".join((*self.words, f"or {text}")) if self.words else text

    def default_text(self) -> str:
        return self.shown_default or show(self.default)

    def parse(self, text: str, key: str | None = None, source: str = "") -> Any:
        """The value `text` stands for; a ParameterError names the key (`source`:
        where the text came from, when not the config), the text and what is allowed."""
        text = text.strip()
        try:
            value = self._read(text)
        except ValueError:
            raise self._error(text, key, source) from None
        self.check(value, key, source)
        return value

    def check(self, value: Any, key: str | None = None, source: str = "") -> None:
        """A typed value (a settings dataclass's field, or what `parse` read) against the declaration."""
        if isinstance(value, str) and value in self.words:
            return
        if self.type == "choice" and value in dict(self.retired):
            where = f" ({source})" if source else ""
            raise ParameterError(
                f"parameter {key or self.name}{where} is {show(value)!r}, which was removed ({dict(self.retired)[value]}); allowed: {self.allowed()}"
            )
        if not self._fits(value):
            raise self._error(show(value), key, source)

    def _read(self, text: str) -> Any:
        if text in self.words:
            return text
        if self.type == "boolean":
            if text not in (TRUE, FALSE):
                raise ValueError(text)
            return text == TRUE
        if self.type == "integer":
            return _integer(text)
        if self.type == "number":
            return float(text)
        if self.type == "integers":
            return tuple(_integer(part.strip()) for part in text.split(","))
        return text

    def _fits(self, value: Any) -> bool:
        least = self.minimum if self.minimum is not None else -math.inf
        if self.type == "boolean":
            return isinstance(value, bool)
        if self.type == "integer":
            return isinstance(value, int) and not isinstance(value, bool) and value >= least
        if self.type == "number":
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= least
        if self.type == "integers":
            return (
                isinstance(value, (tuple, list))
                and len(value) > 0
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= least for v in value)
            )
        if self.type == "choice":
            return value in self.choices
        return isinstance(value, str)

    def _error(self, text: str, key: str | None, source: str) -> ParameterError:
        where = f" ({source})" if source else ""
        return ParameterError(f"parameter {key or self.name}{where} is {text!r}; allowed: {self.allowed()}")


def _integer(text: str) -> int:
    if not re.fullmatch(r"[+-]?\d+", text):
        raise ValueError(text)
    return int(text)


def show(value: Any) -> str:
    """A value as a config writes it."""
    if isinstance(value, bool):
        return TRUE if value else FALSE
    if isinstance(value, (tuple, list)):
        return ",".join(map(show, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# a variable axis's sequence buckets where its length_buckets.<axis> says none: those below its limit, then the limit
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512)

P = Parameter
SCHEMA: tuple[Parameter, ...] = (
    # --- every model's adapter
    P("weights", "text", "", "the model's weights, a file in the version directory: a safetensors file (`*.safetensors`) or a state_dict (`*.pt`, loaded with `weights_only=True`), for a zoo model (instead of its seeded ones) or a module of your own (`add-model --module` writes one); for a zoo model, except generation models, also a `torch.export` archive (`*.pt2`); `scripts/export_weights.py MODEL VERSION_DIR [--pretrained]` writes one",
      EVERY, ADAPTER, shown_default="none (seeded)"),
    # H100, GoogLeNet, CUDA shared memory in, concurrency 16: host 3,552/s against auto's
    # 2,492 (docs/benchmarks.md, transport experiment)
    P("output_memory", "choice", "host", "where outputs go back: `host` tensors always (fastest measured: a GPU output costs the Python backend a synchronisation and a second round trip to the stub); `auto` GPU tensors (DLPack) for a batch whose inputs came on the GPU, host tensors otherwise; `gpu` always GPU tensors",
      SERVED, ADAPTER, choices=("host", "auto", "gpu")),
    P("torch_threads", "integer", "auto", "torch's intra-op threads in the model's stub process: `auto` is 1 on a GPU instance (its only CPU work is copying requests into pinned staging, which torch's thread per core turns into OpenMP regions competing with Triton's threads) and torch's default on a CPU instance, which computes on them; `0` torch's default; N threads",
      SERVED, ADAPTER, minimum=0, words=("auto",)),
    P("FORCE_CPU_ONLY_INPUT_TENSORS", "choice", "yes", "read by Triton's Python backend itself, hence its own spelling `yes`/`no`: `no` lets inputs stay where the client put them (CUDA shared memory reaches a GPU instance as GPU tensors, checked and copied device to device); `yes` copies every input to the host first (the shipped configs say `no`)",
      SERVED, TRITON, choices=("yes", "no")),
    # --- the engine's build (opara_core.engine.build.EngineSettings, in its field order)
    P("policy", "choice", "auto", "the stream plan: `auto` captures and times several plans per bucket and keeps the fastest (never slower than the sequential graph); or one of the planners: `sequential`, `opara` (the paper's Alg. 1 + 2), `nimble`, `asap`, `wavefront`, `side` (the critical path on one lane, only large branches beside it: few segments for fused lanes)",
      SERVED, ENGINE, choices=("auto", *policies.names())),
    P("max_streams", "integer", 8, "lane budget: CUDA streams per graph",
      SERVED, ENGINE, minimum=1),
    P("buckets", "integers", (1, 2, 4, 8, 16, 32), "batch sizes captured, one CUDA graph each; a batch runs in the smallest bucket that holds it (variable-length models: the batch buckets of every shape)",
      SERVED, ENGINE, minimum=1),
    P("guard", "boolean", True, "compare each captured graph's replay with eager at load; a graph that disagrees falls back (multi-stream -> sequential -> eager)",
      SERVED, ENGINE),
    P("guard_tolerance", "number", 1e-4, "the guard's largest relative error for graphs of ATen kernels",
      SERVED, ENGINE, minimum=0),
    # precision: opara_core.engine.precision (the defaults' measurements are there)
    P("precision", "choice", "fp32", "the numerics the model is built in: `fp32` (the module as written); `tf32` (fp32 tensors, TF32 matrix products and convolutions allowed); `bf16` or `fp16` (weights and activations in half precision; floating inputs and outputs keep the config's datatypes and are cast inside the captured graph, integer inputs stay integers). A half-precision build is compared with the fp32 module on seeded inputs; a graph beyond `precision_tolerance` falls back (the next candidate, last of all fp32) and the report says why. A CPU instance keeps fp32 where the CPU has no native support for the half type. Generation models: the language model and its KV cache, guarded by the decoder's next-token logits",
      EVERY, ENGINE, choices=("fp32", "tf32", "bf16", "fp16")),
    P("precision_tolerance", "number", "auto", "the largest relative error against the fp32 module that a `tf32`, `bf16` or `fp16` build may have (the guard for those precisions); `auto`: twice the error of the module itself run eagerly in that precision on the same inputs, and at least 2e-2 for bf16, 5e-3 for fp16 and tf32 (`opara_core/engine/precision.py` has the measurements)",
      EVERY, ENGINE, minimum=0, words=("auto",)),
    P("fusion", "boolean", True, "fold, merge and fuse kernels before planning (`opara_core/engine/fusion.py`)",
      SERVED, ENGINE),
    # NHWC wins at larger batches and on some models, NCHW on others; auto times both (NHWC weights)
    P("layout", "choice", "auto", "convolution layout: `nchw`, `nhwc` (channels-last) or `auto` (both timed per bucket, one traced graph)",
      SERVED, ENGINE, choices=("auto", "nchw", "nhwc")),
    # each new shape in each bucket and layout is autotuned
    P("autotune", "boolean", True, "`cudnn.benchmark` for the ATen candidates: time every convolution algorithm per shape (faster graphs, slower builds); `false` takes cuDNN's heuristic pick",
      SERVED, ENGINE),
    # every bucket compiles its segments' shapes once; the code is kept on disk
    # (engine.segment_compiler) and loaded by later builds
    P("fused_lanes", "boolean", True, "on a GPU, `auto` also tries plans whose one-lane segments Inductor compiles, run on their lanes in one CUDA graph (`opara_core/engine/fused_lanes.py`): the fastest replays (docs/benchmarks.md); a cold build compiles every segment at every bucket (minutes, the GPU left to other models meanwhile), a warm one loads them; `false` keeps to ATen kernels",
      SERVED, ENGINE),
    # ResNet-50's fused lanes at batch 8 0.918 -> 0.795 ms in one call, 0.817 with this on in another;
    # its warm build 3.2 -> 8.1 s (H200, docs/benchmarks.md run 39); neither way wins everywhere
    # (bf16, H200: Inception-v3 at batch 8 0.930 ms timed against 1.129, ResNet-50 at 1 0.419 against 0.389)
    P("fused_lanes_autotune", "boolean", False, "with `fused_lanes`: `auto` also tries each fused-lanes candidate with its convolutions' cuDNN algorithms picked by timing each, beside cuDNN's heuristic picks, and keeps the faster per bucket (slower builds: every convolution shape timed)",
      SERVED, ENGINE, requires="autotune"),
    # engine.choices
    P("remember_choices", "boolean", True, "keep `auto`'s choice per bucket under `$OPARA_CACHE_DIR/choices`: a later build of the same graphs on the same GPU and software captures only the remembered candidates; `false` times every candidate again",
      SERVED, ENGINE),
    # engine.profile
    P("profile", "boolean", True, "profile each operator's kernels on the GPU at build (kept under `$OPARA_CACHE_DIR/profiles`) so the plans get measured costs; `false` uses static estimates",
      SERVED, ENGINE),
    P("inductor_cache", "text", "", "where fused lanes' and the whole-model compile's Inductor code is kept: this directory, else `TORCHINDUCTOR_CACHE_DIR`, else `$OPARA_CACHE_DIR/inductor`, else `~/.cache/opara/inductor`",
      SERVED, ENGINE, shown_default="none (see help)"),
    # TF32 convolutions: 1.6e-2 relative on GoogLeNet against eager on an H100
    P("fused_tolerance", "number", 5e-2, "the guard's largest relative error for graphs with Inductor-compiled code (fused lanes, the whole-model graph), which picks other TF32 convolution algorithms than eager",
      SERVED, ENGINE, minimum=0),
    # --- published to clients; checked against the model
    P("value_range.<input>", "integers", None, "the valid ids of an integer input, `low,high` (half-open), published for clients (`python -m client` draws random ids in it); must equal the model's",
      SERVED, MODEL, shown_default="required where the model has one"),
    P("upper_bounds.<input>", "integers", None, "one exclusive bound per position of an integer input (DeepFM: each field's vocabulary), published for clients; must equal the model's",
      SERVED, MODEL, shown_default="required where the model has them"),
    # --- variable lengths (opara_core.serving.varlen.VarLenSettings)
    P("scheduler", "choice", "dp", "how a batch's rows are split into padded sub-batches: `dp` (TurboTransformers' DP over the cost table), `greedy` (one sub-batch per sequence bucket), `padded` (all padded to the largest bucket), `single` (every row alone); a request may pick another with its own parameter `scheduler`",
      (VARLEN,), VARLEN_GROUP, choices=tuple(batching.SCHEDULERS)),
    # `launcher warm` sets OPARA_CAPTURE=load, so that an image's cache holds every shape
    P("capture", "choice", "load", "`load` builds every shape when the model loads, largest first; `first_use` builds the smallest shape at load (the compile) and any other the first time a sub-batch needs it",
      (VARLEN,), VARLEN_GROUP, choices=("load", "first_use"), env="OPARA_CAPTURE"),
    # BERT's warm start with saved on an H100: 10.7 s against torch.compile's 66 s, cells as fast
    # (docs/benchmarks.md, variable lengths run 12)
    P("compiler", "choice", "saved", "on a GPU: `saved` exports the whole model once with dynamic batch and lengths, compiles it with Inductor into an artifact under `$OPARA_CACHE_DIR/saved` (compiled by the first start, only loaded by later ones) and captures it at every cell; `engine` builds each shape with the engine (ATen kernels, `auto`'s plans); a shape the whole-model graph cannot build falls back to `engine`",
      (VARLEN,), VARLEN_GROUP, choices=("saved", "engine"),
      retired=(("aot", "AOTInductor's loader died of SIGSEGV on the GPU machine"),
               ("inductor", "torch.compile at every start made BERT's warm start 66 s against saved's 11 s"))),
    P("length_buckets.<axis>", "integers", LENGTH_BUCKETS, "the sequence buckets of a variable axis (BERT: `sequence`; T5: `encoder`, `decoder`), ascending from 1 or more, the last one the axis's limit",
      (VARLEN,), VARLEN_GROUP, minimum=1, shown_default=f"`{show(LENGTH_BUCKETS)}` below the axis's limit, then the limit"),
    P("max_length.<input>", "integer", None, "the longest sequence of a variable-length input, published for clients (`python -m client` caps random lengths at it); must equal the model's limit",
      (VARLEN,), MODEL, minimum=1, shown_default="required: the model's limit"),
    # --- generation (opara_core.serving.generation.GenerationSettings, in its field order)
    P("scheduling", "choice", iteration.ITERATION, "`iteration` (Orca: requests join and leave the batch at every decoding step) or `request` (the baseline: a batch runs until its last request ends and nobody joins)",
      (GENERATION,), GENERATION_GROUP, choices=iteration.MODES),
    P("max_active", "integer", 8, "requests per decoding step: the KV-cache slots",
      (GENERATION,), GENERATION_GROUP, minimum=1),
    P("max_context", "integer", 256, "positions per slot (prompt + generated), at most the model's",
      (GENERATION,), GENERATION_GROUP, minimum=1),
    P("kv_tokens", "integer", 0, "positions all admitted requests may reserve together; 0: `max_active` x `max_context`",
      (GENERATION,), GENERATION_GROUP, minimum=0),
    P("max_queue", "integer", 64, "requests that may wait for a free slot; one more is refused",
      (GENERATION,), GENERATION_GROUP, minimum=0),
    P("config_overrides", "text", "", "`key=number,...`: GPT2Config fields that replace the zoo's configuration, with weights from the zoo's seed (the tests serve a 2-layer GPT-2 this way); cannot be combined with `weights`",
      (GENERATION,), GENERATION_GROUP, shown_default="none"),
    P("cuda_graphs", "boolean", True, "on a GPU instance: capture the decoding step per (rows, span) shape and the prefill per (rows, length) shape as CUDA graphs; `false` runs both eagerly",
      (GENERATION,), GENERATION_GROUP),
    # with 8, every send and the loop's step slowed down several fold (docs/benchmarks.md, generation's sixth run)
    P("sender_threads", "integer", 2, "threads that send the responses, each owning the streams whose key maps to it (their order kept); more made every send slower (the threads fight over the GIL and the stub's one message queue)",
      (GENERATION,), GENERATION_GROUP, minimum=1),
    P("switch_interval_us", "integer", 0, "the stub process's Python thread switch interval in microseconds (`sys.setswitchinterval`); 0 keeps Python's 5 ms",
      (GENERATION,), GENERATION_GROUP, minimum=0),
    P("merge_tokens", "boolean", True, "a stream whose sender is behind gets the tokens generated meanwhile in one response, and the loop never waits for its senders; `false`: exactly one token per response, each iteration waiting until the last one's responses are sent",
      (GENERATION,), GENERATION_GROUP),
    P("admit_every", "integer", 4, "while requests generate, waiting ones join (are prefilled) at most every that many iterations, so that one prefill takes several arrivals; 1 admits at every iteration",
      (GENERATION,), GENERATION_GROUP, minimum=1),
)  # fmt: skip
del P

# keys once accepted and no longer: a config that sets one is refused as unknown, with the reason
REMOVED = (
    ("fail_capture", "a test switch that made every multi-stream capture fail; the tests now patch the capture instead (tests/test_capture.py, tests/test_faults.py)"),
)


def declared(kind: str | None = None) -> tuple[Parameter, ...]:
    """The parameters a kind of model accepts (every one for None), in declaration order."""
    if kind is not None and kind not in KINDS:
        raise KeyError(f"unknown kind of model {kind!r}; known: {', '.join(KINDS)}")
    return tuple(p for p in SCHEMA if kind is None or kind in p.kinds)


def get(name: str) -> Parameter:
    """The declaration called `name` (families by their `prefix.<member>` name)."""
    found = next((p for p in SCHEMA if p.name == name), None)
    if found is None:
        raise KeyError(f"no parameter {name!r} is declared")
    return found


def group(name: str) -> tuple[Parameter, ...]:
    """The plain parameters read into one settings dataclass (`ENGINE`, ...), in declaration order."""
    return tuple(p for p in SCHEMA if p.group == name and not p.family)


def defaults(name: str) -> dict[str, Any]:
    """{field: default} of a group: what its settings dataclass declares as defaults."""
    return {p.name: p.default for p in group(name)}


def check_fields(settings: Any, name: str) -> None:
    """A settings dataclass's values against the declarations of its group
    (its fields are exactly the group's parameters: tests/test_parameters.py)."""
    values = {f.name: getattr(settings, f.name) for f in fields(settings) if f.name in {p.name for p in group(name)}}
    for key, value in values.items():
        get(key).check(value)
    _check_requires(values)


def _check_requires(values: Mapping[str, Any]) -> None:
    """A boolean that `requires` another is true only with that one true too."""
    for key, value in values.items():
        needed = get(key).requires
        if needed and value is True and values.get(needed, get(needed).default) is not True:
            raise ParameterError(f"parameter {key} is {TRUE}, which needs {needed} {TRUE} too; {needed} is {show(values.get(needed, get(needed).default))}")


@dataclass(frozen=True)
class Values:
    """A model's parameters as read: every plain parameter of its kind (the
    config's value or the default) and the family members the config gave."""

    kind: str
    plain: Mapping[str, Any]
    members: Mapping[str, Mapping[str, Any]]  # family -> member -> value
    given: frozenset[str]  # the keys the config (or the environment) set

    def __getitem__(self, name: str) -> Any:
        return self.plain[name]

    def settings(self, name: str) -> dict[str, Any]:
        """The keyword arguments of a group's settings dataclass."""
        return {p.name: self.plain[p.name] for p in group(name) if self.kind in p.kinds}

    def family(self, prefix: str) -> dict[str, Any]:
        """{member: value} of a key family (`length_buckets` -> {"sequence": (16, ...)})."""
        return dict(self.members.get(prefix, {}))


def strings(config: Mapping) -> dict[str, str]:
    """config.pbtxt `parameters` (as Triton's JSON model config gives them) as plain strings."""
    return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}


def parse(kind: str, params: Mapping[str, str], environ: Mapping[str, str] | None = None) -> Values:
    """A model's parameters (strings, `strings(config)`), each read and checked
    against its declaration; environment overrides applied (`environ`, default
    os.environ). Unknown keys fail together, with the known ones listed."""
    known = declared(kind)
    unknown = sorted(key for key in params if not any(p.matches(key) for p in known))
    if unknown:
        listed = ", ".join(sorted(p.name for p in known))
        removed = "".join(f" ({key} was removed: {dict(REMOVED)[key]})" for key in unknown if key in dict(REMOVED))
        raise ParameterError(f"unknown parameters {unknown} for a {kind} model{removed}; known: {listed}")
    environ = os.environ if environ is None else environ
    plain: dict[str, Any] = {}
    members: dict[str, dict[str, Any]] = {}
    given = set(params)
    for p in known:
        if p.family:
            for key in sorted(k for k in params if p.matches(k)):
                members.setdefault(p.family, {})[key[len(p.family) + 1 :]] = p.parse(params[key], key)
            continue
        override = environ.get(p.env, "") if p.env else ""
        if override:
            plain[p.name] = p.parse(override, source=f"from the environment variable {p.env}")
            given.add(p.name)
        elif p.name in params:
            plain[p.name] = p.parse(params[p.name])
        else:
            plain[p.name] = p.default
    _check_requires(plain)
    return Values(kind, plain, members, frozenset(given))


def value(params: Mapping[str, str], name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One plain parameter of `params`, read and checked (the default where it is
    absent), the others left alone: for code that reads a parameter of another's
    config (the floor model reads a benchmarked model's output_memory)."""
    p = get(name)
    environ = os.environ if environ is None else environ
    if p.env and environ.get(p.env):
        return p.parse(environ[p.env], source=f"from the environment variable {p.env}")
    return p.parse(params[name]) if name in params else p.default


# --- docs/configuration.md

COMMAND = "python -m opara_core.parameters --markdown > docs/configuration.md"
TITLES = {BATCH: "Batch models", VARLEN: "Variable-length models", GENERATION: "Generation models"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """docs/configuration.md: a table per kind of model."""
    lines = [
        "# Configuration",
        "",
        f"<!-- Generated from opara_core/parameters.py by `{COMMAND}`; edit the declarations there, not this file (tests/test_parameters.py fails when the two differ). -->",
        "",
        "A model's settings are the `parameters` of its `config.pbtxt`, each a string:",
        "",
        "```",
        'parameters { key: "buckets" value: { string_value: "1,2,4,8" } }',
        "```",
        "",
        f"Booleans are `{TRUE}` or `{FALSE}`, nothing else (Triton's own `FORCE_CPU_ONLY_INPUT_TENSORS` keeps its `yes`/`no`). "
        "A parameter that the kind of model does not accept fails the model's load with an error naming it and listing those it accepts; "
        "a value outside the allowed ones fails it with one line naming the parameter, the value and what is allowed. "
        "`<input>`, `<axis>`: a key family, one key per input or variable axis of the model (`value_range.input_ids`). "
        "An environment override, where a parameter has one, replaces the config's value for every model of the server.",
        "",
    ]
    for kind, description in KINDS.items():
        lines += [f"## {TITLES[kind]}", "", f"{description[0].upper()}{description[1:]}.", ""]
        lines += ["| name | type | default | allowed values | help | env override |", "| --- | --- | --- | --- | --- | --- |"]
        for p in declared(kind):
            cells = (f"`{p.name}`", p.type, f"`{p.default_text()}`" if not p.shown_default else p.shown_default, p.allowed(), p.help, f"`{p.env}`" if p.env else "")
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    lines += ["## Removed", "", "A config that still sets one of these fails to load, with the reason.", ""]
    for p in SCHEMA:
        for retired, why in p.retired:
            lines.append(f"- `{p.name}` `{retired}`: {why}; use one of {p.allowed()} (default `{p.default_text()}`).")
    for name, why in REMOVED:
        lines.append(f"- `{name}`: {why}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The config.pbtxt parameters every kind of model accepts.")
    parser.add_argument("--markdown", action="store_true", help="print docs/configuration.md")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:
        for kind in KINDS:
            print(f"{kind}: {', '.join(p.name for p in declared(kind))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
