"""The model zoo: seeded builders for every model the product serves and plans.

Each entry says how to build the module (seeded random weights, eval mode, no hub
downloads) and what its inputs and outputs look like per sample (without the
batch dimension), so the Triton adapter, the planner and the tests all agree on
one description.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from opara_core.engine.precision import EAGER_FACTOR, HALF
from opara_core.models.deepfm import CRITEO_VOCAB_SIZES, NUM_DENSE
from opara_core.spec import BATCH, GENERATE, LengthAxis, ModelSpec, TensorSpec

__all__ = ["BATCH", "GENERATE", "LengthAxis", "ModelSpec", "TensorSpec", "ZooModel", "get", "names"]

SEED = 0  # ModelSpec.example_inputs draws with seed 0 by default too


@dataclass(frozen=True)
class ZooModel(ModelSpec):
    """A seeded model of the zoo: its interface (ModelSpec) and how to build it."""

    builder: Callable[[], nn.Module] = dataclasses.field(kw_only=True)
    description: str = dataclasses.field(default="", kw_only=True)

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
    "googlenet": ZooModel("googlenet", _image(224), _LOGITS, builder=_googlenet, description="torchvision GoogLeNet (Inception v1), no auxiliary heads"),
    "inception_v3": ZooModel("inception_v3", _image(299), _LOGITS, builder=_inception_v3, description="torchvision Inception v3, no auxiliary head"),
    "resnet50": ZooModel("resnet50", _image(224), _LOGITS, builder=_resnet50, description="torchvision ResNet-50"),
    "nasnet": ZooModel("nasnet", _image(331), _LOGITS, builder=_nasnet, description="timm nasnetalarge (NASNet-A Large)"),
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


def oracle_tolerance(precision: str = "fp32", eager_error: float = 0.0) -> float:
    """How far a served answer may be from the eager model on the CPU in the
    same precision, relative to the largest output. A GPU server convolves in
    TF32 (PyTorch's default for cuDNN): on an H100 (2026-11-22) its logits were
    up to 2.8e-2 of the largest away (NASNet; Inception-v3 1.7e-2, GoogLeNet
    1.1e-2), and batches of different sizes differ by as much from each other;
    FP32 on the CPU stays within 1e-4.

    In bf16 or fp16 the server and the oracle round differently wherever their
    kernels differ (another device's, or a variable-length batch padded to a
    longer bucket: BERT bf16 on the CPU 1.5e-2 from its unpadded run, about its
    own error against fp32, 2026-12-06), and each may be as far from the fp32
    module as the build's guard allows: EAGER_FACTOR times `eager_error`, the
    module's own error in that precision. So the bound adds that and the
    oracle's own error to the fp32 one."""
    fp32 = 5e-2 if torch.cuda.is_available() else 1e-4
    return fp32 + (EAGER_FACTOR + 1) * eager_error if precision in HALF else fp32


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
