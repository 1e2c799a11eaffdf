"""A part of the kvpatch runtime: the fused FP8 MLA attention's launcher: fused_mla, its tuning and scratch.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import os

import torch

from kvpatch.runtime._fused_kernels import _fused_build

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: the launcher

# Launch constants per (query rows per request x heads) bucket; the H200 sweep of
# benchmarks/bench_fused.py picks them. block_m: query rows a program holds (heads x
# draft tokens); block_n: KV positions per step; ctas_per_sm: the grid the split count
# aims at; min_split: fewest positions a split takes before more splits pay.
FUSED_TUNING = {
    "small": {
        "block_m": 16,
        "block_n": 32,
        "num_warps": 4,
        "num_stages": 3,
        "maxnreg": 168,
        "ctas_per_sm": 2,
        "min_split": 128,
        "f16": False,
    },
    "large": {
        "block_m": 32,
        "block_n": 32,
        "num_warps": 4,
        "num_stages": 2,
        "ctas_per_sm": 3,
        "min_split": 128,
        "f16": False,
    },
}  # best of the H200 sweep, GPU run 15 (notes/gpu-runs.md); f16 dots are not measured on a GPU yet

_fused_scratch = {}  # (device, rows, splits) -> (partial out fp32, partial lse fp32)


def _fused_bucket(m_rows):
    return "small" if m_rows <= 16 else "large"


def _fused_scratch_for(device, rows, splits, width):
    key = (device, rows, splits, width)
    bufs = _fused_scratch.get(key)
    if bufs is None:
        # Never read before written: stage 2 reads only the splits stage 1 wrote.
        bufs = (
            torch.empty((rows * splits, width), dtype=torch.float32, device=device),
            torch.empty((rows * splits,), dtype=torch.float32, device=device),
        )
        _fused_scratch[key] = bufs
    return bufs


def _fused_sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


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
    n_tok, heads, d = q_nope.shape
    dpe = q_pe.shape[-1]
    tq = int(q_per_request)
    if n_tok % tq:
        raise ValueError("fused_mla: query rows are not a multiple of q_per_request")
    batch = n_tok // tq
    width = kv_buffer.shape[-1]
    if width != d + dpe:
        raise ValueError(
            "fused_mla: pool rows are %d wide, q has %d + %d" % (width, d, dpe)
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
    by_indptr = kv_indices is not None
    if by_indptr:
        table, lens, table_stride = kv_indices.reshape(-1), kv_indptr, 0
    else:
        table, lens, table_stride = page_table, cache_seqlens, page_table.stride(0)
        if page_table.stride(1) != 1:
            raise ValueError("fused_mla: page_table rows must be contiguous")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    kernels = _fused_build()
    if not kernels:
        raise RuntimeError("fused_mla needs Triton")
    split_k, combine_k = kernels
    m_rows = tq * heads
    cfg = dict(FUSED_TUNING[_fused_bucket(m_rows)], **(config or {}))
    block_m = min(cfg["block_m"], max(16, 1 << (m_rows - 1).bit_length()))
    groups = -(-m_rows // block_m)
    if n_splits is None:
        target = _fused_sm_count(kv2.device) * cfg["ctas_per_sm"]
        n_splits = max(1, min(64, -(-target // max(1, batch * groups))))
    part_o, part_lse = _fused_scratch_for(kv2.device, batch * m_rows, n_splits, d)
    ckv_t = _fused_scale_tensor(ckv_scale, kv2.device)
    kpe_t = _fused_scale_tensor(kpe_scale, kv2.device)
    _fused_last["split"] = _fused_launch(
        split_k,
        (batch, n_splits, groups),
        q_nope,
        q_pe,
        kv2,
        table,
        lens,
        part_o,
        part_lse,
        ckv_t if ckv_t is not None else part_lse,
        kpe_t if kpe_t is not None else part_lse,
        float(sm_scale),
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv2.stride(0),
        table_stride,
        kv2.shape[0],
        n_splits,
        cfg["min_split"],
        H=heads,
        TQ=tq,
        D=d,
        DPE=dpe,
        PS=int(page_size),
        BY_INDPTR=by_indptr,
        CAUSAL=bool(causal) and tq > 1,
        HAS_CKV_SCALE=ckv_t is not None,
        HAS_KPE_SCALE=kpe_t is not None,
        BLOCK_M=block_m,
        BLOCK_N=cfg["block_n"],
        DOT_F32=interpret,
        F16=bool(cfg.get("f16", False)),
        PV_ASM=bool(cfg.get("pv_asm", False)) and not interpret,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    _fused_last["combine"] = _fused_launch(
        combine_k,
        (batch * m_rows,),
        part_o,
        part_lse,
        lens,
        out,
        out.stride(0),
        out.stride(1),
        n_splits,
        cfg["min_split"],
        H=heads,
        TQ=tq,
        D=d,
        PS=int(page_size),
        BY_INDPTR=by_indptr,
        BLOCK_N=cfg["block_n"],
        num_warps=4,
    )
    return out


# Launches after the first of a kind skip Triton's per-call binder (tens of µs of host
# time in eager mode): the compiled kernel is kept under a key that holds everything its
# binary depends on (constexprs, options, each tensor's dtype and 16-byte alignment, each
# int's ==1 / %16 class, the device), and its launcher is called directly.
_fused_compiled = {}


def _fused_spec(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0)
    return type(a)


def _fused_launch(kernel, grid, *args, **kw):
    import triton

    hooks = triton.knobs.runtime
    if hooks.launch_enter_hook is not None or hooks.launch_exit_hook is not None:
        return kernel[grid](*args, **kw)  # a profiler listens: Triton's own path
    dev = args[0].device
    key = (kernel, dev, tuple(_fused_spec(a) for a in args), tuple(kw.items()))
    ck = _fused_compiled.get(key)
    if ck is None:
        ck = kernel[grid](*args, **kw)
        if hasattr(ck, "packed_metadata"):  # not the interpreter
            _fused_compiled[key] = ck
        return ck
    names = kernel.arg_names
    stream = triton.runtime.driver.active.get_current_stream(dev.index)
    g = tuple(grid) + (1,) * (3 - len(grid))
    ck.run(
        g[0],
        g[1],
        g[2],
        stream,
        ck.function,
        ck.packed_metadata,
        None,
        None,
        None,
        *args,
        *[kw[n] for n in names[len(args) :]],
    )
    return ck


_fused_scales = {}
_fused_last = (
    {}
)  # the compiled kernels of the last call (benchmarks read registers, spills)


def _fused_scale_tensor(sc, device):
    """None for no scale (None or 1.0), else a one-element device tensor (a float's made once)."""
    if sc is None or isinstance(sc, torch.Tensor):
        return sc
    sc = float(sc)
    if sc == 1.0:
        return None
    t = _fused_scales.get((device, sc))
    if t is None:
        t = _fused_scales[(device, sc)] = torch.full(
            (1,), sc, dtype=torch.float32, device=device
        )
    return t
