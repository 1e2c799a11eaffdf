"""How much of a per-layer figure is fixed cost, and how much is the rows (issue 17).

bench_fused's per-layer times at 1 x 4k and 8 x 4k sit near 20 us for both the bf16 kernel
and the fused path, while their bytes are 1-10 us at the copy rate. This probe separates the
parts, all in one run and with the same graph_ms timing as bench_fused (L2 flushed):

  empty       a graph of one one-program Triton kernel: the timing's own floor;
  tiny        fused_mla and FlashInfer's bf16 kernel on 1 request x 128 rows (and 1 x 4k);
  slope       both paths at 8 x 4k and 32 x 4k: (t32 - t8) / (rows32 - rows8) is the cost of a
              row with the fixed part removed, given as TB/s on each path's own bytes;
  warm        the same two shapes replayed back to back with no flush (a decode step runs
              its layers back to back: each layer's rows are cold, the timing gaps are not).

Prints only; notes/gpu-runs.md keeps the numbers.

    python gpu/overhead_probe.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import copy_bandwidth, load_runtime, make_pool  # noqa: E402
from bench_fused import BF16, CKV, ROW, SM_SCALE, batch, fi_wrapper, graph_ms  # noqa: E402


def warm_ms(fn, reps=50):
    """Back-to-back replays of one graph holding `fn` eight times, no flush: per fn call."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(8):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * 8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("overhead_probe: no CUDA device", file=sys.stderr)
        return 2
    import triton
    import triton.language as tl

    @triton.jit
    def _one(x):
        tl.store(x, tl.load(x) + 1)

    os.environ.setdefault("KVPATCH_MODE", "gather")
    rt = load_runtime()
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    pool = make_pool(495552, gen)
    pool16 = pool.to(BF16)
    x = torch.zeros(1, device="cuda")
    report = {"copy_bw": bw, "empty_us": graph_ms(lambda: _one[(1,)](x)) * 1e3,
              "empty_warm_us": warm_ms(lambda: _one[(1,)](x)) * 1e3}
    print(f"device {torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; one-program kernel: "
          f"{report['empty_us']:.1f} us flushed, {report['empty_warm_us']:.1f} us back to back", flush=True)
    for name, bs, ctx in (("tiny", 1, 128), ("1x4k", 1, 4096), ("8x4k", 8, 4096), ("32x4k", 32, 4096)):
        b = batch(pool.shape[0], bs, ctx, 16, 1, gen)
        out = torch.empty((bs, 16, CKV), dtype=BF16, device="cuda")
        w = fi_wrapper(ws, b)
        paths = {
            "bf16": lambda: w.run(b["qn_c"], b["qp_c"], pool16[:, :, :CKV], pool16[:, :, CKV:], out=out),
            "fused": lambda: rt.fused_mla(b["q_nope"], b["q_pe"], pool, out, SM_SCALE, kv_indptr=b["kv_indptr"],
                                          kv_indices=b["perm"]),
        }
        row = {"rows": b["rows"], "floor_us": b["rows"] * ROW / bw * 1e6}
        for path, fn in paths.items():
            row[path + "_us"] = graph_ms(fn) * 1e3
            row[path + "_warm_us"] = warm_ms(fn) * 1e3
        report[name] = row
        print(f"{name}: rows {b['rows']}: " + " | ".join(f"{p} {row[p + '_us']:.1f} (warm {row[p + '_warm_us']:.1f})"
                                                      for p in paths) + f" | floor {row['floor_us']:.1f} us", flush=True)
    a, c = report["8x4k"], report["32x4k"]
    d = c["rows"] - a["rows"]
    for path, width in (("bf16", 2 * ROW), ("fused", ROW)):
        for kind in ("", "_warm"):
            per_row = (c[f"{path}{kind}_us"] - a[f"{path}{kind}_us"]) * 1e-6 / d
            fixed = a[f"{path}{kind}_us"] - per_row * a["rows"] * 1e6
            report[f"{path}{kind}_slope_tbs"] = width / per_row / 1e12
            report[f"{path}{kind}_fixed_us"] = fixed
            print(f"slope {path}{kind or ' flushed'}: {width / per_row / 1e12:.2f} TB/s on its {width} B a row; "
                  f"fixed part {fixed:.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
