"""A part of the kvpatch runtime: the page cast (page tables: FA3/FA4, MUSA, XPU).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import torch

from kvpatch.runtime._launch import _launch, _launch_ident
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


_rows_verdicts = {}  # (shape, strides) -> whether _rows finds [slots, slot_len] rows


def _rows_ok(t):
    key = (t.shape, t.stride())
    ok = _rows_verdicts.get(key)
    if ok is None:
        ok = _rows_verdicts[key] = _rows(t) is not None
    return ok


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
        or not _rows_ok(kv_buffer)
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


_page_plans = (
    {}
)  # a page cast's geometry -> its plan (checks and launch constants, see page_cast)


def page_cast(src, dst, page_table, seqlens, page_size, *, backend="auto", config=None):
    """dst[r] = src[r].to(dst.dtype) for every slot r of every page the table reads.

    Request b reads pages page_table[b, :ceil(seqlens[b] / page_size)] (every entry of
    row b when seqlens is None); page p holds slots
    p*page_size ... +page_size-1 of src viewed as [slots, slot_len] (see _rows). Pages out
    of range are skipped; a page shared by two requests is cast once per reader, with the
    same bytes. No host sync. Returns the path taken, "triton" or "torch".
    """
    sl = page_table if seqlens is None else seqlens
    # The checks and launch constants depend on these alone: made once per geometry, as
    # eager mode calls this per layer per step (host time, issue 17).
    key = (
        src.shape,
        src.stride(),
        dst.shape,
        dst.stride(),
        page_table.shape,
        page_table.stride(),
        sl.shape,
        sl.stride(),
        (src.dtype, dst.dtype, page_table.dtype, sl.dtype, seqlens is None),
        src.device,
        dst.device,
        page_size,
        backend,
    )
    plan = _page_plans.get(key) if config is None else None
    if plan is None:
        plan = _page_plan(src, dst, page_table, seqlens, page_size, backend, config)
        if config is None:
            _page_plans[key] = plan
    if plan is False:
        return "torch"  # nothing to read
    if plan["triton"]:
        aligned = (
            not (
                src.data_ptr() | dst.data_ptr() | page_table.data_ptr() | sl.data_ptr()
            )
            & 15
        )
        args = (src, dst, page_table, plan["pt_stride"], sl) + plan["ints"]
        launch = lambda: _launch(  # noqa: E731
            plan["kernel"],
            plan["grid"],
            args,
            plan["consts"],
            plan["ident"] if aligned else None,
        )
        if _try_triton("page cast", plan["fail_key"], backend, launch):
            return "triton"
    elif backend == "triton":
        raise RuntimeError("page_cast: Triton path not available for these tensors")
    src2, dst2 = _rows(src), _rows(dst)
    ps = plan["ps"]
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


def _page_plan(src, dst, page_table, seqlens, page_size, backend, config):
    """page_cast's checks and launch constants for one geometry; False: nothing to read."""
    src2, dst2 = _row_pair("page_cast", src, dst, backend)
    ps = int(page_size)
    if page_table.numel() == 0 or src2.shape[0] < ps:
        return False
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
    plan = {"ps": ps, "triton": False}
    if backend == "torch" or not usable or _get_page_kernel() is None:
        return plan
    n_rows, row_len = src2.shape
    main_d, tail_d = _row_split(row_len)
    br = cfg["block_rows"]
    rows, cols = page_table.shape
    # Static grid (fixed under CUDA graphs): per request, enough programs to fill the
    # chip, never more than its widest possible page run needs.
    per_req = max(
        1,
        min(
            -(-_sm_count(src2.device) * cfg["programs_per_sm"] // max(rows, 1)),
            -(-(cols * ps) // br),
        ),
    )
    every = seqlens is None  # no lengths: every entry of each row is read
    consts = (
        ("D", row_len),
        ("MAIN_D", main_d),
        ("TAIL_D", tail_d),
        ("PS", ps),
        ("EVERY", every),
        ("BLOCK_ROWS", br),
        ("num_warps", cfg["num_warps"]),
    )
    plan.update(
        triton=True,
        kernel=_get_page_kernel(),
        grid=(rows, per_req),
        pt_stride=page_table.stride(0),
        # After the lengths: their stride, the table's width, the pool's pages, the row strides.
        ints=(
            0 if every else seqlens.stride(0),
            cols,
            n_rows // ps,
            src2.stride(0),
            dst2.stride(0),
        ),
        consts=consts,
        # Everything the binary depends on is in the plan's key, so its launches may key
        # on the plan (an uncached plan, made for a one-off config, keys on its arguments).
        ident=_launch_ident("pages") if config is None else None,
        fail_key=("pages", src.dtype, dst.dtype, ps, br, cfg["num_warps"]),
    )
    return plan
