"""A part of the kvpatch runtime: the device functions of the fused FP8 MLA kernels (issue 17):
row loads, the FP8 -> 16-bit conversions, the query's loads. The kernels are the next part,
_fused_kernels.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

# -- joined from here --


def _fused_build_ops(triton, tl):
    """Define the kernels' device functions as module globals: Triton resolves the names a
    kernel calls in the kernel's module, so they cannot stay local to a builder."""
    global _fused_rows, _fused_vrows, _fused_vraw, _fused_vcvt, _fused_q, _fused_amax
    global _fused_store

    @triton.jit
    def _fused_rows(
        row, cols, ok, DOT_F32: tl.constexpr, EVICT: tl.constexpr, F16: tl.constexpr
    ):
        x = tl.load(
            row + cols[None, :], mask=ok[:, None], other=0.0, eviction_policy=EVICT
        )
        if F16:
            x = x.to(
                tl.float16
            )  # one cvt.rn.f16x2.e4m3x2 per two values; bf16 takes a second cvt each
        else:
            x = x.to(tl.bfloat16)
        if DOT_F32:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _fused_vrows(
        row, cols, ok, DOT_F32: tl.constexpr, F16: tl.constexpr, PV_ASM: tl.constexpr
    ):
        # The PV operand V is [positions, latent]: for the dot it must be read transposed,
        # which ldmatrix does for 16-bit values only, so FP8 kept in shared memory is read
        # back a byte at a time (128 ld.shared.b8 a thread a step). PV_ASM converts in
        # registers, through an opaque cvt the pipeliner does not move past shared memory:
        # the operand is staged as f16/bf16 and read with ldmatrix.trans.
        if PV_ASM:
            x = tl.load(
                row + cols[None, :],
                mask=ok[:, None],
                other=0.0,
                eviction_policy="evict_first",
            )
            x = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                "=r,=r,r",
                [x.to(tl.uint8, bitcast=True)],
                dtype=tl.float16,
                is_pure=False,
                pack=4,
            )
            if not F16:
                x = x.to(tl.bfloat16)  # exact: every e4m3 value is a bf16 value
        else:
            x = _fused_rows(row, cols, ok, DOT_F32, "evict_first", F16)
        return x

    @triton.jit
    def _fused_vraw(row, cols, ok, EVICT: tl.constexpr):
        # V_EARLY: the PV operand's raw FP8 bytes, loaded at the top of a step, before the
        # QK dots. With QK's own hint (V_EARLY=2) the load is QK's, merged: one read a row.
        return tl.load(
            row + cols[None, :], mask=ok[:, None], other=0.0, eviction_policy=EVICT
        ).to(tl.uint8, bitcast=True)

    @triton.jit
    def _fused_vcvt(x, F16: tl.constexpr):
        x = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [x],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
        if not F16:
            x = x.to(tl.bfloat16)  # exact: every e4m3 value is a bf16 value
        return x

    @triton.jit
    def _fused_q(q, rows, cols, ok, scale, DOT_F32: tl.constexpr, F16: tl.constexpr):
        x = tl.load(q + rows + cols[None, :], mask=ok[:, None], other=0.0)
        if F16:
            x = (x.to(tl.float32) * scale).to(tl.float16)
        if DOT_F32:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _fused_amax(q, rows, cols, ok):
        return tl.max(
            tl.max(
                tl.abs(
                    tl.load(q + rows + cols[None, :], mask=ok[:, None], other=0.0).to(
                        tl.float32
                    )
                ),
                1,
            ),
            0,
        )

    @triton.jit
    def _fused_store(dst, acc, inv, post, ok, PART16: tl.constexpr):
        # A column block of a split's output (a partial, or the output at one split). f16
        # partials (FUSED_F16_PARTIALS): rounded to f16 as a partial is, then scaled by post,
        # the latent's FP8 scale for a one-split launch (which so writes the bits split +
        # combine would), 1 for a partial. fp32 partials: the scale is in inv.
        if PART16:
            o = (acc * inv[:, None]).to(tl.float16).to(tl.float32) * post
        else:
            o = acc * inv[:, None]
        tl.store(dst, o.to(dst.dtype.element_ty), mask=ok)
