"""One layer's MLA attention path, unpatched vs patched, on the GPU with FlashInfer.

Unpatched: `pool.to(bf16)` (the whole layer pool) + a bf16 BatchMLAPagedAttentionWrapper.run.
Patched, gather mode: the kvpatch runtime's page-gathered cast + the same bf16 run.
Patched, native mode: the FP8 pool straight into a wrapper planned with
kv_data_type=float8_e4m3fn (run with ckv_scale=kpe_scale=1.0).

Each variant is captured in a CUDA graph (as SGLang runs decode) and its replays are
timed with triton.testing.do_bench (median, L2 flushed between runs). The device's
copy bandwidth is measured in the same run and every row reports the effective
bandwidth (bytes the path must move / time) against it. Outputs are checked: gather
must be bit-identical to unpatched, native within 2e-2.

    python benchmarks/bench_attention.py [--quick] [--json out.json]

Needs CUDA, torch, triton and flashinfer (>= 0.6.14 for the native rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KVPATCH_MODE", "native")  # so the native rows can be planned

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEADS, CKV, KPE = 16, 512, 64
ROW = CKV + KPE
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def load_runtime():
    sys.path.insert(0, str(ROOT))  # a clone, kvpatch not installed
    from kvpatch.runtime import load_template

    return load_template()


def copy_bandwidth() -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    from triton.testing import do_bench

    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * n / (ms * 1e-3)


def make_pool(slots: int, gen: torch.Generator) -> torch.Tensor:
    """SGLang's layout: uint8 storage [slots, 1, 576], read through an FP8 view."""
    store = torch.empty((slots, 1, ROW), dtype=torch.uint8, device="cuda")
    chunk = 1 << 16
    for s in range(0, slots, chunk):
        e = min(slots, s + chunk)
        store[s:e] = (torch.randn((e - s, 1, ROW), device="cuda", generator=gen) * 0.5).to(FP8).view(torch.uint8)
    return store.view(FP8)


class Case:
    def __init__(self, kind, slots, bs, ctx, extend=1):
        self.kind, self.slots, self.bs, self.ctx, self.extend = kind, slots, bs, ctx, extend

    @property
    def name(self):
        if self.kind == "decode":
            return f"decode pool={self.slots} bs={self.bs} ctx={self.ctx}"
        return f"prefill pool={self.slots} bs={self.bs} prefix={self.ctx} extend={self.extend}"


def build_batch(case: Case, gen):
    bs, kv_len = case.bs, case.ctx + (case.extend if case.kind == "prefill" else 0)
    qo_len = 1 if case.kind == "decode" else case.extend
    total = bs * kv_len
    perm = torch.randperm(case.slots, device="cuda", generator=gen)[:total].to(torch.int32)
    kv_indptr = torch.arange(0, bs + 1, device="cuda", dtype=torch.int32) * kv_len
    qo_indptr = torch.arange(0, bs + 1, device="cuda", dtype=torch.int32) * qo_len
    kv_lens = torch.full((bs,), kv_len, dtype=torch.int32, device="cuda")
    q = torch.randn((bs * qo_len, HEADS, ROW), device="cuda", dtype=BF16, generator=gen)
    return dict(kv_indices=perm, kv_indptr=kv_indptr, qo_indptr=qo_indptr, kv_lens=kv_lens,
                q_nope=q[..., :CKV].contiguous(), q_pe=q[..., CKV:].contiguous(), total=total)


