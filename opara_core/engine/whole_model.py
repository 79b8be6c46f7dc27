"""One whole-model Inductor graph for every input shape, captured per shape.

A variable-length model's cells (sequence bucket x batch bucket) differ only in
sizes. Built per cell, every cell traced, planned and timed its own graphs (BERT's
36 cells: 93 s on an H100) and the multi-lane plans kept memory per lane
stream. Exported once with dynamic sizes and compiled by Inductor into a saved
artifact (`WholeModelSaved`), the model is one generated graph, and each cell is
a CUDA graph captured around it on one stream: every cell's graph reuses the
blocks the larger ones freed.

Two other forms were measured and removed: `torch.compile(dynamic=True)` with
freezing at every start (H100: 54 s to compile for BERT's 36 cells, and a warm
start still reran Dynamo and AOTAutograd: 66 s, against the saved artifact's
11 s) and an AOTInductor package (compiled once, loaded by later starts; on
the GPU machine, torch 2.11+cu130, its loader died of SIGSEGV even for a
two-layer model's package). docs/benchmarks.md, variable lengths, has the runs.

The loaded artifact must outlive its CUDA graphs (they read the weights it was
bound to): each CapturedGraph keeps it as its `owner`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from opara_core.engine import cache, custom_ops, gpu_turn, skinny_gemm
from opara_core.engine.capture import CapturedGraph, CaptureError, capture_module
from opara_core.engine.exported_merge import MERGE_VERSION, merge_linears
from opara_core.engine.short_attention import ShortAttentionPass
from opara_core.engine.trace_cache import export_shapes, module_fingerprint

log = logging.getLogger(__name__)

# per input, {dimension: (name, smallest, largest)}; dimensions of one name are one size
DynamicDims = Sequence[dict[int, tuple[str, int, int]]]
FORMAT = 2  # of a saved artifact's key (2: keyed through engine.cache, the TF32 switches in it)
SOFTWARE = ("gpu", "torch", "tf32")  # what the compiled code depends on of the software (Inductor keys its own cache by TF32 too)


def compiled_or_loaded(path: Path, compile: Callable[[], None], load: Callable[[], Callable], what: str) -> tuple[Callable, bool]:
    """The runner `load()` makes of what is saved at `path`, `compile()`d first
    where nothing is; a damaged one (it does not load) is compiled again, once.
    Also whether it was compiled now."""
    compiled_now = not path.exists()
    if compiled_now:
        with gpu_turn.aside(f"compiling the {what}"):
            compile()
    try:
        return load(), compiled_now
    except Exception as error:  # noqa: BLE001 - whatever a damaged file makes the loader raise
        if compiled_now:
            raise
        log.warning("%s %s did not load (%s: %s); compiling it again", what, path, type(error).__name__, error)
        with gpu_turn.aside(f"compiling the {what}"):
            compile()
        return load(), True


def _bind(arguments: list[torch.Tensor | None], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The graph's flat inputs: the weights of `arguments`, the model inputs where it holds None."""
    given = iter(inputs)
    return [next(given) if argument is None else argument for argument in arguments]


def _after(prologue: Callable[[], None], model: Callable) -> Callable:
    """`model`, with `prologue` run (and captured) ahead of it."""

    def run(*inputs):
        prologue()
        return model(*inputs)

    return run


def _capture(
    model: Callable, static_in: Sequence[torch.Tensor], pool: Any, what: str, prologue: Callable[[], None] | None = None, warmup: int = 3
) -> CapturedGraph:
    try:
        with torch.inference_mode():
            return capture_module(model if prologue is None else _after(prologue, model), static_in, pool, warmup=warmup)
    except CaptureError:
        raise
    except Exception as error:  # noqa: BLE001 - Dynamo and Inductor raise many kinds
        raise CaptureError(f"{what} failed at {[tuple(x.shape) for x in static_in]}: {type(error).__name__}: {error}") from error


