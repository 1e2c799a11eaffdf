"""A part of the kvpatch runtime: the 64-row split kernel with its FP8 loads and
conversions in a warp partition of their own (issue 17, 128 heads).

The 64-row kernel (_fused_wgmma) runs each tile's copy wait, conversion, QK, softmax and PV
in series on its 8 warps (ncu, GPU run 48: no eligible warp 79% of cycles). Here a 4-warp
loader partition (gl.warp_specialize) copies a tile's FP8 rows (cp.async) into the upper
half of the free slot of a ring of two f16 tiles, converts them in place to f16 in the
NVMMA layout wgmma reads, and signals the slot ready (mbarrier); the 8 MMA warps run QK,
the softmax and PV as the 64-row kernel does, then signal the slot empty. q (72 KB) and two
f16 tiles fill the 227 KB an SM has: no room for an FP8 stage. An NVMMA tile keeps each
64-column block in 8 KB of its own, so block u's FP8 bytes wait at 32 + 4u KB and the
conversion overwrites only blocks already read (_fws_convert).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts (see there); the
imports above the "joined from here" line only let this part read alone.
"""

from kvpatch.runtime._fused_gluon_ops import (  # globals once _fused_gluon_build_ops has run
    _fused_hopper_lang,
    _fg_kv_scales,
    _fg_online,
    _fg_out64,
    _fg_q64,
    _fg_range,
    _fg_rescale,
    _fg_slots,
)

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: the 64-row kernel with a loader partition (Gluon)

# Registers a thread of the loader's 4 warps (setmaxnreg): the 8 MMA warps get what is left
# of 168 a thread over the CTA's 384, 224 at 56. tools/fused_aot.py: no spills at 56; at 40
# and 48 the loader spills.
FUSED_WS_LOADER_REGS = 56
_fused_wgmma_ws = None  # the kernel, built on first use; False: no Gluon here


def _fused_wgmma_ws_build():
    global _fused_wgmma_ws
    if _fused_wgmma_ws is None:
        lang = _fused_hopper_lang()
        _fused_wgmma_ws = _fws_kernel(*lang) if lang else False
    return _fused_wgmma_ws


