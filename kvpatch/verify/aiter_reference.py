"""Torch stand-in for aiter's ``mha_batch_prefill_func`` (ROCm/aiter, aiter/ops/mha.py).

No ROCm GPU is lent to verify, so both sides of a verify run this reference (on the
CPU, or on a CUDA GPU): it has the kernel's semantics for what a patched cast can
change, the rows read. The argument contract, as the aiter versions SGLang pins
define it (the first eight parameters are the same in all of them):

- ``q`` ``[total_q, heads, d]``; request ``b``'s queries are rows
  ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``; the batch is ``len(kv_indptr) - 1``.
- ``k`` ``[slots, kv_heads, d]`` and ``v`` ``[slots, kv_heads, dv]``: the linear layout,
  one slot per page (rank 3). Request ``b`` reads the rows
  ``kv_page_indices[kv_indptr[b]:kv_indptr[b + 1]]`` of both, in that order, and
  nothing else: a row listed nowhere (a NaN there, say an ungathered shadow row) never
  reaches the output; one listed does.
- ``causal``: aligned bottom-right, as flash-attention's varlen kernels: query ``i`` of
  a request with ``n`` queries and ``L`` keys reads keys ``j <= L - n + i``;
  ``window_size=(left, right)`` (-1: unbounded) bounds ``j`` around that position.
- ``logits_soft_cap`` > 0: scores become ``cap * tanh(score / cap)``; ``softmax_scale``
  defaults to ``d ** -0.5``; ``sink_ptr`` (one logit per head) joins each softmax's
  denominator; ``k_descale``/``v_descale`` scale an FP8 cache read as is.
- ``return_lse``: ``(out, lse [heads, total_q])``; ``out=`` is written and returned.
"""

from __future__ import annotations

import torch

KERNEL_NAME = "reference-aiter-mha-batch-prefill"


def _scaled(x, descale):
    x = x.float()
    return x * descale.float().reshape(-1)[0] if descale is not None else x


def mha_batch_prefill_func(q, k, v, cu_seqlens_q, kv_indptr, kv_page_indices, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                           window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_lse=False,
                           return_attn_probs=False, out=None, sink_ptr=None, q_descale=None, k_descale=None,
                           v_descale=None, **unknown):
    if unknown:
        raise NotImplementedError(f"reference mha_batch_prefill_func: {sorted(unknown)} not modelled")
    if dropout_p or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("reference mha_batch_prefill_func: no dropout, ALiBi or attention probs")
    if k.dim() != 3 or v.dim() != 3:
        raise NotImplementedError(f"reference mha_batch_prefill_func: the linear [slots, heads, dim] layout only, "
                                  f"got k {tuple(k.shape)}")
    total_q, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    qf = _scaled(q, q_descale).reshape(total_q, kv_heads, group, d)
    o = torch.zeros((total_q, heads, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, heads), float("-inf"), dtype=torch.float32, device=q.device)
    indptr = kv_indptr.to(torch.int64).tolist()
    cu = cu_seqlens_q.to(torch.int64).tolist()
    left, right = window_size
    for b in range(len(indptr) - 1):
        q0, q1 = cu[b], cu[b + 1]
        n = q1 - q0
        if n <= 0:
            continue
        rows = kv_page_indices[indptr[b]:indptr[b + 1]].to(torch.int64)  # only the listed rows are read
        length = rows.shape[0]
        kk = _scaled(k[rows], k_descale)                                       # [L, hk, d]
        vv = _scaled(v[rows], v_descale)
        s = torch.einsum("tkgd,jkd->tkgj", qf[q0:q1], kk) * scale            # [n, hk, g, L]
        if logits_soft_cap and logits_soft_cap > 0:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        j = torch.arange(length, device=q.device)
        pos = torch.arange(n, device=q.device) + (length - n)                 # bottom-right alignment
        keep = torch.ones((n, length), dtype=torch.bool, device=q.device)
        if causal:
            keep &= j[None, :] <= pos[:, None]
        if left >= 0:
            keep &= j[None, :] >= (pos - left)[:, None]
        if right >= 0 and not causal:
            keep &= j[None, :] <= (pos + right)[:, None]
        s = torch.where(keep[:, None, None, :], s, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        if sink_ptr is not None:
            sink = sink_ptr.float().reshape(kv_heads, group)[None, :, :, None]
            m = torch.maximum(m, sink)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        if sink_ptr is not None:
            denom = denom + torch.exp(sink - m)
        ob = torch.einsum("tkgj,jkd->tkgd", p, vv) / torch.where(denom > 0, denom, torch.ones_like(denom))
        o[q0:q1] = ob.reshape(n, heads, -1)
        lse[q0:q1] = torch.where(denom > 0, torch.log(denom) + m, torch.full_like(m, float("-inf"))).reshape(n, heads)
    dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
    o = o.to(dtype)
    if out is not None:
        out.copy_(o.reshape(out.shape))
        o = out
    return (o, lse.transpose(0, 1).contiguous()) if return_lse else o


# By the names SGLang imports them under (stubs.REAL).
REAL = {"mha_batch_prefill_func": mha_batch_prefill_func}
