"""Torch stand-ins for aiter's ``mha_batch_prefill_func`` (ROCm/aiter, aiter/ops/mha.py) and
``paged_attention_ragged`` (aiter/ops/attention.py).

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

``paged_attention_ragged`` (MHA decode; its parameters are ``pagedcall.RAGGED_KERNELS``'):

- one query token a request: ``query`` ``[num_seqs, heads, d]``, ``out`` the same shape
  (``dv`` wide), written and returned; GQA, ``heads`` a multiple of the cache's heads.
- ``key_cache``/``value_cache`` ``[blocks, block_size, kv_heads, d]`` ("NHD"; "HND" swaps
  dims 1 and 2). Request ``b`` reads the pages ``kv_page_indices[kv_indptr[b]:kv_indptr[b + 1]]``,
  in that order, each full but the last, which holds ``kv_last_page_lens[b]`` slots; the
  batch is ``num_seqs``, so entries of the three lists past it are never read.
- ``kv_cache_dtype="auto"``: the cache is in the query's dtype (an 8-bit cache under "auto"
  would be read as other bytes: refused); "fp8"/"fp8_e4m3"/"fp8_e5m2": an 8-bit float cache
  read times ``k_scale``/``v_scale``. ``logits_soft_cap`` > 0 as above; ``scale`` multiplies
  the scores. A context past ``max_num_partitions * partition_size`` (the workspace's
  partitions) is refused, as the kernel cannot hold it.
"""

from __future__ import annotations

import torch

KERNEL_NAME = "reference-aiter-mha-batch-prefill"
DECODE_KERNEL_NAME = "reference-aiter-paged-attention-ragged"
# What aiter's kv_cache_dtype calls the query's own dtype, and an 8-bit float cache it dequantizes.
SAME_DTYPE, FP8_CACHE_DTYPES = "auto", ("fp8", "fp8_e4m3", "fp8_e5m2")
LAYOUTS = ("NHD", "HND")  # [blocks, block_size, heads, d] and [blocks, heads, block_size, d]


def _scaled(x, descale):
    x = x.float()  # a scale is a tensor (SGLang's [1] float32) or a plain float
    return x * torch.as_tensor(descale, device=x.device).float().reshape(-1)[0] if descale is not None else x


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


def _decode_checks(query, key_cache, value_cache, alibi_slopes, kv_cache_dtype, kv_cache_layout, fp8_out_scale, mtp):
    if alibi_slopes is not None or fp8_out_scale is not None or mtp != 1:
        raise NotImplementedError("reference paged_attention_ragged: no ALiBi, FP8 output or mtp > 1")
    if kv_cache_layout not in LAYOUTS or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise NotImplementedError(f"reference paged_attention_ragged: rank-4 {LAYOUTS} caches only, got "
                                  f"{kv_cache_layout!r} k {tuple(key_cache.shape)}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if kv_cache_dtype == SAME_DTYPE and cache.dtype != query.dtype:
            # the real kernel would read the cache's bytes as the query's dtype: garbage, not an error
            raise TypeError(f"paged_attention_ragged: kv_cache_dtype={SAME_DTYPE!r} with a {cache.dtype} {name} "
                            f"and {query.dtype} queries")
        if kv_cache_dtype in FP8_CACHE_DTYPES and not (cache.is_floating_point() and cache.element_size() == 1):
            raise TypeError(f"paged_attention_ragged: kv_cache_dtype={kv_cache_dtype!r} with a {cache.dtype} {name}")
    if kv_cache_dtype != SAME_DTYPE and kv_cache_dtype not in FP8_CACHE_DTYPES:
        raise NotImplementedError(f"reference paged_attention_ragged: kv_cache_dtype={kv_cache_dtype!r}")


def paged_attention_ragged(out, workspace_buffer, query, key_cache, value_cache, scale, kv_indptr, kv_page_indices,
                           kv_last_page_lens, block_size, max_num_partitions, alibi_slopes, kv_cache_dtype,
                           kv_cache_layout, logits_soft_cap, k_scale, v_scale, fp8_out_scale=None,
                           partition_size=256, mtp=1):
    _decode_checks(query, key_cache, value_cache, alibi_slopes, kv_cache_dtype, kv_cache_layout, fp8_out_scale, mtp)
    if kv_cache_layout != LAYOUTS[0]:
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    blocks, bsz, kv_heads, d = key_cache.shape
    if bsz != block_size:
        raise ValueError(f"paged_attention_ragged: block_size={block_size}, but the cache's pages hold {bsz} slots")
    num_seqs, heads, _ = query.shape
    group = heads // kv_heads
    indptr = kv_indptr.to(torch.int64).tolist()[: num_seqs + 1]  # the batch is the queries': the rest is stale
    last = kv_last_page_lens.to(torch.int64).tolist()[:num_seqs]
    if len(indptr) != num_seqs + 1 or len(last) != num_seqs:
        raise ValueError(f"paged_attention_ragged: {num_seqs} queries, kv_indptr of {kv_indptr.numel()} and "
                         f"kv_last_page_lens of {kv_last_page_lens.numel()}")
    fp8 = kv_cache_dtype in FP8_CACHE_DTYPES  # "auto" reads the cache as is: the scales are not applied
    k_descale, v_descale = (k_scale, v_scale) if fp8 else (None, None)
    k_slots = key_cache.reshape(blocks * bsz, kv_heads, d)  # slot = page * block_size + offset
    v_slots = value_cache.reshape(blocks * bsz, kv_heads, value_cache.shape[-1])
    qf = query.float().reshape(num_seqs, kv_heads, group, d)
    o = torch.zeros((num_seqs, heads, v_slots.shape[-1]), dtype=torch.float32, device=query.device)
    offsets = torch.arange(bsz, device=query.device)
    for b in range(num_seqs):
        pages = kv_page_indices[indptr[b]:indptr[b + 1]].to(torch.int64)  # only the listed pages are read
        if pages.numel() == 0:
            continue
        if not 1 <= last[b] <= bsz:
            raise ValueError(f"paged_attention_ragged: kv_last_page_lens[{b}]={last[b]} with pages of {bsz} slots")
        length = (pages.numel() - 1) * bsz + last[b]
        if length > max_num_partitions * partition_size:
            raise ValueError(f"paged_attention_ragged: request {b} has {length} keys, past the workspace's "
                             f"{max_num_partitions} partitions of {partition_size}")
        rows = (pages[:, None] * bsz + offsets).reshape(-1)[:length]
        kk, vv = _scaled(k_slots[rows], k_descale), _scaled(v_slots[rows], v_descale)  # [L, hk, d]
        s = torch.einsum("kgd,jkd->kgj", qf[b], kk) * scale
        if logits_soft_cap and logits_soft_cap > 0:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        o[b] = torch.einsum("kgj,jkd->kgd", s.softmax(-1), vv).reshape(heads, -1)
    out[:num_seqs].copy_(o.to(out.dtype).reshape(out[:num_seqs].shape))
    return out


# By the names SGLang imports them under (stubs.REAL): the kernels' own.
REAL = {f.__name__: f for f in (mha_batch_prefill_func, paged_attention_ragged)}
