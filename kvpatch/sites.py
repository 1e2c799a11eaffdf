"""sites: the records kvpatch reports, and the status vocabulary.

A ``Site`` is one cast (or patched call) of a KV buffer; a ``PlanCall`` is one
FlashInfer MLA ``plan()`` call. Both are plain data: they cross process
boundaries, feed the reports and the upgrade audit, and are written to
``.kvpatch/state.json``. The JSON field names are a public, versioned schema
(see ``report.JSON_SCHEMA``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

# Site statuses.
HOT = "hot"  # casts a whole layer pool; a rule rewrites it, or none does yet
NOOP = "no-op"  # provably the same dtype already
PATCHED = "patched"  # kvpatch's rewrite is present
UNSUPPORTED = "unsupported"  # a pool-wide cast no rule can rewrite safely here
GATHERED = "gathered"  # casts only gathered rows: never pool-wide
FIXED_UPSTREAM = "fixed-upstream"  # the MLA kernel reads the pool without a full cast
SUPPRESSED = "suppressed"  # a `# kvpatch: ignore` comment covers it (kvpatch/analysis/suppress.py)
SITE_STATUSES = (HOT, NOOP, PATCHED, UNSUPPORTED, GATHERED, FIXED_UPSTREAM, SUPPRESSED)
NEEDS_ACTION = (HOT, UNSUPPORTED)

# Plan-call statuses.
PLAN_REWRITE = "rewrite"  # apply retargets its kv dtype
PLAN_PATCHED = "patched"
PLAN_IGNORED = "ignored"  # fast_mla_decode_plan: the dtypes are not used
PLAN_UNSUPPORTED = "unsupported"
PLAN_STATUSES = (PLAN_REWRITE, PLAN_PATCHED, PLAN_IGNORED, PLAN_UNSUPPORTED, SUPPRESSED)


@dataclass
class Site:
    file: str
    line: int
    end_line: int
    column: int
    qualname: str
    path: str  # prefill | decode | other
    backend: str
    buffer: str  # the pool expression, e.g. self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    dtype: str  # the dtype expression cast to, e.g. q.dtype
    form: str  # inline | two-statement | patched
    kernel: str  # the call that consumes the result
    status: str
    reason: str
    rule: Optional[str]  # id of the rule that decided the status
    fixable: bool = False  # apply would rewrite it
    statement: str = ""  # the source of the statement holding the site
    notes: List[str] = field(default_factory=list)
    suppressed_line: Optional[int] = None  # the line of the `# kvpatch: ignore` comment

    @property
    def key(self) -> str:
        """Line-independent identity, for the upgrade audit."""
        return f"{self.file}::{self.qualname}::{self.rule or '-'}::{self.buffer}"

    def to_dict(self) -> Dict:
        return asdict(self)


@dataclass
class PlanCall:
    file: str
    line: int
    qualname: str
    receiver: str
    form: str  # positional | keyword | function
    q_dtype: Optional[str]
    kv_dtype: Optional[str]
    page_size: Optional[str]
    causal: Optional[str]
    status: str
    reason: str
    rule: Optional[str]
    fixable: bool = False
    statement: str = ""
    suppressed_line: Optional[int] = None  # the line of the `# kvpatch: ignore` comment

    @property
    def key(self) -> str:
        return f"{self.file}::{self.qualname}::plan::{self.receiver}"

    def to_dict(self) -> Dict:
        return asdict(self)


# A finding of the audit: a cast site or a plan call (tell them apart with isinstance).
Record = Union[Site, PlanCall]


@dataclass
class FileError:
    file: str
    message: str
    line: Optional[int] = None

    def to_dict(self) -> Dict:
        return asdict(self)


@dataclass
class FileRecords:
    """What crosses process boundaries."""

    rel: str
    sites: List[Site]
    plans: List[PlanCall]
    errors: List[FileError]
    fixable: bool
    # What scan_tree's `plan` hook made of this file when fixable (apply: its
    # rewrite, made where the file was analysed, holding these same records).
    planned: Any = None


@dataclass
class ScanResult:
    root: Path
    files_scanned: int
    candidates: int
    files: List[FileRecords]
    errors: List[FileError]
    seconds: float

    @property
    def sites(self) -> List[Site]:
        return [s for f in self.files for s in f.sites]

    @property
    def plans(self) -> List[PlanCall]:
        return [p for f in self.files for p in f.plans]

    @property
    def all_errors(self) -> List[FileError]:
        return self.errors + [e for f in self.files for e in f.errors]


def path_kind(qualname: str) -> str:
    name = qualname.rsplit(".", 1)[-1].lower()
    if "decode" in name:
        return "decode"
    if "extend" in name or "prefill" in name:
        return "prefill"
    return "other"


def backend_name(rel: str) -> str:
    parts = rel.split("/")
    stem = parts[-1][:-3] if parts[-1].endswith(".py") else parts[-1]
    for suffix in ("_backend", "_attn_backend", "_attention_backend"):
        if stem.endswith(suffix) and stem != suffix:
            stem = stem[: -len(suffix)]
            break
    if "hardware_backend" in parts:
        i = parts.index("hardware_backend")
        if i + 1 < len(parts) - 1:
            return f"{parts[i + 1]}/{stem}"
    return stem
