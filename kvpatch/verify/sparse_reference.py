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
  ``i % block_size``; ``-1`` skipped. Returns ``(out [b, s_q, h_q, dv], lse)``. With
  ``is_fp8_kvcache=True`` (NSA's FP8-compute path) ``k_cache`` is ``quantize_k_cache``'s
  packed 656-byte rows (``fp8_packed_reference``): the rows read are dequantized, the
  others never touched; anything else is refused.
- ``quantize_k_cache(cache_k)``: SGLang's NSA quantizer into that format (served from
  ``fp8_packed_reference``; row-wise, bf16 in).

A row listed nowhere (a NaN there, say an uncast row of the deferred buffer) never
reaches the output; a row listed does. Computed in float32.
"""

from __future__ import annotations

import sys

import torch

from . import fp8_packed_reference as fp8ref

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
    # Gather, then widen: widening first would copy the whole cache (when it is the pool
    # itself, verify's full-pool guard rightly takes that for a full-pool cast).
    rows = kv2.index_select(0, safe).float()
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
    if unknown or indices is None:
        raise NotImplementedError("reference flash_mla_with_kvcache: the sparse (indices=) form only")
    b, s_q, h_q, d = q.shape
    if k_cache.dim() != 4 or k_cache.shape[2] != 1:
        raise NotImplementedError("reference flash_mla_with_kvcache: k_cache [blocks, block_size, 1, d] only")
    if is_fp8_kvcache:
        # FlashMLA's FP8 sparse decode reads quantize_k_cache's 656-byte rows (FP8 latent
        # tiles with float32 scales, bf16 rope): a BF16 cache handed to it is refused, as
        # the kernel refuses it, rather than reinterpreted.
        if k_cache.dtype not in (fp8ref.FP8, torch.uint8) or k_cache.shape[-1] != fp8ref.PACKED:
            raise TypeError(f"flash_mla_with_kvcache(is_fp8_kvcache=True): k_cache must be the packed "
                            f"[..., {fp8ref.PACKED}] FP8 format, got {list(k_cache.shape)} {k_cache.dtype}")
        if q.shape[-1] != fp8ref.D:
            raise ValueError(f"flash_mla_with_kvcache(is_fp8_kvcache=True): q is [.., {fp8ref.D}], got {d}")
        gather = lambda idx: fp8ref.gather_dequantized(k_cache, idx)  # noqa: E731
    else:
        kv2 = k_cache.reshape(-1, k_cache.shape[-1])
        gather = lambda idx: _rows(kv2, idx)  # noqa: E731
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    out = torch.empty((b, s_q, h_q, head_dim_v), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    for i in range(b):
        for t in range(s_q):
            rows, valid = gather(indices[i, t])
            out[i, t], _, lse[i, :, t] = _attend(q[i, t], rows, valid, scale, head_dim_v)
    return out.to(q.dtype), lse


def tilelang_sparse_fwd(q, kv, indices, sm_scale, d_v=512):
    """SGLang's tilelang NSA kernel (nsa/tilelang_kernel.py): flash_mla_sparse_fwd's
    interface, returning the output alone."""
    return flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v)[0]


# --- what the NSA backend calls around the kernels (verify/sparse.py serves these) -------


def transform_index_page_table_decode(page_table, topk_indices, result=None, page_size=1):
    """SGLang nsa/transform_index.py (its torch `_ref`): entry j of query i's top-k is a
    position in its request; the pool slot is page_table[i, j]; -1 stays -1."""
    if page_size != 1:
        raise NotImplementedError("transform_index_page_table_decode: page_size 1 only (as SGLang)")
    out = torch.gather(page_table.to(torch.int32), 1, topk_indices.clamp(min=0).long())
    out = torch.where(topk_indices < 0, torch.full_like(out, -1), out)
    if result is not None:
        result.copy_(out)
        return result
    return out


def transform_index_page_table_prefill(page_table, topk_indices, extend_lens_cpu, page_size=1):
    """The prefill form: request i's row of page_table serves its extend_lens_cpu[i] queries."""
    if len(extend_lens_cpu) != page_table.shape[0] or sum(extend_lens_cpu) != topk_indices.shape[0]:
        raise ValueError("transform_index_page_table_prefill: extend lengths do not match the tables")
    rows = torch.repeat_interleave(page_table, torch.tensor(list(extend_lens_cpu), device=page_table.device), 0)
    return transform_index_page_table_decode(rows, topk_indices, page_size=page_size)


