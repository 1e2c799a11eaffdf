"""Split count: the host picks it without the lengths (they are on the device), from the batch.

Rounding target / (batch x row groups) up launches a partial second wave when the batch
does not divide the grid target (128 x 1k: 3 splits, 384 programs for 264 slots on an H100
at 2 CTAs an SM); fused_mla's plan rounds down in the 16-row bucket since GPU run 24. This
times both roundings (the runtime's own _fused_split_count) and one split fewer, on the
shapes where they differ, with FlashInfer's bf16 kernel in the same run. Prints only.

    python gpu/split_count_probe.py
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import make_pool  # noqa: E402
from bench_fused import BF16, CKV, SM_SCALE, batch, fi_wrapper, graph_ms, probe_setup  # noqa: E402


def main():
    setup = probe_setup("split_count_probe")
    if setup is None:
        return 2
    rt, gen, ws = setup
    pool = make_pool(1 << 20, gen)
    pool16 = pool.to(BF16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for heads, bs, ctx in ((16, 128, 1024), (16, 64, 8192), (16, 32, 4096), (16, 48, 4096), (16, 100, 2048),
                           (128, 32, 4096), (128, 8, 4096)):
        bucket = "small" if heads <= 16 else "large"
        cfg = rt.FUSED_TUNING[bucket]
        groups = -(-heads // min(cfg["block_m"], heads))
        target = sms * cfg["ctas_per_sm"]
        up = rt._fused_split_count(target, bs * groups, False)
        down = rt._fused_split_count(target, bs * groups, True)
        b = batch(pool.shape[0], bs, ctx, heads, 1, gen)
        out = torch.empty((bs, heads, CKV), dtype=BF16, device="cuda")
        w = fi_wrapper(ws, b)
        bf16 = graph_ms(lambda: w.run(b["qn_c"], b["qp_c"], pool16[:, :, :CKV], pool16[:, :, CKV:], out=out)) * 1e3
        line = f"h={heads} {bs}x{ctx}: bf16 {bf16:.1f} us"
        for n in sorted({up, down, max(1, down - 1)}):
            us = graph_ms(lambda: rt.fused_mla(b["q_nope"], b["q_pe"], pool, out, SM_SCALE, kv_indptr=b["kv_indptr"],
                                               kv_indices=b["perm"], n_splits=n)) * 1e3
            line += f" | {n} splits{' (up)' if n == up else ''}{' (down)' if n == down else ''}: {us:.1f} us ({us / bf16:.2f}x)"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
