"""python -m kvpatch.verify PATH [...]: a stand-alone front end (exit 1 on failure)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import run_verify


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpatch.verify")
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--mode", action="append", choices=("gather", "native", "auto"))
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, help="write the reports here")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.verbose else None
    reports = []
    for root in a.roots:
        r = run_verify(root, modes=tuple(a.mode or ("gather", "native")), device=a.device,
                       graph=not a.no_graph, quick=a.quick, log=log)
        print(r.format())
        reports.append(r)
    if a.json:
        a.json.write_text(json.dumps([r.to_dict() for r in reports], indent=2))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
