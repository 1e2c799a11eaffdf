"""A part of the kvpatch runtime: routed FlashInfer MLA run() calls (mla_run).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import torch

from kvpatch.runtime._modes import _warn_once, mode
from kvpatch.runtime._dispatch import (
    _capturing,
    _COUNT_ATTR,
    _INDPTR_ATTR,
    _planned_fp8,
    kv_for_kernel,
    run_kwargs,
)
from kvpatch.runtime._fused import fused_mla
from kvpatch.runtime._route import (
    _fused_or_not,
    _NOT_SERVED,
    _pool_of,
    _shadow_view,
    _want_fused,
)

# -- joined from here --


# ---------------------------------------------------------------------------
# Routed FlashInfer MLA run() calls. The rewrite hands the pool on uncast
# (kv_for_mla_run) and calls mla_run(wrapper.run, <run's own arguments>). Per call: the
# fused FP8 attention where it computes exactly what the planned wrapper would (a decode
# plan: one query per request, no causal mask, page size 1) and the mode picks it; the
# FP8 pool itself where the wrapper was planned for FP8 (native); else the planned rows
# cast into the shadow (kv_for_kernel) and run() on them. Caches that cannot be traced
# back to one pool are cast whole: never wrong, only slower.

_MLA_CACHES = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")
# run()'s other arguments: the values with which the fused path computes what run() does.
# Any other argument, or another value, keeps the call on run().
_MLA_FUSED_OK = {
    "out": None,  # a tensor is checked below
    "lse": (None,),
    "return_lse": (False, None),
    "profiler_buffer": (None,),
    "kv_len": (None,),
    "page_table": (None,),
    "return_lse_base_on_e": (False, True),  # moot without an lse
    "o_scale": (None,),
    "ckv_scale": (None,),
    "ckv_scale_arr": (None,),
    "kpe_scale": (None,),
}


def kv_for_mla_run(kv_buffer, q_dtype):
    """What a routed run() call's caches are cut from in place of kv_buffer.to(q_dtype):
    the pool as stored (mla_run casts the rows run() reads, or reads the FP8 rows itself).
    """
    if mode() == "off":
        return kv_buffer.to(q_dtype)
    return kv_buffer


def mla_run(run, *args, **kw):
    """run(*args, **kw) for a FlashInfer MLA wrapper's bound run(), whose ckv and kpe
    caches may be views of an FP8 pool handed on uncast by kv_for_mla_run."""
    named = dict(zip(_MLA_CACHES, args))
    for name in _MLA_CACHES[len(args) :]:
        if name in kw:
            named[name] = kw[name]
    q, ckv, kpe = named.get("q_nope"), named.get("ckv_cache"), named.get("kpe_cache")
    T = torch.Tensor  # per call: no generator (host time)
    if not (isinstance(q, T) and isinstance(ckv, T) and isinstance(kpe, T)):
        return run(*args, **kw)
    if ckv.dtype == q.dtype and kpe.dtype == q.dtype:
        # Cast already (KVPATCH_MODE=off), a bf16 pool, or the DCP branch's own buffer.
        return run(*args, **kw)
    wrapper = getattr(run, "__self__", None)
    if _planned_fp8(wrapper):
        return run(*args, **kw, **run_kwargs(wrapper))
    pool = _pool_of(kpe, ckv) if ckv.dim() == 3 and kpe.dim() == 3 else None
    if pool is not None:
        fused = _mla_fused_inputs(wrapper, named, args, kw, pool)
        if fused is not None and _want_fused(pool.device, q.shape[1], 1):
            out = _fused_or_not(
                (pool.device, q.shape[1], 1), _mla_fused, named, kw, pool, *fused
            )
            if out is not _NOT_SERVED:
                return out
        shadow = kv_for_kernel(pool, wrapper, q.dtype)
        ckv2 = _shadow_view(shadow, pool, ckv)
        kpe2 = _shadow_view(shadow, pool, kpe)
    else:
        _warn_once(
            ("mla-whole",),
            "kvpatch: routed run()'s caches not traced to one pool; casting them whole",
        )
        ckv2, kpe2 = ckv.to(q.dtype), kpe.to(q.dtype)
    return _mla_call(run, args, kw, ckv2, kpe2)


def _mla_call(run, args, kw, ckv, kpe):
    """run() with its caches replaced, each where the call passed it."""
    args = list(args)
    for i, (name, t) in enumerate((("ckv_cache", ckv), ("kpe_cache", kpe)), 2):
        if len(args) > i:
            args[i] = t
        else:
            kw = dict(kw, **{name: t})
    return run(*args, **kw)


def _mla_fused_inputs(wrapper, named, args, kw, pool):
    """(indptr, indices, sm_scale) when the fused path computes exactly what the wrapper's
    planned run() would for this call, else None. The fused path is CUDA-only."""
    if not pool.is_cuda:
        return None
    return _mla_contract(wrapper, named, args, kw, pool.device)


def _mla_contract(wrapper, named, args, kw, device):
    """The fused path's contract, device aside. Runs on every routed call: plain reads.

    The plan must be a decode plan that went through plan_rows: no causal mask, page size
    1, and as many query rows as the plan has requests (FlashInfer's decode layout, one
    query a request). The indices are the wrapper's own, the ones run() reads."""
    if len(args) > len(_MLA_CACHES):
        return None
    for name, value in kw.items():
        if name in _MLA_CACHES:
            continue
        ok = _MLA_FUSED_OK.get(name, ())
        if ok is None:
            continue
        if value is not None and not isinstance(value, (bool, int, float)):
            return None
        if value not in ok:
            return None
    state = getattr(wrapper, "__dict__", {})
    held = state.get(_INDPTR_ATTR)
    indices = getattr(wrapper, "_kv_indices_buf", None)
    sm_scale = getattr(wrapper, "_sm_scale", None)
    if (
        held is None
        or state.get(_COUNT_ATTR) is None
        or getattr(wrapper, "_causal", None) is not False
        or getattr(wrapper, "_page_size", None) != 1
        or not isinstance(sm_scale, (float, int))
        or not isinstance(indices, torch.Tensor)
        or indices.device != device
        or held[0].device != device
    ):
        return None
    # A graph replays what it captured: only a wrapper made for graphs keeps the buffers
    # a later plan writes (plan_rows writes the same indptr buffer on every plan).
    if _capturing() and not getattr(wrapper, "_use_cuda_graph", False):
        return None
    q, q_pe, out = named["q_nope"], named.get("q_pe"), kw.get("out")
    T = torch.Tensor
    if not isinstance(q_pe, T) or q.dim() != 3 or q_pe.dim() != 3:
        return None
    if q.dtype is not torch.bfloat16 or q_pe.dtype is not q.dtype:
        return None
    if q.shape[0] != held[1] or q_pe.shape[:2] != q.shape[:2]:
        return None
    if out is not None and not (
        isinstance(out, T)
        and out.shape == q.shape
        and out.dtype is q.dtype
        and out.stride(-1) == 1
    ):
        return None
    return held[0], indices, float(sm_scale)


def _mla_fused(named, kw, pool, indptr, indices, sm_scale):
    q = named["q_nope"]
    out = kw.get("out")
    if out is None:  # run() allocates its output per call too
        out = torch.empty_like(q)
    fused_mla(
        q,
        named["q_pe"],
        pool,
        out,
        sm_scale,
        kv_indptr=indptr,
        kv_indices=indices,
    )
    return out
