"""A part of the kvpatch runtime: the fused FP8 MLA attention's launcher: fused_mla, its tuning and scratch.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import os

import torch

from kvpatch.runtime._fused_kernels import (
    _fused_build,
    _fused_sm_count,
    _fused_split_count,
)
from kvpatch.runtime._fused_gluon import _fused_gluon_choice
from kvpatch.runtime._fused_wgmma import _fused_wgmma_choice
from kvpatch.runtime._fused_scratch import (
    FUSED_F16_PARTIALS,
    _fused_scale_key,
    _fused_scale_tensor,
    _fused_scratch_for,
)
from kvpatch.runtime._launch import _launch, _launch_ident

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: the launcher

# Launch constants per (query rows per request x heads) bucket, from benchmarks/bench_fused.py's
# sweep. block_m: query rows a program holds (heads x draft tokens); block_n: KV positions a
# step; ctas_per_sm: the grid the split count aims at; min_split: fewest positions a split
# takes; splits_down: that count rounded down; qk_acc: independent QK accumulator chains.
FUSED_TUNING = {
    "small": {
        "block_m": 16,
        "block_n": 64,
        "num_warps": 4,
        "num_stages": 2,
        "ctas_per_sm": 2,
        "min_split": 64,
        "f16": True,
        "pv_asm": True,
        "qk_acc": 2,
        "splits_down": True,
    },
    "large": {
        "block_m": 32,
        "block_n": 32,
        "num_warps": 4,
        "num_stages": 2,
        "ctas_per_sm": 3,
        "min_split": 128,
        "f16": True,
        "pv_asm": True,
    },
}  # best of GPU runs 16, 18, 22 (H100, notes/gpu-runs.md): f16 dots, PV by inline asm; small:
# two QK chains, splits from 64 positions (1 x 4k 17.3 us against 21.0 at 128)

# The combine's tile: SB splits x DB columns, at most this many fp32 values (64 registers a
# thread at 4 warps). Few splits: a program merges a whole row (no more programs than rows,
# which a large batch has many of: GPU run 22 lost 5-20 us to 4x the programs); many
# splits (a small batch): the row in column blocks, all of a block's splits in one read.
_FUSED_COMBINE_TILE = 8192

_fused_plans = {}  # a call's geometry -> its launch plan (see fused_mla)
# the compiled kernels of the last call (benchmarks read registers, spills)
_fused_last = {}


def _fused_combine_tile(n_splits, d):
    """The combine's (SB, DB): the splits read at once (a power of two, at most 64) and
    the columns a program merges."""
    sb = min(64, 1 << max(0, n_splits - 1).bit_length())
    return sb, min(d, _FUSED_COMBINE_TILE // sb)


def _fused_bucket(m_rows):
    return "small" if m_rows <= 16 else "large"


def fused_mla(
    q_nope,
    q_pe,
    kv_buffer,
    out,
    sm_scale,
    *,
    kv_indptr=None,
    kv_indices=None,
    page_table=None,
    cache_seqlens=None,
    page_size=1,
    q_per_request=1,
    causal=False,
    ckv_scale=None,
    kpe_scale=None,
    n_splits=None,
    config=None,
):
    """out[b*T + t, h] = MLA attention of query (b, t, h) over request b's rows, read as FP8.

    q_nope [B*T, H, 512] and q_pe [B*T, H, 64] (bf16, last dim contiguous); kv_buffer the
    FP8 pool, [slots, 1, 576] or [pages, page_size, 1, 576] (rows of 512 latent + 64 rope);
    out [B*T, H, 512], written. Rows come from (kv_indptr, kv_indices) or from
    (page_table, cache_seqlens), with page_size slots per index. T = q_per_request query
    tokens per request; causal masks query t to positions <= len - T + t. ckv_scale /
    kpe_scale: None, a float, or a one-element device tensor (FP8 dequant scales of the
    latent and rope parts; the latent scale also scales the output, V being the latent).
    Returns out. Graph-safe: no allocation after the first call per shape, no host sync.
    """
    by_indptr = kv_indices is not None
    table = kv_indices if by_indptr else page_table
    lens = kv_indptr if by_indptr else cache_seqlens
    # Everything the plan's checks and launch constants depend on; the call's own values
    # (addresses, sm_scale, tensor scales) are read per call. Host time per eager call is
    # the point: the checks run once per geometry, not per call.
    key = (
        q_nope.shape,
        q_nope.stride(),
        q_pe.shape,
        q_pe.stride(),
        out.shape,
        out.stride(),
        kv_buffer.shape,
        kv_buffer.stride(),
        table.shape,
        table.stride(),
        lens.shape,
        (q_nope.dtype, q_pe.dtype, kv_buffer.dtype, out.dtype, table.dtype, lens.dtype),
        kv_buffer.device,
        by_indptr,
        page_size,
        q_per_request,
        causal,
        n_splits,
        _fused_scale_key(ckv_scale),
        _fused_scale_key(kpe_scale),
    )
    plan = _fused_plans.get(key) if config is None else None
    if plan is None or plan["tuning"] is not FUSED_TUNING[plan["bucket"]]:
        plan = _fused_plan(q_nope, q_pe, kv_buffer, out, table, key, config)
        if config is None:
            _fused_plans[key] = plan
    # One alignment class for every caller tensor: all 16-byte aligned (the usual case)
    # is the plan's own binary; any other goes through the full per-argument key.
    ptrs = (
        q_nope.data_ptr(),
        q_pe.data_ptr(),
        kv_buffer.data_ptr(),
        table.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
    )
    aligned = not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5]) & 15
    ckv_t = ckv_scale if plan["ckv_tensor"] else plan["ckv_t"]
    kpe_t = kpe_scale if plan["kpe_tensor"] else plan["kpe_t"]
    part_o, part_lse = plan["scratch"]
    p_o, p_lse = plan["scratch_ptrs"]
    if plan["direct"]:
        part_o, p_o = out, ptrs[5]
    if ckv_t is None:
        ckv_t = part_lse  # not read (HAS_CKV_SCALE off): any valid pointer
    if kpe_t is None:
        kpe_t = part_lse
    spec = split_ptrs = None
    if aligned and plan["ident"] is not None:
        p_ckv, p_kpe = ckv_t.data_ptr(), kpe_t.data_ptr()
        spec = (plan["ident"], not p_ckv & 15, not p_kpe & 15)
        # The pointers as ints once the binary is cached: only for CUDA tensors, which
        # Triton's launcher would have checked (a CPU tensor gets its error from there).
        # kv_buffer's device is in the plan key: a CPU pool's plan never launched.
        if (
            plan["flat"]
            and q_nope.is_cuda
            and q_pe.is_cuda
            and table.is_cuda
            and lens.is_cuda
            and out.is_cuda
            and ckv_t.is_cuda
            and kpe_t.is_cuda
        ):
            split_ptrs = (
                ptrs[:5]
                + (p_o, p_lse, p_ckv, p_kpe, float(sm_scale))
                + plan["split_ints"]
            )
    _fused_last["split"] = _launch(
        plan["split_k"],
        plan["split_grid"],
        (
            q_nope,
            q_pe,
            kv_buffer,
            table if plan["flat"] else table.reshape(-1),
            lens,
            part_o,
            part_lse,
            ckv_t,
            kpe_t,
            float(sm_scale),
        )
        + plan["split_ints"],
        plan["split_consts"],
        spec,
        split_ptrs,
    )
    if not plan["direct"]:
        _fused_last["combine"] = _launch(
            plan["combine_k"],
            plan["combine_grid"],
            (part_o, part_lse, lens, out, ckv_t) + plan["combine_ints"],
            plan["combine_consts"],
            spec,
            split_ptrs and (p_o, p_lse, ptrs[4], ptrs[5], p_ckv) + plan["combine_ints"],
        )
    return out


def _fused_plan(q_nope, q_pe, kv_buffer, out, table, key, config):
    """The checks and launch constants of one call geometry (fused_mla's plan)."""
    by_indptr, page_size, q_per_request, causal, n_splits = key[13:18]
    n_tok, heads, d = q_nope.shape
    dpe = q_pe.shape[-1]
    tq = int(q_per_request)
    if n_tok % tq:
        raise ValueError("fused_mla: query rows are not a multiple of q_per_request")
    batch = n_tok // tq
    width = kv_buffer.shape[-1]
    # The kernels' FP8 -> f16 conversions are e4m3's (an e5m2 pool would read wrong).
    if width != d + dpe or kv_buffer.dtype != torch.float8_e4m3fn:
        raise ValueError(
            "fused_mla: pool rows must be float8_e4m3fn, %d + %d wide (got %s, %d)"
            % (d, dpe, kv_buffer.dtype, width)
        )
    kv2 = kv_buffer.view(-1, width)
    if d % 4 or (d // 4) & (d // 4 - 1):
        raise ValueError(
            "fused_mla: the latent width must be 4 x a power of two (MLA: 512)"
        )
    if (
        kv2.stride(1) != 1
        or q_nope.stride(2) != 1
        or q_pe.stride(2) != 1
        or out.stride(2) != 1
    ):
        raise ValueError("fused_mla: last dims must be contiguous")
    if by_indptr:
        flat, table_stride = table.is_contiguous(), 0
    else:
        flat, table_stride = True, table.stride(0)
        if table.stride(1) != 1:
            raise ValueError("fused_mla: page_table rows must be contiguous")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    kernels = _fused_build()
    if not kernels:
        raise RuntimeError("fused_mla needs Triton")
    split_k, combine_k = kernels
    m_rows = tq * heads
    bucket = _fused_bucket(m_rows)
    tuning = FUSED_TUNING[bucket]
    cfg = dict(tuning, **(config or {}))
    block_m = cfg["block_m"]
    if not cfg.get(
        "pad_m"
    ):  # pad_m: keep block_m above the rows (a Triton wgmma probe)
        block_m = min(block_m, max(16, 1 << (m_rows - 1).bit_length()))
    groups = -(-m_rows // block_m)
    ckv_key, kpe_key = key[18:20]
    ckv_tensor, kpe_tensor = isinstance(ckv_key, tuple), isinstance(kpe_key, tuple)
    ckv_t = None if ckv_tensor else _fused_scale_tensor(ckv_key, kv2.device)
    kpe_t = None if kpe_tensor else _fused_scale_tensor(kpe_key, kv2.device)
    has_ckv, has_kpe = ckv_tensor or ckv_t is not None, kpe_tensor or kpe_t is not None
    # The Gluon kernels where they serve (runtime parts _fused_gluon, _fused_wgmma), each
    # with its own tuning; the 64-row one with its own row groups.
    gluon = _fused_gluon_choice(
        (heads, tq, d, dpe, flat, interpret, kv2.device, cfg, n_splits, batch * groups),
        (page_size, by_indptr, has_ckv, has_kpe),
    ) or _fused_wgmma_choice(
        (m_rows, d, dpe, flat, interpret, kv2.device, cfg, n_splits, batch),
        (page_size, by_indptr, causal, has_ckv, has_kpe, heads, tq),
    )
    if gluon:
        split_k, cfg, n_splits = gluon[:3]
        groups = -(-m_rows // gluon[4])
    if n_splits is None:
        n_splits = _fused_split_count(
            _fused_sm_count(kv2.device) * cfg["ctas_per_sm"],
            batch * groups,
            cfg.get("splits_down", False),
        )
    # One split: the split kernel writes the output itself (no combine launch).
    direct = n_splits == 1 and cfg.get("direct", True)
    comb_sb, comb_db = _fused_combine_tile(n_splits, d)
    # A cached plan's ident stands for its constants in the launch key (a one-off config's
    # plan is not cached and has none: the launch keys on its constants).
    ident = _launch_ident("fused") if config is None else None
    part16 = bool(cfg.get("f16_partials", FUSED_F16_PARTIALS))
    scratch = _fused_scratch_for(
        kv2.device, 1 if direct else batch * m_rows * n_splits, d, part16
    )
    if gluon:
        split_consts = gluon[3] + (("PART16", part16),)
    else:
        split_consts = tuple(
            dict(
                H=heads,
                TQ=tq,
                D=d,
                DPE=dpe,
                PS=int(page_size),
                BY_INDPTR=by_indptr,
                CAUSAL=bool(causal) and tq > 1,
                HAS_CKV_SCALE=has_ckv,
                HAS_KPE_SCALE=has_kpe,
                BLOCK_M=block_m,
                BLOCK_N=cfg["block_n"],
                DOT_F32=interpret,
                F16=bool(cfg.get("f16", False)),
                PV_ASM=bool(cfg.get("pv_asm", False)) and not interpret,
                V_EARLY=int(cfg.get("v_early", 0)) if not interpret else 0,
                QK_ACC=int(cfg.get("qk_acc", 1)),
                DIRECT=direct,
                PART16=part16,
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
                **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
            ).items()
        )
    return {
        "ident": ident,
        "bucket": bucket,
        "tuning": tuning,
        "flat": flat,
        "ckv_tensor": ckv_tensor,
        "kpe_tensor": kpe_tensor,
        "ckv_t": ckv_t,
        "kpe_t": kpe_t,
        "direct": direct,
        "scratch": scratch,
        "scratch_ptrs": (scratch[0].data_ptr(), scratch[1].data_ptr()),
        "split_k": split_k,
        "split_grid": (batch, n_splits, groups),
        # After sm_scale: the strides, the pool's slot count, the split count, min_split.
        "split_ints": (
            out.stride(0),
            out.stride(1),
            q_nope.stride(0),
            q_nope.stride(1),
            q_pe.stride(0),
            q_pe.stride(1),
            kv2.stride(0),
            table_stride,
            kv2.shape[0],
            n_splits,
            cfg["min_split"],
        ),
        "split_consts": split_consts,
        "combine_k": combine_k,
        "combine_grid": (batch * m_rows, d // comb_db),
        "combine_ints": (out.stride(0), out.stride(1), n_splits, cfg["min_split"]),
        "combine_consts": tuple(
            dict(
                H=heads,
                TQ=tq,
                D=d,
                PS=int(page_size),
                BY_INDPTR=by_indptr,
                BLOCK_N=cfg["block_n"],
                SB=comb_sb,
                DB=comb_db,
                APPLY_CKV=has_ckv and part16,
                num_warps=4,
            ).items()
        ),
    }
