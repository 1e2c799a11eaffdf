"""A part of the kvpatch runtime: routed sgl-kernel paged MLA decode calls (paged_mla).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import torch

from kvpatch.runtime._modes import _FP8, _warn_once
from kvpatch.runtime._dispatch import _shadow
from kvpatch.runtime._pages import _table_ok, page_cast
from kvpatch.runtime._fused import fused_mla
from kvpatch.runtime._route import (
    _fused_or_not,
    _NOT_SERVED,
    _pool_geometry,
    _shadow_view,
    _slot_stride,
    _UNSEEN,
    _want_fused,
    _whole_casts,
)

# -- joined from here --


# ---------------------------------------------------------------------------
# Routed sgl-kernel paged MLA decode (SGLang's XPU backend: flash_mla_decode, by
# position). The rewrite (rule KVP108) hands the pool on uncast (kv_for_routed_kernel) and
# calls paged_mla(flash_mla_decode, <the call's own arguments>). Per call: the fused FP8
# attention where it computes exactly what the kernel would and the mode picks it (CUDA
# only); else the pages the call's own table lists are cast into the shadow and the kernel
# runs on a view of it; a cache that cannot be traced to one pool is cast whole (never
# wrong, only slower).

# sgl-kernel's flash_mla_decode, parameters in order (sgl-kernel-xpu,
# python/sgl_kernel/attention.py): q_nope [B, H, 512], q_pe [B, H, 64], the cache
# [pages, page_size, 576], seq_lens [B] and page_table [B, max_pages] (int32), workspace,
# sm_scale, num_kv_splits (scheduling only). Returns a new [B, H, 512] tensor.
_PM_PARAMS = (
    "q_nope",
    "q_pe",
    "kv_c_and_k_pe_cache",
    "seq_lens",
    "page_table",
    "workspace",
    "sm_scale",
    "num_kv_splits",
)
_PM_INDEX = {name: i for i, name in enumerate(_PM_PARAMS)}
_PM_CACHE = 2
_PM_LATENT, _PM_ROPE = 512, 64


def paged_mla(kernel, *args, **kw):
    """kernel(*args, **kw) for sgl-kernel's positional paged MLA decode (flash_mla_decode),
    whose cache may be a [pages, page_size, 576] view of an FP8 pool handed on uncast by
    kv_for_routed_kernel."""
    b = _pm_bind(args, kw)
    if b is None:  # not the signature the rewrite bound: whole casts, as the original
        return _pm_whole(kernel, args, kw)
    q, cache = b[0], b[_PM_CACHE]
    if not isinstance(q, torch.Tensor) or not isinstance(cache, torch.Tensor):
        return kernel(*args, **kw)
    if cache.dtype == q.dtype:
        return kernel(*args, **kw)  # cast already (KVPATCH_MODE=off), or a bf16 pool
    pool = _pm_pool_of(cache)
    if pool is None:
        _warn_once(
            ("paged-mla-whole",),
            "kvpatch: routed paged MLA call's cache not traced to one pool; casting it whole",
        )
        return _pm_call(kernel, args, kw, cache.to(q.dtype))
    ps = cache.shape[1]
    if _pm_fused_ok(b, pool) and _want_fused(pool.device, q.shape[1], 1):
        out = _fused_or_not((pool.device, q.shape[1], 1), _pm_fused, b, pool, ps)
        if out is not _NOT_SERVED:
            return out
    pt, sl = b[4], b[3]
    if not isinstance(sl, torch.Tensor):
        sl = None  # every entry of the table: a superset of what the kernel reads
    if not _table_ok(pool, (pt, sl)):
        _warn_once(
            ("paged-mla-table",),
            "kvpatch: routed paged MLA call's page table not usable; casting its cache whole",
        )
        return _pm_call(kernel, args, kw, cache.to(q.dtype))
    shadow = _shadow(pool, q.dtype)
    page_cast(pool, shadow, pt, sl, ps)
    return _pm_call(kernel, args, kw, _shadow_view(shadow, pool, cache))


def _pm_bind(args, kw):
    """The call's arguments by parameter (None where not given), or None where they do not
    bind: too many positions, an unknown keyword, a parameter given twice."""
    n = len(args)
    if n > len(_PM_PARAMS):
        return None
    b = list(args) + [None] * (len(_PM_PARAMS) - n)
    for name, value in kw.items():
        i = _PM_INDEX.get(name, -1)
        if i < n:  # unknown (-1), or already given by position
            return None
        b[i] = value
    return b


def _pm_call(kernel, args, kw, cache):
    """The kernel with its cache replaced, where the call passed it."""
    if len(args) > _PM_CACHE:
        return kernel(*args[:_PM_CACHE], cache, *args[_PM_CACHE + 1 :], **kw)
    return kernel(*args, **dict(kw, kv_c_and_k_pe_cache=cache))


def _pm_whole(kernel, args, kw):
    q = args[0] if args else kw.get("q_nope")
    if not isinstance(q, torch.Tensor):
        return kernel(*args, **kw)
    return _whole_casts(kernel, args, kw, q)


def _pm_pool_of(cache):
    """The [slots, 576] pool that the [pages, page_size, 576] view `cache` was cut from
    (SGLang's [slots, 1, 576] MLA pool, viewed as pages), or None: FP8, rows contiguous and
    back to back. The verdict is kept per the view's address and geometry, as _pool_of
    keeps its own (the same layer's view is a new object every call)."""
    key = (cache.data_ptr(), cache.shape, cache.stride(), cache.dtype)
    geo = _pool_geometry.get(key, _UNSEEN)
    if geo is _UNSEEN:
        geo = None
        if cache.dtype is _FP8 and cache.dim() == 3 and cache.stride(2) == 1:
            row = _slot_stride(cache)
            if row == cache.shape[2]:
                geo = (cache.shape[0] * cache.shape[1], row, row)
        if len(_pool_geometry) >= 4096:  # layers x pools: a bound, not a working set
            _pool_geometry.clear()
        _pool_geometry[key] = geo
    if geo is None:
        return None
    try:
        return cache.as_strided(geo[:2], (geo[2], 1), cache.storage_offset())
    except RuntimeError:
        return None  # not within the storage after all: the whole cast, never wrong


def _pm_fused_ok(b, pool):
    """Whether the fused path (CUDA only) computes exactly what flash_mla_decode would."""
    return pool.is_cuda and _pm_contract(b, pool)


def _pm_contract(b, pool):
    """The fused path's contract, the device's kind aside: one query token a request (the
    decode layout), and the kernel's own dtype checks. Runs on every routed call: plain
    reads. num_kv_splits only steers the kernel's scheduling; workspace is its own."""
    if pool.shape[1] != _PM_LATENT + _PM_ROPE:
        return False
    q, q_pe, sl, pt = b[0], b[1], b[3], b[4]
    T = torch.Tensor
    if not (isinstance(q_pe, T) and isinstance(pt, T) and isinstance(sl, T)):
        return False
    if not isinstance(b[6], float):
        return False
    if q.dtype is not torch.bfloat16 or q_pe.dtype is not q.dtype:
        return False
    if q.dim() != 3 or q_pe.dim() != 3 or pt.dim() != 2 or sl.dim() != 1:
        return False
    batch = q.shape[0]
    return (
        q.shape[2] == _PM_LATENT
        and q_pe.shape[2] == _PM_ROPE
        and q_pe.shape[:2] == q.shape[:2]
        and q.stride(2) == 1
        and q_pe.stride(2) == 1
        and pt.shape[0] == batch
        and pt.stride(1) == 1
        and sl.shape[0] == batch
        and pt.dtype is torch.int32
        and sl.dtype is torch.int32
        and q.device == pool.device
        and pt.device == pool.device
        and sl.device == pool.device
    )


def _pm_fused(b, pool, page_size):
    q = b[0]
    # flash_mla_decode returns a new [B, H, 512] tensor in the query's dtype.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    fused_mla(
        q,
        b[1],
        pool,
        out,
        b[6],
        page_table=b[4],
        cache_seqlens=b[3],
        page_size=page_size,
    )
    return out