def run_variant(rt, variant, case, pool, batch, ws):
    """Returns (ms, output) for one variant, timed over CUDA-graph replays."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    from triton.testing import do_bench

    bs = case.bs
    causal = case.kind == "prefill"
    w = BatchMLAPagedAttentionWrapper(
        ws, use_cuda_graph=True,
        qo_indptr=torch.empty(bs + 1, dtype=torch.int32, device="cuda"),
        kv_indptr=torch.empty(bs + 1, dtype=torch.int32, device="cuda"),
        kv_indices=torch.empty(batch["total"], dtype=torch.int32, device="cuda"),
        kv_len_arr=torch.empty(bs, dtype=torch.int32, device="cuda"),
        backend="auto",
    )
    if variant == "native":
        kv_dtype = rt.plan_kv_dtype(w, BF16, BF16, FP8, causal)
        if kv_dtype is not FP8:
            return None, None
    else:
        kv_dtype = BF16
        w._kvpatch_kv_dtype = BF16
    sm_scale = 1.0 / math.sqrt(192)
    w.plan(batch["qo_indptr"], batch["kv_indptr"], batch["kv_indices"], batch["kv_lens"], HEADS, CKV, KPE, 1,
           causal, sm_scale, BF16, kv_dtype)
    out = torch.empty_like(batch["q_nope"])

    def step():
        if variant == "unpatched":
            kv = pool.to(BF16)
            kwargs = {}
        else:
            kv = rt.kv_for_kernel(pool, w, BF16)
            kwargs = rt.run_kwargs(w)
        w.run(batch["q_nope"], batch["q_pe"], kv[:, :, :CKV], kv[:, :, CKV:], out=out, **kwargs)

    step()  # warm up, allocate the shadow outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    torch.cuda.synchronize()
    result = out.clone()
    ms = do_bench(g.replay, warmup=10, rep=60, return_mode="median")
    return ms, result


def cast_bytes(variant, case, total):
    if variant == "unpatched":
        return case.slots * ROW * 3  # read 1 B + write 2 B per element
    if variant == "gather":
        return total * (ROW * 3 + 4)
    return 0


def kernel_bytes(variant, total):
    return total * ROW * (1 if variant == "native" else 2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a handful of cases")
    ap.add_argument("--json", default=None, help="write results here (default: $OUT/bench_attention.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; this benchmark needs a GPU", file=sys.stderr)
        return 2
    try:
        import flashinfer
    except ImportError:
        print("bench_attention: flashinfer is not importable", file=sys.stderr)
        return 2
    rt = load_runtime()
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"device: {dev}; flashinfer {flashinfer.__version__}; torch {torch.__version__}; "
          f"runtime mode {rt.mode()}; copy bandwidth {bw / 1e12:.2f} TB/s (read+write)")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    cases = []
    pools = (495552,) if args.quick else (131072, 495552)
    for slots in pools:
        for bs in ((1, 32, 128) if args.quick else (1, 8, 32, 128)):
            for ctx in ((4096,) if args.quick else (1024, 4096, 16384, 32768)):
                if bs * ctx <= slots:
                    cases.append(Case("decode", slots, bs, ctx))
    if args.quick:
        cases.append(Case("decode", 495552, 128, 2048))
    for bs in (1, 4):
        for prefix in ((1024,) if args.quick else (1024, 8192)):
            for ext in ((256,) if args.quick else (256, 1024)):
                cases.append(Case("prefill", 495552, bs, prefix, ext))
    pools_cache = {}
    rows = []
    t0 = time.time()
    for case in cases:
        pool = pools_cache.get(case.slots)
        if pool is None:
            pools_cache.clear()
            torch.cuda.empty_cache()
            pool = pools_cache[case.slots] = make_pool(case.slots, gen)
        batch = build_batch(case, gen)
        rec = {"case": case.name, "kind": case.kind, "slots": case.slots, "bs": case.bs, "ctx": case.ctx,
               "extend": case.extend, "rows": batch["total"]}
        ref = None
        for variant in ("unpatched", "gather", "native"):
            rt.poison_shadows()
            ms, out = run_variant(rt, variant, case, pool, batch, ws)
            if ms is None:
                rec[variant] = None
                continue
            moved = cast_bytes(variant, case, batch["total"]) + kernel_bytes(variant, batch["total"])
            entry = {"ms": ms, "eff_tbps": moved / (ms * 1e-3) / 1e12, "pct_copy_bw": 100 * moved / (ms * 1e-3) / bw}
            if variant == "unpatched":
                ref = out
            else:
                entry["speedup"] = rec["unpatched"]["ms"] / ms
                if variant == "gather":
                    entry["bit_identical"] = bool(torch.equal(out, ref))
                else:
                    err = (out.float() - ref.float()).abs()
                    entry["max_abs_err"] = float(err.max())
                    entry["identical_share"] = float((out == ref).float().mean())
            rec[variant] = entry
        rows.append(rec)
        g, n = rec.get("gather"), rec.get("native")
        print(f"{case.name:<48} unpatched {rec['unpatched']['ms'] * 1e3:8.1f} us | "
              f"gather {g['ms'] * 1e3:8.1f} us {g['speedup']:5.1f}x eq={g['bit_identical']} | "
              + (f"native {n['ms'] * 1e3:8.1f} us {n['speedup']:5.1f}x err={n['max_abs_err']:.3g}" if n else "native n/a"),
              flush=True)
    # Targets from the issue.
    target = next((r for r in rows if r["kind"] == "decode" and r["slots"] == 495552 and r["bs"] == 1
                   and r["ctx"] == 4096), None)
    best = 0.0
    if target is not None:
        best = max(target[v]["speedup"] for v in ("gather", "native") if target.get(v))
    slower = [(r["case"], v) for r in rows for v in ("gather", "native") if r.get(v) and r[v]["speedup"] < 1.0]
    not_equal = [r["case"] for r in rows if r.get("gather") and not r["gather"]["bit_identical"]]
    bad_native = [r["case"] for r in rows if r.get("native") and r["native"]["max_abs_err"] > 2e-2]
    print()
    print(f"{'case':<48} {'unpatched us':>12} {'gather us':>10} {'x':>6} {'native us':>10} {'x':>6} "
          f"{'gather TB/s':>11} {'%copy':>6}")
    for r in rows:
        g, n = r["gather"], r.get("native")
        print(f"{r['case']:<48} {r['unpatched']['ms'] * 1e3:12.1f} {g['ms'] * 1e3:10.1f} {g['speedup']:6.1f} "
              + (f"{n['ms'] * 1e3:10.1f} {n['speedup']:6.1f}" if n else f"{'n/a':>10} {'':>6}")
              + f" {g['eff_tbps']:11.2f} {g['pct_copy_bw']:6.0f}")
    print()
    print(f"target decode bs=1 ctx=4096 pool=495552: best patched speedup {best:.1f}x (>= 10x: "
          f"{'PASS' if best >= 10 else 'FAIL'})")
    print(f"target no case slower than unpatched: {'PASS' if not slower else 'FAIL ' + str(slower)}")
    print(f"gather bit-identical in every case: {'PASS' if not not_equal else 'FAIL ' + str(not_equal)}")
    print(f"native within 2e-2 in every case: {'PASS' if not bad_native else 'FAIL ' + str(bad_native)}")
    print(f"({len(rows)} cases, {time.time() - t0:.0f}s)")
    out_path = args.json or (os.path.join(os.environ["OUT"], "bench_attention.json") if os.environ.get("OUT") else None)
    if out_path:
        with open(out_path, "w") as fh:
            json.dump({"device": dev, "flashinfer": flashinfer.__version__, "torch": torch.__version__,
                       "copy_bw_bytes_per_s": bw, "rows": rows}, fh, indent=2)
    return 0 if (best >= 10 and not slower and not not_equal and not bad_native) else 1


if __name__ == "__main__":
    sys.exit(main())
