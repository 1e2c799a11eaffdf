"""Torch stand-ins for the page-table kernels the FA3 family calls (CPU and CUDA), and
sgl-kernel's XPU paged MLA kernels (``flash_mla_decode``/``flash_mla_prefill``, the same
absorbed attention over the same pages, served by this one reference).

sgl-kernel's ``flash_attn_with_kvcache`` (FA3) cannot load on the GPU here, so both
sides of a verify run this reference instead. It has FA3's semantics for what a
patched cast can change, the rows read:

- ``k_cache`` ``[pages, page_size, kv_heads, d]`` and ``v_cache`` ``[pages, page_size,
  kv_heads, dv]``; request ``b`` reads token ``j < cache_seqlens[b]`` at page
  ``page_table[b, j // page_size]``, slot ``j % page_size``. Nothing else is read:
  entries past a request's length are masked before they can reach the output (a NaN
  there, say an ungathered shadow row, does not leak; one inside does).
- ``q`` ``[total_q, heads, d]`` with ``cu_seqlens_q`` (or ``[b, s, heads, d]``), and
  ``qv`` ``[.., heads, dv]``, the absorbed-MLA half: score = q.k + qv.v.
- ``causal`` with the query offset: query ``i`` of a request with ``n`` queries sits at
  position ``cache_seqlens[b] - n + i`` and reads keys up to it.
- ``return_softmax_lse``: ``(out, lse [heads, total_q])``, as FA3's varlen path.
- the caches must have the query's dtype, as FA3 checks: an FP8 cache that reaches the
  kernel uncast (a routed call left unrouted) raises, it is not read as exact floats.

Everything runs on the device with static shapes (no ``.item()``), so it can be
captured in a CUDA graph and replays with the lengths and tables then in memory.
"""

from __future__ import annotations

import torch

KERNEL_NAME = "reference-fa3"


