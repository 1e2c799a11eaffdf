#!/usr/bin/env python3
"""scan_history: audit every stored version of SGLang's attention backends in a git repository.

For each backend file, every distinct version of it in the repository's history (all refs,
deduplicated by blob) is audited in process, and apply is planned on it: the patched text must
compile and a second apply on it must change nothing. Prints one row per backend (versions,
hot sites rewritten, hot sites left, unsupported, other statuses) and, with --reasons, the
distinct reasons of the sites left. Nothing is written anywhere.

    python tools/scan_history.py /work/.mirror/sshleifer+sglang/repo [--reasons] [--json]
    python tools/scan_history.py /work/.mirror/OWNER+NAME/repo --not-in /work/.mirror/sshleifer+sglang/repo
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpatch.engine import analyze_source  # noqa: E402
from kvpatch.rewrite.transform import RewriteError, plan_rewrite  # noqa: E402
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
    # fork-only backends that handle an FP8 pool (issue 7, forks): HYGON DCU/HCU MLA, FluentLLM's FA,
    # modal-projects' DeepSeek-V4 radix backend; a repository without them just gets no versions
    "layers/attention/dcu_mla_backend.py", "layers/attention/hcu_mla_backend.py",
    "layers/attention/flash_attention_backend.py", "layers/attention/deepseek_v4_backend_radix.py",
)


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def versions(repo: str, path: str, not_in=()):
    """Distinct blobs of `path` over all refs: {blob: first commit seen}, less blobs any `not_in` repo has."""
    out = {}
    for sha in git(repo, "log", "--all", "--format=%h", "--", SRT + path).split():
        line = git(repo, "ls-tree", sha, "--", SRT + path).split()
        if len(line) >= 3 and line[2] not in out:
            out[line[2]] = sha
    for other in not_in:
        out = {b: c for b, c in out.items()
               if subprocess.run(["git", "-C", other, "cat-file", "-e", b], capture_output=True).returncode}
    return out


def scan(repo: str, paths, rules, not_in=()):
    """Rows per path, the reasons of sites left, and failures: (path, commit, blob, what, detail)."""
    rows, left, failed = {}, collections.Counter(), []
    for path in paths:
        row = collections.Counter()
        for blob, sha in versions(repo, path, not_in).items():
            data = subprocess.run(["git", "-C", repo, "cat-file", "blob", blob], check=True,
                                  capture_output=True).stdout
            row["versions"] += 1
            try:
                failure = check(path, sha, data, rules, row, left)
            except Exception as exc:  # a crash of kvpatch itself is a finding, not the end of the scan
                failure = ("crash", "".join(traceback.format_exception_only(type(exc), exc)).strip())
            if failure:
                row[failure[0]] += 1
                failed.append((path, sha, blob, *failure))
        rows[path] = dict(row)
    return rows, left, failed


def check(path, sha, data, rules, row, left):
    fa = analyze_source(SRT + path, data, rules)
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
        return None
    if rw is None:
        return None
    try:
        compile(rw.new_text, f"{sha}:{path}", "exec")
    except SyntaxError as exc:
        return ("patched-does-not-compile", f"{exc.msg} (line {exc.lineno})")
    if plan_rewrite(analyze_source(SRT + path, rw.new_bytes, rules), rules) is not None:
        return ("second-apply-changes", "")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo")
    ap.add_argument("--path", action="append", help="a file under python/sglang/srt/ (default: BACKENDS)")
    ap.add_argument("--not-in", action="append", default=[], metavar="REPO",
                    help="skip blobs another git repository also has (a fork's own versions: --not-in MIRROR)")
    ap.add_argument("--reasons", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows, left, failed = scan(a.repo, a.path or BACKENDS, load_rules(), a.not_in)
    if a.json:
        print(json.dumps({"backends": rows, "left": [dict(zip(("path", "status", "kernel", "reason"), k), versions=n)
                                                      for k, n in left.items()],
                          "failed": [dict(zip(("path", "commit", "blob", "what", "detail"), f)) for f in failed]},
                         indent=1))
        return 1 if failed else 0
    for path, row in rows.items():
        print(f"{path}: " + ", ".join(f"{k} {v}" for k, v in sorted(row.items())))
    for path, sha, blob, what, detail in failed:
        print(f"FAILED {what}: {path} at {sha} (blob {blob}) {detail}")
    if a.reasons:
        for (path, status, kernel, reason), n in sorted(left.items()):
            print(f"\n[{n} versions] {path} {status} {kernel}\n    {reason}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
