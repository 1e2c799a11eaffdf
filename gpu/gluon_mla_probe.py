"""The runtime's Gluon split kernel against its Triton one, through fused_mla, on a GPU.

The Gluon kernel (runtime parts _fused_gluon_ops and _fused_gluon) reads every FP8 byte it
stages from shared memory once for QK and once for PV, in the MMA's own operand layouts, and
splits the QK contraction across the warps by latent chunk (docs/runtime.md). Its first
version here, a standalone kernel (commit 1bfe715, GPU run 43), was exact and took
0.80-0.96x the Triton kernel's time at 16 heads. Joined to the runtime, it serves 16-head
decode by default since its GPU tests and verify passed (GPU runs 44-46).

Per shape (16 heads, one token): FlashInfer's bf16 kernel on a bf16 pool, fused_mla with the
Triton split kernel (gluon=False) and with the Gluon one (gluon=True), in one run; each fused
output against the fp32 reference on the first requests, bit-identical over two runs, and a
wrong row (request 0 reads request 1's first row) must fail the check. Prints only; exit 1 if
a check fails. Compile-only, no GPU: python tools/fused_aot.py --gluon.

    python gpu/gluon_mla_probe.py [--sweep]

--sweep also times the Gluon kernel at each launch tuning of SWEEP (FUSED_GLUON_TUNING's
CTAs an SM, fewest positions a split, stages, register cap, rows a copy instruction covers;
block_n stays 32: its layouts are built for it), per shape against the bf16 kernel, each
checked against the fp32 reference, and prints the best by geometric mean.
"""

from __future__ import annotations

import math
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
SHAPES = ((1, 4096), (8, 4096), (32, 4096), (128, 1024), (8, 32768), (64, 8192))
# (ctas_per_sm, min_split, num_stages, maxnreg, copy_rows, bcast_scores) for --sweep. Runs 47 and 49 (notes/gpu-runs.md):
# the committed (3, 64, 2) best or within 2% of (2, 64, 2), (3, 128, 2), (3, 32, 2) and
# (3, 64, 3) but at 8 x 4k (2 CTAs: 4% less). Run 49 also timed the page indices a step
# ahead: 1-3% slower, removed. ncu (run 51): latency-bound at 3 CTAs (12 warps an SM, 0.5
# eligible a scheduler, DRAM 55%); four CTAs need 128 registers a thread (232 B spilled).
# copy_rows 8 and bcast_scores (session 20, not run): 3 and 8 barriers a step fewer
# (tools/fused_aot.py --gluon); bcast_scores at its register cap (maxnreg "bcast": the
# runtime's FUSED_GLUON_BCAST_MAXNREG; 184 uncapped).
SWEEP = [(3, 64, 2, None, 4, False), (3, 64, 2, None, 8, False), (3, 64, 2, "bcast", 8, True),
         (4, 64, 2, 128, 4, False), (2, 64, 2, None, 4, False)]


