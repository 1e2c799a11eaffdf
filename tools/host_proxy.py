#!/usr/bin/env python3
"""The runtime's per-call Python on this CPU, with no GPU: where eager host time goes.

    python tools/host_proxy.py [--profile NAME]

Issue 17 asks each runtime call's eager host time to be at most 1.5x a plain torch op; the
numbers that count are the device's (benchmarks/bench_fused.py --host-only). This is a
proxy to work on the Python between device sessions: the joined runtime is loaded with its
CUDA checks pointed at the CPU (`device.type == "cuda"` and `.is_cuda` read "cpu"), its
Triton kernels replaced by stand-ins whose compiled launch does nothing, and the probes
that ask a GPU (capability, SM count, graph capture) answered as an H100's. The calls are
bench_fused.py's host calls on CPU tensors, fused path forced, each the fastest of 7 rounds
of 3,000; the baseline is a one-element torch add_ on the CPU (no kernel launch: the ratios
are not the device's). --profile NAME: cProfile of that call, by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import math
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# (text, replacement, least count): the runtime's CUDA checks, pointed at the CPU.
CPU_AS_CUDA = (('!= "cuda"', '!= "cpu"', 3), ('== "cuda"', '== "cpu"', 2), (".is_cuda", ".is_cpu", 7))
FP8, BF16, CKV, ROW = torch.float8_e4m3fn, torch.bfloat16, 512, 576
SM_SCALE = 1 / math.sqrt(192)


def load_proxy(where: Path):
    """The joined runtime with the stand-ins above (a module of its own, in `where`)."""
    from kvpatch.runtime import joined

    src = joined()
    for old, new, least in CPU_AS_CUDA:
        if src.count(old) < least:  # the runtime changed under this tool: say so, do not guess
            raise SystemExit(f"host_proxy: {old!r} found {src.count(old)} times, expected {least}+")
        src = src.replace(old, new)
    path = where / "_kvpatch_host_proxy.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    rt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rt)

    class Hooks:
        launch_enter_hook = launch_exit_hook = None

    class Compiled:
        function, packed_metadata = 0, ()

    class Kernel:  # kernel[grid](...) -> a compiled kernel whose launch is a no-op
        def __init__(self, real):
            self.arg_names = real.arg_names

        def __getitem__(self, grid):
            return lambda *a, **k: Compiled()

    kernels = tuple(Kernel(k) for k in rt._fused_build())
    rt._fused_build = lambda: kernels
    rt._launch_driver = lambda: (Hooks, lambda: 0, lambda dev: 0)
    rt._launch_direct = lambda ck: (lambda *a: None, False, False)
    rt._fused_sm_count = lambda dev: 132
    rt._device_capability = lambda dev: (9, 0)
    rt._fused_gluon_choice = rt._fused_wgmma_choice = lambda *a: None  # the same host path
    rt._capturing = lambda: False
    rt._want_fused = lambda *a: True
    return rt


def calls(rt) -> dict:
    """bench_fused.py's host calls, on CPU tensors (the call sites' slices made once)."""
    from kvpatch.verify.reference import BatchMLAPagedAttentionWrapper

    slots = 65536
    pool = torch.zeros((slots, 1, ROW), dtype=torch.uint8).view(FP8)

    def batch(bs, ctx):
        return (torch.randn(bs, 16, ROW, dtype=BF16), torch.arange(bs + 1, dtype=torch.int32) * ctx,
                torch.randperm(slots)[: bs * ctx].to(torch.int32), torch.full((bs,), ctx, dtype=torch.int32))

    q, indptr, perm, lens = batch(1, 64)
    qn, qp, out = q[..., :CKV], q[..., CKV:], torch.empty(1, 16, CKV, dtype=BF16)
    qb, indptr_b, perm_b, _ = batch(256, 16)
    qbn, qbp, out_b = qb[..., :CKV], qb[..., CKV:], torch.empty(256, 16, CKV, dtype=BF16)
    pt, one = perm.view(1, -1), torch.arange(2, dtype=torch.int32)
    kvv, pv = pool.view(-1, 1, 1, ROW), pool.view(-1, 1, ROW)
    ckv, kpe = pv[:, :, :CKV], pv[:, :, CKV:]
    routed = dict(q=qp, k_cache=kvv[..., CKV:], v_cache=kvv[..., :CKV], qv=qn, page_table=pt, cache_seqlens=lens,
                  cu_seqlens_q=one, max_seqlen_q=1, softmax_scale=SM_SCALE, causal=False, out=out)

    def no_kernel(*a, **k):
        raise AssertionError("the routed call did not take the fused path")

    class NoRun(BatchMLAPagedAttentionWrapper):
        def run(self, *a, **k):
            raise AssertionError("the routed run() did not take the fused path")

    w = NoRun(torch.empty(16, dtype=torch.uint8))
    w.plan(one, rt.plan_rows(w, indptr), perm, lens, 16, CKV, ROW - CKV, 1, False, SM_SCALE, BF16, BF16)
    w.__dict__[rt._INDPTR_ATTR] = (indptr.clone(), 1)  # what plan_rows keeps on a GPU
    small = torch.empty(1)
    return {
        "torch add_ (one element, CPU; baseline)": lambda: small.add_(1.0),
        "fused_mla (two launches)": lambda: rt.fused_mla(qn, qp, pool, out, SM_SCALE, kv_indptr=indptr,
                                                         kv_indices=perm),
        "fused_mla (256 requests, one launch)": lambda: rt.fused_mla(qbn, qbp, pool, out_b, SM_SCALE,
                                                                     kv_indptr=indptr_b, kv_indices=perm_b),
        "paged_attention (routed, fused)": lambda: rt.paged_attention(no_kernel, **routed),
        "mla_run (routed run(), fused)": lambda: rt.mla_run(w.run, qn, qp, ckv, kpe, out=out),
        "paged_mla (routed XPU decode, fused)": lambda: rt.paged_mla(no_kernel, qn, qp, pv, lens, pt, None,
                                                                     SM_SCALE, num_kv_splits=1),
    }


def best_us(fn, rounds=7, n=3000) -> float:
    fn()  # the plan, outside the rounds
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="a call's name (a prefix will do): its cProfile")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rt = load_proxy(Path(tmp))
        todo = calls(rt)
        times = {name: best_us(fn) for name, fn in todo.items()}
        base = next(iter(times.values()))
        for name, us in times.items():
            print(f"{name:<42} {us:6.2f} us of Python ({us / base:.2f}x the CPU op)", flush=True)
        if args.profile:
            name = next(n for n in todo if n.startswith(args.profile))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20000):
                todo[name]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
