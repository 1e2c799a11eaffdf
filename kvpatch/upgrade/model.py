"""The upgrade audit's data: categories, the JSON schema, the records."""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple
from kvpatch import RULESET_VERSION, __version__
from kvpatch.patch import Patch
from kvpatch.sites import FIXED_UPSTREAM, GATHERED, NEEDS_ACTION, NOOP, PATCHED, FileError, Record, ScanResult, Site

SCHEMA_ID = "kvpatch.upgrade/1"

UNCHANGED, MOVED, CHANGED, NEW, REMOVED = "unchanged", "moved", "changed", "new", "removed"
REPLACED, UNMATCHED = "replaced", "unmatched"
FIXED = FIXED_UPSTREAM  # the category has the site status's name
SITE_CATEGORIES = (UNMATCHED, NEW, CHANGED, FIXED, REPLACED, REMOVED, MOVED, UNCHANGED)
PLAN_CATEGORIES = (UNMATCHED, NEW, CHANGED, REPLACED, REMOVED, MOVED, UNCHANGED)

from kvpatch.output.exitcodes import EXIT_ACTION, EXIT_ERROR, EXIT_OK  # noqa: E402,F401 - re-exported

_ACTION = NEEDS_ACTION
_HANDLED = (PATCHED,)
_RESOLVED = (GATHERED, FIXED_UPSTREAM, NOOP)
SOURCE_LINES = 40  # a function longer than this is shown in excerpts
MOVED_SIMILARITY = 0.6  # a vanished function "moved" to a same-named one at least this alike


class UpgradeError(Exception):
    """A one-line reason the upgrade audit cannot run (exit 2)."""


# -- the JSON schema -----------------------------------------------------------
_NULLSTR = {"type": ["string", "null"]}
_ENTRY = {
    "type": "object",
    "required": ["category", "action", "why", "key", "file", "qualname", "rule", "buffer", "receiver", "old",
                 "new", "old_status", "new_status", "statement_changed", "replaced_by", "function"],
    "properties": {
        "category": {"enum": list(SITE_CATEGORIES)}, "action": {"type": "boolean"}, "why": {"type": "string"},
        "key": {"type": "string"}, "file": {"type": "string"}, "qualname": {"type": "string"},
        "rule": _NULLSTR, "buffer": _NULLSTR, "receiver": _NULLSTR,
        "old": {"type": ["object", "null"]}, "new": {"type": ["object", "null"]},
        "old_status": _NULLSTR, "new_status": _NULLSTR, "statement_changed": {"type": "boolean"},
        "replaced_by": {"type": "array", "items": {"type": "string"}},
        "function": {"oneOf": [{"type": "null"}, {
            "type": "object",
            "required": ["file", "qualname", "line", "end_line", "reads_kv_buffer", "casts", "source", "truncated"],
        }]},
    },
}
_TREE = {
    "type": "object",
    "required": ["root", "ref", "commit", "files_scanned", "candidate_files", "seconds", "summary"],
    "properties": {"root": {"type": "string"}, "ref": _NULLSTR, "commit": _NULLSTR,
                   "files_scanned": {"type": "integer"}, "candidate_files": {"type": "integer"},
                   "seconds": {"type": "number"},
                   "summary": {"type": "object", "additionalProperties": {"type": "integer"}}},
}
JSON_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "type": "object",
    "required": ["schema", "kvpatch_version", "ruleset_version", "old", "new", "summary", "sites", "plan_calls",
                 "patch", "errors", "action_needed", "exit_code", "seconds"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "kvpatch_version": {"type": "string"}, "ruleset_version": {"type": "string"},
        "old": _TREE, "new": _TREE,
        "summary": {"type": "object", "required": ["sites", "plan_calls"]},
        "sites": {"type": "array", "items": _ENTRY},
        "plan_calls": {"type": "array", "items": _ENTRY},
        "patch": {"type": "object", "required": ["applies", "files", "runtime_files", "refused", "skipped",
                                                  "sites_rewritten", "plans_rewritten"]},
        "errors": {"type": "array", "items": {"type": "object", "required": ["tree", "file", "message", "line"]}},
        "action_needed": {"type": "array", "items": {"type": "string"}},
        "exit_code": {"enum": [0, 1, 2]},
        "seconds": {"type": "number"},
    },
}


# -- records ---------------------------------------------------------------------
@dataclass
class FunctionInfo:
    file: str
    qualname: str
    line: int
    end_line: int
    reads_kv_buffer: bool
    casts: List[Tuple[int, str]]
    plan_calls: int
    source: str
    truncated: bool

    def to_dict(self) -> Dict:
        return {"file": self.file, "qualname": self.qualname, "line": self.line, "end_line": self.end_line,
                "reads_kv_buffer": self.reads_kv_buffer,
                "casts": [{"line": ln, "code": c} for ln, c in self.casts],
                "source": self.source, "truncated": self.truncated}


