"""The 64-row warpgroup-MMA split kernel (runtime part _fused_wgmma) on a GPU, through fused_mla.

At 128 heads and with draft tokens the 16/32-row kernels re-read and re-convert each KV tile
in 4-8 CTAs (2.1-3.1x FlashInfer's bf16 kernel, GPU run 44). This kernel holds 64 query rows
a CTA in two warpgroups (FlashMLA's shape). Per shape, in one run: FlashInfer's bf16 kernel
on a bf16 pool, fused_mla with the Triton kernel (the committed path) and with the 64-row
kernel (config wgmma=True); each fused output against the fp32 reference on the first
requests (causal for draft tokens), bit-identical over two runs, and a wrong row (request 0
reads the slot after each of its rows) must fail the check. Then one shape through a page
table at page size 64 with both FP8 scales, against the scaled reference, and a sweep of the
kernel's launch tuning. Prints only; exit 1 if a check fails. Compile-only, no GPU:
python tools/fused_aot.py --wgmma.

    python gpu/gluon_wgmma_probe.py [--sweep] [--ws | --xchg]
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import copy_bandwidth, make_pool  # noqa: E402
from bench_fused import (ROW, SM_SCALE, batch, fi_wrapper, graph_ms, probe_check, probe_setup,  # noqa: E402
                         split_kernel_name)

from kvpatch.verify.fused_reference import fused_reference  # noqa: E402
from kvpatch.verify.judge import FUSED_REL_TOL, vector_rel_err  # noqa: E402

TOL = FUSED_REL_TOL  # per output vector, against fp32 (verify's and the GPU tests')
# (heads, batch, context, query tokens): the 128-head and draft-token shapes, and
# one request (latency) and a long batch at 128 heads.
SHAPES = ((128, 1, 4096, 1), (128, 8, 4096, 1), (128, 32, 4096, 1), (128, 64, 8192, 1),
          (16, 8, 4096, 4), (16, 32, 4096, 4), (16, 8, 4096, 8), (16, 32, 4096, 8))
# (block_n, stages, min_split, lean) for --sweep. GPU runs 47-48 (notes/gpu-runs.md): block_n 32 was
# 1.2-1.6x slower than 64 at every shape, 2 stages and min_split 64-256 within 2% of the
# committed tuning; a variant converting the next tile into a second f16 buffer while PV ran
# (block_n 32: shared memory holds two tiles only there) lost 12-60%, and is gone.
# lean: two barriers a step instead of four (the tile's fence merged into the stage
# barrier; the end-of-step barrier left to the next step's first): NOT RUN yet.
SWEEP = [(64, 2, 128, False), (64, 1, 256, False), (64, 1, 128, True), (64, 2, 128, True)]
# (name, the 64-row kernel on, config keys): what is timed and checked at each shape.
PATHS = (("triton", False, {}), ("wgmma", True, {"wg_ws": False}))
WS = ("ws", True, {"wg_ws": True})
UP = ("ws_up", True, {"wg_ws": True, "wg_splits": "up"})
# xchg (session 20, not run): the softmax's halves exchanged through shared memory, P read
# by the PV's wgmma from there: 4 barriers a step in the MMA warps, not 11.
XCHG = ("ws_xchg", True, {"wg_ws": True, "wg_xchg": True})


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    sweep = "--sweep" in argv
    # --ws: the loader-partition kernel (runtime part _fused_wgmma_ws, the default) beside the
    # plain one, each checked; run under `timeout`: a wrong barrier phase hangs, not fails.
    # ws_up: its split count rounded up (the default before run 51), for the A/B against
    # the splits that fill the last wave of CTAs (the default since). --xchg: the loader
    # kernel with the softmax's exchange beside the default, in a run of its own (a hang in
    # it must not take the default's numbers).
    variants = (WS, UP) if "--ws" in argv else (WS, XCHG) if "--xchg" in argv else ()
    paths = PATHS + variants
    setup = probe_setup("gluon_wgmma_probe")
    if setup is None:
        return 2
    rt, gen, ws = setup
    if not rt._fused_wgmma_build():
        print("gluon_wgmma_probe: this Triton has no Gluon", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s", flush=True)
    ok_all = True
    pool = None
    for heads, bs, ctx, tq in SHAPES:
        slots = 1 << 20 if bs * ctx > 495552 else 495552
        if pool is None or pool.shape[0] != slots:
            pool = None
            torch.cuda.empty_cache()
            pool = make_pool(slots, gen)
        b = batch(slots, bs, ctx, heads, tq, gen)
        out = torch.empty((bs * tq, heads, 512), dtype=torch.bfloat16, device="cuda")
        pool16 = pool.to(torch.bfloat16)
        w = fi_wrapper(ws, b)
        bf16 = graph_ms(lambda: w.run(b["qn_c"], b["qp_c"], pool16[:, :, :512], pool16[:, :, 512:], out=out)) * 1e3
        pool16 = None  # the bf16 copy only for the bf16 kernel
        nq = min(bs, 4) * tq
        ref = fused_reference(b["q_nope"][:nq], b["q_pe"][:nq], pool, SM_SCALE,
                              lambda i: b["perm"][b["kv_indptr"][i]:b["kv_indptr"][i + 1]], tq, tq > 1)
        head = f"{heads}h {bs}x{ctx} tq={tq}"
        line = f"{head}: bf16 {bf16:7.1f} us | floor {b['rows'] * ROW / bw * 1e6:6.1f} us"
        res = {}
        for name, wg, extra in paths:
            cfg = dict(rt.FUSED_TUNING["large"], wgmma=wg, gluon=False, **extra)

            def run(perm=b["perm"], cfg=cfg):
                rt.fused_mla(b["q_nope"], b["q_pe"], pool, out, SM_SCALE, kv_indptr=b["kv_indptr"], kv_indices=perm,
                             q_per_request=tq, causal=tq > 1, config=cfg)
                return out

            us, err, det, sab = probe_check(run, b, slots, ref, nq)
            kname = split_kernel_name(rt)
            good = (err < TOL and det and sab > TOL and kname.startswith("_fused_wgmma") == wg
                    and ("_ws_" in kname) == bool(extra.get("wg_ws")))
            ok_all &= good
            res[name] = us
            line += (f" | {name} ({kname}) {us:7.1f} us ({us / bf16:.2f}x bf16) err {err:.1e} det {det} "
                     f"sabotage {sab:.1e} {'OK' if good else 'FAILED'}")
        line += f" | wgmma / triton {res['wgmma'] / res['triton']:.2f}x"
        for name, *_ in variants:
            line += f" | {name} / wgmma {res[name] / res['wgmma']:.2f}x"
        print(line, flush=True)
        if sweep:
            for bn, stages, min_split, lean in SWEEP:
                cfg = dict(rt.FUSED_TUNING["large"], wgmma=True, gluon=False, wg_ws=False, wg_block_n=bn,
                           wg_num_stages=stages, wg_min_split=min_split, wg_lean=lean)
                try:
                    us = graph_ms(lambda: run(cfg=cfg)) * 1e3
                    e2 = vector_rel_err(out[:nq], ref)
                    ok_all &= e2 < TOL
                    print(f"    {head} block_n {bn} stages {stages} min_split {min_split} lean {lean}: {us:7.1f} us "
                          f"({us / bf16:.2f}x bf16) err {e2:.1e}", flush=True)
                except Exception as exc:  # a tuning that does not fit (shared memory): said
                    print(f"    {head} block_n {bn} stages {stages}: {type(exc).__name__}: {exc}"[:300], flush=True)
    ok_all &= paged_scaled(rt, gen, paths=paths)
    print("gluon_wgmma_probe:", "all checks passed" if ok_all else "A CHECK FAILED", flush=True)
    return 0 if ok_all else 1


def paged_scaled(rt, gen, heads=128, bs=6, ps=64, tq=1, paths=PATHS):
    """Page table at page size 64 with ragged lengths and both FP8 scales (tensors), and the
    same through 16 heads x 4 draft tokens (causal), against the scaled fp32 reference."""
    ok = True
    pages = 4096
    pool = make_pool(pages * ps, gen).view(pages, ps, 1, ROW)
    for heads, tq in ((128, 1), (16, 4)):
        lens = torch.tensor([tq, 63, 64, 65, 1000, 3001][:bs], dtype=torch.int32, device="cuda")
        width = 64
        table = torch.randperm(pages, device="cuda", generator=gen)[: bs * width].to(torch.int32).view(bs, width)
        q = torch.randn((bs * tq, heads, ROW), device="cuda", dtype=torch.bfloat16, generator=gen)
        qn, qp = q[..., :512], q[..., 512:]
        ckv = torch.tensor([0.75], device="cuda")
        kpe = torch.tensor([1.5], device="cuda")

        def rows_of(i, table=table, lens=lens):
            n = int(lens[i])
            pos = torch.arange(n, device="cuda")
            return table[i, pos // ps].long() * ps + pos % ps

        ref = fused_reference(qn, qp, pool, SM_SCALE, rows_of, tq, tq > 1, 0.75, 1.5)
        for name, wg, extra in paths:
            out = torch.empty((bs * tq, heads, 512), dtype=torch.bfloat16, device="cuda")
            cfg = dict(rt.FUSED_TUNING["large"], wgmma=wg, gluon=False, **extra)
            for n_splits in (None, 1):
                rt.fused_mla(qn, qp, pool, out, SM_SCALE, page_table=table, cache_seqlens=lens, page_size=ps,
                             q_per_request=tq, causal=tq > 1, ckv_scale=ckv, kpe_scale=kpe, n_splits=n_splits,
                             config=cfg)
                err = vector_rel_err(out, ref)
                kname = split_kernel_name(rt)
                good = (err < TOL and kname.startswith("_fused_wgmma") == wg
                        and ("_ws_" in kname) == bool(extra.get("wg_ws")))
                ok &= good
                print(f"paged {ps}, scales, {heads}h tq={tq} ragged lens, n_splits {n_splits}: {name} ({kname}) "
                      f"err {err:.1e} {'OK' if good else 'FAILED'}", flush=True)
            # a wrong scale must fail
            rt.fused_mla(qn, qp, pool, out, SM_SCALE, page_table=table, cache_seqlens=lens, page_size=ps,
                         q_per_request=tq, causal=tq > 1, ckv_scale=kpe, kpe_scale=ckv, config=cfg)
            sab = vector_rel_err(out, ref)
            ok &= sab > TOL
            print(f"    swapped scales: err {sab:.1e} {'fails as it should' if sab > TOL else 'NOT CAUGHT'}", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
