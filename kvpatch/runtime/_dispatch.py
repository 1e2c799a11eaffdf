"""A part of the kvpatch runtime: the plan and run hooks a patched backend calls.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import torch

from kvpatch.runtime._modes import (
    _at_least,
    _device_capability,
    _FA2_MIN,
    _FA3_MIN,
    _flashinfer_version,
    _FP8,
    _parse_version,
    _shadow_users,
    _shadows,
    _warn_once,
    mode,
)
from kvpatch.runtime._gather import _rows, gather_cast

# -- joined from here --


# ---------------------------------------------------------------------------
# Plan / run hooks


def _native_ok(wrapper, q_dtype, kv_cache_dtype, causal):
    if mode() != "native":
        return False
    # uint8 maps to an FP4 kernel in FlashInfer; e5m2 is not supported: e4m3fn only.
    if kv_cache_dtype is not _FP8 or q_dtype is not torch.bfloat16:
        return False
    # Causal (prefill, verify) plans always gather: their consumer can also receive
    # the DCP branch's compact bf16 buffer, and FlashInfer 0.6.18's FP8 prefill
    # kernel ran at 0.4-0.8x of the unpatched bf16 path on the H200.
    if causal:
        return False
    device = getattr(wrapper, "device", None)
    if not isinstance(device, torch.device) or device.type != "cuda":
        return False
    cap = _device_capability(device)
    if cap is None or cap[0] != 9:
        return False
    version = _parse_version(_flashinfer_version())
    backend = getattr(wrapper, "_backend", None)
    if backend == "fa3":
        return _at_least(version, _FA3_MIN)
    if backend == "fa2":
        return _at_least(version, _FA2_MIN)
    return False


def plan_kv_dtype(wrapper, q_dtype, kv_dtype, kv_cache_dtype, causal):
    """The kv dtype to plan with: FP8 when the wrapper runs FP8 MLA natively, else kv_dtype.

    The choice is recorded on the wrapper so kv_for_kernel and run_kwargs follow the plan.
    """
    native = _native_ok(wrapper, q_dtype, kv_cache_dtype, bool(causal))
    choice = _FP8 if native else kv_dtype
    try:
        wrapper._kvpatch_kv_dtype = choice
    except Exception:  # an object without a __dict__ cannot be planned native
        return kv_dtype
    return choice


def _planned_fp8(wrapper):
    return getattr(wrapper, "_kvpatch_kv_dtype", None) is _FP8


def run_kwargs(wrapper):
    """FP8 run() needs both scales (and bf16 run() rejects them); SGLang stores unscaled."""
    if _planned_fp8(wrapper):
        return {"ckv_scale": 1.0, "kpe_scale": 1.0}
    return {}


def _shadow(kv_buffer, dtype):
    """The persistent shadow for kv_buffer. Two sources of one shape (an MHA layer's k and
    v, both cast before the one kernel that reads them) must not share one: the last two
    sources cast each hold their own, and a new source takes the one used least recently
    (a layer's kernel has run by the time the next layer casts)."""
    base = (kv_buffer.device, tuple(kv_buffer.shape), dtype)
    # [(source address, slot)], most recent last
    users = _shadow_users.setdefault(base, [])
    ptr = kv_buffer.data_ptr()
    mine = next((u for u in users if u[0] == ptr), None)
    if mine is None:
        mine = (ptr, len(users)) if len(users) < 2 else (ptr, users.pop(0)[1])
    else:
        users.remove(mine)
    users.append(mine)
    key = base + (mine[1],)
    buf = _shadows.get(key)
    if buf is None:
        # Contents never matter: only rows the kernel reads are read, and those are cast
        # right before every run.
        buf = torch.empty(kv_buffer.shape, dtype=dtype, device=kv_buffer.device)
        _shadows[key] = buf
    return buf


# What a routed plan call left on its wrapper: the device count of indices the
# next run() reads, and (for the fused path, mla_run) a device copy of the plan's
# kv_indptr with its request count. One persistent tensor each per wrapper, so a
# captured graph reads what the plan before each replay wrote.
_COUNT_ATTR = "_kvpatch_rows"
_INDPTR_ATTR = "_kvpatch_indptr"  # (device indptr buffer, requests) or None


def _capturing():
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def _wrapper_device(wrapper, kv_indptr):
    device = getattr(wrapper, "device", None)
    if isinstance(device, torch.device):
        return device
    indices = getattr(wrapper, "_kv_indices_buf", None)
    if isinstance(indices, torch.Tensor):
        return indices.device
    return kv_indptr.device


def plan_rows(wrapper, kv_indptr):
    """Pass kv_indptr through to a plan call, noting how many indices run() reads.

    Every call that gives a FlashInfer MLA wrapper its indices (wrapper.plan,
    fast_mla_decode_plan, fast_mla_prefill_plan) routes its kv_indptr here, so the
    count comes from the call itself, not from wrapper state that some plan paths
    never refresh. A host indptr is read on the host (no sync); a device indptr is
    copied on the device (a graph that captured the copy replays it). A host value
    inside graph capture would be frozen into the graph: the wrapper is then marked
    unknown and kv_for_kernel casts the whole pool.
    """
    try:
        if not isinstance(kv_indptr, torch.Tensor) or kv_indptr.dim() != 1:
            raise TypeError("kv_indptr is not a 1-D tensor")
        count = wrapper.__dict__.get(_COUNT_ATTR)
        device = _wrapper_device(wrapper, kv_indptr)
        if count is None or count.device != device:
            if _capturing():
                raise RuntimeError("first plan of this wrapper inside graph capture")
            count = torch.zeros(1, dtype=torch.int64, device=device)
        if kv_indptr.numel() == 0:
            count.zero_()
        elif kv_indptr.device.type == "cpu":
            if _capturing():
                raise RuntimeError("host kv_indptr inside graph capture")
            count.fill_(int(kv_indptr[-1]))
        else:
            count.copy_(kv_indptr[-1:])
        wrapper.__dict__[_COUNT_ATTR] = count
    except Exception as exc:
        try:
            wrapper.__dict__[_COUNT_ATTR] = None  # unknown: whole-pool cast
            wrapper.__dict__[_INDPTR_ATTR] = None
        except Exception:
            pass
        _warn_once(
            ("plan_rows", type(wrapper).__name__, str(exc)),
            "kvpatch: rows of %s unknown (%s); casting the whole pool",
            type(wrapper).__name__,
            exc,
        )
        return kv_indptr
    _note_indptr(wrapper, kv_indptr, count.device)
    return kv_indptr


def _note_indptr(wrapper, kv_indptr, device):
    """Keep a device copy of the plan's kv_indptr on the wrapper, for the fused path.

    A host indptr is staged through pinned memory, so the copy is asynchronous (torch's
    pinned allocator keeps the block until the copy has run). The buffer is made once
    and kept: a graph wrapper's (use_cuda_graph) is as large as the indptr buffer it was
    made with, which no later plan of it exceeds; any other wrapper's grows, and is never
    read under capture (mla_run). Anything unexpected leaves the fused path unplanned.
    """
    state = wrapper.__dict__
    if device.type != "cuda":  # the fused path is CUDA-only
        state[_INDPTR_ATTR] = None
        return
    try:
        n = kv_indptr.numel()
        held = state.get(_INDPTR_ATTR)
        buf = held[0] if held else None
        if buf is None or buf.numel() < n or buf.dtype != kv_indptr.dtype:
            graph = getattr(wrapper, "_use_cuda_graph", False)
            if _capturing() or (buf is not None and graph):
                raise RuntimeError("the indptr buffer of a graph wrapper cannot grow")
            own = getattr(wrapper, "_kv_indptr_buf", None)
            size = max(n, own.numel()) if graph and isinstance(own, torch.Tensor) else n
            buf = torch.zeros(size, dtype=kv_indptr.dtype, device=device)
        if kv_indptr.device.type == "cpu":
            src = kv_indptr if kv_indptr.is_pinned() else kv_indptr.pin_memory()
            buf[:n].copy_(src, non_blocking=True)
        else:
            buf[:n].copy_(kv_indptr)
        state[_INDPTR_ATTR] = (buf, n - 1)
    except Exception:
        # The fused path declines; gather and native are unaffected.
        state[_INDPTR_ATTR] = None


def kv_for_kernel(kv_buffer, wrapper, q_dtype, kv_indptr=None):
    """What the kernel reads in place of kv_buffer.to(q_dtype).

    The rows are wrapper._kv_indices_buf[:n] (the indices run() reads), n as the
    last routed plan call noted it (plan_rows). kv_indptr is accepted for call sites
    written by kvpatch 0.1 and not read: a backend's indptr buffer is not always
    the one the kernel was planned with.
    """
    if mode() == "off":
        return kv_buffer.to(q_dtype)
    if kv_buffer.dtype == q_dtype:
        return kv_buffer
    if kv_buffer.dtype is _FP8 and _planned_fp8(wrapper):
        return kv_buffer
    indices = getattr(wrapper, "_kv_indices_buf", None)
    count = getattr(wrapper, "__dict__", {}).get(_COUNT_ATTR)
    if not (
        isinstance(indices, torch.Tensor)
        and isinstance(count, torch.Tensor)
        and indices.device == kv_buffer.device
        and count.device == kv_buffer.device
    ):
        _warn_once(
            ("unplanned", type(wrapper).__name__),
            "kvpatch: no plan of %s was routed through kvpatch on the pool's device; "
            "casting the whole pool",
            type(wrapper).__name__,
        )
        return kv_buffer.to(q_dtype)
    if _rows(kv_buffer) is None:
        _warn_once(
            ("strides", tuple(kv_buffer.stride())),
            "kvpatch: KV buffer strides %s do not form rows; casting the whole pool",
            tuple(kv_buffer.stride()),
        )
        return kv_buffer.to(q_dtype)
    shadow = _shadow(kv_buffer, q_dtype)
    gather_cast(
        kv_buffer,
        shadow,
        indices,
        count,
        0,
        rows_per_index=int(getattr(wrapper, "_page_size", 1) or 1),
    )
    return shadow
