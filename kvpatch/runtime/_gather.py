"""A part of the kvpatch runtime: the gathered cast (Triton, or the torch fallback).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import math

import torch

from kvpatch.runtime._launch import _launch
from kvpatch.runtime._modes import _sm_count, _triton_failed, _warn_once, TUNING
from kvpatch.runtime._kernels import _get_kernel, _row_split

# -- joined from here --


# ---------------------------------------------------------------------------
# The gathered cast


def _rows(t):
    """t as a [slots, slot_len] view (no copy), or None when its strides do not allow it.

    A slot is what one token occupies: all dims but the last two are slot dims, so the
    MLA pool's [slots, 1, 576] and [pages, page_size, 1, 576] both give rows of 576.
    """
    if t.dim() == 0:
        return None
    lead = t.dim() - 2 if t.dim() >= 3 else 1
    try:
        return t.view(math.prod(t.shape[:lead]), math.prod(t.shape[lead:]))
    except RuntimeError:
        return None


def gather_cast(
    src,
    dst,
    indices,
    indptr,
    indptr_pos,
    indptr2=None,
    indptr2_pos=0,
    rows_per_index=1,
    *,
    backend="auto",
    config=None,
):
    """dst[r] = src[r].to(dst.dtype) for every row r read through indices[:n].

    n = min(max(indptr[indptr_pos], indptr2[indptr2_pos]), indices.numel()), read on the
    device. Index i covers slots i*rows_per_index ... +rows_per_index-1 of src viewed as
    [slots, slot_len] (see _rows); out-of-range indices are skipped. No host sync.

    backend: "auto" (Triton on CUDA when importable, else torch), "triton" (forced; also
    runs on CPU under TRITON_INTERPRET=1) or "torch". config overrides TUNING.
    Returns the path taken, "triton" or "torch".
    """
    src2, dst2 = _row_pair("gather_cast", src, dst, backend)
    rpi = int(rows_per_index)
    if rpi < 1:
        raise ValueError("gather_cast: rows_per_index must be >= 1")
    if indptr2 is None:
        indptr2, indptr2_pos = indptr, indptr_pos
    idx = indices.reshape(-1)  # a view for the 1-D buffers FlashInfer keeps
    if idx.numel() == 0 or src2.shape[0] < rpi:
        return "torch"
    cfg = dict(TUNING, **(config or {}))
    if backend != "torch" and _triton_ok(
        src2, dst2, idx, indptr, indptr2, rpi, backend
    ):
        key = (src.dtype, dst.dtype, rpi, cfg["block_rows"], cfg["num_warps"])
        if _try_triton(
            "gather",
            key,
            backend,
            lambda: _launch_gather(
                src2, dst2, idx, indptr, indptr_pos, indptr2, indptr2_pos, rpi, cfg
            ),
        ):
            return "triton"
    elif backend == "triton":
        raise RuntimeError("gather_cast: Triton path not available for these tensors")
    _gather_cast_torch(src2, dst2, idx, indptr, indptr_pos, indptr2, indptr2_pos, rpi)
    return "torch"


def _row_pair(what, src, dst, backend):
    """src and dst as [slots, slot_len] rows, after the checks both casts share."""
    if src.shape != dst.shape or src.device != dst.device:
        raise ValueError(what + ": src and dst need the same shape and device")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(what + ": backend must be auto, triton or torch")
    src2, dst2 = _rows(src), _rows(dst)
    if src2 is None or dst2 is None:
        raise ValueError(what + ": src/dst strides do not form [slots, slot_len] rows")
    return src2, dst2


def _try_triton(what, key, backend, launch):
    """Run launch() unless this key's kernel failed before; True if it ran.

    Under backend="triton" a failure raises; under "auto" it is remembered for
    the key, warned once, and the caller takes its torch path instead.
    """
    if key in _triton_failed:
        return False
    try:
        launch()
        return True
    except Exception as exc:
        if backend == "triton":
            raise
        _triton_failed.add(key)
        _warn_once(
            ("triton", key), "kvpatch: Triton %s failed (%s); using torch", what, exc
        )
        return False


def _triton_ok(src2, dst2, idx, indptr, indptr2, rpi, backend):
    if not (src2.is_cuda or backend == "triton"):
        return False
    if src2.stride(1) != 1 or dst2.stride(1) != 1 or not idx.is_contiguous():
        return False  # the kernel assumes a contiguous inner row (vector loads)
    if idx.dtype not in (torch.int32, torch.int64):
        return False
    if any(t.dtype not in (torch.int32, torch.int64) for t in (indptr, indptr2)):
        return False
    if any(t.device != src2.device for t in (dst2, idx, indptr, indptr2)):
        return False
    if idx.numel() * rpi >= 2**31:
        return False  # the kernel's work counter is int32
    return _get_kernel() is not None


def _launch_gather(src2, dst2, idx, indptr, pos1, indptr2, pos2, rpi, cfg):
    kernel = _get_kernel()
    n_rows, row_len = src2.shape
    main_d, tail_d = _row_split(row_len)
    br = cfg["block_rows"]
    # Persistent grid: sized on the host from the buffer length (fixed under CUDA
    # graphs); the kernel loops over however many rows the device says are valid.
    max_blocks = -(-(idx.numel() * rpi) // br)
    grid = (max(1, min(_sm_count(src2.device) * cfg["programs_per_sm"], max_blocks)),)
    _launch(
        kernel,
        grid,
        (
            src2,
            dst2,
            idx,
            indptr,
            int(pos1),
            indptr2,
            int(pos2),
            idx.numel(),
            n_rows // rpi,
            src2.stride(0),
            dst2.stride(0),
        ),
        (
            ("D", row_len),
            ("MAIN_D", main_d),
            ("TAIL_D", tail_d),
            ("RPI", rpi),
            ("BLOCK_ROWS", br),
            ("num_warps", cfg["num_warps"]),
        ),
    )


def _gather_cast_torch(src2, dst2, idx, indptr, pos1, indptr2, pos2, rpi):
    # No .item(): valid entries are masked on the device, so this is also graph-safe.
    units = src2.shape[0] // rpi
    n = torch.maximum(indptr[pos1], indptr2[pos2]).clamp(0, idx.numel())
    pos = torch.arange(idx.numel(), device=idx.device)
    i = idx.long()
    _cast_units_torch(src2, dst2, i, (pos < n) & (i >= 0) & (i < units), rpi)


def _cast_units_torch(src2, dst2, i, valid, rpi):
    """dst unit u = src unit u cast, for every u = i[k] with valid[k] (units of rpi rows)."""
    units = src2.shape[0] // rpi
    d = src2.shape[1]
    src_u = src2[: units * rpi].view(units, rpi, d)
    dst_u = dst2[: units * rpi].view(units, rpi, d)
    # Invalid entries are redirected to the first valid row, which is written with the
    # same value; if none is valid they rewrite a row with its own old value. Either
    # way duplicates in index_copy_ agree, so the result is deterministic.
    first = i.index_select(0, torch.argmax(valid.to(torch.int32)).view(1)).clamp(
        0, units - 1
    )
    safe = torch.where(valid, i, first)
    new = src_u.index_select(0, safe).to(dst2.dtype)
    old = dst_u.index_select(0, safe)
    dst_u.index_copy_(0, safe, torch.where(valid.any(), new, old))
