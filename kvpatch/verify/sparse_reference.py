"""Torch stand-ins for the sparse MLA kernels KVP105 routes rows to (issue 20, kind 2).

The real kernels (sgl-kernel's FlashMLA `flash_mla_sparse_fwd`, `flash_mla_with_kvcache`
with `indices=`, SGLang's tilelang `tilelang_sparse_fwd`) need an SM90/SM100 GPU; these
references have their semantics for what a patched cast can change, the rows read:

- ``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v)``: ``q [s_q, h_q, d_qk]``,
  ``kv [s_kv, h_kv=1, d_qk]``, ``indices [s_q, h_kv=1, topk]`` (int32). Query token ``t``
  attends to the rows ``kv[indices[t, 0, j]]``; an entry ``-1`` (or ``>= s_kv``) is
  invalid: it is skipped, and its row is never read. The value is ``kv[..., :d_v]``.
  Returns ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])``.
  (FlashMLA README, "sparse attention prefill"; SGLang nsa_backend.py's call sites.)
- ``flash_mla_with_kvcache(q, k_cache, cache_seqlens, head_dim_v, ..., indices=)``, the
  sparse decode: ``q [b, s_q, h_q, d]``, ``k_cache [blocks, block_size, 1, d]``,
  ``indices [b, s_q, topk]``: token index ``i`` is block ``i // block_size``, offset
  ``i % block_size``; ``-1`` skipped. Returns ``(out [b, s_q, h_q, dv], lse)``.

A row listed nowhere (a NaN there, say an uncast row of the deferred buffer) never
reaches the output; a row listed does. Computed in float32.
"""

from __future__ import annotations

import torch

KERNEL_NAME = "reference-flashmla-sparse"


def _attend(q, rows, valid, scale, d_v):
    """q [h, d]; rows [n, d] (invalid ones zeroed); valid [n] -> (out [h, d_v], max, lse)."""
    s = (q.float() @ rows.float().T) * scale
    s = s.masked_fill(~valid[None, :], float("-inf"))
    m = s.amax(dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None])
    p = torch.nan_to_num(p, nan=0.0)  # a query with no valid row: all -inf
    return p @ rows[:, :d_v].float(), m, lse


def _rows(kv2, idx):
    """kv2 [n, d]; idx [k] -> (rows [k, d] with invalid rows zero, valid [k]); an invalid
    entry's row is never read (zeros stand in)."""
    n = kv2.shape[0]
    valid = (idx >= 0) & (idx < n)
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    rows = kv2.float().index_select(0, safe)
    return torch.where(valid[:, None], rows, torch.zeros_like(rows)), valid


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512):
    if kv.dim() != 3 or kv.shape[1] != 1 or indices.dim() != 3:
        raise NotImplementedError("reference flash_mla_sparse_fwd: kv [s_kv, 1, d], indices [s_q, 1, topk] only")
    s_q, h_q, _ = q.shape
    kv2 = kv[:, 0, :]
    out = torch.empty((s_q, h_q, d_v), dtype=torch.float32, device=q.device)
    mx = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(mx)
    for t in range(s_q):
        rows, valid = _rows(kv2, indices[t, 0])
        out[t], mx[t], lse[t] = _attend(q[t], rows, valid, sm_scale, d_v)
    return out.to(q.dtype), mx, lse


def flash_mla_with_kvcache(q, k_cache, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=None,
                           num_splits=None, softmax_scale=None, causal=False, indices=None, block_table=None,
                           is_fp8_kvcache=False, **unknown):
    if unknown or indices is None or is_fp8_kvcache:
        raise NotImplementedError("reference flash_mla_with_kvcache: the sparse (indices=) BF16 form only")
    b, s_q, h_q, d = q.shape
    kv2 = k_cache.reshape(-1, k_cache.shape[-1]) if k_cache.shape[2] == 1 else None
    if kv2 is None:
        raise NotImplementedError("reference flash_mla_with_kvcache: one KV head")
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    out = torch.empty((b, s_q, h_q, head_dim_v), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    for i in range(b):
        for t in range(s_q):
            rows, valid = _rows(kv2, indices[i, t])
            out[i, t], _, lse[i, :, t] = _attend(q[i, t], rows, valid, scale, head_dim_v)
    return out.to(q.dtype), lse


def tilelang_sparse_fwd(q, kv, indices, sm_scale, d_v=512):
    """SGLang's tilelang NSA kernel (nsa/tilelang_kernel.py): flash_mla_sparse_fwd's
    interface, returning the output alone."""
    return flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v)[0]
