"""A part of the kvpatch runtime: the loader partition of the 64-row kernel
(_fused_wgmma_ws) that holds the next tile in registers ("wg_prefetch", off).

The default loader copies a tile into its ring slot only once the slot is free, then
converts it: the copy's latency comes first on every tile, and ncu (GPU run 50) found the
loader kernel waiting on it. This loader issues tile t + 1's loads as soon as tile t is
stored; they land while it waits for t + 1's slot (the MMA warps' work on tile t), and each
thread converts its own rows straight into the slot, with no FP8 stage in shared memory.
A tile is 72 registers a thread, as int32 words of 4 FP8 values: a lone FP8 value takes a
32-bit register of its own, and the loader spilled 4.6 KB a thread that way. It gets
FUSED_WS_PREFETCH_REGS registers; the MMA warps keep 192, with no spills
(tools/fused_aot.py --wgmma --ws --prefetch).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts (see there); the
imports above the "joined from here" line only let this part read alone.
"""

from kvpatch.runtime._fused_gluon_ops import _fg_slots  # a global once built

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: the 64-row kernel's loader that prefetches into registers

# Registers a thread of that loader (setmaxnreg): 72 hold the tile.
FUSED_WS_PREFETCH_REGS = 120
_fws_load_regs = None  # set by _fws_regs_build, with the kernel


def _fws_regs_build(gluon, gl, fence_async_shared, mbarrier):
    # A kernel's callees are resolved among its module's globals.
    global _fws_f16, _fws_fetch, _fws_load_regs

    @gluon.jit
    def _fws_fetch(kv32, slot, stride32, c4, D: gl.constexpr):
        # A tile's FP8 rows into registers as int32 words (4 values each: an FP8 value kept
        # alone would take a 32-bit register of its own), the 8 latent blocks of 64 columns
        # and the rope. Masked rows read as zeros (P is 0 there, and 0 x NaN would not be).
        rows = kv32 + slot.to(gl.int64)[:, None] * stride32 + c4[None, :]
        ok = (slot >= 0)[:, None]
        x0 = gl.load(rows, mask=ok, other=0)
        x1 = gl.load(rows + 16, mask=ok, other=0)
        x2 = gl.load(rows + 32, mask=ok, other=0)
        x3 = gl.load(rows + 48, mask=ok, other=0)
        x4 = gl.load(rows + 64, mask=ok, other=0)
        x5 = gl.load(rows + 80, mask=ok, other=0)
        x6 = gl.load(rows + 96, mask=ok, other=0)
        x7 = gl.load(rows + 112, mask=ok, other=0)
        xpe = gl.load(rows + D // 4, mask=ok, other=0)
        return x0, x1, x2, x3, x4, x5, x6, x7, xpe

    @gluon.jit
    def _fws_f16(w):
        # [BN, 16] int32 words of 4 FP8 values -> [BN, 64] f16, in order
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .b32 a, b; mov.b32 {l, h}, $4; "
            "cvt.rn.f16x2.e4m3x2 a, l; cvt.rn.f16x2.e4m3x2 b, h; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r",
            [w],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True,
            pack=1,
        )
        x = gl.join(gl.join(o0, o2), gl.join(o1, o3))
        return x.reshape(w.shape[0], 4 * w.shape[1])

    @gluon.jit
    def _fws_load_regs(
        kv,
        table,
        base,
        lo,
        hi,
        n_slots,
        stride_kv,
        ring,
        ring_pe,
        ok_s,
        ready,
        empty,
        PS: gl.constexpr,
        D: gl.constexpr,
        BN: gl.constexpr,
    ):
        # The copy's latency off the loader's path: tile t + 1's loads are issued as soon as
        # tile t is stored, and land while the loader waits for t + 1's slot (the MMA warps'
        # work on tile t). No FP8 stage in shared memory: each thread converts its own rows.
        w_l: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        r = gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))
        c4 = gl.arange(0, 16, layout=gl.SliceLayout(0, w_l))
        kv32 = kv.to(gl.pointer_type(gl.int32), bitcast=True)
        stride32 = stride_kv // 4  # the launch routes only strides of whole words here
        slot = _fg_slots(table, base, lo, hi, n_slots, PS, r)
        x0, x1, x2, x3, x4, x5, x6, x7, xpe = _fws_fetch(kv32, slot, stride32, c4, D)
        for t in range(gl.cdiv(hi - lo, BN)):
            b = t % 2
            nxt = _fg_slots(table, base, lo + (t + 1) * BN, hi, n_slots, PS, r)
            mbarrier.wait(empty.index(b), ((t // 2) & 1) ^ 1)  # a new barrier: passes
            ring_b = ring.index(b)
            ring_b.slice(0, 64, 1).store(_fws_f16(x0))
            ring_b.slice(64, 64, 1).store(_fws_f16(x1))
            ring_b.slice(128, 64, 1).store(_fws_f16(x2))
            ring_b.slice(192, 64, 1).store(_fws_f16(x3))
            ring_b.slice(256, 64, 1).store(_fws_f16(x4))
            ring_b.slice(320, 64, 1).store(_fws_f16(x5))
            ring_b.slice(384, 64, 1).store(_fws_f16(x6))
            ring_b.slice(448, 64, 1).store(_fws_f16(x7))
            ring_pe.index(b).store(_fws_f16(xpe))
            ok_s.index(b).store((slot >= 0).to(gl.int32))
            fence_async_shared()  # the generic stores, before wgmma's async reads
            mbarrier.arrive(ready.index(b), count=1)
            slot = nxt
            x0, x1, x2, x3, x4, x5, x6, x7, xpe = _fws_fetch(
                kv32, slot, stride32, c4, D
            )
