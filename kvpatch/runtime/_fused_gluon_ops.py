"""A part of the kvpatch runtime: the Gluon language the split kernels are built from, where
it may serve, and their device functions (issue 17): what the kernels share (a split's
positions, q's power-of-two scale, the FP8 scales, the online softmax step and its finish),
the 64-row kernels' q in shared memory and their output, and the 16-row kernel's q operand
and staged FP8 tiles read as its MMA operands. The kernels are the next parts, _fused_gluon,
_fused_wgmma and _fused_wgmma_ws.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts (see there); nothing
above the "joined from here" line is kept.
"""

import torch

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: the Gluon language, and the Gluon kernels' device functions

# Where the Gluon kernel has run on a GPU (its GPU tests, verify, the benchmark). Gluon is
# experimental and its API moves between Triton releases, and mma.sync tiles are tuned per
# GPU: another Triton or GPU keeps the Triton kernel, which is slower, never wrong.
FUSED_GLUON_TRITON = ("3.6.",)
FUSED_GLUON_CAPABILITY = ((9, 0),)


def _fused_gluon_device(device):
    """Whether a Gluon kernel may serve on device: a CUDA GPU of a capability it has run on."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device) in FUSED_GLUON_CAPABILITY
    )


def _fused_gluon_lang():
    """(gluon, gl) where this Triton is one the Gluon kernels have run on, else None."""
    try:
        import triton

        if not triton.__version__.startswith(FUSED_GLUON_TRITON):
            return None
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
    except Exception:
        return None
    return gluon, gl


def _fused_hopper_lang():
    """(gluon, gl, async_copy, fence_async_shared, mbarrier, warpgroup_mma,
    warpgroup_mma_wait) for the 64-row kernels, device functions built; or None."""
    lang = _fused_gluon_lang()
    try:
        from triton.experimental.gluon.language.nvidia import hopper
    except Exception:
        lang = None
    if lang is None:
        return None
    _fused_gluon_build_ops(*lang)
    return lang + (
        hopper.async_copy,
        hopper.fence_async_shared,
        hopper.mbarrier,
        hopper.warpgroup_mma,
        hopper.warpgroup_mma_wait,
    )


_fused_gluon_ops_built = False


def _fused_gluon_build_ops(gluon, gl):
    """Define the Gluon kernels' device functions as module globals (a kernel's callees are
    resolved in its module), once. The layouts they convert to are checked at compile time:
    assert_trivial fails the build if any of them would move data between threads."""
    global _fg_perm, _fg_q3, _fg_k3, _fg_pe3, _fg_v3, _fused_gluon_ops_built
    global _fg_range, _fg_slots, _fg_qk_scale, _fg_kv_scales, _fg_online, _fg_finish
    global _fg_rescale
    global _fg_q64, _fg_out64, _fg_sum_bcast
    if _fused_gluon_ops_built:
        return
    _fused_gluon_ops_built = True

    @gluon.jit
    def _fg_range(
        lens,
        table_stride,
        n_splits,
        min_split,
        PS: gl.constexpr,
        BY_INDPTR: gl.constexpr,
        BN: gl.constexpr,
    ):
        # This program's request b and split s: the request's first table entry and length,
        # and the split's positions [lo, hi), a share of at least min_split rounded to BN.
        # Boundaries from the device lengths alone: bit-identical runs.
        b = gl.program_id(0)
        s = gl.program_id(1)
        if BY_INDPTR:
            first = gl.load(lens + b)
            kv_len = (gl.load(lens + b + 1) - first) * PS
            base = first.to(gl.int64)
        else:
            kv_len = gl.load(lens + b)
            base = b.to(gl.int64) * table_stride
        kv_len = gl.maximum(kv_len, 0)
        per = gl.cdiv(gl.maximum(gl.cdiv(kv_len, n_splits), min_split), BN) * BN
        lo = s * per
        return b, s, base, kv_len, lo, gl.minimum(lo + per, kv_len)

    @gluon.jit
    def _fg_slots(table, base, start, hi, n_slots, PS: gl.constexpr, r):
        # The pool slots of positions start + r, -1 where masked or outside the pool (never
        # read: the copy fills zeros, the score is -inf). int32: a slot count past 2^31
        # would be a pool of over a terabyte.
        pos = start + r
        ok = pos < hi
        page = gl.load(table + base + pos // PS, mask=ok, other=0)
        slot = page * PS + pos % PS
        return gl.where(ok & (slot >= 0) & (slot < n_slots), slot, -1)

    @gluon.jit
    def _fg_qk_scale(amax, sm_scale):
        # q scaled into f16's range by a power of two (exact), as the Triton kernel does:
        # (q's multiplier, the scores' scale in base 2).
        e = gl.ceil(gl.log2(gl.maximum(amax, 1e-30))).to(gl.int32) - 14
        e = gl.minimum(gl.maximum(e, -100), 100)
        q_mul = ((127 - e) << 23).to(gl.float32, bitcast=True)
        qk_scale = (
            sm_scale
            * 1.4426950408889634
            * ((127 + e) << 23).to(gl.float32, bitcast=True)
        )
        return q_mul, qk_scale

    @gluon.jit
    def _fg_kv_scales(
        ckv_scale, kpe_scale, HAS_CKV_SCALE: gl.constexpr, HAS_KPE_SCALE: gl.constexpr
    ):
        ckv = 1.0
        if HAS_CKV_SCALE:
            ckv = gl.load(ckv_scale).to(gl.float32)
        kpe = 1.0
        if HAS_KPE_SCALE:
            kpe = gl.load(kpe_scale).to(gl.float32)
        return ckv, kpe

    @gluon.jit
    def _fg_online(m_i, l_i, sc):
        # One step of the online softmax (base 2): the new running max, the factor that
        # rescales what came before, P, and the new running sum.
        m_new, alpha, p = _fg_rescale(m_i, gl.max(sc, 1), sc)
        return m_new, alpha, p, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _fg_rescale(m_i, m_t, sc):
        # The step given the tile's row maxima m_t: the new running max, the factor that
        # rescales what came before, and P (the loader kernel's XCHG finds m_t itself).
        m_new = gl.maximum(m_i, m_t)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet
        return m_new, gl.exp2(m_i - m_use), gl.exp2(sc - m_use[:, None])

    @gluon.jit
    def _fg_sum_bcast(sx, s3, s_l: gl.constexpr):
        # The 16-row kernel's scores summed over its four warps' latent chunks (s3, the
        # MMA's partials) with every warp holding the whole tile, in s_l (the rows and keys
        # of the PV's A operand): one barrier, then each warp adds the four from shared
        # memory itself, so the softmax, P and the output's rescale need no other warp. A
        # quarter of the columns a warp took 8 more barriers (session 20's PTX); the
        # step's closing barrier keeps the next store after every warp's loads.
        H: gl.constexpr = s3.shape[1]
        sx.store(s3.reshape([4 * H, s3.shape[2]]))
        gl.thread_barrier()
        return (
            sx.slice(0, H).load(s_l)
            + sx.slice(H, H).load(s_l)
            + sx.slice(2 * H, H).load(s_l)
            + sx.slice(3 * H, H).load(s_l)
        )

    @gluon.jit
    def _fg_finish(m_i, l_i, ckv, PART16: gl.constexpr):
        # The output's row factor, ckv / l (V is the latent: its scale scales the output;
        # f16 partials, PART16, leave it to the combine: 1 / l), and the split's
        # log-sum-exp (base 2; -inf for a split that saw no row).
        seen = l_i > 0.0
        if PART16:
            inv = 1.0 / gl.where(seen, l_i, 1.0)
        else:
            inv = ckv / gl.where(seen, l_i, 1.0)
        lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
        return inv, lse

    @gluon.jit
    def _fg_q64(q_nope, q_pe, b, g, sq, sm_scale, TQ, H, D, DPE, mma_sl):
        # The 64 query rows m = (token, head) of group g, scaled into f16's range by a power
        # of two (exact), stored once in the NVMMA layout wgmma reads as its A operand:
        # (q, its rope part, the scores' scale). sq: q_nope's and q_pe's strides.
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        HALF: gl.constexpr = D // 2
        mq = g * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, q_l))
        mq_ok = (mq < TQ * H)[:, None]
        qrow = (b * TQ + mq // H).to(gl.int64)
        qn_rows = (q_nope + qrow * sq[0] + (mq % H) * sq[1])[:, None]
        qp_rows = (q_pe + qrow * sq[2] + (mq % H) * sq[3])[:, None]
        cq = gl.arange(0, HALF, layout=gl.SliceLayout(0, q_l))[None, :]
        cqp = gl.arange(0, DPE, layout=gl.SliceLayout(0, q_l))[None, :]
        # (each use converts to fp32 itself: the 64-row kernel's instructions as they ran)
        qa = gl.load(qn_rows + cq, mask=mq_ok, other=0.0)
        qb = gl.load(qn_rows + HALF + cq, mask=mq_ok, other=0.0)
        qr = gl.load(qp_rows + cqp, mask=mq_ok, other=0.0)
        amax = gl.maximum(
            gl.maximum(
                gl.max(gl.max(gl.abs(qa.to(gl.float32)), 1), 0),
                gl.max(gl.max(gl.abs(qb.to(gl.float32)), 1), 0),
            ),
            gl.max(gl.max(gl.abs(qr.to(gl.float32)), 1), 0),
        )
        q_mul, qk_scale = _fg_qk_scale(amax, sm_scale)
        q_s = gl.allocate_shared_memory(gl.float16, [64, D], mma_sl)
        qpe_s = gl.allocate_shared_memory(gl.float16, [64, DPE], mma_sl)
        q_s.slice(0, HALF, 1).store((qa.to(gl.float32) * q_mul).to(gl.float16))
        q_s.slice(HALF, HALF, 1).store((qb.to(gl.float32) * q_mul).to(gl.float16))
        qpe_s.store((qr.to(gl.float32) * q_mul).to(gl.float16))
        return q_s, qpe_s, qk_scale

    @gluon.jit
    def _fg_out64(
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
    ):
        # A 64-row group's finish: the output rows themselves (one split, DIRECT), else
        # this split's partial rows and log-sum-exps. so: the output's strides.
        inv, lse = _fg_finish(m_i, l_i, ckv, PART16)
        inv = gl.convert_layout(inv, gl.SliceLayout(1, o_l))
        o = acc * inv[:, None]
        if DIRECT and PART16:
            # An f16 partial leaves the latent's scale to the combine; one split rounds as
            # a partial is, then scales: the bits split + combine would write.
            o = o.to(gl.float16).to(gl.float32) * ckv
        mo = g * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
        mo_ok = (mo < TQ * H)[:, None]
        co = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))[None, :]
        if DIRECT:
            orow = (b * TQ + mo // H).to(gl.int64) * so[0] + (mo % H) * so[1]
            gl.store(
                part_o + orow[:, None] + co, o.to(part_o.dtype.element_ty), mask=mo_ok
            )
        else:
            prow = (b * TQ * H + mo).to(gl.int64) * n_splits + s
            gl.store(
                part_o + prow[:, None] * D + co,
                o.to(part_o.dtype.element_ty),
                mask=mo_ok,
            )
            ms = g * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_l))
            ps = (b * TQ * H + ms).to(gl.int64) * n_splits + s
            gl.store(part_lse + ps, lse, mask=ms < TQ * H)

    @gluon.jit
    def _fg_perm(k):
        # Logical latent dim k -> its byte in the row: in each 16-wide group the QK
        # operand's registers k+1 and k+8 become a thread's adjacent bytes.
        return (
            (k & ~15)
            | (((k >> 2) & 1) << 3)
            | (((k >> 1) & 1) << 2)
            | (((k >> 3) & 1) << 1)
            | (k & 1)
        )

    @gluon.jit
    def _fg_q3(
        base,
        stride_h,
        col0,
        W: gl.constexpr,
        STEP: gl.constexpr,
        q_mul,
        A3: gl.constexpr,
    ):
        # q's [4, 16, W] operand: warp w's W dims from col0 + STEP w, permuted as K's.
        w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, A3)))
        h = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, A3)))
        k = _fg_perm(gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, A3))))
        col = (col0 + STEP * w)[:, None, None] + k[None, None, :]
        x = gl.load(base + h[None, :, None] * stride_h + col).to(gl.float32)
        return (x * q_mul).to(gl.float16)

    @gluon.jit
    def _fg_k3(t, B3: gl.constexpr, BN: gl.constexpr, W: gl.constexpr):
        # [4 chunks, BN rows, W bytes] as loaded -> [4, W dims (logical), BN]: no movement.
        t = t.to(gl.float16).permute([0, 2, 1])
        t = t.reshape([4, W // 16, 2, 2, 2, 2, BN]).permute([0, 1, 4, 2, 3, 5, 6])
        return gl.convert_layout(t.reshape([4, W, BN]), B3, assert_trivial=True)

    @gluon.jit
    def _fg_pe3(t, B3: gl.constexpr, BN: gl.constexpr):
        # [BN rows, 64 rope bytes] (warp w: bytes 16 w..) -> [4, 16 dims (logical), BN].
        t = t.to(gl.float16).reshape([BN, 4, 16]).permute([1, 2, 0])
        t = t.reshape([4, 1, 2, 2, 2, 2, BN]).permute([0, 1, 4, 2, 3, 5, 6])
        return gl.convert_layout(t.reshape([4, 16, BN]), B3, assert_trivial=True)

    @gluon.jit
    def _fg_v3(t, B3: gl.constexpr, BN: gl.constexpr):
        # Physical latent column 32 b + 4 i + a -> the MMA's logical column 32 b + 8 a + i.
        t = t.to(gl.float16).reshape([4, BN, 4, 8, 4]).permute([0, 1, 2, 4, 3])
        return gl.convert_layout(t.reshape([4, BN, 128]), B3, assert_trivial=True)
