#!/usr/bin/env python3
"""Benchmark the runtime's gathered FP8 -> bf16 cast against the full-pool cast it replaces.

    python3 benchmarks/bench_gather.py [--out results.json] [--no-sweep]

On one CUDA GPU it measures, in the same run:
  * device copy bandwidth (a large D2D copy; bytes read + written), the ceiling;
  * the full-pool cast SGLang does today (`pool.to(bf16)`, 495,552 x 576 FP8 by default);
  * at 4,096 / 32,768 / 131,072 scattered random rows: torch `pool[idx].to(bf16)`, torch
    gather + scatter into a shadow, the runtime's torch fallback, and the fused Triton kernel;
  * a sweep of the kernel's tuning constants (block_rows, num_warps, programs_per_sm).

Times are CUDA-graph replays (many calls per graph, each on a different random index set so
rows come mostly from HBM, as in decode) and, for reference, triton.testing.do_bench medians
(L2 flushed, but launch-bound for small sizes). Effective bandwidth counts 576 B read +
1152 B written + 4 B index per row. Results go to --out, else $OUT/bench_gather.json, else
./bench_gather.json. Exit status: 0 ok, 1 a kernel result was wrong, 2 no GPU/Triton,
3 a target missed (only with --strict).
"""

import argparse
import itertools
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a clone, kvpatch not installed
from kvpatch.runtime import load_template  # noqa: E402
ROW_BYTES = 576 + 2 * 576 + 4  # fp8 row read, bf16 row written, int32 index read
TARGET_TBPS_AT_131072 = 3.0
TARGET_US_AT_4096 = 15.0


def load_runtime():
    return load_template()