def artifact_key(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], dims: DynamicDims, passes: Mapping[str, Any] | None = None) -> str:
    """The key (engine.cache) of what a saved artifact's code depends on: the
    module's class and structure (`trace_cache.module_fingerprint`: tensors' names,
    shapes and dtypes, classes and settings; not its weights' bytes, which are the
    artifact's inputs: no 440 MB to copy and hash at each BERT start), the inputs'
    dtypes and ranks, the sizes each dynamic dimension may take, the graph
    passes (`passes`), and the GPU, torch and TF32 switches (`SOFTWARE`)."""
    return cache.key(
        {
            "format": FORMAT,
            "module": f"{type(module).__module__}.{type(module).__qualname__}",
            "structure": module_fingerprint(module),
            "inputs": [[str(x.dtype), x.dim()] for x in example_inputs],
            "dims": [{str(k): list(v) for k, v in sorted(d.items())} for d in dims],
            "passes": dict(passes or {}),
        },
        SOFTWARE,
        example_inputs[0].device,
    )


def export_dynamic(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], dims: DynamicDims) -> torch.export.ExportedProgram:
    """`torch.export` of `module` with `dims` dynamic (dimensions of one name one size)."""
    shared: dict[str, Any] = {}
    dynamic_shapes = tuple(
        {k: shared.setdefault(name, torch.export.Dim(name, min=low, max=high)) for k, (name, low, high) in d.items()} for d in dims
    )
    with torch.inference_mode():
        # On CUDA, SDPA pads its mask to a multiple of 8 and export's solver cannot prove the
        # resulting guard for every length: checked at run time instead of refused
        return torch.export.export(
            module, tuple(example_inputs), dynamic_shapes=export_shapes(module, dynamic_shapes), prefer_deferred_runtime_asserts_over_guards=True
        )


