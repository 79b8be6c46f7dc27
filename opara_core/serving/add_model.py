"""`python -m opara_core add-model NAME --repository DIR ...`: a model of the
user's as a Triton model directory: DIR/NAME/config.pbtxt (inputs, outputs,
dtypes and per-row shapes read from the program, the module or the Hugging Face
checkpoint, batching, buckets, the id ranges of integer inputs, a checkpoint's
length limits) and DIR/NAME/1/ with model.py and the model's files.
`make serve MODEL_REPOSITORY=DIR` then serves it.

The config is written with protobuf's text format from Triton's own
ModelConfig message (tritonclient ships it), so it is what Triton reads.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from opara_core.parameters import get as get_parameter
from opara_core.serving import model_config
from opara_core.serving.triton_backend import TRITON_DTYPES
from opara_core.serving.user_models import DYNAMIC_BATCH_HINT, PROGRAM_FILE, ModelFileError, call_factory, load_program, program_signature

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WEIGHTS_FILE = "model.safetensors"
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
               "int64": torch.int64, "int32": torch.int32}  # the dtypes the adapter serves (TRITON_DTYPES)


@dataclass(frozen=True)
class Tensor:
    """One input or output as the config declares it (per row)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    ids: tuple[int, int] | None = None  # [low, high) for an integer input
    ragged: bool = False  # a variable length (-1) that Triton batches across requests (allow_ragged_batch)

    def __post_init__(self) -> None:
        if self.dtype not in TRITON_DTYPES:
            raise ModelFileError(f"{self.name} is {str(self.dtype).removeprefix('torch.')}, which is not served (one of {', '.join(DTYPE_NAMES)})")


def output_names(count: int) -> list[str]:
    """`output` for one output, `output_0`, `output_1`, ... for several."""
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


