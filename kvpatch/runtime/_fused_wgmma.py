"""A part of the kvpatch runtime: the fused FP8 MLA split kernel for 64 query rows a CTA,
by warpgroup MMA (issue 17: 128 heads, and 16 heads with 4 or 8 draft tokens).

The 16-row kernels (Triton's, and the Gluon one in _fused_gluon) hold 16 or 32 query rows a
CTA, so at 128 heads every KV tile is read, converted and multiplied by 4 to 8 CTAs: 2.7-3.1x
FlashInfer's bf16 kernel (GPU run 44). This kernel holds 64 rows (heads x draft tokens) a CTA
in two warpgroups, FlashMLA's shape for an FP8 cache:
- each KV tile (BLOCK_N rows) is copied FP8 into shared memory (cp.async, STAGES deep),
  converted once to f16 into the NVMMA layout wgmma reads, and used from there twice: as
  K^T for QK and as V for PV;
- QK: S[64, BLOCK_N] = q K^T (q in shared memory, 512 + 64 dims), the two warpgroups taking
  half of the tile's rows each (warps [4, 2]);
- PV: O[64, 512] += P V, the warpgroups taking V's columns 0-255 and 256-511: a 64 x 256
  fp32 accumulator each, 128 registers a thread.
At 128 heads two CTAs read a KV row, not eight. Same partials, combine and numerics as the
Triton kernel: FP8 -> f16 exact, q scaled into f16's range by a power of two, fp32 softmax,
P in f16, the KV scales applied to the scores and the output.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts (see there); the
imports above the "joined from here" line only let this part read alone.
"""

from kvpatch.runtime._fused_gluon_ops import _fused_gluon_device, _fused_hopper_lang
from kvpatch.runtime._fused_gluon_ops import (  # globals once _fused_gluon_build_ops has run
    _fg_kv_scales,
    _fg_online,
    _fg_out64,
    _fg_q64,
    _fg_range,
    _fg_slots,
)
from kvpatch.runtime._fused_kernels import _fused_sm_count, _fused_split_count
from kvpatch.runtime._fused_wgmma_ws import FUSED_WS_LOADER_REGS, _fused_wgmma_ws_build

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: the 64-row warpgroup-MMA split kernel (Gluon)

# Its launch constants (GPU runs 47-48, H100): 64 positions a step (32 took 1.2-1.6x the
# time), one FP8 stage (two within 2%), one CTA an SM (184 KB of shared memory). A config's
# "wg_<key>" overrides one (gpu/gluon_wgmma_probe.py's sweep). lean: two barriers a step,
# not four. ws: the loads and conversions in a warp partition (_fused_wgmma_ws), on since
# GPU run 50 (H100): 0.63-0.78x this kernel's time from 8 x 4k at 128 heads, its tests and
# verify on the real trees passed. (Its variants with the next QK issued behind each PV,
# 1.04-1.14x its time, with each block converted as its copy landed, within 2%, and with
# its loader holding the next tile in registers, 1.01-1.05x (GPU run 51), are gone.)
FUSED_WGMMA_TUNING = {
    "block_n": 64,
    "num_stages": 1,
    "num_warps": 8,
    "ctas_per_sm": 1,
    "min_split": 128,
    "lean": False,
    "ws": True,
    "splits": "fill",
    "xchg": False,
}
# "fill" (wg_splits): the fewest splits whose grid fills its last wave of CTAs at least this
# much. ncu (GPU run 50) found the rounded-up count ("up", the rule of the 16-row kernels)
# leaving SMs idle: 128 heads x 32 x 4k ran 3 splits, 192 CTAs on 132 SMs (1.45 waves; 2
# splits are 128, one wave). GPU run 51 (H100, gpu/gluon_wgmma_probe.py --ws): fill took
# 0.74x up's time there (115.4 against 155.2 us), 0.66x at 16 heads x 4 tokens x 32 x 4k,
# 0.75x at 16 x 8, 0.97x at 64 x 8k, within 1% elsewhere; every check passed.
FUSED_WGMMA_FILL = 0.9
# Query rows a CTA holds: the kernel's layouts are two warpgroups of 4 x 16 rows (its BM).
FUSED_WGMMA_ROWS = 64
_fused_wgmma = None  # the kernel, built on first use; False: no Gluon here
# On since its GPU tests and verify on the real trees passed (GPU run 48): 0.55-0.83x the
# Triton kernel's time at 64 rows a request or more. "wgmma": False keeps the Triton kernel.
FUSED_WGMMA_DEFAULT = True


