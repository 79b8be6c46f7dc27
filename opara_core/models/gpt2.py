"""GPT-2 for the zoo (ids in, logits out) and its batched decoding step.

`GPT2Logits` is what the zoo builds: transformers' GPT2LMHeadModel without a
cache, so the planner and the tests see one plain `forward(ids) -> logits`.

`SlotDecoder` is what the generation server runs, on the same weights: a KV
cache preallocated with one slot per active request, one batched prefill for
the requests admitted together, and one decoding step for all active requests
at once (Orca's selective batching). The dense operators (LayerNorms, QKV and output
projections, MLP, LM head) run over the batch of new tokens; attention runs
per request over its own keys and values, by masking each row of the padded
cache to its own length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

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
    """Static buffers of one padded call shape: `shape` is (rows, span) for a
    decoding step (span: cache positions attention reads) and (rows, length)
    for a prefill. A CUDA graph replays on
    exactly these addresses. `inputs` holds all of a call's integers, so one
    copy from the pinned `staging` fills it; `forward` computes `out` from
    `inputs`; `landing` (pinned) takes `out` back."""

    shape: tuple[int, ...]
    inputs: torch.Tensor
    staging: torch.Tensor
    landing: torch.Tensor
    forward: Callable[[], torch.Tensor]
    out: torch.Tensor | None = None
    graph: object | None = None

    @property
    def size(self) -> int:
        return self.shape[0]


class SlotDecoder:
    """Greedy decoding over a slotted KV cache, with the weights of a GPT2LMHeadModel.

    The cache holds, per layer, keys and values of shape [slots + 1, heads,
    max_context, head_dim]; a request keeps its slot from prefill to
    retirement; the extra slot is scratch for the padding rows of a bucket.
    Positions past a request's length are masked out, never read.

    A bucketed step puts each request in its slot's row and reads the cache
    in place: `buckets` (row counts) x `spans` (cache positions; default
    max_context) are its static shapes, and a step runs on the cheapest
    (rows, span) that covers its highest slot and its longest request (rows
    of free slots are padding that writes only their own position 0). A
    scheduler that hands out the lowest free slot keeps the rows few; the
    spans keep attention from reading positions no request has reached. On
    a GPU each shape is one CUDA graph (`capture=True`). Without buckets the
    step runs eagerly, gathering each request's slot, over the longest
    request's span.

    `prefill_many` prefills the requests admitted together in batched
    forwards; `prefill_shapes` ((rows, length) pairs) do the same on static
    buffers padded to the smallest shape that fits, one CUDA graph each with
    `capture` (an eager prefill of GPT-2 small launches some 300 kernels from
    Python; every decoding step of the other requests waits for it).
    """

    PREFILL_TOKENS = 4096  # padded positions per prefill forward: bounds its attention scores' memory

    def __init__(
        self,
        lm: nn.Module,
        slots: int,
        max_context: int,
        device: torch.device,
        buckets: tuple[int, ...] = (),
        capture: bool = False,
        prefill_shapes: tuple[tuple[int, int], ...] = (),
        spans: tuple[int, ...] = (),
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
        self._done = torch.cuda.Event() if device.type == "cuda" else None
        spans = tuple(spans) or (max_context,)
        for size in buckets:
            if not 1 <= size <= slots:
                raise ValueError(f"step bucket {size}: needs 1 <= rows <= slots ({slots})")
        for span in spans:
            if not 1 <= span <= max_context:
                raise ValueError(f"step span {span}: needs 1 <= span <= max_context ({max_context})")
        # cheapest first: attention reads rows x span positions per layer
        shapes = sorted({(size, span) for size in buckets for span in spans}, key=lambda s: (s[0] * s[1], s))
        self.buckets = [self._step_bucket(*shape) for shape in shapes]
        for rows, length in prefill_shapes:
            if not (rows >= 1 and 1 <= length <= max_context):
                raise ValueError(f"prefill shape {(rows, length)}: needs rows >= 1 and 1 <= length <= max_context {max_context}")
        self.prefill_buckets = [self._prefill_bucket(*shape) for shape in sorted(set(prefill_shapes), key=lambda s: (s[0] * s[1], s))]
        if capture:
            self._capture([*self.buckets, *self.prefill_buckets])

    @property
    def slots(self) -> int:
        return self.scratch

    @property
    def cache_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def prefill(self, slot: int, prompt: list[int]) -> int:
        """Fill `slot` with the prompt's keys and values; the first generated token."""
        return self.prefill_many([slot], [prompt])[0]

    def prefill_many(self, slots: list[int], prompts: list[list[int]]) -> list[int]:
        """Prefill several requests, in batched forwards (prompts sorted by
        length, so that each pads little) of at most `PREFILL_TOKENS` padded
        positions and, with prefill shapes, at most their largest row count;
        the first generated token of each."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        max_rows = max((b.shape[0] for b in self.prefill_buckets), default=len(prompts))
        tokens = [0] * len(prompts)
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and end + 1 - start <= max_rows and (end + 1 - start) * len(prompts[order[end]]) <= self.PREFILL_TOKENS:
                end += 1
            chunk = order[start:end]
            for i, token in zip(chunk, self._prefill([slots[i] for i in chunk], [prompts[i] for i in chunk])):
                tokens[i] = token
            start = end
        return tokens

    @torch.inference_mode()
    def _prefill(self, slots: list[int], prompts: list[list[int]]) -> list[int]:
        """One forward over the prompts padded to the longest, or to the
        smallest prefill shape that fits them."""
        count, span = len(prompts), max(len(p) for p in prompts)
        bucket = next((b for b in self.prefill_buckets if b.shape[0] >= count and b.shape[1] >= span), None)
        rows, length = bucket.shape if bucket else (count, span)
        table = [p + [0] * (length - len(p)) + [slot, len(p) - 1] for slot, p in zip(slots, prompts)]
        table += [[0] * length + [self.scratch, 0]] * (rows - count)
        host = torch.tensor(table, dtype=torch.long)
        if bucket is None:
            inputs = host.to(self.device, non_blocking=True)
            return self._prefill_forward(inputs[:, :length], inputs[:, length], inputs[:, length + 1]).tolist()
        return self._run(bucket, host, count)

    @torch.inference_mode()
    def next_logits(self, prompt: list[int]) -> torch.Tensor:
        """The next-token logits after `prompt` (fp32), through the decoder's
        own code run eagerly in its scratch slot (the kernels its graphs
        replay): what a precision guard compares with the fp32 model."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        return self._logits(self._prefill_hidden(ids, torch.tensor([self.scratch], device=self.device))[0, -1]).float()

    def _prefill_forward(self, ids: torch.Tensor, index: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Prompts `ids` [n, L] into cache slots `index`; the token after
        position `last` of each (capturable). Causal masking alone keeps a
        real position from seeing padding (padding comes after it); the
        padding's keys and values land in the cache past the prompt, where
        decoding overwrites each position before any step can see it."""
        x = self._prefill_hidden(ids, index)
        rows = torch.arange(ids.shape[0], device=self.device)
        return self._logits(x[rows, last]).argmax(-1)

    def _prefill_hidden(self, ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The prompts' last hidden states [n, L, E], their keys and values written to slots `index`."""
        span = ids.shape[1]
        positions = self._positions[:span]
        x = self._embed(ids, positions)  # [n, L, E]
        causal = positions[:, None] >= positions[None, :]  # [L, L]
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(block, x)  # [n, H, L, D] each
            self.keys[layer][index, :, :span] = k
            self.values[layer][index, :, :span] = v
            x = self._finish_block(block, x, self._attend(block, q, k, v, causal))
        return x

    def step_bucket(self, slots: list[int], lengths: list[int]) -> _Bucket | None:
        """The cheapest step shape covering the highest slot and the longest
        request (feeding position `lengths[i]`); None: none does."""
        rows, span = max(slots) + 1, max(lengths) + 1
        return next((b for b in self.buckets if b.shape[0] >= rows and b.shape[1] >= span), None)

    @torch.inference_mode()
    def step(self, slots: list[int], tokens: list[int], lengths: list[int]) -> list[int]:
        """One decoding step for every active request: feed `tokens[i]` at
        position `lengths[i]` of `slots[i]`; the next token of each."""
        bucket = self.step_bucket(slots, lengths)
        if bucket is None:
            index, ids, position = (torch.tensor(v, dtype=torch.long, device=self.device) for v in (slots, tokens, lengths))
            return self._step(index, ids, position, max(lengths) + 1).tolist()
        rows = bucket.shape[0]  # row r is slot r: a free slot's row only writes its own position 0
        table = [list(range(rows)), [0] * rows, [0] * rows]
        for slot, token, length in zip(slots, tokens, lengths):
            table[1][slot], table[2][slot] = token, length
        out = self._run(bucket, torch.tensor(table, dtype=torch.long), rows)
        return [out[slot] for slot in slots]

    def _run(self, bucket: _Bucket, host: torch.Tensor, count: int) -> list[int]:
        """Fill the bucket's inputs from `host` (one copy), replay its graph
        (or run it eagerly), and return the first `count` outputs."""
        bucket.staging.copy_(host)
        bucket.inputs.copy_(bucket.staging, non_blocking=True)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.out = bucket.forward()
        bucket.landing.copy_(bucket.out, non_blocking=True)
        if self.device.type == "cuda":
            # wait here, not inside tolist(): an event wait lets other Python threads run meanwhile
            self._done.record(torch.cuda.current_stream(self.device))
            self._done.synchronize()
        return bucket.landing[:count].tolist()

    def _step(self, index: torch.Tensor, ids: torch.Tensor, position: torch.Tensor, span: int, by_slot: bool = False) -> torch.Tensor:
        """The step on device tensors (capturable: no host sync, no new host
        data), attending over positions [0, span). `by_slot`: row i is slot i,
        so attention reads the cache in place instead of gathering each row's
        slot (at 16 rows of 512 positions, that gather copied ~50 MB per
        layer and step and took 0.44 ms of a 3.1 ms step on the H100)."""
        x = self._embed(ids, position)  # [B, E]
        visible = (self._positions[None, :span] <= position[:, None])[:, None, None, :]  # [B, 1, 1, span]
        rows = torch.arange(ids.shape[0], device=self.device)
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(block, x[:, None, :])  # [B, H, 1, D]
            keys, values = self.keys[layer], self.values[layer]
            keys[index, :, position] = k[rows, :, 0]
            values[index, :, position] = v[rows, :, 0]
            if by_slot:
                mine_k, mine_v = keys[: ids.shape[0], :, :span], values[: ids.shape[0], :, :span]
            else:
                mine_k, mine_v = keys[index, :, :span], values[index, :, :span]
            attended = self._attend(block, q, mine_k, mine_v, visible)  # [B, 1, E]
            x = self._finish_block(block, x, attended[:, 0])
        return self._logits(x).argmax(-1)

    def _step_bucket(self, rows: int, span: int) -> _Bucket:
        """Rows of `inputs`: cache slot (row r is slot r), token, position."""
        bucket = self._bucket((rows, span), (3, rows))
        bucket.inputs[0] = torch.arange(rows)
        inputs = bucket.inputs
        bucket.forward = lambda: self._step(inputs[0], inputs[1], inputs[2], span, by_slot=True)
        return bucket

    def _prefill_bucket(self, rows: int, length: int) -> _Bucket:
        """A row of `inputs`: `length` prompt ids, then the cache slot and the prompt's last position."""
        bucket = self._bucket((rows, length), (rows, length + 2))
        bucket.inputs[:, length] = self.scratch
        inputs = bucket.inputs
        bucket.forward = lambda: self._prefill_forward(inputs[:, :length], inputs[:, length], inputs[:, length + 1])
        return bucket

    def _bucket(self, shape: tuple[int, ...], inputs: tuple[int, int]) -> _Bucket:
        pinned = self.device.type == "cuda"
        return _Bucket(
            shape,
            torch.zeros(inputs, dtype=torch.long, device=self.device),
            torch.zeros(inputs, dtype=torch.long, pin_memory=pinned),
            torch.zeros(shape[0], dtype=torch.long, pin_memory=pinned),
            forward=lambda: None,
        )

    @torch.inference_mode()
    def _capture(self, buckets: list[_Bucket]) -> None:
        """One CUDA graph per bucket, warmed up on a side stream first; the
        graphs share one memory pool (they never run at the same time)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for bucket in buckets:
                for _ in range(2):
                    bucket.forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        # the largest first, so the smaller ones fit in its pool
        for bucket in sorted(buckets, key=lambda b: (b.inputs.numel(), math.prod(b.shape)), reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                bucket.out = bucket.forward()
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
