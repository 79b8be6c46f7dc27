"""The Triton kernel of `engine.short_attention` (imported only where it runs it).

One program per (batch, head) holds the whole problem in registers: the query
rows [BLOCK_Q, D], the keys and values [BLOCK_K, D], the scores [BLOCK_Q,
BLOCK_K]. It reads q, k, v, the additive bias and writes the output through
their strides (BERT's q, k and v are views of one projection; a mask bias is
broadcast over heads and query rows with stride 0). Products are fp32
("ieee": no TF32), the softmax fp32 with its row maximum subtracted.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def short_attention(
    q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr,
    LQ, LK, H, scale,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    sbb, sbh, sbi, sbj, sob, soh, sol, sod,
    HAS_BIAS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    i = tl.arange(0, BLOCK_Q)
    j = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    queries = i[:, None] < LQ
    keys = j[None, :] < LK
    q = tl.load(q_ptr + b * sqb + h * sqh + i[:, None] * sql + d[None, :] * sqd, mask=queries, other=0.0)
    k = tl.load(k_ptr + b * skb + h * skh + j[:, None] * skl + d[None, :] * skd, mask=j[:, None] < LK, other=0.0)
    v = tl.load(v_ptr + b * svb + h * svh + j[:, None] * svl + d[None, :] * svd, mask=j[:, None] < LK, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if HAS_BIAS:
        s += tl.load(bias_ptr + b * sbb + h * sbh + i[:, None] * sbi + j[None, :] * sbj, mask=queries & keys, other=0.0)
    s = tl.where(keys, s, float("-inf"))
    p = tl.exp(s - tl.max(s, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    o = tl.dot(p, v, input_precision="ieee")
    tl.store(out_ptr + b * sob + h * soh + i[:, None] * sol + d[None, :] * sod, o, mask=queries)