class WholeModelSaved:
    """The model exported with dynamic sizes and compiled by Inductor into one
    saved artifact (`torch._inductor.standalone_compile`) under `directory`,
    keyed by what its code depends on (`artifact_key`): a later start loads it and runs no
    Dynamo, AOTAutograd or Inductor at all, where `torch.compile` reruns Dynamo
    and AOTAutograd at every start whatever its caches hold (and with freezing
    AOTAutograd's cache refuses the graph). The weights stay graph inputs (not
    frozen: a frozen graph cannot be saved), read from the live module, so the
    artifact holds code only (BERT: 1.2 MB). On an H100 (torch 2.11, 2026-11-27,
    docs/benchmarks.md variable lengths' run 11) BERT's artifact compiled in
    32.3 s and a second start loaded it in 1.1 s, where torch.compile's first
    call on a warm cache took 47.6 s with freezing and 29.9 s without.
    With `skinny_gemms` its fp32 linear layers are `skinny_gemm.SkinnyLinear`s
    before the export (the op with the weight stored transposed as a buffer;
    the post-grad pass needs frozen weights), and those that read one tensor
    are merged into one in the exported graph (`exported_merge`: BERT's query,
    key and value, as freezing merges them), with `short_attention` its
    efficient-attention calls go through `opara::short_attention`. `module`
    stays as it was (the eager oracle). The swapped copy is not kept once the
    graph's inputs are bound: the merged layers' own weights are no longer
    graph inputs, so their transposed buffers are freed (BERT: 36 of 2.25 MiB)."""

    label = "whole-model saved Inductor artifact"

    def __init__(
        self,
        module: torch.nn.Module,
        example_inputs: Sequence[torch.Tensor],
        dims: DynamicDims,
        directory: Path,
        skinny_gemms: bool = True,
        short_attention: bool = True,
    ):
        self.module, self.skinny_gemms = module, skinny_gemms
        prepared = skinny_gemm.with_skinny_linears(module) if skinny_gemms else module  # what is exported
        self.attention_pass = ShortAttentionPass() if short_attention else None
        custom_ops.register_all()  # before the artifact's code calls one
        passes = {"skinny": skinny_gemms, "merge": MERGE_VERSION if skinny_gemms else 0, "attention": self.attention_pass.uuid().hex() if self.attention_pass else ""}
        self.path = Path(directory) / f"{artifact_key(module, example_inputs, dims, passes)}.bin"
        self.signature_path = self.path.with_suffix(".json")  # the graph's inputs in order ([kind, name]), its outputs' structure
        self.runner, self.compiled_now = compiled_or_loaded(
            self.path, lambda: self._compile(prepared, example_inputs, dims), lambda: self._load(prepared), "saved Inductor artifact"
        )

    def _compile(self, prepared: torch.nn.Module, example_inputs: Sequence[torch.Tensor], dims: DynamicDims) -> None:
        """Export, compile and save (the signature first, the artifact last and
        whole: its presence means both are there; servers may start side by side)."""
        exported = export_dynamic(prepared, example_inputs, dims)
        inputs = {spec.arg.name: [spec.kind.name, spec.target] for spec in exported.graph_signature.input_specs}
        merged = merge_linears(exported.graph_module) if self.skinny_gemms else []
        kept = [node.name for node in exported.graph_module.graph.nodes if node.op == "placeholder" and node.name in inputs]
        signature = {  # the merged weights: graph inputs after the others, made from the module's tensors
            "inputs": [inputs[name] for name in kept] + [["MERGED", {"cat": [inputs[part][1] for part in m.parts], "dim": m.dim}] for m in merged],
            "outputs": pytree.treespec_dumps(exported.call_spec.out_spec),  # the module's own output structure
        }
        flat = _bind(self._arguments(prepared, signature["inputs"]), example_inputs)
        options = {"config_patches": {"post_grad_custom_post_pass": self.attention_pass}} if self.attention_pass else {}
        with torch.inference_mode():
            artifact = torch._inductor.standalone_compile(exported.graph_module, flat, dynamic_shapes="from_graph", options=options)
        cache.write_json(self.signature_path, signature)
        with cache.atomic(self.path) as partial:
            artifact.save(path=str(partial), format="binary")
        log.info("saved Inductor artifact compiled: %s", self.path)

    def _arguments(self, prepared: torch.nn.Module, signature: list[list]) -> list[torch.Tensor | None]:
        """The module's tensor for each weight input of the graph (a merged one made
        from its parts: a copy, so weights changed in place later are not seen there);
        None where a model input goes."""
        state = {**dict(prepared.named_parameters(remove_duplicate=False)), **dict(prepared.named_buffers(remove_duplicate=False))}
        arguments = []
        for kind, name in signature:
            if kind == "USER_INPUT":
                arguments.append(None)
            elif kind == "MERGED" and all(part in state for part in name["cat"]):
                arguments.append(torch.cat([state[part].detach() for part in name["cat"]], name["dim"]))
            elif kind in ("PARAMETER", "BUFFER") and name in state:
                arguments.append(state[name])
            else:
                raise ValueError(f"the exported graph takes {kind.lower()} {name!r}, which the module does not hold")
        return arguments

    def _load(self, prepared: torch.nn.Module) -> Callable:
        artifact = torch._inductor.CompiledArtifact.load(path=str(self.path), format="binary")
        signature = json.loads(self.signature_path.read_text())
        arguments, outputs = self._arguments(prepared, signature["inputs"]), pytree.treespec_loads(signature["outputs"])

        def run(*inputs):
            return pytree.tree_unflatten(list(artifact(*_bind(arguments, inputs))), outputs)

        return run

    def capture(self, static_in: Sequence[torch.Tensor], pool: Any, prologue: Callable[[], None] | None = None) -> CapturedGraph:
        """The artifact's model at these inputs' shapes, as one CUDA graph in `pool`
        (`prologue`, if any, captured ahead of it). One warm-up run: nothing in the
        loaded code compiles on a new shape, and the one run loads its kernels and
        lets the skinny GEMM op time a row count it has not met (torch.compile's graph
        keeps three: a new shape may compile there; each run at BERT's 512 x 32 is
        about 70 ms of a start)."""
        return _capture(self.runner, static_in, pool, "the whole-model saved Inductor artifact", prologue, warmup=1)
