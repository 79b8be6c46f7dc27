"""The model zoo: seeded builders for every model the product serves and plans.

Each entry says how to build the module (seeded random weights, eval mode, no hub
downloads) and what its inputs and outputs look like per sample (without the
batch dimension), so the Triton adapter, the planner and the tests all agree on
one description.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from opara_core.models.deepfm import CRITEO_VOCAB_SIZES, NUM_DENSE

SEED = 0


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a zoo model, per sample (no batch dimension).

    `value_range` is the half-open range [low, high) of valid values for integer
    inputs (token ids, embedding indices); an id outside it would index out of an
    embedding table, which inside a CUDA graph kills the process.

    `upper_bounds` tightens that per position along the last axis, for inputs
    whose positions index different tables (DeepFM's per-field vocabularies):
    the id at position i must also be below `upper_bounds[i]`.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    value_range: tuple[int, int] | None = None
    upper_bounds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        ranged = self.value_range is not None or self.upper_bounds is not None
        if ranged and self.dtype.is_floating_point:
            raise ValueError(f"{self.name}: value ranges are for integer inputs only")
        if self.value_range is not None and not self.value_range[0] < self.value_range[1]:
            raise ValueError(f"{self.name}: empty value_range {self.value_range}")
        if self.upper_bounds is not None:
            if not self.shape or len(self.upper_bounds) != self.shape[-1]:
                raise ValueError(
                    f"{self.name}: {len(self.upper_bounds)} upper_bounds for shape {self.shape}"
                )
            low = self.value_range[0] if self.value_range else 0
            if min(self.upper_bounds) <= low:
                raise ValueError(f"{self.name}: an upper bound is <= the lowest valid id {low}")

    def limits(self) -> tuple[int, np.ndarray] | None:
        """(low, high) of valid ids; high broadcasts against a per-sample array.

        None for inputs without a range (floats, or integers that any value suits).
        """
        if self.value_range is None and self.upper_bounds is None:
            return None
        low, high = self.value_range or (0, np.iinfo(np.int64).max)
        if self.upper_bounds is None:
            return low, np.asarray(high, dtype=np.int64)
        return low, np.minimum(np.asarray(self.upper_bounds, dtype=np.int64), high)

    def random(self, batch: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """A random batch that satisfies this spec, drawn on `device` (a
        generator given must be on it): a GPU build's static inputs drawn on
        the host took 0.4 s of NASNet's warm build (H200, run 36)."""
        shape = (batch, *self.shape)
        if self.dtype.is_floating_point:
            return torch.randn(shape, dtype=self.dtype, generator=generator, device=device)
        if self.upper_bounds is None:
            low, high = self.value_range or (0, 2)
            return torch.randint(low, high, shape, dtype=self.dtype, generator=generator, device=device)
        low, high = self.limits()
        span = torch.from_numpy(high - low).to(device)
        # One draw for all positions; the modulo bias of a 62-bit draw is negligible.
        draw = torch.randint(0, 2**62, shape, dtype=torch.int64, generator=generator, device=device)
        return (draw % span + low).to(self.dtype)

    def check(self, values: Any) -> str | None:
        """A one-line description of the first out-of-range id in a batch, or None.

        `values` has a leading batch dimension: a torch tensor on any device or a
        numpy array. Host data is checked with numpy (no copy; cheaper than torch
        for request-sized arrays), GPU data where it is, with one
        synchronisation. Only ranged integer inputs are checked; float inputs
        cannot index out of a table, so they always pass.
        """
        limits = self.limits()
        if limits is None:
            return None
        low, high = limits
        if tuple(values.shape[1:]) != self.shape:
            return f"input {self.name!r}: per-sample shape {tuple(values.shape[1:])}, expected {self.shape}"
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                bad_on_device = (values < low) | (values >= torch.as_tensor(high, device=values.device))
                if not bool(bad_on_device.any()):
                    return None
                values = values.cpu()
            values = values.numpy()
        values = np.asarray(values)
        bad = (values < low) | (values >= high)
        if not bad.any():
            return None
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        sample, position = first[0], first[1:]
        where = position[0] if len(position) == 1 else position
        bound = int(np.broadcast_to(high, self.shape)[position])
        more = int(bad.sum()) - 1
        return (
            f"input {self.name!r}: value {values[first]} at batch item {sample}, position {where} "
            f"is outside [{low}, {bound})" + (f" ({more} more bad values)" if more else "")
        )


