"""Where the eager host time of a runtime call goes, on the device (issue 17, item 4).

For fused_mla, kv_pages_for_kernel and the routed FA3 call: how many launches per call
took Triton's own path (kernel[grid], the slow binder) against the compiled launcher that
_launch keeps, the cached launch keys, and a cProfile of 300 calls (top functions by own
time). Prints only; the numbers that count are bench_fused.py's, against a torch op.

    python gpu/host_profile.py
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_fused import BF16, CKV, ROW, SM_SCALE, batch  # noqa: E402
from bench_attention import load_runtime, make_pool  # noqa: E402


def main():
    import triton
    from triton.runtime.jit import JITFunction

    rt = load_runtime()
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = make_pool(65536, gen)
    b = batch(65536, 1, 64, 16, 1, gen)
    out = torch.empty((1, 16, CKV), dtype=BF16, device="cuda")
    pt, sl = b["perm"].view(1, -1), b["kv_lens"]
    kvv = pool.view(-1, 1, 1, ROW)
    routed = dict(q=b["q_pe"], k_cache=kvv[..., CKV:], v_cache=kvv[..., :CKV], qv=b["q_nope"], page_table=pt,
                  cache_seqlens=sl, cu_seqlens_q=b["qo_indptr"], max_seqlen_q=1, softmax_scale=SM_SCALE,
                  causal=False, out=out)

    def no_kernel(**kw):
        raise AssertionError("the routed call did not take the fused path")

    small = torch.empty(1024, device="cuda")
    calls = {
        "torch add_": lambda: small.add_(1.0),
        "fused_mla": lambda: rt.fused_mla(b["q_nope"], b["q_pe"], pool, out, SM_SCALE,
                                          kv_indptr=b["kv_indptr"], kv_indices=b["perm"]),
        "kv_pages_for_kernel": lambda: rt.kv_pages_for_kernel(pool, BF16, 1, (pt, sl)),
        "paged_attention": lambda: rt.paged_attention(no_kernel, **routed),
    }
    rt._want_fused = lambda *a: True
    slow = [0]
    real_run = JITFunction.run

    def counted(self, *a, **k):
        slow[0] += 1
        return real_run(self, *a, **k)

    JITFunction.run = counted
    hooks = triton.knobs.runtime
    print(f"triton {triton.__version__}; launch hooks enter={hooks.launch_enter_hook} exit={hooks.launch_exit_hook}",
          flush=True)
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        slow[0] = 0
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        print(f"{name:<22} {us:6.1f} us/call; Triton-path launches per call {slow[0] / n:.2f}; "
              f"compiled launch keys {len(rt._launch_compiled)}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    JITFunction.run = real_run
    for key in list(rt._launch_compiled)[:6]:
        print("key", str(key)[:300])


if __name__ == "__main__":
    main()
