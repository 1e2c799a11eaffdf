"""A part of the kvpatch runtime: the fused FP8 MLA decode's split kernel in Gluon (issue 17).

Gluon (triton.experimental.gluon, in Triton 3.5 and later) lets a kernel pick its register
layouts. This kernel reads every FP8 byte it stages once for QK and once for PV, 4 bytes a
thread with a 32-bit shared load, in layouts that are the MMA's own operand layouts up to a
permutation of the reduced index (QK: latent dims, applied to q as well) or the output index
(PV: latent columns, undone at the store); the Triton kernel restages V as f16 and re-reads
q in every warp (GPU run 34: ~47 shared wavefronts a row). The QK contraction is split
across the four warps by latent chunk (warp w: latent dims 128 w.., rope dims 16 w..); the
partial scores are summed through shared memory, a quarter of the columns a warp; warp w's PV
runs on its own chunk. Same split-KV partials as the Triton kernel, merged by its combine.
GPU runs 43-44 (H100): 0.80-0.96x the Triton kernel's time at 16 heads, 0.62-0.86x
FlashInfer's bf16 kernel in the runtime. It serves by default.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts (see there); the
imports above the "joined from here" line only let this part read alone.
"""

from kvpatch.runtime._fused_kernels import _fused_sm_count, _fused_split_count
from kvpatch.runtime._fused_gluon_ops import (  # globals once _fused_gluon_build_ops has run
    _fused_gluon_device,
    _fused_gluon_lang,
    _fg_finish,
    _fg_k3,
    _fg_kv_scales,
    _fg_online,
    _fg_pe3,
    _fg_q3,
    _fg_qk_scale,
    _fg_range,
    _fg_sum_bcast,
    _fg_v3,
    _fused_gluon_build_ops,
)

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: the Gluon split kernel (16 heads, one query token a request)

# Its launch constants (GPU run 43): 32 positions a step, two stages, a grid of three CTAs
# an SM (168 registers, 45 KB shared: three fit). maxnreg: a register cap a thread (None:
# the compiler's 168), which four CTAs an SM need (128: ptxas spills 232 bytes a thread).
# copy_rows: rows a warp's copy instruction covers, 4 or 8 (8: 3 barriers a step fewer).
# bcast_scores: every warp sums all four partial scores (8 barriers a step fewer; a 168 cap).
FUSED_GLUON_TUNING = {
    "block_n": 32,
    "num_stages": 2,
    "num_warps": 4,
    "ctas_per_sm": 3,
    "min_split": 64,
    "maxnreg": None,
    "copy_rows": 4,
    "bcast_scores": False,
}
# The register cap bcast_scores needs for three CTAs an SM (184 uncapped; no spills at 168)
FUSED_GLUON_BCAST_MAXNREG = 168
_fused_gluon = None  # the kernel, built on first use; False: no Gluon here
# On since its GPU tests and verify on the real trees passed (GPU runs 44-46, H100: 0.62-0.86x
# FlashInfer's bf16 kernel at 16 heads, against 0.74-0.96x for the Triton kernel): a config
# with "gluon": False keeps the Triton kernel.
FUSED_GLUON_DEFAULT = True


