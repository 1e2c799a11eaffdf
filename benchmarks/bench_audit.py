#!/usr/bin/env python3
"""Benchmark `kvpatch audit` on a whole checkout, cold process included.

    python3 benchmarks/bench_audit.py CHECKOUT [-n 5] [--ast-grep PATH] [--json OUT]

Each run is a new process (`kvpatch audit CHECKOUT -q`, output discarded), so
interpreter start, imports and the worker pool are all counted; the page cache
is warmed by one untimed run first. It prints the median, min and max wall
time of N runs and the median CPU time (user + sys of the process and its
workers), which does not depend on what else the machine is doing.

When ast-grep is found (--ast-grep, else `ast-grep` on PATH, else
/tmp/venv-sg/bin/ast-grep; install it away from the project, e.g.
`python3 -m venv /tmp/venv-sg && /tmp/venv-sg/bin/pip install ast-grep-cli`), the
same tree is searched with

    ast-grep run -p '$P.get_key_buffer($$$A).to($D)' --lang python CHECKOUT

in the same run, the two commands interleaved so that both see the same
machine, and the ratio kvpatch / ast-grep is printed. (ast-grep finds only that
one spelling; kvpatch also follows names, views, get_value_buffer, plan calls
and decides each site.)

Exit status: 0 measured (and the median is under --target seconds, 2.0 by
default), 1 the target was missed, 2 the audit itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

PATTERN = "$P.get_key_buffer($$$A).to($D)"


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed(cmd: List[str]) -> Tuple[float, float, int]:
    """(wall seconds, CPU seconds, exit code) of one run."""
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        sys.stderr.write(p.stderr.decode("utf-8", "replace"))
    return wall, _children_cpu() - cpu0, p.returncode


def kvpatch_cmd() -> List[str]:
    exe = Path(sys.executable).with_name("kvpatch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvpatch"]


def find_ast_grep(given: Optional[str]) -> Optional[str]:
    for cand in (given, shutil.which("ast-grep"), "/tmp/venv-sg/bin/ast-grep"):
        if cand and Path(cand).exists():
            return cand
    return None


def summary(xs: List[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "runs": [round(x, 3) for x in xs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path)
    ap.add_argument("-n", "--runs", type=int, default=5, help="timed runs of each command (default 5)")
    ap.add_argument("--ast-grep", dest="ast_grep", help="path to the ast-grep binary")
    ap.add_argument("--no-ast-grep", action="store_true", help="do not time ast-grep")
    ap.add_argument("--target", type=float, default=2.0, help="seconds the kvpatch median must stay under")
    ap.add_argument("--json", dest="json_out", type=Path, help="write the results here too")
    args = ap.parse_args(argv)

    root = args.checkout.resolve()
    if not root.is_dir():
        print(f"error: {root}: not a directory", file=sys.stderr)
        return 2
    kv = kvpatch_cmd() + ["audit", str(root), "-q"]
    sg_bin = None if args.no_ast_grep else find_ast_grep(args.ast_grep)
    sg = [sg_bin, "run", "-p", PATTERN, "--lang", "python", str(root)] if sg_bin else None
    n_py = sum(1 for _ in root.rglob("*.py"))

    load0 = os.getloadavg()
    _, _, rc = timed(kv)  # warm the page cache (and check that the audit works)
    if rc not in (0, 1):
        print(f"error: `{' '.join(kv)}` exited {rc}", file=sys.stderr)
        return 2
    if sg:
        timed(sg)
    kv_wall, kv_cpu, sg_wall, sg_cpu = [], [], [], []
    for _ in range(args.runs):
        w, c, _ = timed(kv)
        kv_wall.append(w)
        kv_cpu.append(c)
        if sg:
            w, c, _ = timed(sg)
            sg_wall.append(w)
            sg_cpu.append(c)
    load1 = os.getloadavg()

    res = {
        "checkout": str(root), "python_files": n_py, "cpus": os.cpu_count(), "runs": args.runs,
        "loadavg_1min": [round(load0[0], 2), round(load1[0], 2)],
        "kvpatch": {"command": " ".join(kv), "wall": summary(kv_wall), "cpu": summary(kv_cpu)},
        "target_seconds": args.target,
    }
    print(f"{root}: {n_py} .py files, {os.cpu_count()} CPUs, load {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"kvpatch audit -q : median {res['kvpatch']['wall']['median']:.3f} s wall "
          f"(min {min(kv_wall):.3f}, max {max(kv_wall):.3f}), {statistics.median(kv_cpu):.3f} s CPU, "
          f"{args.runs} cold runs")
    if sg:
        res["ast_grep"] = {"command": " ".join(sg), "wall": summary(sg_wall), "cpu": summary(sg_cpu)}
        ratio = statistics.median(kv_wall) / statistics.median(sg_wall)
        res["ratio_kvpatch_to_ast_grep"] = round(ratio, 3)
        print(f"ast-grep run -p  : median {statistics.median(sg_wall):.3f} s wall "
              f"(min {min(sg_wall):.3f}, max {max(sg_wall):.3f}), {statistics.median(sg_cpu):.3f} s CPU")
        print(f"ratio kvpatch / ast-grep (wall medians): {ratio:.2f}")
    else:
        print("ast-grep not found: no ratio (see --ast-grep)")
    ok = statistics.median(kv_wall) < args.target
    res["target_met"] = ok
    print(f"target: median < {args.target:.1f} s: {'met' if ok else 'MISSED'}")
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
