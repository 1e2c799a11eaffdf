"""Result records of `kvpatch verify` (no torch here: the CLI imports this freely)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class CaseResult:
    """One forward call of the patched file compared with the original."""

    file: str                      # checkout-relative path of the patched file
    qualname: str                  # site under test, e.g. FlashInferMLAAttnBackend.forward_decode
    path: str                      # "decode" | "prefill" | "target_verify" | "draft_extend"
    mode: str                      # KVPATCH_MODE asked for: gather | native | auto | fused
    exec: str                      # "eager" | "graph" (captured CUDA graph) | "replay" (replay path, no capture)
    batch: str                     # human-readable batch shape
    variant: str = ""              # which SGLang path of a speculative case: eagle | dflash
    kernel: str = ""               # "flashinfer" | "reference"
    kv_path: str = ""              # what the patched run really did: gather | native | fused | cast | ?
    max_abs_err: Optional[float] = None
    identical_share: Optional[float] = None
    tolerance: str = ""            # criterion applied
    status: str = SKIPPED
    message: str = ""
    full_pool_casts: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    @property
    def site(self) -> str:
        return f"{self.file} {self.qualname}"

    @property
    def route(self) -> str:
        """path, and the speculative variant where there is one (target_verify:dflash)."""
        return f"{self.path}:{self.variant}" if self.variant else self.path

    def label(self) -> str:
        return f"{self.route}/{self.mode}/{self.exec} {self.batch}"

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        for k in ("max_abs_err", "identical_share"):
            v = d[k]
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = str(v)  # strict JSON has no NaN/inf
        return d


@dataclass
class VerifyReport:
    root: str
    device: str = ""
    kernel: str = ""
    gpu_ran: bool = False
    reason: str = ""               # why something could not run (empty when all ran)
    cases: List[CaseResult] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)   # target-level failures (load, locate)
    notes: List[str] = field(default_factory=list)
    files: List[str] = field(default_factory=list)    # files verified
    # patched files no driver covers, each with why: their rewrites were NOT verified
    unverified: List[str] = field(default_factory=list)

    @property
    def failures(self) -> List[CaseResult]:
        return [c for c in self.cases if c.failed]

    @property
    def skipped(self) -> List[CaseResult]:
        return [c for c in self.cases if c.status == SKIPPED]

    @property
    def ok(self) -> bool:
        """No failure, no target error, and at least one case really passed."""
        return not self.errors and not self.failures and any(c.passed for c in self.cases)

    def add_reason(self, text: str) -> None:
        if text and text not in self.reason:
            self.reason = f"{self.reason}; {text}" if self.reason else text

    def to_dict(self) -> Dict[str, Any]:
        return {
            "root": self.root,
            "ok": self.ok,
            "device": self.device,
            "kernel": self.kernel,
            "gpu_ran": self.gpu_ran,
            "reason": self.reason,
            "files": list(self.files),
            "unverified": list(self.unverified),
            "errors": list(self.errors),
            "notes": list(self.notes),
            "counts": {
                "passed": sum(c.passed for c in self.cases),
                "failed": len(self.failures),
                "skipped": len(self.skipped),
            },
            "cases": [c.to_dict() for c in self.cases],
        }

    def format_table(self) -> str:
        rows = [("status", "site", "path", "mode", "exec", "kv", "kernel", "max_abs_err",
                 "identical", "batch")]
        for c in self.cases:
            rows.append((
                c.status.upper() if c.failed else c.status,
                f"{c.file.rsplit('/', 1)[-1]}:{c.qualname.rsplit('.', 1)[-1]}",
                c.route, c.mode, c.exec, c.kv_path, c.kernel,
                "-" if c.max_abs_err is None else f"{c.max_abs_err:.3g}",
                "-" if c.identical_share is None else f"{c.identical_share:.4f}",
                c.batch,
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1]
                 for r in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def render(self) -> str:
        return self.format()

    @property
    def verdict(self) -> str:
        return "FAILED" if not self.ok else "PARTLY VERIFIED" if self.unverified else "OK"

    def format(self) -> str:
        out = [f"kvpatch verify {self.root}: {self.verdict}"
               f" (device={self.device or '-'}, kernel={self.kernel or '-'},"
               f" gpu_ran={self.gpu_ran})"]
        if self.cases:
            out.append(self.format_table())
        for e in self.errors:
            out.append(f"ERROR: {e}")
        for u in self.unverified:
            out.append(f"NOT VERIFIED: {u}")
        for c in self.failures:
            out.append(f"FAIL {c.site} [{c.label()}]: {c.message}")
        skipped = {c.message for c in self.skipped}
        for m in sorted(skipped):
            out.append(f"skipped: {m}")
        if self.reason:
            out.append(f"reason: {self.reason}")
        for n in self.notes:
            out.append(f"note: {n}")
        return "\n".join(out)