def _token_requests(cu_seqlens_q, total_q, batch, device):
    """(request of each query token, its index among the request's queries, the request's query count)."""
    t = torch.arange(total_q, device=device, dtype=torch.int64)
    cu = cu_seqlens_q.to(torch.int64)
    req = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp_(max=batch - 1)
    return req, t - cu[req], (cu[1:] - cu[:-1])[req]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, *, cache_seqlens=None,
                            page_table=None, cu_seqlens_q=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, return_softmax_lse=False,
                            k_descale=None, v_descale=None, out=None, **_ignored):
    if k is not None or v is not None:
        raise NotImplementedError("reference flash_attn_with_kvcache: appending k/v is not modelled")
    if page_table is None or cache_seqlens is None:
        raise NotImplementedError("reference flash_attn_with_kvcache: needs page_table and cache_seqlens")
    if tuple(window_size) != (-1, -1) or softcap:
        raise NotImplementedError("reference flash_attn_with_kvcache: no sliding window or softcap")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        # As FA3: the caches must have the query's dtype (an FP8 cache wants an FP8 query
        # with descales). A routed call that reached the kernel uncast fails here.
        raise TypeError(f"flash_attn_with_kvcache: query is {q.dtype} but the caches are {k_cache.dtype}/"
                        f"{v_cache.dtype} (they must match)")
    dev = q.device
    batch = cache_seqlens.shape[0]
    four_d = cu_seqlens_q is None
    if four_d:  # [b, s, h, d]: every request has s queries
        if q.dim() != 4:
            raise ValueError(f"flash_attn_with_kvcache: q of {q.dim()} dims without cu_seqlens_q (FA3 wants 4)")
        s = q.shape[1]
        q = q.reshape(-1, *q.shape[2:])
        qv = qv.reshape(-1, *qv.shape[2:]) if qv is not None else None
        cu_seqlens_q = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * s
    total_q, heads, _ = q.shape
    pages, ps, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    width = page_table.shape[1] * ps
    j = torch.arange(width, device=dev)
    page = page_table.to(torch.int64)[:, j // ps].clamp(0, pages - 1)            # [b, width]
    within = (j % ps)[None, :].expand_as(page)
    lens = cache_seqlens.to(torch.int64)
    valid = j[None, :] < lens[:, None]                                            # [b, width]
    kk = k_cache[page, within]                                                    # [b, width, hk, d]
    vv = v_cache[page, within]
    zero = torch.zeros((), dtype=kk.dtype, device=dev)
    kk = torch.where(valid[:, :, None, None], kk, zero).float()
    vv = torch.where(valid[:, :, None, None], vv, zero).float()
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** -0.5
    req, pos, nq = _token_requests(cu_seqlens_q, total_q, batch, dev)
    keep = valid[req]                                                             # [t, width]
    if causal:
        keep = keep & (j[None, :] <= (lens[req] - nq + pos)[:, None])
    qg = q.float().reshape(total_q, kv_heads, group, -1)
    qvg = qv.float().reshape(total_q, kv_heads, group, -1) if qv is not None else None
    scores = torch.zeros((total_q, kv_heads, group, width), dtype=torch.float32, device=dev)
    for b in range(batch):  # static: the batch size is a shape
        s_b = torch.einsum("tkgd,jkd->tkgj", qg, kk[b])
        if qvg is not None:
            s_b = s_b + torch.einsum("tkgd,jkd->tkgj", qvg, vv[b])
        scores = torch.where((req == b)[:, None, None, None], s_b, scores)
    scores = torch.where(keep[:, None, None, :], scores * softmax_scale, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    l_ = p.sum(dim=-1, keepdim=True)
    o = torch.zeros((total_q, kv_heads, group, vv.shape[-1]), dtype=torch.float32, device=dev)
    for b in range(batch):
        o = torch.where((req == b)[:, None, None, None], torch.einsum("tkgj,jkd->tkgd", p, vv[b]), o)
    o = (o / torch.where(l_ > 0, l_, torch.ones_like(l_))).reshape(total_q, heads, -1)
    o = o.to(q.dtype)
    if four_d:
        o = o.reshape(batch, -1, heads, o.shape[-1])
    if out is not None:
        out.copy_(o.reshape(out.shape))
        o = out
    if not return_softmax_lse:
        return o
    lse = torch.where(l_ > 0, torch.log(l_) + m, torch.full_like(m, float("-inf")))
    return o, lse.reshape(total_q, heads).transpose(0, 1).contiguous()


def merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None):
    """sgl-kernel's merge of two partial attention states: v [t, h, d], s (lse) [t, h]."""
    sa, sb = s_a.float(), s_b.float()
    m = torch.maximum(sa, sb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(sa - m), torch.exp(sb - m)
    tot = wa + wb
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    v = (v_a.float() * (wa / safe)[..., None] + v_b.float() * (wb / safe)[..., None]).to(v_a.dtype)
    s = torch.where(tot > 0, torch.log(safe) + m, torch.full_like(m, float("-inf")))
    if v_merged is not None:
        v_merged.copy_(v)
        v = v_merged
    if s_merged is not None:
        s_merged.copy_(s)
        s = s_merged
    return v, s


def _mla_caches(kv_c_and_k_pe_cache, latent):
    """sgl-kernel's paged MLA cache [pages, page_size, latent + rope] as FA3's absorbed pair:
    k_cache the rope part, v_cache the latent part, one KV head each."""
    c = kv_c_and_k_pe_cache.unsqueeze(2)
    return c[..., latent:], c[..., :latent]


def flash_mla_decode(q_nope, q_pe, kv_c_and_k_pe_cache, seq_lens, page_table, workspace, sm_scale,
                     num_kv_splits=1):
    """sgl-kernel's (XPU) paged MLA decode: one query per request, reads token j < seq_lens[b]
    at page page_table[b, j // page_size]. Out [batch, heads, latent]."""
    k_cache, v_cache = _mla_caches(kv_c_and_k_pe_cache, q_nope.shape[-1])
    batch = seq_lens.shape[0]
    cu = torch.arange(batch + 1, device=q_nope.device, dtype=torch.int32)
    return flash_attn_with_kvcache(q_pe, k_cache, v_cache, qv=q_nope, cache_seqlens=seq_lens, page_table=page_table,
                                   cu_seqlens_q=cu, softmax_scale=sm_scale, causal=False)


def flash_mla_prefill(q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k, max_seqlen_q, page_table,
                      workspace, sm_scale, causal=True, num_kv_splits=-1):
    """sgl-kernel's (XPU) paged MLA prefill: ragged queries (cu_seqlens_q), each request's
    new tokens causal after its unmasked prefix (FA3's query offset). Out [total_q, heads, latent]."""
    k_cache, v_cache = _mla_caches(kv_c_and_k_pe_cache, q_nope.shape[-1])
    return flash_attn_with_kvcache(q_pe, k_cache, v_cache, qv=q_nope, cache_seqlens=seq_lens_k, page_table=page_table,
                                   cu_seqlens_q=cu_seqlens_q, softmax_scale=sm_scale, causal=causal)


def paged_view(flat, page_size):
    """SGLang 0.5.23's mem_cache.layout.paged_view: ``[slots, ...]`` -> ``[slots // page_size,
    page_size, ...]`` as a strided view."""
    n, stride = int(flat.shape[0]), flat.stride(0)
    return flat.as_strided((n // page_size, page_size, *flat.shape[1:]),
                           (stride * page_size, stride, *flat.stride()[1:]))


# By the names SGLang imports them under (stubs.REAL). MUSA's backend imports FA3's
# merge_state_v2_wrapper (a plain pass-through to merge_state_v2) from the FA3 module.
REAL = {"flash_attn_with_kvcache": flash_attn_with_kvcache, "merge_state_v2": merge_state_v2,
        "merge_state_v2_wrapper": merge_state_v2, "paged_view": paged_view,
        "flash_mla_decode": flash_mla_decode, "flash_mla_prefill": flash_mla_prefill}
