"""Hugging Face checkpoints a user brings, served with variable lengths.

A checkpoint directory on local disk (`config.json` and safetensors weights, as
`save_pretrained` writes them: a BERT, RoBERTa or T5 the user fine-tuned, of
any size its architecture allows) is served through the variable-length path
(serving.varlen) with the checkpoint's own configuration: its ids are checked
against its own vocabulary, its lengths against its own limit, and its hidden
size is the output's. `python -m opara_core add-model NAME --hf DIR` copies the
checkpoint into the version directory and writes config.pbtxt from it;
`HFModel` (the model.py's base class) reads the checkpoint's config.json again
at load and checks config.pbtxt against it.

Encoders take `input_ids` and `attention_mask` and return `last_hidden_state`
([batch, tokens, hidden]); T5 also takes `decoder_input_ids` and returns the
decoder's `last_hidden_state`, one encoder and one decoder pass (the zoo's
`t5`). Weights load from safetensors only: a pickled `pytorch_model.bin`
could run code.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from opara_core.parameters import Values
from opara_core.serving.user_models import ModelFileError
from opara_core.serving.varlen import VarLenModel
from opara_core.spec import LengthAxis, ModelSpec, TensorSpec

log = logging.getLogger(__name__)

# model_type (config.json) -> how many positions the position table reserves before the first token
# (RoBERTa's family counts positions from padding_idx + 1); None: no absolute positions (T5: relative)
ENCODERS = {"bert": 0, "roberta": None, "xlm-roberta": None, "camembert": None, "electra": 0, "distilbert": 0}
ENCODER_DECODERS = ("t5",)
SUPPORTED = (*ENCODERS, *ENCODER_DECODERS)
POOLED = ("bert", "roberta", "xlm-roberta", "camembert")  # AutoModel adds a pooler unless told not to
EXAMPLE_LENGTH = 128  # the example length the engine traces with; requests take any length to the limit
T5_LIMIT = 512  # T5's relative attention has no table to outgrow: its configs' n_positions, where they lack one


def read_checkpoint_config(directory: Path) -> Any:
    """The checkpoint's configuration (transformers' AutoConfig), checked to be one this serves."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ModelFileError(f"{directory} holds no config.json: give a Hugging Face checkpoint directory (save_pretrained writes one)")
    if not any(directory.glob("*.safetensors")):
        found = "pytorch_model.bin (a pickle, which could run code)" if (directory / "pytorch_model.bin").exists() else "no weights"
        raise ModelFileError(f"{directory} has {found}: save the checkpoint with safetensors (save_pretrained's default)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as error:
        raise ModelFileError(f"{directory / 'config.json'}: {str(error).splitlines()[0]}") from None
    if config.model_type not in SUPPORTED:
        raise ModelFileError(f"{directory}: architecture {config.model_type!r} is not served here; served: {', '.join(SUPPORTED)}")
    return config


def _limit(config: Any) -> int:
    """The longest sequence the checkpoint's position table allows."""
    if config.model_type == "t5":
        return int(getattr(config, "n_positions", None) or T5_LIMIT)
    offset = ENCODERS[config.model_type]
    if offset is None:  # positions start after padding_idx
        offset = int(config.pad_token_id) + 1
    return int(config.max_position_embeddings) - offset


def checkpoint_spec(name: str, config: Any) -> ModelSpec:
    """What the checkpoint takes and returns, from its own configuration."""
    limit, vocab, hidden = _limit(config), int(config.vocab_size), int(config.hidden_size if config.model_type != "t5" else config.d_model)
    length = min(EXAMPLE_LENGTH, limit)

    def ids(input_name: str, high: int, at: int = length) -> TensorSpec:
        return TensorSpec(input_name, torch.int64, (at,), value_range=(0, high))

    if config.model_type == "t5":
        decoder = min(32, limit)
        return ModelSpec(
            name,
            (ids("input_ids", vocab), ids("attention_mask", 2), ids("decoder_input_ids", vocab, decoder)),
            (TensorSpec("last_hidden_state", torch.float32, (decoder, hidden)),),
            lengths=(LengthAxis("encoder", ("input_ids", "attention_mask"), (), limit),
                     LengthAxis("decoder", ("decoder_input_ids",), ("last_hidden_state",), limit)),
        )
    return ModelSpec(
        name,
        (ids("input_ids", vocab), ids("attention_mask", 2)),
        (TensorSpec("last_hidden_state", torch.float32, (length, hidden)),),
        lengths=(LengthAxis("sequence", ("input_ids", "attention_mask"), ("last_hidden_state",), limit),),
    )


def load_checkpoint(directory: Path, config: Any | None = None) -> torch.nn.Module:
    """The checkpoint as a module of plain tensors in the spec's input order (eval mode, fp32, SDPA attention)."""
    from transformers import AutoModel, T5Model

    from opara_core.models.hf import BertLastHiddenState, T5DecoderLastHiddenState

    config = config if config is not None else read_checkpoint_config(directory)
    options = {"attn_implementation": "sdpa", "dtype": torch.float32, "use_safetensors": True}
    try:
        if config.model_type == "t5":
            return T5DecoderLastHiddenState(T5Model.from_pretrained(str(directory), **options)).eval()
        extra = {"add_pooling_layer": False} if config.model_type in POOLED else {}  # last_hidden_state only
        return BertLastHiddenState(AutoModel.from_pretrained(str(directory), **options, **extra)).eval()
    except (OSError, ValueError, RuntimeError) as error:
        raise ModelFileError(f"{directory}: the checkpoint did not load: {str(error).splitlines()[0]}") from None


class HFModel(VarLenModel):
    """Base class of the model.py that serves the Hugging Face checkpoint in its
    version directory, with variable lengths, as config.pbtxt declares it
    (checked against the checkpoint's own configuration at load)."""

    def _describe(self, config: dict, values: Values, version_dir: Path) -> ModelSpec:
        self._checkpoint = read_checkpoint_config(version_dir)
        return checkpoint_spec(config["name"], self._checkpoint)

    def _module(self, values: Values, version_dir: Path) -> torch.nn.Module:
        if values["weights"]:
            raise ModelFileError("a Hugging Face checkpoint holds its own weights: remove the weights parameter")
        log.info("serving the %s checkpoint in %s", self._checkpoint.model_type, version_dir)
        return load_checkpoint(version_dir, self._checkpoint)