def _fws_kernel(gluon, gl, async_copy, fence_async_shared, mbarrier, wgmma, wgmma_wait):
    # A kernel's callees are resolved among its module's globals.
    global _fws_convert, _fws_load, _fws_mma, _fws_qk, _fws_scores, _fws_xchg

    @gluon.jit
    def _fws_convert(ring_b, pe_b, D: gl.constexpr, BN: gl.constexpr):
        # The staged FP8 block u (bytes 32 + 4u KB of the slot) -> f16 columns 64u.. (bytes
        # 8u KB). Blocks 0-3 overwrite no staged byte; 4-5 overwrite blocks 0-3, read before
        # the first barrier; 6-7 overwrite blocks 4-7, all read before the second. The rope
        # is staged in the upper half of its own f16 tile, read before the second barrier.
        cv_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        st = ring_b._reinterpret(gl.float8e4nv, [2 * D // 64, BN, 64], plain)
        st_pe = pe_b._reinterpret(gl.float8e4nv, [2, BN, 64], plain).index(1)
        for u in gl.static_range(6):
            if u == 4:
                gl.thread_barrier()
            x = st.index(8 + u).load(cv_l)
            ring_b.slice(64 * u, 64, 1).store(x.to(gl.float16))
        x6 = st.index(14).load(cv_l)
        x7 = st.index(15).load(cv_l)
        xpe = st_pe.load(cv_l)
        gl.thread_barrier()
        ring_b.slice(384, 64, 1).store(x6.to(gl.float16))
        ring_b.slice(448, 64, 1).store(x7.to(gl.float16))
        pe_b.store(xpe.to(gl.float16))

    @gluon.jit
    def _fws_load(
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
        cp_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        r = gl.arange(0, BN, layout=gl.SliceLayout(1, cp_l))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, cp_l))
        # A tile's page indices are loaded before the wait for its slot (their latency
        # would otherwise come before every copy).
        slot = _fg_slots(table, base, lo, hi, n_slots, PS, r)
        for t in range(gl.cdiv(hi - lo, BN)):
            b = t % 2
            mbarrier.wait(empty.index(b), ((t // 2) & 1) ^ 1)  # a new barrier: passes
            rows = kv + slot.to(gl.int64)[:, None] * stride_kv + c[None, :]
            ok = (slot >= 0)[:, None]
            st = ring.index(b)._reinterpret(gl.float8e4nv, [2 * D // 64, BN, 64], plain)
            for u in gl.static_range(D // 64):
                async_copy.async_copy_global_to_shared(
                    st.index(D // 64 + u), rows + 64 * u, mask=ok
                )
            st_pe = ring_pe.index(b)._reinterpret(gl.float8e4nv, [2, BN, 64], plain)
            async_copy.async_copy_global_to_shared(st_pe.index(1), rows + D, mask=ok)
            async_copy.commit_group()
            ok_s.index(b).store((slot >= 0).to(gl.int32))
            slot = _fg_slots(table, base, lo + (t + 1) * BN, hi, n_slots, PS, r)
            async_copy.wait_group(0)
            gl.thread_barrier()  # every loader thread's bytes staged
            _fws_convert(ring.index(b), ring_pe.index(b), D, BN)
            fence_async_shared()  # the generic stores, before wgmma's async reads
            mbarrier.arrive(ready.index(b), count=1)

    @gluon.jit
    def _fws_qk(q_s, qpe_s, ring, ring_pe, b, zs, SPLIT_PE):
        # QK of ring slot b, issued: two wgmma groups either way.
        sc = wgmma(q_s, ring.index(b).permute((1, 0)), zs, use_acc=False, is_async=True)
        pe = ring_pe.index(b).permute((1, 0))
        if SPLIT_PE:  # the rope's scores apart: each part has its own FP8 scale
            sp = wgmma(qpe_s, pe, zs, use_acc=False, is_async=True)
        else:
            sc = wgmma(qpe_s, pe, sc, is_async=True)
            sp = zs
        return sc, sp

    @gluon.jit
    def _fws_scores(sc, sp, ckv, kpe, SPLIT_PE):
        if SPLIT_PE:
            sc, sp = wgmma_wait(0, deps=(sc, sp))
            sc = sc * ckv + sp * kpe
        else:
            sc = wgmma_wait(0, deps=(sc,))
        return sc

    @gluon.jit
    def _fws_xchg(sc, m_i, l_i, xm, xl, p_s, s_l: gl.constexpr):
        # XCHG: a softmax step with the warpgroups' halves of the keys exchanged through xm,
        # xl (each half's row maxima, sums: [64, 2], a [64, 2, 32] view making each half
        # its warpgroup's own) and p_s (P, read there by the PV's wgmma): 4 barriers a step
        # where the conversions took 11 (sm_90a PTX). Later barriers order the next stores.
        BM: gl.constexpr = sc.shape[0]
        HN: gl.constexpr = sc.shape[1] // 2
        xm.store(gl.max(sc.reshape([BM, 2, HN]), 2))
        gl.thread_barrier()
        m_t = gl.maximum(
            gl.max(xm.slice(0, 1, 1).load(s_l), 1),
            gl.max(xm.slice(1, 1, 1).load(s_l), 1),
        )
        m_new, alpha, p = _fg_rescale(m_i, m_t, sc)
        p_s.store(p.to(gl.float16))
        xl.store(gl.sum(p.reshape([BM, 2, HN]), 2))
        fence_async_shared()  # P's generic stores, before the wgmma's async reads
        gl.thread_barrier()
        l_t = gl.sum(xl.slice(0, 1, 1).load(s_l), 1) + gl.sum(
            xl.slice(1, 1, 1).load(s_l), 1
        )
        return m_new, alpha, l_i * alpha + l_t

    @gluon.jit
    def _fws_mma(
        q_s,
        qpe_s,
        ring,
        ring_pe,
        ok_s,
        ready,
        empty,
        lo,
        hi,
        kv_len,
        qk_scale,
        ckv,
        kpe,
        g,
        TQ: gl.constexpr,
        H: gl.constexpr,
        D: gl.constexpr,
        BN: gl.constexpr,
        CAUSAL: gl.constexpr,
        SPLIT_PE: gl.constexpr,
        s_l: gl.constexpr,
        o_l: gl.constexpr,
        XCHG: gl.constexpr,
        xm,
        xl,
        p_s,
    ):
        BM: gl.constexpr = 64
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)  # the output's rows
        rows = g * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_l))
        limit = kv_len - TQ + rows // H  # causal: query t sees positions <= limit
        rs = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([BM, D], gl.float32, o_l)
        zs = gl.zeros([BM, BN], gl.float32, s_l)
        for t in range(gl.cdiv(hi - lo, BN)):
            b = t % 2
            mbarrier.wait(ready.index(b), (t // 2) & 1)
            sc, sp = _fws_qk(q_s, qpe_s, ring, ring_pe, b, zs, SPLIT_PE)
            sc = _fws_scores(sc, sp, ckv, kpe, SPLIT_PE)
            keep = (ok_s.index(b).load(gl.SliceLayout(0, s_l)) != 0)[None, :]
            if CAUSAL:
                keep = keep & ((lo + t * BN + rs)[None, :] <= limit[:, None])
            sc = gl.where(keep, sc * qk_scale, float("-inf"))
            if XCHG:
                m_new, alpha, l_i = _fws_xchg(sc, m_i, l_i, xm, xl, p_s, s_l)
                al = gl.convert_layout(alpha, row_o, assert_trivial=True)
                acc = wgmma(p_s, ring.index(b), acc * al[:, None], is_async=True)
            else:
                m_new, alpha, p, l_i = _fg_online(m_i, l_i, sc)
                p16 = gl.convert_layout(p.to(gl.float16), p_l)
                al = gl.convert_layout(alpha, row_o)
                acc = wgmma(p16, ring.index(b), acc * al[:, None], is_async=True)
            acc = wgmma_wait(0, deps=(acc,))
            m_i = m_new
            fence_async_shared()  # wgmma's reads, before the loader's copies refill
            mbarrier.arrive(empty.index(b), count=1)
        return acc, m_i, l_i

    @gluon.jit(do_not_specialize=["n_splits", "n_slots", "table_stride", "min_split"])
    def _fused_wgmma_ws_split_kernel(
        q_nope,
        q_pe,
        kv,
        table,
        lens,
        part_o,
        part_lse,
        ckv_scale,
        kpe_scale,
        sm_scale,
        stride_o_t,  # the Triton kernel's argument order: fused_mla's launch serves all
        stride_o_h,
        stride_qn_t,
        stride_qn_h,
        stride_qp_t,
        stride_qp_h,
        stride_kv,
        table_stride,
        n_slots,
        n_splits,
        min_split,
        H: gl.constexpr,
        TQ: gl.constexpr,
        D: gl.constexpr,
        DPE: gl.constexpr,
        PS: gl.constexpr,
        BY_INDPTR: gl.constexpr,
        CAUSAL: gl.constexpr,
        HAS_CKV_SCALE: gl.constexpr,
        HAS_KPE_SCALE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        DIRECT: gl.constexpr,
        LOADER_REGS: gl.constexpr,
        PART16: gl.constexpr,
        XCHG: gl.constexpr,
    ):
        gl.static_assert(D == 512 and DPE == 64 and BLOCK_N == 64)
        BN: gl.constexpr = BLOCK_N
        HALF: gl.constexpr = D // 2
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
        )
        o_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HALF, 16]
        )
        mma_sl: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2
        )

        g = gl.program_id(2)
        b, s, base, kv_len, lo, hi = _fg_range(
            lens, table_stride, n_splits, min_split, PS, BY_INDPTR, BN
        )
        if not DIRECT and lo >= hi:
            return  # the combine skips an idle split

        # q, scaled into f16's range by a power of two, in shared memory for wgmma.
        sq = (stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h)
        q_s, qpe_s, qk_scale = _fg_q64(
            q_nope, q_pe, b, g, sq, sm_scale, TQ, H, D, DPE, mma_sl
        )
        fence_async_shared()
        ckv, kpe = _fg_kv_scales(ckv_scale, kpe_scale, HAS_CKV_SCALE, HAS_KPE_SCALE)

        ring = gl.allocate_shared_memory(gl.float16, [2, BN, D], mma_sl)
        ring_pe = gl.allocate_shared_memory(gl.float16, [2, BN, DPE], mma_sl)
        ok_s = gl.allocate_shared_memory(
            gl.int32, [2, BN], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        # XCHG's exchange (_fws_xchg): 9 KB, in the 6.6 KB left and the 4 KB of scratch it frees
        if XCHG:
            x_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            xm = gl.allocate_shared_memory(gl.float32, [64, 2], x_l)
            xl = gl.allocate_shared_memory(gl.float32, [64, 2], x_l)
            p_s = gl.allocate_shared_memory(gl.float16, [64, BN], mma_sl)
        else:
            xm = ok_s  # not read
            xl = ok_s
            p_s = ok_s
        acc, m_i, l_i = gl.warp_specialize(
            [
                (
                    _fws_mma,
                    (
                        q_s,
                        qpe_s,
                        ring,
                        ring_pe,
                        ok_s,
                        ready,
                        empty,
                        lo,
                        hi,
                        kv_len,
                        qk_scale,
                        ckv,
                        kpe,
                        g,
                        TQ,
                        H,
                        D,
                        BN,
                        CAUSAL,
                        HAS_CKV_SCALE or HAS_KPE_SCALE,
                        s_l,
                        o_l,
                        XCHG,
                        xm,
                        xl,
                        p_s,
                    ),
                ),
                (
                    _fws_load,
                    (
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
                        PS,
                        D,
                        BN,
                    ),
                ),
            ],
            [4],
            [LOADER_REGS],
        )

        so = (stride_o_t, stride_o_h)
        _fg_out64(
            acc,
            m_i,
            l_i,
            ckv,
            part_o,
            part_lse,
            b,
            s,
            g,
            so,
            n_splits,
            TQ,
            H,
            D,
            DIRECT,
            PART16,
            s_l,
            o_l,
        )

    return _fused_wgmma_ws_split_kernel
