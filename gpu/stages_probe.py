"""Double-buffered row loads: the fused kernel at num_stages 5 against the committed tuning.

tools/fused_aot.py --dump shows why the committed kernel is latency-bound within a CTA: with
the row loads one indirection below the page index, Triton's pipeliner gives them the dots'
own stage at num_stages 2 to 4 (one shared buffer each; `async_wait {num = 0}` at the top of
the loop, the next tile's copies issued after the last dot), so a CTA never computes while its
own loads fly. From num_stages 5 each row load gets two buffers and the wait leaves one
iteration's copies in flight (`async_wait {num = 11}`). Every sweep before this one stopped at
num_stages 4.

Times each candidate on the bucket's shapes against the committed tuning and FlashInfer's bf16
kernel on a bf16 pool, in one run, with each candidate's error against the fp32 reference on
the first requests and a bit-equality check over two runs. Prints only.

    python gpu/stages_probe.py [small|large ...]
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import make_pool  # noqa: E402
from bench_fused import batch, probe_candidates, probe_setup  # noqa: E402

# (candidate, grid targets as CTAs an SM); registers and shared memory from fused_aot.py.
# GPU run 33 (notes/stages_probe.h100.log) swept num_stages 5 with block_n 16/32/64 and 4 or 8
# warps against the committed tuning; run 34 (notes/stages_probe2.h100.log) added v_early 3 (one
# global load a latent chunk feeding both dots; commit 8e82420, removed after: 5-40% slower).
# None beat the committed kernel by more than 6% on any 16-head shape; every large-bucket
# candidate lost. ncu (run 34, step profile_full): see notes/gpu-runs.md.
CANDIDATES = {
    "small": [
        (dict(block_n=32, num_stages=5), (2,)),  # 194 regs, 98 KB
        (dict(block_n=32, num_warps=8, num_stages=5), (1,)),  # 146 regs: one CTA an SM
        (dict(block_n=16, num_stages=5, maxnreg=128), (3,)),  # 128 regs, 58 KB
        (dict(block_n=64, num_warps=8, num_stages=5), (1,)),  # 152 regs, 178 KB
    ],
    "large": [
        (dict(block_m=32, block_n=32, num_stages=5, qk_acc=2), (1,)),  # 255 regs, 118 KB
        (dict(block_m=32, block_n=16, num_stages=5, qk_acc=2), (2,)),  # 255 regs, 77 KB
        (dict(block_m=64, block_n=32, num_warps=8, num_stages=5, qk_acc=2), (1,)),  # wgmma, 246 regs
    ],
}
SHAPES = {
    "small": [(16, 32, 4096, 1), (16, 8, 4096, 1), (16, 1, 4096, 1), (16, 128, 1024, 1), (16, 8, 32768, 1)],
    "large": [(128, 8, 4096, 1), (128, 32, 4096, 1), (16, 32, 4096, 4), (16, 8, 4096, 8)],
}


def main(argv):
    setup = probe_setup("stages_probe")
    if setup is None:
        return 2
    rt, gen, ws = setup
    pool = make_pool(495552, gen)
    pool16 = pool.to(torch.bfloat16)
    for bucket in argv or list(SHAPES):
        base = rt.FUSED_TUNING[bucket]
        for heads, bs, ctx, tq in SHAPES[bucket]:
            b = batch(pool.shape[0], bs, ctx, heads, tq, gen)
            probe_candidates(rt, ws, pool, pool16, b, base, [(c, n) for c, grids in CANDIDATES[bucket] for n in grids],
                             f"{bucket} {heads}h {bs}x{ctx} tq{tq}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
