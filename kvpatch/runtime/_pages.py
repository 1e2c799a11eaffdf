"""A part of the kvpatch runtime: the page cast (page tables: FA3/FA4, MUSA, XPU).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import torch

from kvpatch.runtime._modes import _sm_count, _warn_once, mode, TUNING
from kvpatch.runtime._dispatch import _shadow
from kvpatch.runtime._gather import _cast_units_torch, _row_pair, _rows, _try_triton
from kvpatch.runtime._kernels import _get_page_kernel, _row_split

# -- joined from here --


# ---------------------------------------------------------------------------
# Page tables: FA3/FA4, MUSA and XPU kernels read pages, not an indices list


def _table_ok(kv_buffer, table):
    if not (isinstance(table, tuple) and len(table) == 2):
        return False
    pt, sl = table
    if not (
        isinstance(pt, torch.Tensor)
        and pt.dim() == 2
        and pt.device == kv_buffer.device
        and not pt.is_floating_point()
    ):
        return False
    return sl is None or (
        isinstance(sl, torch.Tensor)
        and sl.dim() == 1
        and sl.numel() >= pt.shape[0]
        and sl.device == kv_buffer.device
        and not sl.is_floating_point()
    )


def _resolve(table):
    """A (page_table, cache_seqlens) pair, or a lambda giving one (read at the cast: a
    call whose metadata is missing this step, say None.page_table, does not run)."""
    if callable(table):
        try:
            return table()
        except (AttributeError, TypeError, KeyError, IndexError):
            return (None, None)
    return table


def kv_pages_for_kernel(kv_buffer, q_dtype, page_size, *tables):
    """What a page-table kernel reads in place of kv_buffer.to(q_dtype).

    tables: one (page_table, cache_seqlens) pair, or a lambda giving it, per kernel call
    that reads the result (the cascade call and local-attention metadata add pairs); a
    pair of Nones is a call that does not run this step, and cache_seqlens None means
    every entry of the table (a call whose lengths are not known at the cast). Every page
    page_table[b, :ceil(cache_seqlens[b] / page_size)] of every pair is cast into the
    persistent shadow at the same slots; the rest of the shadow is never read by those
    calls. Counts are read on the device.
    """
    if mode() == "off":
        return kv_buffer.to(q_dtype)
    if kv_buffer.dtype == q_dtype:
        return kv_buffer
    tables = [_resolve(t) for t in tables]
    live = [
        t for t in tables if not (isinstance(t, tuple) and len(t) == 2 and t[0] is None)
    ]
    ps = int(page_size) if isinstance(page_size, int) and page_size >= 1 else None
    if (
        ps is None
        or not all(_table_ok(kv_buffer, t) for t in live)
        or _rows(kv_buffer) is None
    ):
        _warn_once(
            ("pages", type(page_size).__name__, len(tables)),
            "kvpatch: page tables or page size not usable (page_size=%r); casting the whole pool",
            page_size,
        )
        return kv_buffer.to(q_dtype)
    shadow = _shadow(kv_buffer, q_dtype)
    for pt, sl in live:
        page_cast(kv_buffer, shadow, pt, sl, ps)
    return shadow


def ragged_pages(kv_indptr, kv_indices, page_size):
    """A ragged page list as one (page_table, cache_seqlens) pair for kv_pages_for_kernel.

    A kernel handed (kv_indptr, kv_indices) reads, for request b, the pages
    kv_indices[kv_indptr[b]:kv_indptr[b + 1]]; their union lies within
    kv_indices[:max(kv_indptr)]: one table row of that many pages (page_size slots each).
    The count is read on the device (no host sync, static shapes); where the indptr
    buffer holds stale entries past the batch, the max covers them too (a superset).
    """
    if kv_indptr is None or kv_indices is None:
        return (None, None)
    count = kv_indptr.reshape(-1).amax(0, keepdim=True)
    return kv_indices.reshape(1, -1), count * int(page_size)


def page_cast(src, dst, page_table, seqlens, page_size, *, backend="auto", config=None):
    """dst[r] = src[r].to(dst.dtype) for every slot r of every page the table reads.

    Request b reads pages page_table[b, :ceil(seqlens[b] / page_size)] (every entry of
    row b when seqlens is None); page p holds slots
    p*page_size ... +page_size-1 of src viewed as [slots, slot_len] (see _rows). Pages out
    of range are skipped; a page shared by two requests is cast once per reader, with the
    same bytes. No host sync. Returns the path taken, "triton" or "torch".
    """
    src2, dst2 = _row_pair("page_cast", src, dst, backend)
    ps = int(page_size)
    if page_table.numel() == 0 or src2.shape[0] < ps:
        return "torch"
    cfg = dict(TUNING, **(config or {}))
    usable = (
        (src2.is_cuda or backend == "triton")
        and src2.stride(1) == 1
        and dst2.stride(1) == 1
        and page_table.stride(1) == 1
        and page_table.shape[1] * ps < 2**31
        and page_table.dtype in (torch.int32, torch.int64)
        and (seqlens is None or seqlens.dtype in (torch.int32, torch.int64))
    )
    if backend != "torch" and usable and _get_page_kernel() is not None:
        key = ("pages", src.dtype, dst.dtype, ps, cfg["block_rows"], cfg["num_warps"])
        launch = lambda: _launch_pages(
            src2, dst2, page_table, seqlens, ps, cfg
        )  # noqa: E731
        if _try_triton("page cast", key, backend, launch):
            return "triton"
    elif backend == "triton":
        raise RuntimeError("page_cast: Triton path not available for these tensors")
    units = src2.shape[0] // ps
    rows, cols = page_table.shape
    i = page_table.long().reshape(-1)
    valid = (i >= 0) & (i < units)
    if seqlens is not None:
        n_pages = ((seqlens[:rows].long() + ps - 1) // ps).clamp(0, cols)
        j = torch.arange(cols, device=page_table.device)
        valid &= (j[None, :] < n_pages[:, None]).reshape(-1)
    _cast_units_torch(src2, dst2, i, valid, ps)
    return "torch"


def _launch_pages(src2, dst2, pt, sl, ps, cfg):
    kernel = _get_page_kernel()
    n_rows, row_len = src2.shape
    main_d, tail_d = _row_split(row_len)
    br = cfg["block_rows"]
    rows, cols = pt.shape
    # Static grid (fixed under CUDA graphs): per request, enough programs to fill the
    # chip, never more than its widest possible page run needs.
    per_req = max(
        1,
        min(
            -(-_sm_count(src2.device) * cfg["programs_per_sm"] // max(rows, 1)),
            -(-(cols * ps) // br),
        ),
    )
    every = sl is None  # no lengths: every entry of each row is read
    kernel[(rows, per_req)](
        src2,
        dst2,
        pt,
        pt.stride(0),
        pt if every else sl,
        0 if every else sl.stride(0),
        cols,
        n_rows // ps,
        src2.stride(0),
        dst2.stride(0),
        D=row_len,
        MAIN_D=main_d,
        TAIL_D=tail_d,
        PS=ps,
        EVERY=every,
        BLOCK_ROWS=br,
        num_warps=cfg["num_warps"],
    )
