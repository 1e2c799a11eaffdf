"""A part of the kvpatch runtime: routed kernel calls (the fused path, or the gather and the kernel).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import torch

from kvpatch.runtime._modes import (
    _mode,
    _device_capability,
    _FP8,
    _requested,
    _warn_once,
    mode,
)
from kvpatch.runtime._dispatch import _shadow
from kvpatch.runtime._pages import page_cast
from kvpatch.runtime._fused import fused_mla
from kvpatch.runtime._fused_wgmma import FUSED_WGMMA_DEFAULT, FUSED_WGMMA_TUNING
from kvpatch.runtime._fused_wgmma_ws import _fused_wgmma_ws_build

# -- joined from here --


# ---------------------------------------------------------------------------
# Routed kernel calls. A rewrite that routes a kernel call hands the pool on uncast
# (kv_for_routed_kernel) and calls paged_attention(kernel, **the call's own arguments).
# There, per call: the fused FP8 attention when it can serve the call and the mode picks
# it; else the pages the call's own table lists are cast into the shadow and the original
# kernel runs on them; a call whose caches cannot be traced to one pool gets its caches
# cast whole (never wrong, only slower).

# auto: the most query rows a request may hold (heads x query tokens) for the fused path,
# per compute capability, where benchmarks/bench_fused.py measured fused faster than the
# gathered cast plus the bf16 kernel at every shape it prints (notes/gpu-runs.md, runs 15, 18, 19).
# A GPU not listed is not measured: auto gathers there.
FUSED_AUTO_ROWS = {(9, 0): 16}
# And the (heads, query tokens) shapes the 64-row kernel (runtime part _fused_wgmma) serves
# where it was measured faster than the gather at every batch bench_fused.py prints (GPU run
# 51, H100, the table's fused and gather, us at 8 and 32 x 4k, before its splits filled the
# last wave, which took 0.66-1.0x that time in the same run's probe): 16 x 4 draft tokens
# 39.1 and 108.3 against 54.6 and 167.6; 16 x 8 47.9 and 155.9 against 61.1 and 183.9;
# 64 heads 38.9 and 109.1 against 54.2 and 167.6; 128 heads 47.7 and 158.4 against 60.1
# and 182.8.
FUSED_AUTO_WGMMA = {(9, 0): ((16, 4), (16, 8), (64, 1), (128, 1))}

# FA3's flash_attn_with_kvcache: arguments the fused path reads (values checked below) and
# arguments that only steer the original kernel's scheduling. Any other argument with a
# value other than its default keeps the call on the original kernel.
_FA3_READ = (
    "q",
    "k_cache",
    "v_cache",
    "qv",
    "page_table",
    "cache_seqlens",
    "cu_seqlens_q",
    "max_seqlen_q",
    "softmax_scale",
    "causal",
    "out",
)
# ver picks FA3 or FA4 (SGLang passes it); cu_seqlens_k_new only places new k/v, which a
# routed call never passes (k and v must be None, below), so the kernel ignores it.
_FA3_STEERING = (
    "num_splits",
    "pack_gqa",
    "sm_margin",
    "scheduler_metadata",
    "ver",
    "cu_seqlens_k_new",
)
_FA3_DEFAULTS = {
    "window_size": ((-1, -1), [-1, -1]),
    "softcap": (0.0, 0),
    "return_softmax_lse": (False,),
    "attention_chunk": (0, None),
}
# Arguments the fused path serves only as None (SGLang passes k_descale=None, say).
_FA3_NONE = (
    "k",
    "v",
    "q_descale",
    "k_descale",
    "v_descale",
    "rotary_cos",
    "rotary_sin",
    "rotary_seqlens",
    "cache_batch_idx",
    "cache_leftpad",
    "sinks",
)
_FA3_KNOWN = frozenset(_FA3_READ + _FA3_STEERING + tuple(_FA3_DEFAULTS) + _FA3_NONE)
_fused_failed = (
    set()
)  # (device, heads, tq) whose fused launch raised: gather from then on


def kv_for_routed_kernel(kv_buffer, q_dtype):
    """What a routed kernel call receives in place of kv_buffer.to(q_dtype): the pool as
    stored (paged_attention casts what the call reads, or reads the FP8 rows itself)."""
    if mode() == "off":
        return kv_buffer.to(q_dtype)
    return kv_buffer


def paged_attention(kernel, *args, **kw):
    """kernel(*args, **kw) for a page-table kernel (FA3's flash_attn_with_kvcache) whose
    caches may come uncast from kv_for_routed_kernel."""
    k, v, q = kw.get("k_cache"), kw.get("v_cache"), kw.get("q")
    T = torch.Tensor  # per call: no generator (host time)
    if not (isinstance(k, T) and isinstance(v, T) and isinstance(q, T)):
        return kernel(*args, **_cast_fp8_args(kw, q))
    if k.dtype == q.dtype and v.dtype == q.dtype:
        return kernel(*args, **kw)  # cast already (KVPATCH_MODE=off), or a bf16 pool
    if args:  # the rewrite routes keyword calls only; anything else gets whole casts
        return _whole_casts(kernel, args, kw, q)
    pool = _pool_of(k, v)
    shape = _fused_shape(kw, pool)
    if shape is not None and _want_fused(pool.device, *shape[:2]):
        out = _fused_or_not(
            (pool.device, shape[0], shape[1]), _fused_fa3, kw, pool, *shape
        )
        if out is not _NOT_SERVED:
            return out
    return kernel(**_gathered(kw, pool))


_NOT_SERVED = object()


def _fused_or_not(key, fused, *args):
    """fused(*args), or _NOT_SERVED when it raised (a compile or launch failure): calls of
    key, (device, heads, query tokens), take the gathered path from then on."""
    try:
        return fused(*args)
    except Exception as exc:
        _fused_failed.add(key)
        _warn_once(
            ("fused", type(exc).__name__),
            "kvpatch: fused attention failed (%s); gathering",
            exc,
        )
        return _NOT_SERVED


def _shadow_view(shadow, pool, t):
    """The view of shadow that t (a view of pool) is of pool."""
    return shadow.as_strided(
        t.shape, t.stride(), t.storage_offset() - pool.storage_offset()
    )


def _cast_whole(t, dtype):
    # Any 8-bit float, the pool's dtype whatever it is (SGLang's fp8_e5m2 KV cache too):
    # the original cast the pool to q's dtype, and the kernel reads nothing else that small.
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() == 1:
        return t.to(dtype)
    return t


def _cast_fp8_args(kw, q):
    if not isinstance(q, torch.Tensor):
        return kw
    return {name: _cast_whole(t, q.dtype) for name, t in kw.items()}


def _whole_casts(kernel, args, kw, q):
    """The kernel on its arguments with every 8-bit float one cast to q's dtype: what the
    original's whole cast handed it (never wrong, only slower)."""
    return kernel(*[_cast_whole(a, q.dtype) for a in args], **_cast_fp8_args(kw, q))


def _slot_stride(t):
    """The stride between a [pages, page_size, 1, d] view's slots, or None. A dim of size
    1 may carry any stride (x.view(-1, 1, 1, d) gives dim 1 the row's): page size 1 reads
    it from the pages' stride."""
    if t.shape[1] == 1:
        return t.stride(0)
    return t.stride(1) if t.stride(0) == t.stride(1) * t.shape[1] else None


_pool_geometry = (
    {}
)  # the views' addresses, shapes, strides, dtypes -> the pool's (slots, width, row), or None
_UNSEEN = object()


def _pool_of(k, v):
    """The [slots, row] pool that the views k (rope part) and v (latent part), each
    [pages, page_size, 1, d] or [pages, page_size, d], were cut from, or None: v must
    start a row, k follow it in the same row, both with the rows' stride and the same
    page geometry. The verdict is kept per the views' addresses and
    geometry (the same layer's views are new objects every call): two views at the same
    addresses with the same shapes and strides lie as the first two did, one storage."""
    key = (
        k.data_ptr(),
        v.data_ptr(),
        k.shape,
        v.shape,
        k.stride(),
        v.stride(),
        k.dtype,
        v.dtype,
    )
    geo = _pool_geometry.get(key, _UNSEEN)
    if geo is _UNSEEN:
        # [pages, page_size, d] views (FlashInfer MLA's caches) are the 4-D layout's
        # [pages, page_size, heads, d] with one head.
        if k.dim() == 3 and v.dim() == 3:
            geo = _pool_geometry_of(k.unsqueeze(2), v.unsqueeze(2))
        else:
            geo = _pool_geometry_of(k, v)
        if len(_pool_geometry) >= 4096:  # layers x pools: a bound, not a working set
            _pool_geometry.clear()
        _pool_geometry[key] = geo
    if geo is None:
        return None
    try:
        return v.as_strided(geo[:2], (geo[2], 1), v.storage_offset())
    except (
        RuntimeError
    ):  # not within v's storage after all: the whole casts, never wrong
        return None


def _pool_geometry_of(k, v):
    if k.dtype is not _FP8 or v.dtype is not _FP8 or k.dim() != 4 or v.dim() != 4:
        return None
    try:
        same = k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    except Exception:
        return None
    row = _slot_stride(k)
    width = v.shape[-1] + k.shape[-1]
    if not (
        same
        and row == width
        and _slot_stride(v) == row
        and k.stride(0) == v.stride(0)
        and (k.stride(-1) == 1 or k.shape[-1] == 1)
        and v.stride(-1) == 1
        and k.shape[:3] == v.shape[:3]
        and k.shape[2] == 1
        and k.storage_offset() == v.storage_offset() + v.shape[-1]
        and v.storage_offset() % row == 0
    ):
        return None
    return (v.shape[0] * v.shape[1], width, row)


_FA3_NONE_SET = frozenset(_FA3_NONE)
_FA3_DEFAULT_SET = frozenset(_FA3_DEFAULTS)


def _fused_shape(kw, pool):
    """(heads, query tokens per request, batch) when the fused path computes exactly what
    FA3 would for this call, else None. Runs on every routed call: kept to plain reads.
    """
    if pool is None or not pool.is_cuda or not _FA3_KNOWN.issuperset(kw):
        return None
    for name in _FA3_NONE_SET.intersection(kw):
        if kw[name] is not None:
            return None
    for name in _FA3_DEFAULT_SET.intersection(kw):
        if kw[name] not in _FA3_DEFAULTS[name]:
            return None
    q, qv, pt, sl = kw["q"], kw.get("qv"), kw.get("page_table"), kw.get("cache_seqlens")
    T = torch.Tensor
    if not (isinstance(qv, T) and isinstance(pt, T) and isinstance(sl, T)):
        return None
    if (
        q.dtype is not torch.bfloat16
        or qv.dtype is not q.dtype
        or pt.dim() != 2
        or sl.dim() != 1
    ):
        return None
    qs, qvs = q.shape, qv.shape
    if (
        len(qs) != 3
        or len(qvs) != 3
        or qs[:2] != qvs[:2]
        or not isinstance(kw.get("softmax_scale"), float)
    ):
        return None
    out = kw.get("out")
    if out is not None and not (
        isinstance(out, T)
        and out.shape == qvs
        and out.dtype is qv.dtype
        and out.stride(-1) == 1
    ):
        return None
    tokens, heads, batch = qs[0], qs[1], pt.shape[0]
    if kw.get("cu_seqlens_q") is None:
        return None
    # Uniform query lengths, proven on the host: each request holds at most max_seqlen_q
    # tokens, and all of them together hold batch x max_seqlen_q.
    tq = kw.get("max_seqlen_q")
    if not isinstance(tq, int) or tq < 1 or tokens != batch * tq or sl.shape[0] < batch:
        return None
    return heads, tq, batch


def _fused_auto(cap, heads, tq):
    """Whether auto sends a call of `heads` x `tq` query rows a request to the fused path on `cap`."""
    if heads * tq <= FUSED_AUTO_ROWS.get(cap, 0):
        return True
    # The shapes were measured on the loader-partition kernel: where it is off or cannot build
    # (another Triton), a slower kernel would serve, slower there than the gather.
    return (
        FUSED_WGMMA_DEFAULT
        and FUSED_WGMMA_TUNING["ws"]
        and (heads, tq) in FUSED_AUTO_WGMMA.get(cap, ())
        and bool(_fused_wgmma_ws_build())
    )


def _want_fused(device, heads, tq):
    m = _mode or mode()
    if m not in ("fused", "gather") or (device, heads, tq) in _fused_failed:
        return False
    if m == "fused":
        return True
    if _requested != "auto":
        return False
    cap = _device_capability(device)
    return _fused_auto(cap, heads, tq)


def _fused_fa3(kw, pool, heads, tq, batch):
    q_pe, q_nope = kw["q"], kw["qv"]
    out = kw.get("out")
    if out is None:  # FA3 allocates its output per call too
        out = torch.empty(
            (q_nope.shape[0], heads, q_nope.shape[-1]),
            dtype=q_nope.dtype,
            device=q_nope.device,
        )
    fused_mla(
        q_nope,
        q_pe,
        pool,
        out,
        kw["softmax_scale"],
        page_table=kw["page_table"],
        cache_seqlens=kw["cache_seqlens"],
        page_size=kw["v_cache"].shape[1],
        q_per_request=tq,
        causal=bool(kw.get("causal", False)),
    )
    return out


def _gathered(kw, pool):
    """The call's arguments with its caches replaced by views of the shadow, into which
    the pages its own table lists were cast; whole casts where that cannot be done."""
    k, v, q = kw["k_cache"], kw["v_cache"], kw["q"]
    pt, sl = kw.get("page_table"), kw.get("cache_seqlens")
    if pool is None or not isinstance(pt, torch.Tensor):
        _warn_once(
            ("route-whole",),
            "kvpatch: routed call's caches not traced to one pool; casting them whole",
        )
        return _cast_fp8_args(kw, q)
    shadow = _shadow(pool, q.dtype)
    page_cast(
        pool, shadow, pt, sl if isinstance(sl, torch.Tensor) else None, v.shape[1]
    )
    out = dict(kw)
    for name, t in (("k_cache", k), ("v_cache", v)):
        out[name] = _shadow_view(shadow, pool, t)
    return out
