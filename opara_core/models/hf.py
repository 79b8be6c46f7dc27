"""Wrappers that make HuggingFace models take and return plain tensors.

A ModelOutput (a dict subclass) as the result, keyword-only inputs and a KV
cache all complicate torch.export and the serving adapter, which both want
`forward(*tensors) -> tensor` in the order of the zoo entry's input specs.
"""

from __future__ import annotations

import torch
from torch import nn


class BertLastHiddenState(nn.Module):
    """BertModel(input_ids, attention_mask) -> last_hidden_state [B, S, H]."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class T5DecoderLastHiddenState(nn.Module):
    """T5Model(input_ids, attention_mask, decoder_input_ids) -> decoder last_hidden_state.

    One full encoder + decoder pass without a cache: the served unit is a fixed
    decoder window, not step-by-step generation.
    """

    def __init__(self, t5: nn.Module) -> None:
        super().__init__()
        self.t5 = t5

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor
    ) -> torch.Tensor:
        out = self.t5(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            use_cache=False,
        )
        return out.last_hidden_state