def _fused_gluon_choice(geometry, consts):
    """(kernel, config, split count, launch constants, rows a CTA) when the Gluon kernel serves this
    call geometry, else None. geometry: (heads, query tokens, latent and rope widths, flat
    table, interpreter, device, config, split count or None, programs before splits);
    consts: (page size, indptr rows, whether each FP8 scale is applied). A batch of one
    split a request keeps the Triton kernel: it writes the output in one launch, which
    eager batches pay for in host time."""
    heads, tq, d, dpe, flat, interpret, device, cfg, n_splits, programs = geometry
    if (heads, tq, d, dpe) != (16, 1, 512, 64) or not flat or interpret:
        return None
    if not cfg.get("gluon", FUSED_GLUON_DEFAULT) or not _fused_gluon_device(device):
        return None
    kernel = _fused_gluon_build()
    if not kernel:
        return None
    cfg = dict(cfg, **FUSED_GLUON_TUNING)
    if n_splits is None:
        sms = _fused_sm_count(device) * cfg["ctas_per_sm"]
        n_splits = _fused_split_count(sms, programs, cfg.get("splits_down", False))
    if n_splits == 1 and cfg.get("direct", True):
        return None
    page_size, by_indptr, has_ckv, has_kpe = consts
    launch = dict(
        H=16,
        D=512,
        DPE=64,
        PS=int(page_size),
        BY_INDPTR=by_indptr,
        HAS_CKV_SCALE=has_ckv,
        HAS_KPE_SCALE=has_kpe,
        BLOCK_N=cfg["block_n"],
        STAGES=cfg["num_stages"],
        COPY8=cfg["copy_rows"] == 8,
        BCAST=bool(cfg["bcast_scores"]),
        num_warps=cfg["num_warps"],
    )
    if cfg["maxnreg"]:
        launch["maxnreg"] = cfg["maxnreg"]
    return kernel, cfg, n_splits, tuple(launch.items()), 16


def _fused_gluon_build():
    global _fused_gluon
    if _fused_gluon is not None:
        return _fused_gluon
    lang = _fused_gluon_lang()
    try:
        from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    except Exception:
        lang = None
    if lang is None:
        _fused_gluon = False
        return _fused_gluon
    _fused_gluon_build_ops(*lang)
    _fused_gluon = _fg_kernel(*lang, async_copy, mma_v2)
    return _fused_gluon


