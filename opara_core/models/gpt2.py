"""GPT-2 for the zoo (ids in, logits out) and its batched decoding step.

`GPT2Logits` is what the zoo builds: transformers' GPT2LMHeadModel without a
cache, so the planner and the tests see one plain `forward(ids) -> logits`.

`SlotDecoder` is what the generation server runs, on the same weights: a KV
cache preallocated with one slot per active request, a prefill per admitted
request, and one decoding step for all active requests at once (Orca's
selective batching). The dense operators (LayerNorms, QKV and output
projections, MLP, LM head) run over the batch of new tokens; attention runs
per request over its own keys and values, by masking each row of the padded
cache to its own length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class GPT2Logits(nn.Module):
    """GPT2LMHeadModel(input_ids) -> logits [B, S, vocab], no KV cache."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


@dataclass
class _Bucket:
    """Static inputs and output of the decoding step for `size` rows (a CUDA
    graph replays on exactly these addresses)."""

    size: int
    index: torch.Tensor
    ids: torch.Tensor
    position: torch.Tensor
    out: torch.Tensor | None = None
    graph: object | None = None


class SlotDecoder:
    """Greedy decoding over a slotted KV cache, with the weights of a GPT2LMHeadModel.

    The cache holds, per layer, keys and values of shape [slots + 1, heads,
    max_context, head_dim]; a request keeps its slot from prefill to
    retirement; the extra slot is scratch for the padding rows of a bucket.
    Positions past a request's length are masked out, never read.

    `buckets` (active-batch sizes) run the step on static buffers padded to
    the smallest bucket that fits, attending over the whole context; on a GPU
    each bucket is one CUDA graph (`capture=True`). Without buckets, or above
    the largest, the step runs eagerly over the longest request's span.
    """

    def __init__(
        self, lm: nn.Module, slots: int, max_context: int, device: torch.device, buckets: tuple[int, ...] = (), capture: bool = False
    ) -> None:
        config = lm.config
        if max_context > config.n_positions:
            raise ValueError(f"max_context {max_context} exceeds the model's {config.n_positions} positions")
        self.lm = lm.to(device).eval()
        self.blocks = list(lm.transformer.h)
        self.heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.max_context = max_context
        self.device = device
        self.scratch = slots
        shape = (len(self.blocks), slots + 1, self.heads, max_context, self.head_dim)
        dtype = lm.transformer.wte.weight.dtype
        # zeros, not empty: a masked position still multiplies its value by 0, and garbage could be NaN
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._positions = torch.arange(max_context, device=device)
        self.buckets = [self._static(size) for size in sorted(set(buckets)) if size >= 1]
        if capture:
            self._capture()

    @property
    def slots(self) -> int:
        return self.scratch

    @property
    def cache_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @torch.inference_mode()
    def prefill(self, slot: int, prompt: list[int]) -> int:
        """Fill `slot` with the prompt's keys and values; the first generated token."""
        length = len(prompt)
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        x = self._embed(ids, self._positions[:length])  # [L, E]
        causal = self._positions[:length, None] >= self._positions[None, :length]  # [L, L]
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(block, x)  # [H, L, D] each
            self.keys[layer, slot, :, :length] = k
            self.values[layer, slot, :, :length] = v
            x = self._finish_block(block, x, self._attend(block, q, k, v, causal))
        return int(self._logits(x[-1:]).argmax(-1))

    @torch.inference_mode()
    def step(self, slots: list[int], tokens: list[int], lengths: list[int]) -> list[int]:
        """One decoding step for every active request: feed `tokens[i]` at
        position `lengths[i]` of `slots[i]`; the next token of each."""
        count = len(slots)
        bucket = next((b for b in self.buckets if b.size >= count), None)
        if bucket is None:
            index, ids, position = (torch.tensor(v, dtype=torch.long, device=self.device) for v in (slots, tokens, lengths))
            return self._step(index, ids, position, max(lengths) + 1).tolist()
        pad = bucket.size - count
        for static, values, filler in ((bucket.index, slots, self.scratch), (bucket.ids, tokens, 0), (bucket.position, lengths, 0)):
            static.copy_(torch.tensor(values + [filler] * pad, dtype=torch.long))
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.out = self._step(bucket.index, bucket.ids, bucket.position, self.max_context)
        return bucket.out[:count].tolist()

    def _step(self, index: torch.Tensor, ids: torch.Tensor, position: torch.Tensor, span: int) -> torch.Tensor:
        """The step on device tensors (capturable: no host sync, no new host data)."""
        x = self._embed(ids, position)  # [B, E]
        visible = (self._positions[None, :span] <= position[:, None])[:, None, None, :]  # [B, 1, 1, span]
        rows = torch.arange(ids.shape[0], device=self.device)
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(block, x[:, None, :])  # [B, H, 1, D]
            keys, values = self.keys[layer], self.values[layer]
            keys[index, :, position] = k[rows, :, 0]
            values[index, :, position] = v[rows, :, 0]
            attended = self._attend(block, q, keys[index, :, :span], values[index, :, :span], visible)  # [B, 1, E]
            x = self._finish_block(block, x, attended[:, 0])
        return self._logits(x).argmax(-1)

    def _static(self, size: int) -> _Bucket:
        zeros = lambda: torch.zeros(size, dtype=torch.long, device=self.device)  # noqa: E731
        return _Bucket(size, zeros() + self.scratch, zeros(), zeros())

    @torch.inference_mode()
    def _capture(self) -> None:
        """One CUDA graph per bucket, warmed up on a side stream first; the
        graphs share one memory pool (they never run at the same time)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                for _ in range(2):
                    self._step(bucket.index, bucket.ids, bucket.position, self.max_context)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        for bucket in reversed(self.buckets):  # the largest first, so the smaller ones fit in its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                bucket.out = self._step(bucket.index, bucket.ids, bucket.position, self.max_context)
            bucket.graph, pool = graph, graph.pool()
        torch.cuda.synchronize(self.device)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        transformer = self.lm.transformer
        return transformer.wte(ids) + transformer.wpe(positions)

    def _qkv(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., L, E] -> three [..., H, L, D]."""
        q, k, v = block.attn.c_attn(block.ln_1(x)).split(self.heads * self.head_dim, dim=-1)
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        return tuple(t.reshape(shape).transpose(-3, -2) for t in (q, k, v))

    def _attend(self, block: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Masked attention, as transformers' eager GPT-2 computes it: [..., H, L, D] -> [..., L, E]."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * block.attn.scaling
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [..., H, L, D]
        return out.transpose(-3, -2).reshape(*out.shape[:-3], out.shape[-2], -1)

    def _finish_block(self, block: nn.Module, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + block.attn.c_proj(attended)
        return x + block.mlp(block.ln_2(x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(self.lm.transformer.ln_f(x))


def gpt2_small(**overrides) -> nn.Module:
    """transformers' GPT2LMHeadModel in the GPT-2 small configuration (its
    defaults), with weights from torch's current seed; `overrides` change the
    configuration (tests use fewer layers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    # eager attention: the same arithmetic as SlotDecoder, so greedy tokens agree exactly
    config = GPT2Config(attn_implementation="eager", **overrides)
    return GPT2LMHeadModel(config)