def main(argv=None):
    sweep = "--sweep" in (sys.argv[1:] if argv is None else argv)
    setup = probe_setup("gluon_mla_probe")
    if setup is None:
        return 2
    rt, gen, ws = setup
    if not rt._fused_gluon_build():
        print("gluon_mla_probe: this Triton has no Gluon", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    ok_all = True
    tuned = {t: [] for t in SWEEP}
    for bs, ctx in SHAPES:
        slots = 1 << 20 if bs * ctx > 495552 else 495552
        pool = make_pool(slots, gen)
        b = batch(slots, bs, ctx, 16, 1, gen)
        out = torch.empty((bs, 16, 512), dtype=torch.bfloat16, device="cuda")
        pool16 = pool.to(torch.bfloat16)
        w = fi_wrapper(ws, b)
        bf16 = graph_ms(lambda: w.run(b["qn_c"], b["qp_c"], pool16[:, :, :512], pool16[:, :, 512:], out=out)) * 1e3
        nq = min(bs, 4)
        ref = fused_reference(b["q_nope"][:nq], b["q_pe"][:nq], pool, SM_SCALE,
                              lambda i: b["perm"][b["kv_indptr"][i]:b["kv_indptr"][i + 1]], 1, False)
        line = f"16h {bs}x{ctx}: bf16 {bf16:7.1f} us | floor {b['rows'] * ROW / bw * 1e6:6.1f} us"
        res = {}
        for name, gluon in (("triton", False), ("gluon", True)):
            cfg = dict(rt.FUSED_TUNING["small"], gluon=gluon)

            def run(perm=b["perm"], cfg=cfg):
                rt.fused_mla(b["q_nope"], b["q_pe"], pool, out, SM_SCALE, kv_indptr=b["kv_indptr"], kv_indices=perm,
                             config=cfg)
                return out

            us, err, det, sab = probe_check(run, b, slots, ref, nq)
            kname = split_kernel_name(rt)
            good = err < TOL and det and sab > TOL and (kname.startswith("_fused_gluon") == gluon)
            ok_all &= good
            res[name] = us
            line += (f" | {name} ({kname}) {us:7.1f} us ({us / bf16:.2f}x bf16) err {err:.1e} det {det} "
                     f"sabotage {sab:.1e} {'OK' if good else 'FAILED'}")
        line += f" | gluon / triton {res['gluon'] / res['triton']:.2f}x"
        print(line, flush=True)
        if sweep:
            ok_all &= sweep_shape(rt, run, bf16, tuned, f"16h {bs}x{ctx}", lambda o, nq=nq, ref=ref: vector_rel_err(o[:nq], ref))
    if sweep:
        ranked = sorted(tuned.items(), key=lambda kv: sum(math.log(r) for r in kv[1]))
        for t, ratios in ranked[:5]:
            print(f"sweep top: ctas_per_sm {t[0]} min_split {t[1]} stages {t[2]} maxnreg {t[3]} copy_rows {t[4]} "
                  f"bcast {t[5]}: "
                  + " ".join(f"{r:.2f}x" for r in ratios) + " bf16", flush=True)
    return 0 if ok_all else 1


def sweep_shape(rt, run, bf16, tuned, head, error):
    """run (the shape's fused call, gluon config) timed at each SWEEP tuning of the Gluon
    kernel; a config passed in makes fused_mla plan afresh, so each tuning takes effect.
    Each tuning's output is checked too (error: its error against the fp32 reference):
    False when one is off."""
    committed = dict(rt.FUSED_GLUON_TUNING)
    cfg = dict(rt.FUSED_TUNING["small"], gluon=True)
    good = True
    try:
        for t in SWEEP:
            ctas, min_split, stages, maxnreg, rows, bcast = t
            maxnreg = rt.FUSED_GLUON_BCAST_MAXNREG if maxnreg == "bcast" else maxnreg
            rt.FUSED_GLUON_TUNING = dict(committed, ctas_per_sm=ctas, min_split=min_split, num_stages=stages,
                                         maxnreg=maxnreg, copy_rows=rows, bcast_scores=bcast)
            err = error(run(cfg=cfg))
            good &= err < TOL
            us = graph_ms(lambda: run(cfg=cfg)) * 1e3
            kname = split_kernel_name(rt)  # a one-split batch keeps the Triton kernel: said
            tuned[t].append(us / bf16)
            print(f"    {head} ctas {ctas} min_split {min_split} stages {stages} maxnreg {maxnreg} copy_rows {rows} "
                  f"bcast {bcast}: "
                  f"{us:7.1f} us "
                  f"({us / bf16:.2f}x bf16, {kname}) err {err:.1e}{'' if err < TOL else ' FAILED'}", flush=True)
    finally:
        rt.FUSED_GLUON_TUNING = committed
    return good


if __name__ == "__main__":
    sys.exit(main())