def _fused_wgmma_choice(geometry, consts):
    """(kernel, config, split count, launch constants, rows a CTA) when the 64-row kernel
    serves this call, else None. geometry: (heads x query tokens, latent and rope widths,
    flat table, interpreter, device, config, split count or None, batch); consts: (page
    size, indptr rows, causal, whether each FP8 scale is applied, heads, query tokens).
    """
    m_rows, d, dpe, flat, interpret, device, cfg, n_splits, batch = geometry
    if (d, dpe) != (512, 64) or m_rows < FUSED_WGMMA_ROWS or not flat or interpret:
        return None
    if not cfg.get("wgmma", FUSED_WGMMA_DEFAULT) or not _fused_gluon_device(device):
        return None
    cfg = dict(cfg, **FUSED_WGMMA_TUNING)
    for k in FUSED_WGMMA_TUNING.keys() - {"num_warps"}:  # the layouts are 8 warps
        cfg[k] = cfg.get("wg_" + k, cfg[k])
    kernel = cfg["ws"] and _fused_wgmma_ws_build()
    # The loader kernel off or not built (another Triton): the one without it.
    if not kernel:
        kernel = _fused_wgmma_build()
        cfg["ws"] = False
    if not kernel:
        return None
    groups = -(-m_rows // FUSED_WGMMA_ROWS)
    if n_splits is None:
        sms = _fused_sm_count(device) * cfg["ctas_per_sm"]
        n_splits = _fused_wgmma_splits(sms, batch * groups, cfg["splits"])
    page_size, by_indptr, causal, has_ckv, has_kpe, heads, tq = consts
    launch = dict(
        H=heads,
        TQ=tq,
        D=512,
        DPE=64,
        PS=int(page_size),
        BY_INDPTR=by_indptr,
        CAUSAL=bool(causal) and tq > 1,
        HAS_CKV_SCALE=has_ckv,
        HAS_KPE_SCALE=has_kpe,
        BLOCK_N=cfg["block_n"],
        STAGES=cfg["num_stages"],
        DIRECT=n_splits == 1 and cfg.get("direct", True),
        LEAN=cfg["lean"],
        num_warps=cfg["num_warps"],
    )
    if cfg["ws"]:  # a ring of two tiles, its own barriers
        del launch["STAGES"], launch["LEAN"]
        launch.update(LOADER_REGS=FUSED_WS_LOADER_REGS, XCHG=bool(cfg["xchg"]))
    return kernel, cfg, n_splits, tuple(launch.items()), FUSED_WGMMA_ROWS


def _fused_wgmma_splits(slots, programs, how):
    """Splits a request gets, for `programs` CTAs a split on `slots` CTA slots (the lengths
    stay on the device). "up": the grid at least one wave (the 16-row kernels' rule);
    "fill": the fewest splits (at most 64) whose last wave is FUSED_WGMMA_FILL full, else
    the count that fills it best."""
    if how == "up":
        return _fused_split_count(slots, programs, False)
    programs, best, fill = max(1, programs), 1, 0.0
    for n in range(1, 65):
        ctas = programs * n
        f = ctas / (slots * -(-ctas // slots))
        if f >= FUSED_WGMMA_FILL:
            return n
        if f > fill:
            best, fill = n, f
    return best


def _fused_wgmma_build():
    global _fused_wgmma
    if _fused_wgmma is None:
        lang = _fused_hopper_lang()
        _fused_wgmma = _fw_kernel(*lang) if lang else False
    return _fused_wgmma


def _fw_kernel(gluon, gl, async_copy, fence_async_shared, mbarrier, wgmma, wgmma_wait):
    # A kernel's callees are resolved among its module's globals.
    global _fw_copy, _fw_convert

    @gluon.jit
    def _fw_copy(
        kv, slot, slot_pe, stride_kv, D: gl.constexpr, dst, dst_pe, c_cp, c_pe
    ):
        async_copy.async_copy_global_to_shared(
            dst,
            kv + slot.to(gl.int64)[:, None] * stride_kv + c_cp[None, :],
            mask=(slot >= 0)[:, None],
        )
        async_copy.async_copy_global_to_shared(
            dst_pe,
            kv + slot_pe.to(gl.int64)[:, None] * stride_kv + D + c_pe[None, :],
            mask=(slot_pe >= 0)[:, None],
        )
        async_copy.commit_group()

    @gluon.jit
    def _fw_convert(
        src,
        src_pe,
        dst,
        dst_pe,
        Q4: gl.constexpr,
        cv_l: gl.constexpr,
        cpe_l: gl.constexpr,
    ):
        # One conversion a tile: FP8 -> f16 (exact) into the MMA layout, a quarter at a time.
        for c in gl.static_range(4):
            dst.slice(c * Q4, Q4, 1).store(
                src.slice(c * Q4, Q4, 1).load(cv_l).to(gl.float16)
            )
        dst_pe.store(src_pe.load(cpe_l).to(gl.float16))

    @gluon.jit(do_not_specialize=["n_splits", "n_slots", "table_stride", "min_split"])
    def _fused_wgmma_split_kernel(
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
        STAGES: gl.constexpr,
        DIRECT: gl.constexpr,
        LEAN: gl.constexpr,
        PART16: gl.constexpr,
    ):
        BM: gl.constexpr = 64  # FUSED_WGMMA_ROWS
        BN: gl.constexpr = BLOCK_N
        HALF: gl.constexpr = D // 2
        SPLIT_PE: gl.constexpr = HAS_CKV_SCALE or HAS_KPE_SCALE
        # Warps [4, 2]: a warpgroup covers the 64 rows; the two split the N dimension.
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
        )
        o_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HALF, 16]
        )
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        mma_sl: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2
        )
        st_sl: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0])
        # copies and conversions: 16 bytes a thread and row piece
        cp_l: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [8, 1], [1, 0])
        cpe_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
        Q4: gl.constexpr = D // 4
        cv_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])

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
        ckv, kpe = _fg_kv_scales(ckv_scale, kpe_scale, HAS_CKV_SCALE, HAS_KPE_SCALE)

        # KV: FP8 stages (cp.async), and the f16 tile both MMAs read.
        kv_st = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, D], st_sl)
        pe_st = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, DPE], st_sl)
        k_s = gl.allocate_shared_memory(gl.float16, [BN, D], mma_sl)
        kpe_s = gl.allocate_shared_memory(gl.float16, [BN, DPE], mma_sl)
        r_cp = gl.arange(0, BN, layout=gl.SliceLayout(1, cp_l))
        c_cp = gl.arange(0, D, layout=gl.SliceLayout(0, cp_l))
        r_pe = gl.arange(0, BN, layout=gl.SliceLayout(1, cpe_l))
        c_pe = gl.arange(0, DPE, layout=gl.SliceLayout(0, cpe_l))
        n_steps = gl.cdiv(hi - lo, BN)
        # Tiles 0 .. STAGES-1 in flight; a masked or out-of-pool row is never read (the copy
        # fills zeros) and its score is -inf.
        for u in gl.static_range(STAGES):
            _fw_copy(
                kv,
                _fg_slots(table, base, lo + u * BN, hi, n_slots, PS, r_cp),
                _fg_slots(table, base, lo + u * BN, hi, n_slots, PS, r_pe),
                stride_kv,
                D,
                kv_st.index(u),
                pe_st.index(u),
                c_cp,
                c_pe,
            )
        # The page indices are loaded a step before their use (a dependent global load
        # per step otherwise stalls the CTA, the only one on its SM).
        nxt = _fg_slots(table, base, lo + STAGES * BN, hi, n_slots, PS, r_cp)
        nxt_pe = _fg_slots(table, base, lo + STAGES * BN, hi, n_slots, PS, r_pe)

        rows = g * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_l))
        limit = kv_len - TQ + rows // H  # causal: query t sees positions <= limit
        rs = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([BM, D], gl.float32, o_l)
        zs = gl.zeros([BM, BN], gl.float32, s_l)
        cur_s = _fg_slots(table, base, lo, hi, n_slots, PS, rs)
        for t in range(n_steps):
            st = t % STAGES
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()
            _fw_convert(kv_st.index(st), pe_st.index(st), k_s, kpe_s, Q4, cv_l, cpe_l)
            if LEAN:  # one barrier: the tile's stores fenced for wgmma, stage st free
                fence_async_shared()
            gl.thread_barrier()  # every thread done reading stage st before it refills
            _fw_copy(
                kv,
                nxt,
                nxt_pe,
                stride_kv,
                D,
                kv_st.index(st),
                pe_st.index(st),
                c_cp,
                c_pe,
            )
            nxt = _fg_slots(
                table, base, lo + (t + STAGES + 1) * BN, hi, n_slots, PS, r_cp
            )
            nxt_pe = _fg_slots(
                table, base, lo + (t + STAGES + 1) * BN, hi, n_slots, PS, r_pe
            )
            if not LEAN:
                fence_async_shared()  # the generic stores above, before wgmma's async reads
                gl.thread_barrier()
            sc = wgmma(q_s, k_s.permute((1, 0)), zs, use_acc=False, is_async=True)
            if SPLIT_PE:
                sp = wgmma(
                    qpe_s, kpe_s.permute((1, 0)), zs, use_acc=False, is_async=True
                )
                sc, sp = wgmma_wait(0, deps=(sc, sp))
                sc = sc * ckv + sp * kpe
            else:
                sc = wgmma(qpe_s, kpe_s.permute((1, 0)), sc, is_async=True)
                sc = wgmma_wait(0, deps=(sc,))
            pos = lo + t * BN + rs
            keep = (cur_s >= 0)[None, :]
            cur_s = _fg_slots(table, base, lo + (t + 1) * BN, hi, n_slots, PS, rs)
            if CAUSAL:
                keep = keep & (pos[None, :] <= limit[:, None])
            sc = gl.where(keep, sc * qk_scale, float("-inf"))
            m_new, alpha, p, l_i = _fg_online(m_i, l_i, sc)
            p16 = gl.convert_layout(p.to(gl.float16), p_l)
            al = gl.convert_layout(alpha, gl.SliceLayout(1, o_l))
            acc = wgmma(p16, k_s, acc * al[:, None], is_async=True)
            acc = wgmma_wait(0, deps=(acc,))
            m_i = m_new
            if (
                not LEAN
            ):  # LEAN: the next step's first barrier, after each PV's wait, does it
                gl.thread_barrier()  # both warpgroups past the f16 tile before it is rewritten
        async_copy.wait_group(0)

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

    return _fused_wgmma_split_kernel
