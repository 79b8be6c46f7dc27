"""DeepFM (Guo et al., 2017) shaped for the Criteo display-ads data set.

Written here rather than taken from a CTR library so that it has no extra
dependency and so that every field has its own embedding table: the 26
independent lookups (times two, first- and second-order) are the operator
parallelism that multi-stream CUDA graphs exploit.
"""

from __future__ import annotations

import torch
from torch import nn

NUM_DENSE = 13
"""Criteo's integer-valued features I1..I13 (fed as normalised floats)."""

CRITEO_VOCAB_SIZES: tuple[int, ...] = (
    1460, 583, 100_000, 100_000, 305, 24, 12517, 633, 3, 93145, 5683, 100_000, 3194,
    27, 14992, 100_000, 10, 5652, 2173, 4, 100_000, 18, 15, 100_000, 105, 100_000,
)
"""Vocabulary of the categorical fields C1..C26.

The per-field cardinalities of the Criteo Kaggle set (as counted by DLRM's
preprocessing) capped at 100_000, so the tables keep Criteo's skew (from 3 to
millions of ids) while all of them together stay at about 54 MB of FP32.
"""

EMBEDDING_DIM = 16
DNN_UNITS = (400, 400, 400)
EMBEDDING_INIT_STD = 0.01
"""Small like trained CTR embeddings, so the FM term does not saturate the sigmoid."""


class DeepFM(nn.Module):
    """FM first- and second-order terms plus a ReLU MLP, summed into one logit.

    forward(dense [B, 13] float32, sparse [B, 26] int64) -> probability [B, 1].
    Id `sparse[:, i]` must lie in [0, vocab_sizes[i]).
    """

    def __init__(
        self,
        vocab_sizes: tuple[int, ...] = CRITEO_VOCAB_SIZES,
        num_dense: int = NUM_DENSE,
        embedding_dim: int = EMBEDDING_DIM,
        dnn_units: tuple[int, ...] = DNN_UNITS,
    ) -> None:
        super().__init__()
        self.vocab_sizes = tuple(vocab_sizes)
        # First order: one weight per id, plus a linear term for the dense features.
        self.first_order = nn.ModuleList(nn.Embedding(n, 1) for n in vocab_sizes)
        self.dense_linear = nn.Linear(num_dense, 1)
        # Second order and DNN share the field embeddings, as in the paper.
        self.embeddings = nn.ModuleList(nn.Embedding(n, embedding_dim) for n in vocab_sizes)
        layers: list[nn.Module] = []
        width = len(vocab_sizes) * embedding_dim + num_dense
        for units in dnn_units:
            layers += [nn.Linear(width, units), nn.ReLU()]
            width = units
        layers.append(nn.Linear(width, 1))
        self.dnn = nn.Sequential(*layers)
        for table in (*self.first_order, *self.embeddings):
            nn.init.normal_(table.weight, std=EMBEDDING_INIT_STD)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        first = self.dense_linear(dense) + sum(
            table(sparse[:, i]) for i, table in enumerate(self.first_order)
        )
        fields = torch.stack([table(sparse[:, i]) for i, table in enumerate(self.embeddings)], dim=1)
        # FM identity: sum_{i<j} <v_i, v_j> = ((sum v)^2 - sum v^2) / 2, per embedding dim.
        second = 0.5 * (fields.sum(dim=1).pow(2) - fields.pow(2).sum(dim=1)).sum(dim=1, keepdim=True)
        deep = self.dnn(torch.cat([fields.flatten(1), dense], dim=1))
        return torch.sigmoid(first + second + deep)