@dataclass
class Entry:
    category: str
    old: Optional[Record] = None
    new: Optional[Record] = None
    action: bool = False
    why: str = ""
    statement_changed: bool = False
    replaced_by: List[str] = field(default_factory=list)
    function: Optional[FunctionInfo] = None
    action_why: str = ""  # the short reason it needs action

    @property
    def rec(self) -> Record:
        return self.new if self.new is not None else self.old

    @property
    def is_site(self) -> bool:
        return isinstance(self.rec, Site)

    @property
    def key(self) -> str:
        return self.rec.key

    def where(self) -> str:
        """file:line in the new tree (old line in parentheses), or the old place."""
        r = self.rec
        if self.new is not None and self.old is not None and self.old.line != self.new.line:
            return f"{r.file}:{self.new.line} (was {self.old.line})"
        if self.new is None and self.function is not None:
            return f"{r.file}:{self.function.line} (site was at line {self.old.line})"
        return f"{r.file}:{r.line}" + (" (old tree)" if self.new is None else "")

    def to_dict(self) -> Dict:
        r = self.rec
        site = self.is_site
        return {
            "category": self.category, "action": self.action, "why": self.why, "key": self.key,
            "file": r.file, "qualname": r.qualname, "rule": r.rule,
            "buffer": r.buffer if site else None, "receiver": None if site else r.receiver,
            "old": self.old.to_dict() if self.old is not None else None,
            "new": self.new.to_dict() if self.new is not None else None,
            "old_status": self.old.status if self.old is not None else None,
            "new_status": self.new.status if self.new is not None else None,
            "statement_changed": self.statement_changed, "replaced_by": list(self.replaced_by),
            "function": self.function.to_dict() if self.function is not None else None,
        }


@dataclass
class Tree:
    root: Path  # where it was scanned
    display: str  # what to call it
    ref: Optional[str]
    commit: Optional[str]
    scan: ScanResult

    def to_dict(self) -> Dict:
        from kvpatch.output.report import summary_counts

        return {"root": self.display, "ref": self.ref, "commit": self.commit,
                "files_scanned": self.scan.files_scanned, "candidate_files": self.scan.candidates,
                "seconds": round(self.scan.seconds, 3), "summary": summary_counts(self.scan)}


@dataclass
class Upgrade:
    old: Tree
    new: Tree
    sites: List[Entry]
    plans: List[Entry]
    patch: Patch  # of the new tree
    errors: List[Tuple[str, FileError]]  # (tree, error)
    seconds: float = 0.0

    @property
    def action_needed(self) -> List[str]:
        out = []
        for e in self.sites + self.plans:
            if e.action:
                what = "site" if e.is_site else "plan call"
                out.append(f"{e.category} {what} {e.where()} {e.rec.qualname}: {e.action_why or e.why}")
        for r in self.patch.refused:
            out.append(f"apply would refuse {r.file}: {r.message}")
        return out

    @property
    def exit_code(self) -> int:
        if self.errors:
            return EXIT_ERROR
        return EXIT_ACTION if self.action_needed else EXIT_OK

    def counts(self, entries: List[Entry], cats: Sequence[str]) -> Dict[str, int]:
        c = Counter(e.category for e in entries)
        return {k: c.get(k, 0) for k in cats}

    def to_dict(self) -> Dict:
        return {
            "schema": SCHEMA_ID,
            "kvpatch_version": __version__,
            "ruleset_version": RULESET_VERSION,
            "old": self.old.to_dict(),
            "new": self.new.to_dict(),
            "summary": {"sites": self.counts(self.sites, SITE_CATEGORIES),
                        "plan_calls": self.counts(self.plans, PLAN_CATEGORIES)},
            "sites": [e.to_dict() for e in self.sites],
            "plan_calls": [e.to_dict() for e in self.plans],
            "patch": patch_summary(self.patch),
            "errors": [{"tree": t, **e.to_dict()} for t, e in self.errors],
            "action_needed": self.action_needed,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
        }


# -- the patch on the new tree ---------------------------------------------------------
def _diffstat(old: Optional[str], new: str) -> Tuple[int, int]:
    added = removed = 0
    for ln in difflib.unified_diff((old or "").splitlines(), new.splitlines(), lineterm="", n=0):
        if ln.startswith("+") and not ln.startswith("+++"):
            added += 1
        elif ln.startswith("-") and not ln.startswith("---"):
            removed += 1
    return added, removed


def patch_summary(p: Patch) -> Dict:
    files = []
    for r in p.rewrites:
        a, d = _diffstat(r.old_text, r.new_text)
        files.append({"file": r.rel, "sites": [s.key for s in r.sites], "plan_calls": [x.key for x in r.plans],
                      "lines_added": a, "lines_removed": d})
    return {
        "applies": not p.refused,
        "files": files,
        "runtime_files": [{"file": rt.rel, "action": "create" if rt.old is None else "update"} for rt in p.runtimes],
        "refused": [{"file": e.file, "message": e.message} for e in p.refused],
        "skipped": [{"key": s.key, "file": s.file, "line": s.line, "status": s.status, "reason": s.reason}
                    for s in p.skipped()],
        "sites_rewritten": p.sites_rewritten,
        "plans_rewritten": p.plans_rewritten,
    }
