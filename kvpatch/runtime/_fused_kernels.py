"""A part of the kvpatch runtime: the fused FP8 MLA attention's Triton kernels (issue 17).

The device functions they call are the part before, _fused_ops; the launcher, its
tuning and its scratch buffers the next part, _fused.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import torch

from kvpatch.runtime._fused_ops import (  # globals once _fused_build_ops has run
    _fused_amax,
    _fused_build_ops,
    _fused_q,
    _fused_rows,
    _fused_store,
    _fused_vcvt,
    _fused_vraw,
    _fused_vrows,
)

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention, the kernels: they read the FP8 latent pool in place (issue 17).
# The gathered cast moves 576 B (FP8 read) + 1,152 B (bf16 write) + 1,152 B (the kernel's
# bf16 read) a row; this kernel reads each row's 576 FP8 bytes and dequantises them in
# registers. Rows come through the index structures the original kernel is given:
# FlashInfer's kv_indptr / kv_indices (page_size slots an index), or a page_table with
# cache_seqlens (FA3/FA4, MUSA, XPU). Lengths are read on the device: a CUDA graph replays
# correctly with more or fewer rows than at capture. Split-KV: stage 1 runs a program per
# (request, split, query-row group) over a contiguous share of the request's positions, the
# share derived from the device length (a short request leaves programs idle); stage 2
# merges the splits by log-sum-exp. Boundaries depend only on the lengths: bit-identical runs.
#
# Numerics: FP8 -> f16 is exact (one cvt a pair of values); f16 dots with fp32 accumulation,
# q scaled into f16's range by a power of two (exact), fp32 softmax (base 2), P rounded to
# f16 for the PV dot, fp32 partials. bf16 dots (config f16=False) round as FlashInfer and
# FA3 do. Masked or out-of-pool rows are never loaded: poison outside the rows read cannot
# leak.

# (split kernel, combine kernel), built on first use; False: no Triton
_fused_kernels = None


def _fused_build():
    global _fused_kernels
    if _fused_kernels is not None:
        return _fused_kernels
    try:
        import triton
        import triton.language as tl
    except Exception:
        _fused_kernels = False
        return _fused_kernels
    _fused_build_ops(triton, tl)

    @triton.jit(do_not_specialize=["n_splits", "n_slots", "table_stride", "min_split"])
    def _fused_split_kernel(
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
        stride_o_t,
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
        H: tl.constexpr,
        TQ: tl.constexpr,
        D: tl.constexpr,
        DPE: tl.constexpr,
        PS: tl.constexpr,
        BY_INDPTR: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_CKV_SCALE: tl.constexpr,
        HAS_KPE_SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_F32: tl.constexpr,
        F16: tl.constexpr,
        PV_ASM: tl.constexpr,
        V_EARLY: tl.constexpr,
        QK_ACC: tl.constexpr,
        DIRECT: tl.constexpr,
        PART16: tl.constexpr,
    ):
        # The latent (D = 4 x C) is handled in four column chunks, each its own operand
        # and accumulator: a whole [BLOCK_N, 512] bf16 tile as one dot operand pinned
        # 255 registers a thread and one CTA per SM (H200 sweep, notes/gpu-runs.md).
        # The PV chunks reload their rows so one chunk is live at a time. The two loads of
        # a chunk carry different eviction hints on purpose: identical loads are merged
        # by CSE, which kept the four chunks live in registers from QK to PV (255 a
        # thread, spills) and left them synchronous. Kept apart, each load has one dot
        # as its user, and the pipeliner stages it through shared memory (cp.async).
        # DOT_F32: Triton's interpreter (CPU tests) multiplies bf16 operands as raw bits,
        # so there the dots take the same bf16 values widened to fp32.
        C: tl.constexpr = D // 4
        # V_EARLY 2 gives V's load QK's hint, so the two loads are one (merged by CSE).
        V_HINT: tl.constexpr = "evict_last" if V_EARLY == 2 else "evict_first"
        b = tl.program_id(0)
        s = tl.program_id(1)
        g = tl.program_id(2)
        if BY_INDPTR:
            first = tl.load(lens + b)
            kv_len = (tl.load(lens + b + 1) - first) * PS
            base = first.to(tl.int64)
        else:
            kv_len = tl.load(lens + b)
            base = b.to(tl.int64) * table_stride
        kv_len = tl.maximum(kv_len, 0)
        # The split's share: a multiple of BLOCK_N, at least min_split positions.
        per = (
            tl.cdiv(tl.maximum(tl.cdiv(kv_len, n_splits), min_split), BLOCK_N) * BLOCK_N
        )
        lo = s * per
        hi = tl.minimum(lo + per, kv_len)
        # DIRECT (one split): part_o is the output itself and no stage 2 runs, so a request
        # with no rows still writes its zeros; with splits, stage 2 skips an idle one.
        if not DIRECT and lo >= hi:
            return
        m = g * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < TQ * H
        t = m // H
        h = m % H
        qrow = (b * TQ + t).to(tl.int64)
        c = tl.arange(0, C)
        dp = tl.arange(0, DPE)
        qn_rows = qrow[:, None] * stride_qn_t + h[:, None] * stride_qn_h
        qp_rows = qrow[:, None] * stride_qp_t + h[:, None] * stride_qp_h
        qk_scale = sm_scale * 1.4426950408889634
        q_mul = 1.0
        if F16:
            # f16 dots: FP8 -> f16 is one instruction a pair, and f16 keeps more bits than
            # bf16; q (bf16) may exceed f16's range, so it is scaled by a power of two that
            # puts its largest value at most 2^15 (exact), and the scores are scaled back.
            amax = tl.maximum(
                _fused_amax(q_nope, qn_rows, tl.arange(0, D), m_ok),
                _fused_amax(q_pe, qp_rows, dp, m_ok),
            )
            e = tl.ceil(tl.log2(tl.maximum(amax, 1e-30))).to(tl.int32) - 14
            e = tl.minimum(tl.maximum(e, -100), 100)
            q_mul = ((127 - e) << 23).to(
                tl.float32, bitcast=True
            )  # 2^-e, built exactly
            qk_scale = qk_scale * ((127 + e) << 23).to(tl.float32, bitcast=True)
        q0 = _fused_q(q_nope, qn_rows, c, m_ok, q_mul, DOT_F32, F16)
        q1 = _fused_q(q_nope, qn_rows, C + c, m_ok, q_mul, DOT_F32, F16)
        q2 = _fused_q(q_nope, qn_rows, 2 * C + c, m_ok, q_mul, DOT_F32, F16)
        q3 = _fused_q(q_nope, qn_rows, 3 * C + c, m_ok, q_mul, DOT_F32, F16)
        qp = _fused_q(q_pe, qp_rows, dp, m_ok, q_mul, DOT_F32, F16)
        ckv = 1.0
        if HAS_CKV_SCALE:
            ckv = tl.load(ckv_scale).to(tl.float32)
        kpe = 1.0
        if HAS_KPE_SCALE:
            kpe = tl.load(kpe_scale).to(tl.float32)
        limit = (
            kv_len - TQ + t
        )  # causal: query t sees positions <= limit (bottom-right aligned)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, C], tl.float32)
        acc1 = tl.zeros([BLOCK_M, C], tl.float32)
        acc2 = tl.zeros([BLOCK_M, C], tl.float32)
        acc3 = tl.zeros([BLOCK_M, C], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            ok = pos < hi
            page = tl.load(table + base + pos // PS, mask=ok, other=0).to(tl.int64)
            slot = page * PS + pos % PS
            ok = ok & (slot >= 0) & (slot < n_slots)  # never read outside the pool
            row = kv + slot[:, None] * stride_kv
            if V_EARLY:
                v0 = _fused_vraw(row, c, ok, V_HINT)
                v1 = _fused_vraw(row, C + c, ok, V_HINT)
                v2 = _fused_vraw(row, 2 * C + c, ok, V_HINT)
                v3 = _fused_vraw(row, 3 * C + c, ok, V_HINT)
            # QK_ACC 2: two independent accumulators over the four latent chunks. One
            # chains 32 dependent MMAs a step (8 k-steps a chunk), latency a lone CTA pays
            # in full at small batch; two halve the chain. (Four fold back to two: Triton
            # turns add(dot(a, b, 0), c) into dot(a, b, c).)
            qa = tl.dot(
                q0, tl.trans(_fused_rows(row, c, ok, DOT_F32, "evict_last", F16))
            )
            qa = tl.dot(
                q1,
                tl.trans(_fused_rows(row, C + c, ok, DOT_F32, "evict_last", F16)),
                qa,
            )
            qb = qa
            if QK_ACC == 2:
                qb = tl.zeros_like(qa)
            qb = tl.dot(
                q2,
                tl.trans(_fused_rows(row, 2 * C + c, ok, DOT_F32, "evict_last", F16)),
                qb,
            )
            qk = tl.dot(
                q3,
                tl.trans(_fused_rows(row, 3 * C + c, ok, DOT_F32, "evict_last", F16)),
                qb,
            )
            if QK_ACC == 2:
                qk = qa + qk
            if HAS_CKV_SCALE:
                qk = qk * ckv
            qpe = tl.dot(
                qp, tl.trans(_fused_rows(row, D + dp, ok, DOT_F32, "evict_last", F16))
            )
            if HAS_KPE_SCALE:
                qpe = qpe * kpe
            qk = (qk + qpe) * qk_scale
            keep = ok[None, :]
            if CAUSAL:
                keep = keep & (pos[None, :] <= limit[:, None])
            qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(
                m_new == float("-inf"), 0.0, m_new
            )  # a row with nothing seen yet
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if F16:
                pb = p.to(tl.float16)
            else:
                pb = p.to(tl.bfloat16)
            if DOT_F32:
                pb = pb.to(tl.float32)
            acc0 = tl.dot(
                pb,
                (
                    _fused_vcvt(v0, F16)
                    if V_EARLY
                    else _fused_vrows(row, c, ok, DOT_F32, F16, PV_ASM)
                ),
                acc0 * alpha[:, None],
            )
            acc1 = tl.dot(
                pb,
                (
                    _fused_vcvt(v1, F16)
                    if V_EARLY
                    else _fused_vrows(row, C + c, ok, DOT_F32, F16, PV_ASM)
                ),
                acc1 * alpha[:, None],
            )
            acc2 = tl.dot(
                pb,
                (
                    _fused_vcvt(v2, F16)
                    if V_EARLY
                    else _fused_vrows(row, 2 * C + c, ok, DOT_F32, F16, PV_ASM)
                ),
                acc2 * alpha[:, None],
            )
            acc3 = tl.dot(
                pb,
                (
                    _fused_vcvt(v3, F16)
                    if V_EARLY
                    else _fused_vrows(row, 3 * C + c, ok, DOT_F32, F16, PV_ASM)
                ),
                acc3 * alpha[:, None],
            )
            m_i = m_new
        seen = l_i > 0.0
        if PART16:  # the latent's scale: the combine's, or DIRECT's below
            inv = 1.0 / tl.where(seen, l_i, 1.0)
        else:  # V is the latent: its scale scales the output
            inv = ckv / tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        if DIRECT:
            # The combine of one split is o * 2^0 / 1: the same rounding, one launch fewer
            # (eager batches above the graph sizes: host time is the cost there).
            dst = (
                part_o
                + qrow[:, None] * stride_o_t
                + h[:, None] * stride_o_h
                + c[None, :]
            )
            post = ckv
        else:
            prow = (b * TQ * H + m).to(tl.int64) * n_splits + s
            dst = part_o + prow[:, None] * D + c[None, :]
            tl.store(part_lse + prow, lse, mask=m_ok)
            post = 1.0
        okm = m_ok[:, None]
        _fused_store(dst, acc0, inv, post, okm, PART16)
        _fused_store(dst + C, acc1, inv, post, okm, PART16)
        _fused_store(dst + 2 * C, acc2, inv, post, okm, PART16)
        _fused_store(dst + 3 * C, acc3, inv, post, okm, PART16)

    @triton.jit(do_not_specialize=["n_splits", "min_split"])
    def _fused_combine_kernel(
        part_o,
        part_lse,
        lens,
        out,
        ckv_scale,
        stride_o_t,
        stride_o_h,
        n_splits,
        min_split,
        H: tl.constexpr,
        TQ: tl.constexpr,
        D: tl.constexpr,
        PS: tl.constexpr,
        BY_INDPTR: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SB: tl.constexpr,
        DB: tl.constexpr,
        APPLY_CKV: tl.constexpr,
    ):
        # One program a (query row, DB-wide column block). The splits' partials are read
        # SB at a time as one tile, all loads in flight together. A loop of one split an
        # iteration waited an L2 round trip per split, 32 of them at 1 x 4k: the one read
        # took the fused layer's fixed cost from 12.3 to 8.5 us (GPU run 22, H100).
        r = tl.program_id(0)  # (b, t, h) flattened
        d0 = tl.program_id(1) * DB
        b = r // (TQ * H)
        th = r % (TQ * H)
        t = th // H
        h = th % H
        if BY_INDPTR:
            kv_len = (tl.load(lens + b + 1) - tl.load(lens + b)) * PS
        else:
            kv_len = tl.load(lens + b)
        kv_len = tl.maximum(kv_len, 0)
        per = (
            tl.cdiv(tl.maximum(tl.cdiv(kv_len, n_splits), min_split), BLOCK_N) * BLOCK_N
        )
        live = tl.cdiv(kv_len, per)
        # Columns in runs of 4 (4 values a thread): the warps lie along the row for f16
        # partials too. Runs of 8 put them on two splits, summed through shared memory:
        # GPU run 50's f16 combine took 1.4-2.5x the fp32 one (tools/fused_aot.py --combine).
        dn = d0 + (tl.arange(0, DB) // 4) * 4 + tl.arange(0, DB) % 4
        sb = tl.arange(0, SB)
        base = r.to(tl.int64) * n_splits
        m_run = float("-inf")
        l_run = 0.0
        acc = tl.zeros([DB], tl.float32)
        for s0 in range(0, live, SB):
            s_ok = s0 + sb < live
            lse = tl.load(part_lse + base + s0 + sb, mask=s_ok, other=float("-inf"))
            o = tl.load(
                part_o + (base + s0 + sb)[:, None] * D + dn[None, :],
                mask=s_ok[:, None],
                other=0.0,
            )
            m_new = tl.maximum(m_run, tl.max(lse, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_run - m_use)
            w = tl.exp2(lse - m_use)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            l_run = l_run * alpha + tl.sum(w, 0)
            m_run = m_new
        res = acc / tl.where(l_run > 0.0, l_run, 1.0)
        if APPLY_CKV:  # f16 partials leave the latent's scale here (FUSED_F16_PARTIALS)
            res = res * tl.load(ckv_scale).to(tl.float32)
        dst = out + (b * TQ + t).to(tl.int64) * stride_o_t + h * stride_o_h + dn
        tl.store(dst, res.to(out.dtype.element_ty))

    _fused_kernels = (_fused_split_kernel, _fused_combine_kernel)
    return _fused_kernels


# The grid: the split kernel derives each split's share from n_splits on the device; the host
# picks n_splits from the batch alone (the lengths stay on the device).
def _fused_split_count(target, programs, down):
    """Splits a request gets so the grid (programs x splits) meets target, the lengths
    unknown on the host. Rounded down (small bucket) the grid stays within one wave of
    equal programs; rounded up, 128 x 1k at 16 heads launched 3 splits, 384 programs for
    264 slots (80.5 us against 66.6 for 2; 64 x 8k 298.6 against 198.4: GPU run 24)."""
    programs = max(1, programs)
    n = target // programs if down else -(-target // programs)
    return max(1, min(64, n))


def _fused_sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count
