#!/usr/bin/env python3
"""scan_history: audit every stored version of SGLang's attention backends in a git repository.

For each backend file, every distinct version of it in the repository's history (all refs,
deduplicated by blob) is audited in process, and apply is planned on it: the patched text must
compile and a second apply on it must change nothing. Prints one row per backend (versions,
hot sites rewritten, hot sites left, unsupported, other statuses) and, with --reasons, the
distinct reasons of the sites left. Nothing is written anywhere.

    python tools/scan_history.py /work/.mirror/sshleifer+sglang/repo [--reasons] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpatch.engine import analyze_source  # noqa: E402
from kvpatch.rewrite import RewriteError, plan_rewrite  # noqa: E402
from kvpatch.rule import load_rules  # noqa: E402
from kvpatch.sites import HOT, UNSUPPORTED  # noqa: E402

SRT = "python/sglang/srt/"
BACKENDS = (  # the backends issue 7 names, plus the page-table family itself
    "layers/attention/aiter_backend.py", "layers/attention/nsa_backend.py", "layers/attention/dsa_backend.py",
    "layers/attention/trtllm_mla_backend.py", "layers/attention/tokenspeed_mla_backend.py",
    "layers/attention/ascend_backend.py", "hardware_backend/npu/attention/ascend_backend.py",
    "hardware_backend/npu/attention/ascend_dsv4_backend.py", "layers/attention/xpu_backend.py",
    "layers/attention/flashattention_backend.py", "hardware_backend/musa/attention/flashattention_backend.py",
    "layers/attention/flashmla_backend.py", "layers/attention/cutlass_mla_backend.py",
    "layers/attention/flashinfer_mla_backend.py",
)


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def versions(repo: str, path: str):
    """Distinct blobs of `path` over all refs: {blob: first commit seen}."""
    out = {}
    for sha in git(repo, "log", "--all", "--format=%h", "--", SRT + path).split():
        line = git(repo, "ls-tree", sha, "--", SRT + path).split()
        if len(line) >= 3 and line[2] not in out:
            out[line[2]] = sha
    return out


def scan(repo: str, paths, rules):
    rows, left = {}, collections.Counter()
    for path in paths:
        row = collections.Counter()
        for blob, sha in versions(repo, path).items():
            data = subprocess.run(["git", "-C", repo, "cat-file", "blob", blob], check=True,
                                  capture_output=True).stdout
            fa = analyze_source(SRT + path, data, rules)
            row["versions"] += 1
            for s in fa.sites:
                key = "rewritten" if s.status == HOT and s.fixable else s.status
                row[key] += 1
                if s.status in (HOT, UNSUPPORTED) and not s.fixable:
                    left[(path, s.status, s.kernel, re.sub(r"line \d+", "line N", s.reason))] += 1
            try:
                rw = plan_rewrite(fa, rules)
            except RewriteError as exc:
                row["apply-refused"] += 1
                left[(path, "apply-refused", "", str(exc))] += 1
                continue
            if rw is None:
                continue
            compile(rw.new_text, f"{sha}:{path}", "exec")
            if plan_rewrite(analyze_source(SRT + path, rw.new_bytes, rules), rules) is not None:
                row["second-apply-changes"] += 1
        rows[path] = dict(row)
    return rows, left


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo")
    ap.add_argument("--path", action="append", help="a file under python/sglang/srt/ (default: BACKENDS)")
    ap.add_argument("--reasons", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows, left = scan(a.repo, a.path or BACKENDS, load_rules())
    if a.json:
        print(json.dumps({"backends": rows, "left": [dict(zip(("path", "status", "kernel", "reason"), k), versions=n)
                                                      for k, n in left.items()]}, indent=1))
        return 0
    for path, row in rows.items():
        print(f"{path}: " + ", ".join(f"{k} {v}" for k, v in sorted(row.items())))
    if a.reasons:
        for (path, status, kernel, reason), n in sorted(left.items()):
            print(f"\n[{n} versions] {path} {status} {kernel}\n    {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
