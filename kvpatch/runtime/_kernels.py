"""A part of the kvpatch runtime: the Triton kernels, built on first CUDA use.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""


# -- joined from here --


def _get_kernel():
    """The indices kernel, built on first use; None when Triton is not importable."""
    _build_kernels()
    return _kernel or None


def _get_page_kernel():
    _build_kernels()
    return _page_kernel or None


def _build_kernels():
    # The helper and tl are module globals: Triton resolves names a kernel calls there.
    global _kernel, _page_kernel, _cast_rows, triton, tl
    if _kernel is not None:
        return
    try:
        import triton
        import triton.language as tl
    except Exception:
        _kernel = _page_kernel = False
        return

    @triton.jit
    def _cast_rows(
        src,
        dst,
        row,
        ok,
        src_stride,
        dst_stride,
        D: tl.constexpr,
        MAIN_D: tl.constexpr,
        TAIL_D: tl.constexpr,
    ):
        cols = tl.arange(0, MAIN_D)
        s = src + row[:, None] * src_stride
        d = dst + row[:, None] * dst_stride
        m = ok[:, None]
        # Both loads are issued before the stores so they overlap in flight.
        x = tl.load(s + cols[None, :], mask=m)
        if TAIL_D > 0:
            tcols = MAIN_D + tl.arange(0, TAIL_D)
            tm = m
            if MAIN_D + TAIL_D > D:  # a column mask only when the tail is ragged
                tm = m & (tcols[None, :] < D)
            t = tl.load(s + tcols[None, :], mask=tm)
        tl.store(d + cols[None, :], x.to(dst.dtype.element_ty), mask=m)
        if TAIL_D > 0:
            tl.store(d + tcols[None, :], t.to(dst.dtype.element_ty), mask=tm)

    @triton.jit(do_not_specialize=["pos1", "pos2", "n_idx", "n_units"])
    def _gather_cast_kernel(
        src,
        dst,
        idx_ptr,
        ip1,
        pos1,
        ip2,
        pos2,
        n_idx,
        n_units,
        src_stride,
        dst_stride,
        D: tl.constexpr,
        MAIN_D: tl.constexpr,
        TAIL_D: tl.constexpr,
        RPI: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
    ):
        # Valid count from device memory: replays see whatever SGLang wrote in place.
        n = tl.maximum(tl.load(ip1 + pos1), tl.load(ip2 + pos2))
        n = tl.minimum(tl.maximum(n, 0), n_idx).to(
            tl.int32
        )  # host checks n_idx*RPI < 2**31
        total = n * RPI
        lanes = tl.arange(0, BLOCK_ROWS)
        for blk in range(
            tl.program_id(0), tl.cdiv(total, BLOCK_ROWS), tl.num_programs(0)
        ):
            w = blk * BLOCK_ROWS + lanes
            live = w < total
            unit = tl.load(idx_ptr + w // RPI, mask=live, other=-1).to(tl.int64)
            ok = live & (unit >= 0) & (unit < n_units)  # never touch rows out of range
            _cast_rows(
                src,
                dst,
                unit * RPI + w % RPI,
                ok,
                src_stride,
                dst_stride,
                D,
                MAIN_D,
                TAIL_D,
            )

    @triton.jit(do_not_specialize=["n_cols", "n_units", "pt_stride", "sl_stride"])
    def _page_cast_kernel(
        src,
        dst,
        pt_ptr,
        pt_stride,
        sl_ptr,
        sl_stride,
        n_cols,
        n_units,
        src_stride,
        dst_stride,
        D: tl.constexpr,
        MAIN_D: tl.constexpr,
        TAIL_D: tl.constexpr,
        PS: tl.constexpr,
        EVERY: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
    ):
        # Program (b, c) casts request b's live pages, page_table[b, :ceil(seqlen/PS)],
        # with C programs striding over them: work follows the live rows, not the
        # table's width. Lengths come from device memory (graph replays rewrite them).
        b = tl.program_id(0)
        if EVERY:
            n_pages = n_cols
        else:
            seqlen = tl.load(sl_ptr + b * sl_stride).to(tl.int32)
            n_pages = tl.minimum(tl.maximum(tl.cdiv(seqlen, PS), 0), n_cols)
        total = n_pages * PS
        lanes = tl.arange(0, BLOCK_ROWS)
        for blk in range(
            tl.program_id(1), tl.cdiv(total, BLOCK_ROWS), tl.num_programs(1)
        ):
            w = blk * BLOCK_ROWS + lanes
            live = w < total
            page = tl.load(
                pt_ptr + b.to(tl.int64) * pt_stride + w // PS, mask=live, other=-1
            ).to(tl.int64)
            ok = live & (page >= 0) & (page < n_units)  # never touch rows out of range
            _cast_rows(
                src,
                dst,
                page * PS + w % PS,
                ok,
                src_stride,
                dst_stride,
                D,
                MAIN_D,
                TAIL_D,
            )

    _kernel, _page_kernel = _gather_cast_kernel, _page_cast_kernel


def _row_split(row_len):
    main_d = 1 << (row_len.bit_length() - 1)  # 576 -> 512 + a 64-wide tail
    rest = row_len - main_d
    return main_d, (1 << (rest - 1).bit_length() if rest else 0)
