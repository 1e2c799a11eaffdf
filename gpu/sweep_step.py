"""The small-batch regime of the fused kernel: split count and split length against the bf16 kernel.

At 4 x 4k (the #35291 step: 61 layers, 16 heads, 131,072 slots) a layer's attention is a few
microseconds of bytes and mostly launch and latency: the split count (ctas_per_sm), the
shortest split (min_split) and block_n decide it. Prints, per launch configuration, the fused
step against FlashInfer's bf16 kernel step measured in the same run, and the same for one
layer at 1 x 4k and 8 x 4k. Prints only; the tuning it supports goes to FUSED_TUNING.

    python gpu/sweep_step.py [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import copy_bandwidth, load_runtime, make_pool  # noqa: E402
from bench_fused import BF16, CKV, ROW, SM_SCALE, batch, fi_wrapper, graph_ms  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=61)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_step: no CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("KVPATCH_MODE", "gather")
    rt = load_runtime()
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    slots = 131072
    pools = [make_pool(slots, gen) for _ in range(args.layers)]
    pools16 = [p.to(BF16) for p in pools]
    print(f"device {torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; "
          f"default small bucket {rt.FUSED_TUNING['small']}", flush=True)
    shapes = {"step 4x4k x%d layers" % args.layers: (4, 4096, pools, pools16),
              "1x4k": (1, 4096, pools[:1], pools16[:1]), "8x4k": (8, 4096, pools[:1], pools16[:1])}
    base = dict(rt.FUSED_TUNING["small"], gluon=False)  # Triton configs; None: the default
    # qk_acc 2: two independent QK accumulator chains (16 dependent MMAs a step, not 32), the
    # latency a lone CTA pays in full; deeper pipelines (stages 3, 4) prefetch further ahead.
    configs = [None] + [dict(base, block_n=64, num_stages=2, ctas_per_sm=c, min_split=ms, qk_acc=qa)
                        for qa in (1, 2) for c, ms in itertools.product((1, 2, 4), (64, 128))]
    configs += [dict(base, block_n=bn, num_stages=st, ctas_per_sm=1, min_split=ms, qk_acc=2, maxnreg=None)
                for bn, st in ((64, 3), (32, 4)) for ms in (64, 128)]
    report = {"copy_bw": bw, "rows": []}
    for name, (bs, ctx, ps, ps16) in shapes.items():
        b = batch(slots, bs, ctx, 16, 1, gen)
        out = torch.empty((bs, 16, CKV), dtype=BF16, device="cuda")
        w = fi_wrapper(ws, b)
        bf16 = graph_ms(lambda: [w.run(b["qn_c"], b["qp_c"], p[:, :, :CKV], p[:, :, CKV:], out=out) for p in ps16])
        floor = len(ps) * b["rows"] * ROW / bw * 1e3
        print(f"{name}: bf16 kernel {bf16 * 1e3:8.1f} us, floor {floor * 1e3:6.1f} us", flush=True)
        for cfg in configs:
            try:
                us = graph_ms(lambda: [rt.fused_mla(b["q_nope"], b["q_pe"], p, out, SM_SCALE, kv_indptr=b["kv_indptr"],
                                                    kv_indices=b["perm"], config=cfg) for p in ps]) * 1e3
            except Exception as exc:  # a config that does not compile here is skipped, and said
                print(f"  {cfg}: failed {type(exc).__name__}: {exc}", flush=True)
                continue
            label = "default" if cfg is None else {k: cfg[k] for k in ("block_n", "num_stages", "ctas_per_sm",
                                                                      "min_split", "qk_acc")}
            print(f"  fused {us:8.1f} us ({us / (bf16 * 1e3):.3f}x bf16)  {label}", flush=True)
            report["rows"].append({"shape": name, "config": label, "fused_us": us, "bf16_us": bf16 * 1e3,
                                   "floor_us": floor * 1e3})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
