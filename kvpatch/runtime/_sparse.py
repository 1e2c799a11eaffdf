"""A part of the kvpatch runtime: the deferred cast for sparse kernels in class helpers
(issue 20, kind 2: NSA's `self._forward_*` helpers).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace; the imports above
the line only let a part read alone, and are dropped.

A backend casts the pool in forward_extend and hands the result to helper methods, where
each kernel is told its rows (top-k slot indices, a page table). The rewrite (KVP105)
turns the cast into kv_rows_deferred(pool, dtype), which returns a persistent buffer of
the cast's shape and dtype without casting anything, and wraps the cache argument of each
kernel the value reaches in kv_rows_at_kernel(view, indices, lead), which casts exactly
the rows that kernel reads (in the kernel's own view of the buffer) from the pool before
the kernel runs. torch only: no Triton, no host sync, one persistent buffer per shape.
"""

import math

import torch

from kvpatch.runtime._modes import mode

# -- joined from here --


# ---------------------------------------------------------------------------
# Deferred cast: the rows each sparse kernel reads, cast next to the kernel

_deferred_shadows = {}  # (device, shape, dtype) -> the buffer kv_rows_deferred returns
_deferred_src = {}  # that buffer's data_ptr -> (pool, buffer): the pool it stands for


def kv_rows_deferred(kv_buffer, q_dtype):
    """What a backend gets in place of kv_buffer.to(q_dtype) when every kernel the result
    reaches is wrapped in kv_rows_at_kernel: a persistent buffer of that shape and dtype,
    none of whose rows is cast yet. Off, on the same dtype, or on a pool that is not one
    contiguous block, it is the plain cast (and the wrapped kernels then pass it through).
    """
    if mode() == "off" or not isinstance(kv_buffer, torch.Tensor):
        return kv_buffer.to(q_dtype)
    if kv_buffer.dtype == q_dtype or not kv_buffer.is_contiguous():
        return kv_buffer.to(q_dtype)
    key = (kv_buffer.device, tuple(kv_buffer.shape), q_dtype)
    buf = _deferred_shadows.get(key)
    if buf is None:
        buf = _deferred_shadows[key] = torch.empty(
            kv_buffer.shape, dtype=q_dtype, device=kv_buffer.device
        )
    _deferred_src[buf.data_ptr()] = (kv_buffer, buf)
    return buf


def kv_rows_at_kernel(kv, indices, lead=1):
    """kv, with the rows a sparse kernel reads cast from the pool kv_rows_deferred stood for.

    kv is the kernel's cache argument as handed (a view of the deferred buffer: sliced,
    viewed into pages); the kernel reads, of kv viewed as [rows, ...] with its first `lead`
    dims flattened (lead=-1: all but the last), the rows named by `indices` (any shape;
    negative or out-of-range entries name no row). Those rows are cast in place and kv is
    returned. A tensor that is no view of a deferred buffer is returned as is; a view this
    cannot index by rows is cast whole (slower, never wrong).
    """
    if not isinstance(kv, torch.Tensor):
        return kv
    try:
        base = kv.untyped_storage().data_ptr()
    except (RuntimeError, AttributeError):
        return kv
    entry = _deferred_src.get(base)
    if entry is None:
        return kv
    pool, buf = entry
    if kv.dtype != buf.dtype or kv.device != buf.device:
        return kv
    # The pool and the buffer share shape and contiguous strides: the same view of the pool.
    src = pool.as_strided(kv.shape, kv.stride(), kv.storage_offset())
    n_lead = kv.dim() - 1 if lead == -1 else int(lead)
    if (
        not isinstance(indices, torch.Tensor)
        or indices.is_floating_point()
        or indices.device != kv.device
        or not 1 <= n_lead <= kv.dim()
    ):
        kv.copy_(src)
        return kv
    rows = math.prod(kv.shape[:n_lead])
    try:
        dst2 = kv.view(rows, *kv.shape[n_lead:]) if n_lead > 1 else kv
        src2 = src.view(rows, *src.shape[n_lead:]) if n_lead > 1 else src
    except RuntimeError:  # leading dims that do not flatten without a copy
        kv.copy_(src)
        return kv
    if rows == 0:
        return kv
    i = indices.reshape(-1).long()
    # An invalid entry reads row 0 and writes row 0 with its own cast: a row more, never a
    # wrong one; duplicates write the same bytes.
    safe = torch.where((i >= 0) & (i < rows), i, torch.zeros_like(i))
    dst2.index_copy_(0, safe, src2.index_select(0, safe).to(kv.dtype))
    return kv