@dataclass(frozen=True)
class LengthAxis:
    """A sequence axis that a request may give at any length from 1 to `limit`:
    the last dimension of each of `inputs` and the first per-sample dimension of
    each of `outputs` (an output follows the request's length on that axis)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    limit: int


BATCH, GENERATE = "batch", "generate"


@dataclass(frozen=True)
class ZooModel:
    """A servable model: how to build it and what goes in and out.

    `serving` says how Triton serves it: "batch" (one response per request,
    through serving.triton_backend) or "generate" (a decoupled model that
    streams generated tokens, through serving.generation); `inputs` and
    `outputs` always describe the module's own forward.
    """

    name: str
    builder: Callable[[], nn.Module]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    description: str = ""
    serving: str = BATCH
    lengths: tuple[LengthAxis, ...] = ()  # variable sequence axes; the specs hold one example length

    def at(self, lengths: tuple[int, ...]) -> "ZooModel":
        """This model with every variable axis fixed at the given length, one per
        `self.lengths` axis: what the engine traces and captures for one bucket."""
        if len(lengths) != len(self.lengths):
            raise ValueError(f"{self.name} has {len(self.lengths)} variable axes, got lengths {lengths}")
        inputs = {n: length for axis, length in zip(self.lengths, lengths) for n in axis.inputs}
        outputs = {n: length for axis, length in zip(self.lengths, lengths) for n in axis.outputs}

        def fixed(spec: TensorSpec, at: dict[str, int], dim: int) -> TensorSpec:
            if spec.name not in at:
                return spec
            shape = list(spec.shape)
            shape[dim] = at[spec.name]
            return dataclasses.replace(spec, shape=tuple(shape))

        return dataclasses.replace(
            self,
            inputs=tuple(fixed(s, inputs, -1) for s in self.inputs),
            outputs=tuple(fixed(s, outputs, 0) for s in self.outputs),
        )

    def build(self, seed: int = SEED) -> nn.Module:
        """The module with deterministic random weights, in eval mode.

        BatchNorm statistics are calibrated on seeded random inputs: with the
        initial statistics (mean 0, variance 1) a randomly initialised CNN maps
        every input to (nearly) the same logits, which would make the eager
        model useless as an oracle.
        """
        torch.manual_seed(seed)
        module = self.builder().eval()
        return calibrate_batchnorm(module, self.example_inputs(batch=1, seed=seed + 1))

    def example_inputs(self, batch: int = 1, seed: int = SEED) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return tuple(spec.random(batch, generator) for spec in self.inputs)


def calibrate_batchnorm(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> nn.Module:
    """Set every BatchNorm's running statistics to those of `inputs` (one pass,
    only the norms in training mode), then return the module in eval mode."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return module
    momenta = [m.momentum for m in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the calibration pass
        norm.train()
    with torch.no_grad():
        module(*inputs)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    return module.eval()


def _googlenet() -> nn.Module:
    from torchvision.models import googlenet

    return googlenet(weights=None, aux_logits=False, init_weights=True)


def _inception_v3() -> nn.Module:
    from torchvision.models import inception_v3

    return inception_v3(weights=None, aux_logits=False, init_weights=True)


def _resnet50() -> nn.Module:
    from torchvision.models import resnet50

    return resnet50(weights=None)


def _nasnet() -> nn.Module:
    import timm

    return timm.create_model("nasnetalarge", pretrained=False)


def _deepfm() -> nn.Module:
    from opara_core.models.deepfm import DeepFM

    return DeepFM()


BERT_SEQ_LEN = 128  # the example length; requests take any length up to BERT_MAX_LEN
BERT_MAX_LEN = 512  # BERT-base's position embeddings
BERT_VOCAB = 30522


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    from opara_core.models.hf import BertLastHiddenState

    # BERT-base defaults. SDPA exports with a dynamic batch and decomposes into
    # plain bmm/softmax ops, so the exported graph is device-neutral.
    config = BertConfig(vocab_size=BERT_VOCAB, attn_implementation="sdpa")
    return BertLastHiddenState(BertModel(config, add_pooling_layer=False))


T5_ENCODER_LEN = 128  # example lengths; requests take any length up to the limits below
T5_DECODER_LEN = 32
T5_MAX_ENCODER_LEN = 512
T5_MAX_DECODER_LEN = 128
T5_VOCAB = 32128
T5_D_MODEL = 512


def _t5() -> nn.Module:
    from transformers import T5Config, T5Model

    from opara_core.models.hf import T5DecoderLastHiddenState

    config = T5Config(
        vocab_size=T5_VOCAB,
        d_model=T5_D_MODEL,
        d_kv=64,
        d_ff=2048,
        num_layers=6,
        num_decoder_layers=6,
        num_heads=8,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="relu",
        use_cache=False,
    )
    return T5DecoderLastHiddenState(T5Model(config))


GPT2_VOCAB = 50257
GPT2_EXAMPLE_LEN = 16  # the zoo entry's fixed sequence; the generation server takes any length


def _gpt2() -> nn.Module:
    from opara_core.models.gpt2 import GPT2Logits, gpt2_small

    return GPT2Logits(gpt2_small())


def _image(size: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec("image", torch.float32, (3, size, size)),)


_LOGITS = (TensorSpec("logits", torch.float32, (1000,)),)


def _ids(name: str, length: int, high: int) -> TensorSpec:
    """Token ids (or a 0/1 mask, high=2) of one sequence length."""
    return TensorSpec(name, torch.int64, (length,), value_range=(0, high))

_MODELS: dict[str, ZooModel] = {
    "googlenet": ZooModel("googlenet", _googlenet, _image(224), _LOGITS, description="torchvision GoogLeNet (Inception v1), no auxiliary heads"),
    "inception_v3": ZooModel("inception_v3", _inception_v3, _image(299), _LOGITS, description="torchvision Inception v3, no auxiliary head"),
    "resnet50": ZooModel("resnet50", _resnet50, _image(224), _LOGITS, description="torchvision ResNet-50"),
    "nasnet": ZooModel("nasnet", _nasnet, _image(331), _LOGITS, description="timm nasnetalarge (NASNet-A Large)"),
    "deepfm": ZooModel(
        name="deepfm",
        builder=_deepfm,
        inputs=(
            TensorSpec("dense", torch.float32, (NUM_DENSE,)),
            TensorSpec(
                "sparse",
                torch.int64,
                (len(CRITEO_VOCAB_SIZES),),
                value_range=(0, max(CRITEO_VOCAB_SIZES)),
                upper_bounds=CRITEO_VOCAB_SIZES,
            ),
        ),
        outputs=(TensorSpec("probability", torch.float32, (1,)),),
        description=(
            "DeepFM for Criteo: 13 dense + 26 sparse fields, one embedding table per field "
            "(dim 16, vocabularies capped at 100k), FM + 400-400-400 ReLU DNN, sigmoid"
        ),
    ),
    "bert": ZooModel(
        name="bert",
        builder=_bert,
        inputs=(_ids("input_ids", BERT_SEQ_LEN, BERT_VOCAB), _ids("attention_mask", BERT_SEQ_LEN, 2)),
        outputs=(TensorSpec("last_hidden_state", torch.float32, (BERT_SEQ_LEN, 768)),),
        description=(
            "HuggingFace BertModel, BERT-base config (12 layers, hidden 768, 12 heads, "
            "vocab 30522), SDPA attention, no pooler; returns last_hidden_state"
        ),
        lengths=(LengthAxis("sequence", ("input_ids", "attention_mask"), ("last_hidden_state",), BERT_MAX_LEN),),
    ),
    "t5": ZooModel(
        name="t5",
        builder=_t5,
        inputs=(
            _ids("input_ids", T5_ENCODER_LEN, T5_VOCAB),
            _ids("attention_mask", T5_ENCODER_LEN, 2),
            _ids("decoder_input_ids", T5_DECODER_LEN, T5_VOCAB),
        ),
        outputs=(TensorSpec("last_hidden_state", torch.float32, (T5_DECODER_LEN, T5_D_MODEL)),),
        description=(
            "HuggingFace T5Model, t5-small config (d_model 512, d_kv 64, d_ff 2048, ReLU FF, "
            "6+6 layers, 8 heads, vocab 32128, 32 relative-attention buckets, max distance 128), "
            "no KV cache; one encoder pass (1 to 512 tokens) + decoder pass (1 to 128 tokens), "
            "returns the decoder's last_hidden_state"
        ),
        lengths=(
            LengthAxis("encoder", ("input_ids", "attention_mask"), (), T5_MAX_ENCODER_LEN),
            LengthAxis("decoder", ("decoder_input_ids",), ("last_hidden_state",), T5_MAX_DECODER_LEN),
        ),
    ),
    "gpt2": ZooModel(
        name="gpt2",
        builder=_gpt2,
        inputs=(_ids("input_ids", GPT2_EXAMPLE_LEN, GPT2_VOCAB),),
        outputs=(TensorSpec("logits", torch.float32, (GPT2_EXAMPLE_LEN, GPT2_VOCAB)),),
        description=(
            "HuggingFace GPT2LMHeadModel, GPT-2 small config (12 layers, hidden 768, 12 heads, "
            "vocab 50257, 1024 positions), eager attention; served as a decoupled model that "
            "generates greedily with iteration-level scheduling (opara_core.serving.generation)"
        ),
        serving=GENERATE,
    ),
}


def oracle_tolerance() -> float:
    """How far a served answer may be from the eager model on the CPU, relative
    to the largest output. A GPU server convolves in TF32 (PyTorch's default for
    cuDNN): on an H100 (2026-11-22) its logits were up to 2.8e-2 of the largest
    away (NASNet; Inception-v3 1.7e-2, GoogLeNet 1.1e-2), and batches of different
    sizes differ by as much from each other; FP32 on the CPU stays within 1e-4."""
    return 5e-2 if torch.cuda.is_available() else 1e-4


def names(serving: str | None = BATCH) -> list[str]:
    """Names of the zoo models served as `serving`, in a stable order: by
    default the batch models, which the engine traces, plans and captures and
    Triton batches; `GENERATE` for the generation models; None for all."""
    return [name for name, entry in _MODELS.items() if serving is None or entry.serving == serving]


def get(name: str) -> ZooModel:
    """The zoo entry called `name`; a KeyError lists the known names."""
    try:
        return _MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(_MODELS)}") from None


def dynamic_shapes(model: ZooModel, max_batch: int = 64) -> tuple[dict[int, Any], ...]:
    """torch.export `dynamic_shapes` for `model`'s inputs: dim 0 (batch) is dynamic.

    One shared Dim, so the exported program knows all inputs have the same batch.
    Export with an example batch of 2 or more, or 1 gets specialised in.
    """
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    return tuple({0: batch} for _ in model.inputs)
