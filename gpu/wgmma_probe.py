"""wgmma or mma.sync: the fused kernel at block_m 64 / 8 warps against the committed tuning.

Triton emits wgmma (Hopper's warpgroup MMA, B read from shared memory) only for M = 64 a
warpgroup; the committed tuning (block_m 16 and 32 at 4 warps) compiles to mma.sync
(tools/fused_aot.py --dump: 80 wgmma, 0 mma.sync at block_m 64 / 8 warps; 0 and 136 at
block_m 32 / 4 warps). At 128 heads and with draft tokens the kernel does 8x the MMA work
of 16 heads per row, where the bf16 kernel stays 2-3x faster (runs 22-26). This times both
on the shapes of each bucket, FlashInfer's bf16 kernel on a bf16 pool in the same run, and
checks each config's output against an fp32 reference on the first requests. Prints only.

    python gpu/wgmma_probe.py
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import make_pool  # noqa: E402
from bench_fused import batch, probe_candidates, probe_setup  # noqa: E402

WGMMA = {
    "large": [dict(block_m=64, block_n=32, num_warps=8, num_stages=2, qk_acc=2),
              dict(block_m=64, block_n=64, num_warps=8, num_stages=2, qk_acc=2),
              dict(block_m=64, block_n=16, num_warps=8, num_stages=3, qk_acc=2)],
    "small": [dict(block_m=64, block_n=32, num_warps=8, num_stages=2, qk_acc=2, pad_m=True)],
}
SHAPES = {"large": [(128, 8, 4096, 1), (128, 32, 4096, 1), (16, 32, 4096, 4), (16, 8, 4096, 8)],
          "small": [(16, 32, 4096, 1), (16, 8, 32768, 1)]}


def main():
    setup = probe_setup("wgmma_probe")
    if setup is None:
        return 2
    rt, gen, ws = setup
    pool = make_pool(495552, gen)
    pool16 = pool.to(torch.bfloat16)
    for bucket, shapes in SHAPES.items():
        base = rt.FUSED_TUNING[bucket]
        for heads, bs, ctx, tq in shapes:
            b = batch(pool.shape[0], bs, ctx, heads, tq, gen)
            probe_candidates(rt, ws, pool, pool16, b, base, [(c, n) for c in WGMMA[bucket] for n in (1, 2)],
                             f"{heads}h {bs}x{ctx} tq{tq}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