def dequantize_k_cache_paged(quant_k_cache, page_table_1_flattened):
    """SGLang nsa/dequant_k_cache.py's row contract: the rows page_table_1_flattened of the
    cache viewed as [slots, dim], returned in order as [n, 1, dim]. The packed FP8 byte
    format (values with per-tile scales) is not modelled: both sides of a verify hand it
    the same cast values, and only which rows it reads can differ."""
    flat = quant_k_cache.reshape(-1, quant_k_cache.shape[-1])
    idx = page_table_1_flattened.long()
    if bool(((idx < 0) | (idx >= flat.shape[0])).any()):
        raise IndexError("dequantize_k_cache_paged: an index outside the cache")
    return flat.index_select(0, idx)[:, None, :]


def _same_dtype(name, q, kv, fp8=False):
    # As the real kernels: a BF16 query reads a BF16 cache (FlashMLA's sparse kernels check
    # it), so a cache cast to the wrong dtype is refused, not read as exact floats.
    if not fp8 and kv.dtype != q.dtype:
        raise TypeError(f"{name}: query is {q.dtype} but the cache is {kv.dtype} (they must match)")


def _served(name, fn, q_of, kv_of, fp8_of=lambda a, k: False):
    def kernel(*args, **kwargs):
        q, kv = q_of(args, kwargs), kv_of(args, kwargs)
        if isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor):
            _same_dtype(name, q, kv, bool(fp8_of(args, kwargs)))
        CALLS.append((name, sys._getframe(1).f_code.co_name))
        return fn(*args, **kwargs)

    kernel.__name__ = name
    return kernel


def _arg(i, kw):
    return lambda a, k: k[kw] if kw in k else (a[i] if len(a) > i else None)


# (kernel, the function that called it) of every call the sandbox served, in order:
# verify/sparse.py reads which helper reached which kernel.
CALLS = []
REAL = {
    "flash_mla_sparse_fwd": _served("flash_mla_sparse_fwd", flash_mla_sparse_fwd, _arg(0, "q"), _arg(1, "kv")),
    "tilelang_sparse_fwd": _served("tilelang_sparse_fwd", tilelang_sparse_fwd, _arg(0, "q"), _arg(1, "kv")),
    "flash_mla_with_kvcache": _served("flash_mla_with_kvcache", flash_mla_with_kvcache, _arg(0, "q"),
                                      _arg(1, "k_cache"), _arg(99, "is_fp8_kvcache")),
    # Served through _served so CALLS records which helper quantized: the row-wise step
    # KVP105 wraps on the FP8-compute path (analysis.helpers.ROW_WISE).
    "quantize_k_cache": _served("quantize_k_cache", fp8ref.quantize_k_cache, lambda a, k: None, lambda a, k: None),
    "dequantize_k_cache_paged": _served("dequantize_k_cache_paged", dequantize_k_cache_paged,
                                        lambda a, k: None, lambda a, k: None),
    # SGLang's own fallback (trtllm_mla_backend.py) where its CUDA concat kernel is not used.
    "_concat_mla_absorb_q_general": lambda q_nope, q_rope: torch.cat([q_nope, q_rope], dim=-1),
    "transform_index_page_table_decode": transform_index_page_table_decode,
    "transform_index_page_table_prefill": transform_index_page_table_prefill,
}
