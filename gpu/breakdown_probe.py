"""Where a fused call's time goes, per kernel, on a GPU (gpu/run_all.sh step `breakdown`).

The fused path is two launches: the split kernel (partials, or the output at one split) and
the combine. At 16 heads x 8 x 4k the whole call takes ~30 us for 6.3 us of FP8 bytes at the
copy rate (GPU run 44), and the partials a split writes (16 x 512 fp32 a split, read back by
the combine) are of the order of the KV bytes themselves. This probe says how the time
splits before a kernel is changed for it: per shape, each kernel's mean device time from
torch.profiler over eager calls, the sum, the CUDA-graph replay time of the whole call (the
difference is launch gaps), the bytes of partials written and the FP8 floor, all in one run.

    python gpu/breakdown_probe.py [--f16-partials on|off]   (the splits' partials in f16 or fp32)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import copy_bandwidth, make_pool  # noqa: E402
from bench_fused import ROW, SM_SCALE, batch, graph_ms, probe_setup  # noqa: E402

# (heads, draft tokens, batch, context): issue 17's 16-head shapes and the 64-row kernel's.
SHAPES = ((16, 1, 1, 4096), (16, 1, 8, 4096), (16, 1, 32, 4096), (16, 1, 8, 32768),
          (128, 1, 8, 4096), (128, 1, 32, 4096), (16, 4, 8, 4096))
CALLS = 20


def kernel_times(fn):
    """{kernel name: (mean device us, launches a call)} over CALLS eager calls of fn."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    return {k: (total[k] / count[k], count[k] / CALLS) for k in total}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--f16-partials", choices=("default", "on", "off"), default="default",
                    help="FUSED_F16_PARTIALS for this run (default: the runtime's)")
    args = ap.parse_args(argv)
    setup = probe_setup("breakdown_probe")
    if setup is None:
        return 2
    rt, gen, _ = setup
    if args.f16_partials != "default":
        rt.FUSED_F16_PARTIALS = args.f16_partials == "on"
    bw = copy_bandwidth()
    print(f"copy rate {bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}", flush=True)
    for heads, tq, bs, ctx in SHAPES:
        slots = 1 << 20 if bs * ctx > 495552 else 495552
        pool = make_pool(slots, gen)
        b = batch(slots, bs, ctx, heads, tq, gen)
        out = torch.empty((bs * tq, heads, 512), dtype=torch.bfloat16, device="cuda")

        def run():
            rt.fused_mla(b["q_nope"], b["q_pe"], pool, out, SM_SCALE, kv_indptr=b["kv_indptr"],
                         kv_indices=b["perm"], q_per_request=tq, causal=tq > 1)

        graph = graph_ms(run) * 1e3
        times = kernel_times(run)
        plan = list(rt._fused_plans.values())[-1]  # this shape's: planned on its first call
        splits = plan["split_grid"][1]
        part = bs * tq * heads * 512 * plan["scratch"][0].element_size() * splits if splits > 1 else 0
        kern = sum(us * n for us, n in times.values())
        print(f"{heads}h x{tq} {bs}x{ctx}: graph {graph:7.1f} us | kernels {kern:7.1f} us "
              f"(gaps {graph - kern:5.1f}) | splits {splits} | partials {part / 1e6:6.1f} MB {plan['scratch'][0].dtype} "
              f"({part * 2 / bw * 1e6:5.1f} us write+read at the copy rate) | floor "
              f"{b['rows'] * ROW / bw * 1e6:6.1f} us", flush=True)
        for name, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            print(f"    {us:7.1f} us x{n:g}  {name[:90]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
