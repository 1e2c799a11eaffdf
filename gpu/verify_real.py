#!/usr/bin/env python3
"""Verify real patched SGLang checkouts on a GPU, production-sized.

    python3 gpu/verify_real.py CHECKOUT [CHECKOUT ...] [--modes gather,native,fused] [--no-graph]
                               [--medium] [--unified] [--dcp N] [--out DIR]

Each CHECKOUT is a tree patched by `kvpatch apply` (with .kvpatch/state.json and
.kvpatch/originals/, or a git checkout whose original is in git). Only the
patched backend file, its _kvpatch_runtime.py sibling and .kvpatch/ are read,
so a stripped copy holding just those travels fine. Runs kvpatch.verify on
CUDA in both modes, eager and CUDA-graph, with a 495,552-slot FP8 pool and
batches 1x4096, 32x4096, 128x2048 (16 heads) and 32x4096 (128 heads) decode,
2 x (1024 prefix + 256 extend) prefill at 16/32/64/128 heads. Prints a table
per checkout and writes verify_real.json and verify_real.txt under $OUT (or
--out). Exit 1 if any checkout fails, 2 if no GPU run happened.
FlashInfer JIT-compiles its MLA modules on first plan (20-40 s each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from kvpatch.verify import run_verify  # noqa: E402
from kvpatch.verify.judge import FUSED_KERNELS  # noqa: E402
from kvpatch.verify.world import BIG_SHAPES, GPU_SHAPES  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--modes", default="gather,native,fused")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--medium", action="store_true", help="the smaller default GPU shapes")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "verify_out")))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script only")
    ap.add_argument("--dcp", type=int, default=1, help="verify as one rank of this many DCP ranks (decode)")
    ap.add_argument("--dcp-rank", type=int, default=1)
    ap.add_argument("--unified", action="store_true",
                    help="unified memory: virtual ids in the request table, translated pool rows (0.5.19+)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    try:
        import torch
        log(f"torch {torch.__version__}, cuda={torch.cuda.is_available()}"
            + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""))
        import flashinfer
        log(f"flashinfer {getattr(flashinfer, '__version__', '?')}")
    except Exception as exc:
        log(f"note: {type(exc).__name__}: {exc}")

    shapes = GPU_SHAPES if a.medium else BIG_SHAPES
    if a.unified:
        shapes = dataclasses.replace(shapes, unified=True)
    if a.dcp > 1:
        shapes = dataclasses.replace(shapes, dcp=a.dcp, dcp_rank=a.dcp_rank)
    reports, text = [], []
    for root in a.roots:
        log(f"verify {root}")
        r = run_verify(root, modes=tuple(m for m in a.modes.split(",") if m), device=a.device,
                       graph=not a.no_graph, shapes=shapes, log=log)
        out = r.format()
        print(out, flush=True)
        text.append(out)
        reports.append(r)
    log(f"fused plans by split kernel: {dict(FUSED_KERNELS) or 'none'}")
    (a.out / "verify_real.json").write_text(json.dumps(
        {"elapsed_s": round(time.time() - t0, 1), "pool_slots": shapes.pool_slots,
         "fused_plans_by_kernel": dict(FUSED_KERNELS),
         "reports": [r.to_dict() for r in reports]}, indent=2))
    (a.out / "verify_real.txt").write_text("\n\n".join(text) + "\n")
    summary = ", ".join(f"{r.root}: {r.verdict}" for r in reports)
    log(f"done: {summary}; wrote {a.out}/verify_real.json")
    if not all(r.ok for r in reports):
        return 1
    return 0 if all(r.gpu_ran for r in reports) else 2


if __name__ == "__main__":
    sys.exit(main())
