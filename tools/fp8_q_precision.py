#!/usr/bin/env python3
"""Would an FP8 QK serve? The fused kernels' worst output error with q quantised to FP8, on the CPU.

    python tools/fp8_q_precision.py [--heads 128 16] [--rows 4096 32768] [--seeds 3]

At 128 heads (and 16 heads x 8 draft tokens) the fused kernels are bound by the f16 tensor
pipe and by shared-memory traffic (notes/gpu-runs.md, runs 50 and 52), and QK is 576 of
every 1,088 multiply-adds a row. FP8 wgmma runs at twice the f16 rate and would read K as
stored, with no f16 copy in shared memory; but both its operands must be FP8, so q would be
quantised too. This script answers the numerics question before any device minute: on the
data the benchmark and verify use (q ~ N(0, 1) in bf16, the pool N(0, 0.25) in e4m3), the
worst output vector's error (kvpatch.verify.judge.vector_rel_err, the metric verify and
bench_fused.py judge the fused path by) against an fp32 reference on the same FP8 rows, for:

- f16 q: what the kernels do today (q scaled by a power of two into f16, exact for bf16
  values; fp32 scores; P rounded to f16; bf16 output);
- e4m3 q, one scale a query row (amax / 448);
- e4m3 q, one scale a query row and 64-dim block (what a fine-grained FP8 GEMM would do);
- e4m3 q as two terms (q8 + e4m3 of the residual): two FP8 MMAs, the f16 rate again.

Prints each variant's worst error over heads x seeds, against FUSED_REL_TOL. torch only.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpatch.verify.judge import FUSED_REL_TOL, vector_rel_err  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CKV, ROW = 512, 576
SM_SCALE = 1 / math.sqrt(192)  # DeepSeek's MLA softmax scale (qk_nope 128 + rope 64)


def _e4m3(x: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """x quantised to e4m3 with one scale a row (blocks=1) or a row and block, dequantised."""
    xb = x.reshape(x.shape[0], blocks, -1)
    scale = FP8_MAX / xb.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return ((xb * scale).to(FP8).float() / scale).reshape(x.shape)


def _attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The kernels' numerics after the scores: fp32 softmax, P rounded to f16, bf16 output."""
    s = (q @ kv.T) * SM_SCALE
    p = torch.exp(s - s.max(-1, keepdim=True).values)
    o = (p.half().float() @ kv[:, :CKV]) / p.sum(-1, keepdim=True)
    return o.bfloat16().float()


def variants(q: torch.Tensor) -> dict:
    q8 = _e4m3(q)
    return {
        "f16 q (today's kernels)": q,
        "e4m3 q, a scale a row": q8,
        "e4m3 q, a scale a row and 64 dims": _e4m3(q, ROW // 64),
        "e4m3 q, two terms (two FP8 MMAs)": q8 + _e4m3(q - q8),
    }


def worst(heads: int, rows: int, seeds: int) -> dict:
    out: dict = {}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        kv = (torch.randn((rows, ROW), generator=gen) * 0.5).to(FP8).float()
        q = torch.randn((heads, ROW), generator=gen).bfloat16().float()
        s = (q @ kv.T) * SM_SCALE
        ref = torch.softmax(s, -1) @ kv[:, :CKV]
        for name, qv in variants(q).items():
            out[name] = max(out.get(name, 0.0), vector_rel_err(_attend(qv, kv), ref))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"worst output vector |out - ref| / |ref| over heads x {args.seeds} seeds; "
          f"tolerance {FUSED_REL_TOL}")
    for heads in args.heads:
        for rows in args.rows:
            for name, err in worst(heads, rows, args.seeds).items():
                verdict = "within" if err < FUSED_REL_TOL else "ABOVE"
                print(f"{heads:4d}h {rows:6d} rows  {name:<36} {err:.2e}  {verdict} tolerance", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