def _fg_kernel(gluon, gl, async_copy, mma_v2):
    @gluon.jit(do_not_specialize=["n_splits", "n_slots", "table_stride", "min_split"])
    def _fused_gluon_split_kernel(
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
        stride_o_t,  # the Triton kernel's argument order: fused_mla's launch serves both
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
        D: gl.constexpr,
        DPE: gl.constexpr,
        PS: gl.constexpr,
        BY_INDPTR: gl.constexpr,
        HAS_CKV_SCALE: gl.constexpr,
        HAS_KPE_SCALE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        PART16: gl.constexpr,
        COPY8: gl.constexpr,
        BCAST: gl.constexpr,
    ):
        BN: gl.constexpr = BLOCK_N
        C: gl.constexpr = D // 4
        mma3: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]
        )
        a3: gl.constexpr = gl.DotOperandLayout(0, mma3, 2)
        b3: gl.constexpr = gl.DotOperandLayout(1, mma3, 2)
        # The scores summed over the warps' partials in-thread, a quarter of the columns a warp.
        rs3: gl.constexpr = gl.BlockedLayout([4, 2, 2], [1, 8, 4], [1, 1, 4], [2, 1, 0])
        # BCAST: the scores in every warp, as the PV's A operand holds P (_fg_sum_bcast)
        s_l: gl.constexpr = gl.SliceLayout(0, a3) if BCAST else gl.SliceLayout(0, rs3)
        # Copies of 16 bytes a thread. COPY8 (8 rows a warp): a row's slot is in the same
        # threads for latent and rope; 4 rows a warp cost 3 barriers and a shared round trip.
        cp3: gl.constexpr = gl.BlockedLayout(
            [1, 1, 16], [1, 8, 4] if COPY8 else [1, 4, 8], [1, 4, 1], [2, 1, 0]
        )
        cp_pe: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        st3: gl.constexpr = gl.BlockedLayout(
            [1, 1, 4], [1, 1, 32], [4, 1, 1], [2, 1, 0]
        )
        sw: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [2, 1, 0])
        sw_pe: gl.constexpr = gl.SwizzledSharedLayout(16, 2, 4, [1, 0])
        sw_sx: gl.constexpr = gl.SwizzledSharedLayout(2, 1, 8, [1, 0])
        # The staged tiles read as the MMA operands' layouts (up to the permutations above):
        # two low column bits in registers, so one 32-bit shared load a thread and row.
        K3PHYS: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[
                [0, 0, 1],
                [0, 0, 2],
                [0, 0, 16],
                [0, 0, 32],
                [0, 8, 0],
                [0, 16, 0],
            ],
            lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            warp_bases=[[1, 0, 0], [2, 0, 0]],
            block_bases=[],
            shape=[4, BN, 64],
        )
        PE3PHYS: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0]],
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 16], [0, 32]],
            block_bases=[],
            shape=[BN, DPE],
        )
        V3PHYS: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[
                [0, 0, 1],
                [0, 0, 2],
                [0, 1, 0],
                [0, 8, 0],
                [0, 16, 0],
                [0, 0, 32],
                [0, 0, 64],
            ],
            lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
            warp_bases=[[1, 0, 0], [2, 0, 0]],
            block_bases=[],
            shape=[4, BN, C],
        )
        b, s, base, kv_len, lo, hi = _fg_range(
            lens, table_stride, n_splits, min_split, PS, BY_INDPTR, BN
        )
        if lo >= hi:
            return  # the combine skips an idle split
        # q scaled into f16's range by a power of two (exact), as the Triton kernel does.
        hq = gl.arange(0, H, layout=gl.SliceLayout(1, q_l))
        qn = q_nope + b.to(gl.int64) * stride_qn_t
        qp = q_pe + b.to(gl.int64) * stride_qp_t
        cn = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
        cp = gl.arange(0, DPE, layout=gl.SliceLayout(0, q_l))
        amax = gl.maximum(
            gl.max(
                gl.max(
                    gl.abs(
                        gl.load(qn + hq[:, None] * stride_qn_h + cn[None, :]).to(
                            gl.float32
                        )
                    ),
                    1,
                ),
                0,
            ),
            gl.max(
                gl.max(
                    gl.abs(
                        gl.load(qp + hq[:, None] * stride_qp_h + cp[None, :]).to(
                            gl.float32
                        )
                    ),
                    1,
                ),
                0,
            ),
        )
        q_mul, qk_scale = _fg_qk_scale(amax, sm_scale)
        qa = _fg_q3(
            qn, stride_qn_h, 0, 64, C, q_mul, a3
        )  # warp w: dims 128 w + [0, 64)
        qb = _fg_q3(qn, stride_qn_h, 64, 64, C, q_mul, a3)  # and 128 w + [64, 128)
        qr = _fg_q3(
            qp, stride_qp_h, 0, 16, 16, q_mul, a3
        )  # and rope dims 16 w + [0, 16)
        ckv, kpe = _fg_kv_scales(ckv_scale, kpe_scale, HAS_CKV_SCALE, HAS_KPE_SCALE)
        kv_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 4, BN, C], sw)
        pe_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, DPE], sw_pe)
        p_l: gl.constexpr = a3 if BCAST else rs3  # P's layout before the PV's operand
        # the output's rows
        row_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, mma3))
        if BCAST:
            sx = gl.allocate_shared_memory(gl.float32, [4 * H, BN], sw_sx)
        r = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, cp3)))
        cc = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, cp3)))
        jj = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, cp3)))
        cpe = gl.arange(0, DPE, layout=gl.SliceLayout(0, cp_pe))
        rs = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
        n_steps = gl.cdiv(hi - lo, BN)
        m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([H], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([4, H, C], gl.float32, mma3)
        # Step t's rows staged STAGES - 1 steps ahead; a masked or out-of-pool row is never
        # read (the copy fills zeros) and its score is -inf.
        # The page indices are loaded in the step that uses them: loading them a step ahead
        # (as the 64-row kernel does) took 1-3% longer here (GPU run 49).
        for t in range(-(STAGES - 1), n_steps):
            u = t + STAGES - 1
            pos = lo + u * BN + r
            ok = pos < hi
            page = gl.load(table + base + pos // PS, mask=ok, other=0).to(gl.int64)
            slot = page * PS + pos % PS
            ok = ok & (slot >= 0) & (slot < n_slots)
            row = (
                kv
                + slot[None, :, None] * stride_kv
                + (jj * C)[:, None, None]
                + cc[None, None, :]
            )
            async_copy.async_copy_global_to_shared(
                kv_s.index(u % STAGES), row, mask=ok[None, :, None]
            )
            slot_pe = gl.convert_layout(
                slot, gl.SliceLayout(1, cp_pe), assert_trivial=COPY8
            )
            ok_pe = gl.convert_layout(
                ok, gl.SliceLayout(1, cp_pe), assert_trivial=COPY8
            )
            pe_row = kv + slot_pe[:, None] * stride_kv + D + cpe[None, :]
            async_copy.async_copy_global_to_shared(
                pe_s.index(u % STAGES), pe_row, mask=ok_pe[:, None]
            )
            async_copy.commit_group()
            if t >= 0:
                pos_s = lo + t * BN + rs
                ok_s = pos_s < hi
                pg = gl.load(table + base + pos_s // PS, mask=ok_s, other=0).to(
                    gl.int64
                )
                sl = pg * PS + pos_s % PS
                ok_s = ok_s & (sl >= 0) & (sl < n_slots)
                async_copy.wait_group(STAGES - 1)
                gl.thread_barrier()
                tile = kv_s.index(t % STAGES)
                z = gl.zeros([4, H, BN], gl.float32, mma3)
                s3 = mma_v2(
                    qa, _fg_k3(tile.slice(0, 64, 2).load(K3PHYS), b3, BN, 64), z
                )
                s3 = mma_v2(
                    qb, _fg_k3(tile.slice(64, 64, 2).load(K3PHYS), b3, BN, 64), s3
                )
                s3p = mma_v2(
                    qr, _fg_pe3(pe_s.index(t % STAGES).load(PE3PHYS), b3, BN), z
                )
                if HAS_CKV_SCALE:
                    s3 = s3 * ckv
                if HAS_KPE_SCALE:
                    s3p = s3p * kpe
                if BCAST:
                    sc = _fg_sum_bcast(sx, s3 + s3p, s_l)
                else:
                    sc = gl.sum(gl.convert_layout(s3 + s3p, rs3), 0)
                sc = gl.where(ok_s[None, :], sc * qk_scale, float("-inf"))
                m_new, alpha, p, l_i = _fg_online(m_i, l_i, sc)
                p16 = gl.expand_dims(p.to(gl.float16), 0)
                p3 = gl.convert_layout(
                    gl.broadcast(p16, gl.zeros([4, H, BN], gl.float16, p_l))[0],
                    a3,
                    assert_trivial=BCAST,
                )
                al = gl.convert_layout(alpha, row_l, assert_trivial=BCAST)
                al = gl.expand_dims(gl.expand_dims(al, 0), 2)
                acc = mma_v2(p3, _fg_v3(tile.load(V3PHYS), b3, BN), acc * al)
                m_i = m_new
                gl.thread_barrier()  # every warp past this buffer before a later step refills it
        async_copy.wait_group(0)
        inv, lse = _fg_finish(m_i, l_i, ckv, PART16)
        hs = gl.arange(0, H, layout=gl.SliceLayout(1, s_l))
        gl.store(part_lse + (b * H + hs).to(gl.int64) * n_splits + s, lse)
        inv = gl.convert_layout(inv, row_l, assert_trivial=BCAST)
        o = acc * gl.expand_dims(gl.expand_dims(inv, 0), 2)
        o = o.reshape([4, H, 4, 4, 8]).permute([0, 1, 2, 4, 3]).reshape([4, H, C])
        o = gl.convert_layout(o, st3)  # physical columns, then coalesced
        wo = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, st3)))
        ho = gl.arange(0, H, layout=gl.SliceLayout(0, gl.SliceLayout(2, st3)))
        co = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, st3)))
        prow = (b * H + ho).to(gl.int64) * n_splits + s
        dst = (
            part_o
            + prow[None, :, None] * D
            + (wo * C)[:, None, None]
            + co[None, None, :]
        )
        gl.store(dst, o.to(part_o.dtype.element_ty))

    return _fused_gluon_split_kernel
