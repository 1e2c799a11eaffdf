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
from bench_fused import host_calls  # noqa: E402
from bench_attention import load_runtime  # noqa: E402


def main():
    import triton
    from triton.runtime.jit import JITFunction

    rt = load_runtime()
    calls = host_calls(rt, rt, torch.Generator(device="cuda").manual_seed(0))
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
        print(f"{name:<42} {us:6.1f} us/call; Triton-path launches per call {slow[0] / n:.2f}; "
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