def graph_time_us(torch, fns, replays=20):
    """Median GPU time per call: one graph runs every fn once, replayed `replays` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:  # warm-up outside capture: compile, allocate
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    del graph
    return statistics.median(times)


def tbps(nbytes, us):
    return nbytes / (us * 1e-6) / 1e12


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON results path")
    ap.add_argument("--slots", type=int, default=495_552, help="pool rows (slots)")
    ap.add_argument("--rows", default="4096,32768,131072", help="gathered row counts")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep")
    ap.add_argument("--strict", action="store_true", help="exit 3 when a target is missed")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_gather: no CUDA GPU available; this benchmark needs one", file=sys.stderr)
        return 2
    try:
        import triton
        from triton.testing import do_bench
    except ImportError as exc:
        print("bench_gather: Triton is not importable (%s); the fused kernel needs it" % exc,
              file=sys.stderr)
        return 2

    rt = load_runtime()
    rt.reset()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    bf16 = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    results = {
        "device": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__,
        "runtime_version": rt.__kvpatch_runtime_version__, "default_tuning": dict(rt.TUNING),
        "slots": args.slots, "row_bytes": ROW_BYTES, "sizes": {}, "sweep": [],
    }

    def bench_us(fn):
        return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3

    # Ceiling: a 1 GiB device-to-device copy, counted as bytes read + written.
    def copy_tbps_of(nbytes):
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        return tbps(2 * nbytes, bench_us(lambda: dst.copy_(src)))

    copy_tbps = results["copy_tbps"] = copy_tbps_of(1 << 30)

    raw = torch.randint(0, 256, (args.slots, 1, 576), dtype=torch.uint8, device=dev, generator=gen)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaN codes: results compare bit for bit
    pool = raw.view(torch.float8_e4m3fn)  # what get_key_buffer() returns
    pool2d = pool.view(-1, 576)
    shadow = torch.empty(pool.shape, dtype=bf16, device=dev)
    shadow2d = shadow.view(-1, 576)
    full_us = bench_us(lambda: pool.to(bf16))
    full_bytes = args.slots * 3 * 576
    results["full_cast"] = {"us": full_us, "tbps": tbps(full_bytes, full_us)}

    print("device %s, %d SMs, torch %s, triton %s" % (props.name, props.multi_processor_count,
                                                       torch.__version__, triton.__version__))
    print("copy bandwidth (1 GiB D2D, read+write): %.2f TB/s" % copy_tbps)
    print("full-pool cast %d x 576: %.1f us, %.2f TB/s (%.0f%% of copy)\n"
          % (args.slots, full_us, tbps(full_bytes, full_us),
             100 * tbps(full_bytes, full_us) / copy_tbps))

    sizes = [int(s) for s in args.rows.split(",") if s]
    sets = {}
    for rows in sizes:
        k = max(4, min(64, (1 << 18) // rows))  # enough index sets to keep rows out of L2
        idx = [torch.randperm(args.slots, device=dev, generator=gen)[:rows].to(torch.int32)
               for _ in range(k)]
        sets[rows] = (idx, [i.long() for i in idx],
                      [torch.tensor([0, rows], dtype=torch.int32, device=dev) for _ in range(k)])

    def fused(rows, cfg):
        idx, _, ptr = sets[rows]
        return [lambda i=i, p=p: rt.gather_cast(pool, shadow, i, p, 1, backend="triton", config=cfg)
                for i, p in zip(idx, ptr)]

    def fused_correct(rows, cfg):
        """Poisoned shadow, one fused call, bitwise compare; rows not read stay poison."""
        idx, idxl, ptr = sets[rows]
        shadow.fill_(float("nan"))
        rt.gather_cast(pool, shadow, idx[0], ptr[0], 1, backend="triton", config=cfg)
        ok = torch.equal(shadow2d[idxl[0]].view(torch.int16),
                         pool2d[idxl[0]].to(bf16).view(torch.int16))
        untouched = int(torch.isnan(shadow2d).all(dim=1).sum()) == args.slots - rows
        return bool(ok and untouched)

    methods = {
        "torch pool[idx].to": lambda rows: [lambda j=j: pool2d[j].to(bf16) for j in sets[rows][1]],
        "torch gather+scatter": lambda rows: [
            lambda j=j: shadow2d.index_copy_(0, j, pool2d.index_select(0, j).to(bf16))
            for j in sets[rows][1]],
        "runtime torch fallback": lambda rows: [
            lambda i=i, p=p: rt.gather_cast(pool, shadow, i, p, 1, backend="torch")
            for i, p in zip(sets[rows][0], sets[rows][2])],
        "fused triton": lambda rows: fused(rows, None),
    }

    failures = []
    header = "%-8s %-24s %10s %10s %8s %7s %9s" % (
        "rows", "method", "graph us", "bench us", "TB/s", "%copy", "vs full")
    print(header)
    print("-" * len(header))
    for rows in sizes:
        nbytes = rows * ROW_BYTES
        entry = {}
        for name, make in methods.items():
            fns = make(rows)
            g_us = graph_time_us(torch, fns)
            d_us = bench_us(fns[0])
            entry[name] = {"graph_us": g_us, "bench_us": d_us, "tbps": tbps(nbytes, g_us),
                           "pct_copy": 100 * tbps(nbytes, g_us) / copy_tbps,
                           "speedup_vs_full": full_us / g_us}
            print("%-8d %-24s %10.2f %10.2f %8.2f %6.0f%% %8.1fx" % (
                rows, name, g_us, d_us, tbps(nbytes, g_us),
                entry[name]["pct_copy"], full_us / g_us))
        entry["correct"] = fused_correct(rows, None)
        if not entry["correct"]:
            failures.append("%d rows" % rows)
        results["sizes"][str(rows)] = entry
        print()

    best, good = None, []
    if not args.no_sweep:
        grid = list(itertools.product([8, 16, 32, 64], [2, 4, 8], [1, 2, 4, 8, 16]))
        print("sweep: %d configs x %d sizes (graph us)" % (len(grid), len(sizes)))
        for br, nw, pps in grid:
            cfg = {"block_rows": br, "num_warps": nw, "programs_per_sm": pps}
            try:
                us = {rows: graph_time_us(torch, fused(rows, cfg), replays=10) for rows in sizes}
            except Exception as exc:  # a config that does not compile is reported, not fatal
                results["sweep"].append(dict(cfg, error=str(exc)[:200]))
                continue
            correct = fused_correct(min(sizes), cfg)
            if not correct:
                failures.append("config %s" % cfg)
            results["sweep"].append(dict(cfg, us={str(r): v for r, v in us.items()},
                                         correct=correct))
        good = [s for s in results["sweep"] if "us" in s and s["correct"]]
    if good:
        best_at = {r: min(s["us"][str(r)] for s in good) for r in sizes}
        for s in good:  # geometric mean of the slowdown against the best at each size
            s["score"] = math.exp(statistics.mean(
                math.log(s["us"][str(r)] / best_at[r]) for r in sizes))
        good.sort(key=lambda s: s["score"])
        print("%-11s %-9s %-6s %s  score" % ("block_rows", "num_warps", "p/SM",
                                              "  ".join("%9s" % r for r in sizes)))
        for s in good[:10]:
            print("%-11d %-9d %-6d %s  %.3f" % (
                s["block_rows"], s["num_warps"], s["programs_per_sm"],
                "  ".join("%9.2f" % s["us"][str(r)] for r in sizes), s["score"]))
        for r in sizes:
            s = min(good, key=lambda s: s["us"][str(r)])
            print("best at %d rows: block_rows=%d num_warps=%d programs_per_sm=%d: %.2f us, "
                  "%.2f TB/s" % (r, s["block_rows"], s["num_warps"], s["programs_per_sm"],
                                 s["us"][str(r)], tbps(r * ROW_BYTES, s["us"][str(r)])))
        best = {k: good[0][k] for k in ("block_rows", "num_warps", "programs_per_sm")}
        results["suggested_tuning"] = best
        print("best overall (suggested TUNING): %s\n" % best)

    # Targets, on the default tuning and on the best swept one.
    def default_us(r):
        return results["sizes"].get(str(r), {}).get("fused triton", {}).get("graph_us")

    def best_us(r):
        for s in results["sweep"]:
            if "us" in s and all(s[k] == best[k] for k in best):
                return s["us"].get(str(r))
        return None

    targets = {}
    for label, us_at in [("default", default_us)] + ([("best", best_us)] if best else []):
        big, small = us_at(131072), us_at(4096)
        t = targets[label] = {
            "tbps_at_131072": tbps(131072 * ROW_BYTES, big) if big else None,
            "us_at_4096": small,
        }
        t["pass"] = bool(big and small and t["tbps_at_131072"] >= TARGET_TBPS_AT_131072
                         and small < TARGET_US_AT_4096)
        print("target (%s tuning): 131072 rows %s TB/s (want >= %.1f), 4096 rows %s us "
              "(want < %.0f): %s" % (
                  label, "%.2f" % t["tbps_at_131072"] if big else "n/a",
                  TARGET_TBPS_AT_131072, "%.2f" % small if small else "n/a",
                  TARGET_US_AT_4096, "PASS" if t["pass"] else "MISS"))
    results["targets"] = targets

    out = args.out or os.path.join(os.environ.get("OUT", "."), "bench_gather.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))
    print("results written to %s" % out)
    if failures:
        print("FAIL: the fused kernel's result was wrong at %s" % failures, file=sys.stderr)
        return 1
    return 3 if (args.strict and not targets["default"]["pass"]) else 0


if __name__ == "__main__":
    sys.exit(main())