def parse_input(text: str) -> Tensor:
    """`--input NAME:DTYPE:DIMS`, e.g. `image:fp32:3x224x224` or `ids:int64:16:0,1000`
    (an integer input's valid ids, half-open)."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not re.fullmatch(r"\w+", parts[0]) or parts[1] not in DTYPE_NAMES or not re.fullmatch(r"\d+(x\d+)*", parts[2]):
        raise ModelFileError(f"--input {text!r}: expected NAME:DTYPE:DIMS[:LOW,HIGH], e.g. image:fp32:3x224x224 or ids:int64:16:0,1000 (DTYPE one of {', '.join(DTYPE_NAMES)})")
    dtype = DTYPE_NAMES[parts[1]]
    ids = None
    if len(parts) == 4:
        low, _, high = parts[3].partition(",")
        if dtype.is_floating_point or not (low.lstrip("-").isdigit() and high.lstrip("-").isdigit()) or int(low) >= int(high):
            raise ModelFileError(f"--input {text!r}: LOW,HIGH (low < high) is for integer inputs")
        ids = (int(low), int(high))
    return Tensor(parts[0], dtype, tuple(int(d) for d in parts[2].split("x")), ids)


def from_program(program_path: Path, max_batch: int | None, ranges: dict[str, tuple[int, int]]) -> tuple[list[Tensor], list[Tensor], int]:
    """The inputs, outputs and max_batch_size of a torch.export program; an
    integer input's valid ids from `ranges` (--ids), else from the embedding
    table it indexes."""
    inputs, outputs = program_signature(load_program(program_path))
    unknown = sorted(set(ranges) - {e["name"] for e in inputs})
    if unknown:
        raise ModelFileError(f"--ids for {unknown}: {program_path.name} has the inputs {[e['name'] for e in inputs]}")
    found = []
    for entry in inputs:
        if entry["batch"] is None:
            raise ModelFileError(f"input {entry['name']!r} of {program_path.name} has a fixed first dimension {entry['shape'][:1]}: {DYNAMIC_BATCH_HINT}")
        if None in entry["shape"][1:]:
            raise ModelFileError(f"input {entry['name']!r} of {program_path.name} has a variable per-row dimension {list(entry['shape'][1:])}: only the batch dimension may vary here")
        ids = ranges.get(entry["name"])
        if ids is not None and entry["dtype"].is_floating_point:
            raise ModelFileError(f"--ids {entry['name']}: a floating-point input has no ids")
        if ids is None and not entry["dtype"].is_floating_point:
            if entry["ids"] is None:
                raise ModelFileError(f"integer input {entry['name']!r} of {program_path.name} indexes no embedding table directly, so its valid ids are unknown; give them with --ids {entry['name']}=LOW,HIGH")
            ids = (0, entry["ids"])
        found.append(Tensor(entry["name"], entry["dtype"], tuple(entry["shape"][1:]), ids))
    highs = [e["batch"][1] for e in inputs if e["batch"][1] is not None]
    limit = min(highs) if highs else None
    if max_batch is None:
        max_batch = min(32, limit) if limit else 32
    elif limit is not None and max_batch > limit:
        raise ModelFileError(f"--max-batch {max_batch}: {program_path.name} was exported for batches of at most {limit}")
    returned = []
    for name, entry in zip(output_names(len(outputs)), outputs):
        if None in entry["shape"][1:]:
            raise ModelFileError(f"{name} of {program_path.name} has a variable per-row dimension: only the batch dimension may vary here")
        returned.append(Tensor(name, entry["dtype"], tuple(entry["shape"][1:])))
    return found, returned, max_batch


def from_module(module: torch.nn.Module, inputs: list[Tensor]) -> list[Tensor]:
    """The outputs of `module` (one tensor or a tuple of them), per row, from an eager run on a batch of 2."""
    example = []
    for tensor in inputs:
        if tensor.dtype.is_floating_point:
            example.append(torch.randn(2, *tensor.shape, dtype=tensor.dtype))
        else:
            low, high = tensor.ids if tensor.ids else (0, 2)
            example.append(torch.randint(low, high, (2, *tensor.shape), dtype=tensor.dtype))
    try:
        with torch.inference_mode():
            result = module(*example)
    except Exception as error:  # noqa: BLE001 - the user's module, in one line
        raise ModelFileError(f"the module failed on an example batch of 2 with the --input shapes: {type(error).__name__}: {error}") from None
    results = result if isinstance(result, (tuple, list)) else (result,)
    if not results or not all(isinstance(r, torch.Tensor) and r.dim() >= 1 and r.shape[0] == 2 for r in results):
        raise ModelFileError("the module must return a tensor or a tuple of tensors, each with the batch as its first dimension")
    return [Tensor(name, r.dtype, tuple(r.shape[1:])) for name, r in zip(output_names(len(results)), results)]


def config_text(name: str, inputs: list[Tensor], outputs: list[Tensor], max_batch: int, parameters: dict[str, str]) -> str:
    """config.pbtxt, through Triton's ModelConfig message and protobuf's text format."""
    try:
        config = model_config.new(name=name, backend="python", max_batch_size=max_batch)
        for tensor in inputs:
            config.input.add(name=tensor.name, data_type=model_config.data_type(TRITON_DTYPES[tensor.dtype]), dims=list(tensor.shape), allow_ragged_batch=tensor.ragged)
        for tensor in outputs:
            config.output.add(name=tensor.name, data_type=model_config.data_type(TRITON_DTYPES[tensor.dtype]), dims=list(tensor.shape))
    except model_config.ModelConfigError as error:
        raise ModelFileError(f"add-model writes config.pbtxt: {error}") from None
    ranges = {f"value_range.{t.name}": f"{t.ids[0]},{t.ids[1]}" for t in inputs if t.ids}
    buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
    # preferred sizes above 1: a lone request never waits the queue delay (see model_repository/googlenet)
    config.dynamic_batching.preferred_batch_size.extend(b for b in buckets if b > 1)
    config.dynamic_batching.max_queue_delay_microseconds = 100
    config.instance_group.add(count=1)
    parameters = {"FORCE_CPU_ONLY_INPUT_TENSORS": "no", "buckets": ",".join(map(str, buckets)), **parameters, **ranges}
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return model_config.text(config)


MODEL_PY = '''"""{name}: {what}, served through opara_core (written by `python -m opara_core add-model`)."""

from opara_core.serving.{where} import {base}


class TritonPythonModel({base}):
{body}
'''


def from_checkpoint(directory: Path) -> tuple[list[Tensor], list[Tensor], dict[str, str]]:
    """The inputs, outputs and length parameters of a Hugging Face checkpoint
    (serving.hf_models): variable lengths up to the checkpoint's own limit, ids
    below its own vocabulary."""
    from opara_core.serving.hf_models import checkpoint_spec, read_checkpoint_config

    spec = checkpoint_spec("checkpoint", read_checkpoint_config(directory))
    variable = {n: axis for axis in spec.lengths for n in axis.inputs}
    leading = {n for axis in spec.lengths for n in axis.outputs}
    inputs = [Tensor(t.name, t.dtype, (-1,), t.value_range, ragged=True) for t in spec.inputs if t.name in variable]
    outputs = [Tensor(t.name, t.dtype, (-1, *t.shape[1:]) if t.name in leading else t.shape) for t in spec.outputs]
    return inputs, outputs, {f"max_length.{n}": str(axis.limit) for n, axis in variable.items()}


def add_model(name: str, repository: Path, export: Path | None = None, module: str | None = None, hf: Path | None = None,
              inputs: tuple[str, ...] = (), ids: tuple[str, ...] = (), max_batch: int | None = None, precision: str | None = None,
              force: bool = False) -> list[Path]:
    """Write the model directory; the paths written. Exactly one of `export`, `module`, `hf`;
    `precision`: the config's `precision` parameter (engine.precision), none for fp32."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith("."):
        raise ModelFileError(f"model name {name!r}: letters, digits, '_', '.', '-' only")
    if sum(route is not None for route in (export, module, hf)) != 1:
        raise ModelFileError("give exactly one of --export FILE.pt2, --module MODULE:FACTORY and --hf CHECKPOINT_DIR")
    if module is None and inputs:
        raise ModelFileError("--input is for --module: a program or a checkpoint says what it takes")
    if export is None and ids:
        raise ModelFileError("--ids is for --export; with --module give an integer input's ids in --input (NAME:int64:DIMS:LOW,HIGH), a checkpoint's come from its vocabulary")
    if max_batch is not None and max_batch < 1:
        raise ModelFileError(f"--max-batch {max_batch}: at least 1")
    if precision is not None and precision not in get_parameter("precision").choices:
        raise ModelFileError(f"--precision {precision}: one of {', '.join(get_parameter('precision').choices)}")
    target = Path(repository) / name
    if target.exists() and not force:
        raise ModelFileError(f"{target} exists; --force replaces it")
    ranges = {}
    for text in ids:
        key, _, bounds = text.partition("=")
        low, _, high = bounds.partition(",")
        try:
            ranges[key] = (int(low), int(high))
        except ValueError:
            raise ModelFileError(f"--ids {text!r}: expected NAME=LOW,HIGH") from None
        if ranges[key][0] >= ranges[key][1]:
            raise ModelFileError(f"--ids {text!r}: LOW must be below HIGH")
    parameters: dict[str, str] = {}
    copied: dict[str, Path] = {}  # file name in the version directory -> the user's file
    built = None  # --module: the module whose weights are saved beside it
    if export is not None:
        export = Path(export)
        if not export.is_file():
            raise ModelFileError(f"--export {export}: no such file")
        declared, outputs, max_batch = from_program(export, max_batch, ranges)
        copied[PROGRAM_FILE] = export
        model_py = MODEL_PY.format(name=name, what=f"the torch.export program {PROGRAM_FILE}", where="user_models", base="ExportedModel", body="    pass")
    elif hf is not None:
        hf = Path(hf)
        if not hf.is_dir():
            raise ModelFileError(f"--hf {hf}: no such directory")
        declared, outputs, parameters = from_checkpoint(hf)
        max_batch = max_batch or 32
        copied.update({path.name: path for path in sorted(hf.iterdir()) if path.is_file() and not path.name.startswith(".")})
        if "model.py" in copied:
            raise ModelFileError(f"--hf {hf}: its model.py would take the place of the adapter's; rename it")
        model_py = MODEL_PY.format(name=name, what=f"the Hugging Face checkpoint copied from {hf.resolve()}", where="hf_models", base="HFModel", body="    pass")
    else:
        if not inputs:
            raise ModelFileError("--module needs the inputs: --input NAME:DTYPE:DIMS for each (e.g. --input image:fp32:3x224x224)")
        declared = [parse_input(text) for text in inputs]
        for tensor in declared:
            if not tensor.dtype.is_floating_point and tensor.ids is None:
                raise ModelFileError(f"--input {tensor.name}: an integer input needs its valid ids, NAME:{str(tensor.dtype).removeprefix('torch.')}:DIMS:LOW,HIGH")
        where, _, _ = module.rpartition(":")
        factory = module
        if where.endswith(".py"):
            source = Path(where)
            if not source.is_file():
                raise ModelFileError(f"--module {module!r}: {source} does not exist")
            copied[source.name] = source
            factory = f"{source.name}:{module.rpartition(':')[2]}"
        built = call_factory(module)
        outputs = from_module(built, declared)
        max_batch = max_batch or 32
        parameters["weights"] = WEIGHTS_FILE
        model_py = MODEL_PY.format(name=name, what=f"the module {factory}() with the weights in {WEIGHTS_FILE}", where="user_models", base="ModuleModel", body=f"    factory = {factory!r}")
    if precision is not None:
        parameters["precision"] = precision
    text = config_text(name, declared, outputs, max_batch, parameters)
    if target.exists():
        shutil.rmtree(target)
    version = target / "1"
    version.mkdir(parents=True)
    written = [target / "config.pbtxt", version / "model.py"]
    written[0].write_text(text)
    written[1].write_text(model_py)
    for file_name, source in copied.items():
        shutil.copyfile(source, version / file_name)
        written.append(version / file_name)
    if built is not None:
        from safetensors.torch import save_model

        save_model(built, str(version / WEIGHTS_FILE))
        written.append(version / WEIGHTS_FILE)
    return written
