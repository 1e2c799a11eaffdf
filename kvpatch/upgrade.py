"""upgrade: what changed for kvpatch between two versions of a checkout.

``kvpatch audit PATH --against REF`` compares git REF of PATH's repository
(old) with PATH's working tree (new); ``kvpatch audit OLD_DIR NEW_DIR``
compares two trees. Both trees are audited, every site and plan call is
paired across them by its line-independent identity (file, qualname, rule,
buffer), and each gets one category. Then ``patch.build`` runs on the new
tree: which files apply would rewrite, which it refuses, and why.

Site categories
    unchanged       same identity, same statement (ignoring formatting and
                    comments), same line
    moved           same identity and statement, another line; or the same
                    statement in a moved file or a renamed function
    changed         same identity, another statement (both are shown); also
                    when only the rule or the buffer expression changed
                    (e.g. ``forward_batch.token_to_kv_pool`` -> ``self.token_to_kv_pool``)
    new             only in the new tree
    removed         only in the old tree, and its function is gone (when a
                    same-named function of the new tree is at least 60% alike,
                    the function "moved" there and the categories below apply)
    fixed-upstream  a site that needed action (hot, unsupported, patched) whose
                    function is still there, but whose cast is gone or is no
                    longer pool-wide: its status in new is gathered,
                    fixed-upstream or no-op, or no cast is left in the function
    replaced        only in the old tree; the function is still there and holds
                    other sites now (listed in ``replaced_by``)
    unmatched       only in the old tree; the function is still there and still
                    casts something (or reads a KV buffer and casts), but no
                    rule finds a site: a person must look (its source is shown)

Plan-call categories: unchanged, moved, changed, new, removed (the call is
gone; ``why`` says whether its function is), replaced, unmatched (the
function still calls ``.plan(`` but no call is recognised).

Action needed (exit 1): a new hot or unsupported site; a site that became hot
or unsupported, or that apply rewrote (or had patched) in old and cannot
rewrite in new; an unmatched site or plan call; a plan call that is new, or
became, unsupported; or a file whose rewrite apply would refuse. A site that
changed shape but is still rewritten, or that was already hot and unfixable
before, is reported and does not fail the gate. Exit 2: an error (bad path or
ref, a file that does not parse or decode in either tree).

JSON (``--json``), schema id ``kvpatch.upgrade/1`` (``JSON_SCHEMA`` below is the
machine-readable form; additive changes keep the id)::

    {
      "schema": "kvpatch.upgrade/1",
      "kvpatch_version": str, "ruleset_version": str,
      "old": TREE, "new": TREE,
      "summary": {"sites": {CATEGORY: int}, "plan_calls": {CATEGORY: int}},
      "sites": [ENTRY], "plan_calls": [ENTRY],
      "patch": {
        "applies": bool,              # no file refused
        "files": [{"file": str, "sites": [key], "plan_calls": [key],
                   "lines_added": int, "lines_removed": int}],
        "runtime_files": [{"file": str, "action": "create" | "update"}],
        "refused": [{"file": str, "message": str}],
        "skipped": [{"key": str, "file": str, "line": int, "status": str, "reason": str}],
        "sites_rewritten": int, "plans_rewritten": int
      },
      "errors": [{"tree": "old" | "new", "file": str, "message": str, "line": int | null}],
      "action_needed": [str],         # one line per reason for exit 1
      "exit_code": 0 | 1 | 2,
      "seconds": float
    }
    TREE  = {"root": str, "ref": str | null, "commit": str | null,
             "files_scanned": int,          # .py files (at REF: all of them, from git)
             "candidate_files": int, "seconds": float,
             "summary": {STATUS: int}}      # site statuses, as in kvpatch.audit/1
    ENTRY = {"category": CATEGORY, "action": bool, "why": str,
             "key": str,                    # the new record's key, else the old one's
             "file": str, "qualname": str, "rule": str | null,
             "buffer": str | null,         # sites; plan calls: null
             "receiver": str | null,       # plan calls; sites: null
             "old": SITE | PLAN | null, "new": SITE | PLAN | null,   # as in kvpatch.audit/1
             "old_status": str | null, "new_status": str | null,
             "statement_changed": bool,
             "replaced_by": [key],
             "function": null | {"file": str, "qualname": str, "line": int, "end_line": int,
                                 "reads_kv_buffer": bool, "casts": [{"line": int, "code": str}],
                                 "source": str, "truncated": bool}}

SARIF (``--sarif``): one SARIF 2.1.0 result per new, changed or unmatched
entry and per refused file, located in the new tree (rules KVU001 new-site,
KVU002 changed-site, KVU003 unmatched-function, KVU004 patch-refused); level
error when the entry needs action, else note.
"""

from __future__ import annotations

import ast
import difflib
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from kvpatch import RULESET_VERSION, __version__
from kvpatch.locate import KV_GETTERS, kv_tainted, reads_kv

SCHEMA_ID = "kvpatch.upgrade/1"

UNCHANGED, MOVED, CHANGED, NEW, REMOVED = "unchanged", "moved", "changed", "new", "removed"
FIXED, REPLACED, UNMATCHED = "fixed-upstream", "replaced", "unmatched"
SITE_CATEGORIES = (UNMATCHED, NEW, CHANGED, FIXED, REPLACED, REMOVED, MOVED, UNCHANGED)
PLAN_CATEGORIES = (UNMATCHED, NEW, CHANGED, REPLACED, REMOVED, MOVED, UNCHANGED)

EXIT_OK, EXIT_ACTION, EXIT_ERROR = 0, 1, 2

# Site statuses, as in kvpatch.sites (imported lazily: the engine pulls libcst).
_ACTION = ("hot", "unsupported")
_HANDLED = ("patched",)
_RESOLVED = ("gathered", "fixed-upstream", "no-op")
CAST_METHODS = ("float", "half", "bfloat16", "double")
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
    old: object = None  # Site | PlanCall | None
    new: object = None
    action: bool = False
    why: str = ""
    statement_changed: bool = False
    replaced_by: List[str] = field(default_factory=list)
    function: Optional[FunctionInfo] = None
    action_why: str = ""  # the short reason it needs action

    @property
    def rec(self):
        return self.new if self.new is not None else self.old

    @property
    def is_site(self) -> bool:
        return hasattr(self.rec, "buffer")

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
    scan: object  # engine.ScanResult

    def to_dict(self) -> Dict:
        from kvpatch.report import summary_counts

        return {"root": self.display, "ref": self.ref, "commit": self.commit,
                "files_scanned": self.scan.files_scanned, "candidate_files": self.scan.candidates,
                "seconds": round(self.scan.seconds, 3), "summary": summary_counts(self.scan)}


@dataclass
class Upgrade:
    old: Tree
    new: Tree
    sites: List[Entry]
    plans: List[Entry]
    patch: object  # patch.Patch (of the new tree)
    errors: List[Tuple[str, object]]  # (tree, FileError)
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


# -- statements and functions ------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def normalize_statement(text: str) -> str:
    """A statement's meaning without its layout or comments: `ast.dump` when it
    parses, else its tokens with whitespace collapsed."""
    for candidate in (text, textwrap.dedent(text), "if 1:\n" + textwrap.indent(text, "    ")):
        try:
            return ast.dump(ast.parse(candidate))
        except (SyntaxError, ValueError):
            continue
    no_comments = re.sub(r"#[^\n]*", "", text)
    return " ".join(no_comments.split())


def _function_nodes(tree: ast.Module) -> Dict[str, ast.AST]:
    """qualname -> def node, with the nesting locate uses (classes, module-level if/try/with)."""
    out: Dict[str, ast.AST] = {}

    def visit(body, chain: Tuple[str, ...], top: bool) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                visit(stmt.body, chain + (stmt.name,), False)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(".".join(chain + (stmt.name,)), stmt)
            elif top and isinstance(stmt, (ast.If, ast.Try, ast.With)):
                for sub in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, sub, []) or [], chain, top)
                for h in getattr(stmt, "handlers", []) or []:
                    visit(h.body, chain, top)

    visit(tree.body, (), True)
    return out


def _device_like(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int)):
        return True
    if isinstance(node, ast.Attribute) and node.attr == "device":
        return True
    if isinstance(node, ast.Name) and "device" in node.id.lower():
        return True
    if isinstance(node, ast.Call):
        f = node.func
        return (isinstance(f, ast.Name) and f.id == "device") or (isinstance(f, ast.Attribute) and f.attr == "device")
    return False


# Identifiers that name KV-cache data even when no known getter is in sight
# (a renamed getter, `self.token_to_kv_pool.fetch(...)`, a `k_buffer`): the
# upgrade audit must still flag such a cast for a look by hand.
_KV_WORD = re.compile(r"kv|k_buf|v_buf|key_buffer|value_buffer|kpe", re.IGNORECASE)


def _of_kv_data(node: ast.AST, tainted) -> bool:
    if reads_kv(node, tainted):
        return True
    return any(_KV_WORD.search(n.id if isinstance(n, ast.Name) else n.attr)
               for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute)))


def is_cast_call(node: ast.AST) -> bool:
    """`x.to(<dtype>)` (not a device move), `x.float()` and friends, `x.type(T)`."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    attr = node.func.attr
    if attr in CAST_METHODS:
        return not node.args and not node.keywords
    if attr == "type":
        return len(node.args) == 1 and not node.keywords
    if attr != "to":
        return False
    if any(k.arg == "dtype" for k in node.keywords):
        return True
    if not node.args:
        return False
    if len(node.args) == 1:
        return not _device_like(node.args[0])
    return not _device_like(node.args[1])


def _excerpt(lines: List[str], start: int, end: int, marks: Iterable[int], limit: int = SOURCE_LINES) -> Tuple[str, bool]:
    """The function's source (lines start..end, 1-based); a long one as its
    header plus windows around the marked lines."""
    body = lines[start - 1:end]
    if len(body) <= limit:
        return "".join(body).rstrip("\n") + "\n", False
    keep = set(range(start, min(start + 3, end + 1)))
    for ln in sorted(set(marks)):
        keep |= set(range(max(start, ln - 3), min(end, ln + 3) + 1))
    out: List[str] = []
    last = start - 1
    shown = 0
    for ln in sorted(keep):
        if shown >= limit * 2:
            break
        if ln > last + 1:
            out.append(f"    ... ({ln - last - 1} lines)\n")
        out.append(lines[ln - 1] if lines[ln - 1].endswith("\n") else lines[ln - 1] + "\n")
        last, shown = ln, shown + 1
    if last < end:
        out.append(f"    ... ({end - last} lines)\n")
    return "".join(out), True


class Functions:
    """The functions of one tree's files, parsed on demand."""

    def __init__(self, root: Path, ref_tree: Optional["RefTree"] = None) -> None:
        self.root = root
        self.ref_tree = ref_tree  # a git commit written out in part: the rest is read from git
        self._files: Dict[str, Optional[Tuple[List[str], Dict[str, ast.AST], str]]] = {}

    def _load(self, rel: str):
        if rel not in self._files:
            got = None
            p = self.root / rel
            try:
                data = p.read_bytes() if self.ref_tree is None or p.is_file() else self.ref_tree.read(rel)
                if data is None:
                    raise OSError(rel)
                text = data.decode("utf-8", errors="replace")
                tree = ast.parse(data)
                got = (text.splitlines(True), _function_nodes(tree), text)
            except (OSError, SyntaxError, ValueError):
                got = None
            self._files[rel] = got
        return self._files[rel]

    def file_exists(self, rel: str) -> bool:
        if self.ref_tree is not None:
            return self.ref_tree.exists(rel)
        return (self.root / rel).is_file()

    def present(self, rel: str, qualname: str) -> bool:
        got = self._load(rel)
        return got is not None and qualname in got[1]

    def qualnames(self, rel: str) -> List[str]:
        got = self._load(rel)
        return list(got[1]) if got is not None else []

    def lines_of(self, rel: str, qualname: str) -> List[str]:
        """The function's lines, stripped (for similarity)."""
        got = self._load(rel)
        if got is None or qualname not in got[1]:
            return []
        fn = got[1][qualname]
        return [ln.strip() for ln in got[0][fn.lineno - 1:fn.end_lineno] if ln.strip()]

    def info(self, rel: str, qualname: str) -> Optional[FunctionInfo]:
        got = self._load(rel)
        if got is None or qualname not in got[1]:
            return None
        lines, nodes, text = got
        fn = nodes[qualname]
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        end = fn.end_lineno or fn.lineno
        reads = False
        casts: List[Tuple[int, str]] = []
        plans = 0
        marks: List[int] = []
        nodes = list(ast.walk(fn))
        tainted = kv_tainted(fn, nodes)
        for n in nodes:
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else "")
            if name in KV_GETTERS:
                reads = True
                marks.append(n.lineno)
            if name in ("plan", "fast_mla_decode_plan"):
                plans += 1
                marks.append(n.lineno)
            if name == "run":
                marks.append(n.lineno)
            # Only a cast of KV data can be a site no rule finds; a cast of q or o is not.
            if is_cast_call(n) and _of_kv_data(n.func.value, tainted):
                code = ast.get_source_segment(text, n) or ""
                casts.append((n.lineno, " ".join(code.split())[:160]))
                marks.append(n.lineno)
        casts.sort()
        source, truncated = _excerpt(lines, start, end, marks)
        return FunctionInfo(rel, qualname, start, end, reads, casts, plans, source, truncated)


# -- pairing ---------------------------------------------------------------------
_GETTER = re.compile(r"\.(get_\w+)\s*\(")


def _getter(buffer: str) -> str:
    found = _GETTER.findall(buffer or "")
    return found[-1] if found else ""


def _same(a, b) -> bool:
    return normalize_statement(a.statement) == normalize_statement(b.statement)


def _pair(olds: List, news: List, tiers: Sequence[Callable]) -> Tuple[List[Tuple], List, List]:
    """Pair records tier by tier; within a tier, equal statements first, then in line order."""
    pairs: List[Tuple] = []
    rem_old, rem_new = sorted(olds, key=lambda r: (r.file, r.line)), sorted(news, key=lambda r: (r.file, r.line))
    for tier in tiers:
        by_old: Dict = {}
        for r in rem_old:
            k = tier(r, True)
            if k is not None:
                by_old.setdefault(k, []).append(r)
        by_new: Dict = {}
        for r in rem_new:
            k = tier(r, False)
            if k is not None:
                by_new.setdefault(k, []).append(r)
        used_old, used_new = set(), set()
        for k in by_old:
            os_, ns = by_old[k], by_new.get(k, [])
            if not ns:
                continue
            free = list(ns)
            rest = []
            for o in os_:
                n = next((n for n in free if _same(n, o)), None)
                if n is not None:
                    free.remove(n)
                    pairs.append((o, n))
                    used_old.add(id(o))
                    used_new.add(id(n))
                else:
                    rest.append(o)
            for o, n in zip(rest, free):
                pairs.append((o, n))
                used_old.add(id(o))
                used_new.add(id(n))
        rem_old = [r for r in rem_old if id(r) not in used_old]
        rem_new = [r for r in rem_new if id(r) not in used_new]
    return pairs, rem_old, rem_new


class Trees:
    """Both trees' files, for the questions the pairing asks."""

    def __init__(self, old_root: Optional[Path], new_root: Path, new_candidates: Sequence[str] = (),
                 ref_tree: Optional["RefTree"] = None) -> None:
        self.old = Functions(old_root, ref_tree) if old_root is not None else None
        self.new = Functions(new_root)
        self.new_candidates = list(new_candidates)

    def only_here(self, rec, is_old: bool) -> bool:
        """The record's file exists only on its own side (moved or renamed)."""
        if is_old:
            return not self.new.file_exists(rec.file)
        return self.old is not None and not self.old.file_exists(rec.file)

    def fn_only_here(self, rec, is_old: bool) -> bool:
        """The record's function exists only on its own side."""
        if is_old:
            return not self.new.present(rec.file, rec.qualname)
        return self.old is not None and not self.old.present(rec.file, rec.qualname)

    def moved_to(self, rec) -> Optional[Tuple[str, str, float]]:
        """Where an old record's vanished function went: the most similar
        function of the same name among the new tree's candidate files."""
        if self.old is None:
            return None
        src = self.old.lines_of(rec.file, rec.qualname)
        if not src:
            return None
        name = rec.qualname.rsplit(".", 1)[-1]
        best: Optional[Tuple[str, str, float]] = None
        for rel in self.new_candidates:
            for q in self.new.qualnames(rel):
                if q.rsplit(".", 1)[-1] != name or (rel == rec.file and q == rec.qualname):
                    continue
                if self.old.present(rel, q):
                    continue  # it was there already: not where this one went
                other = self.new.lines_of(rel, q)
                sm = difflib.SequenceMatcher(None, src, other, autojunk=False)
                if sm.real_quick_ratio() < MOVED_SIMILARITY or sm.quick_ratio() < MOVED_SIMILARITY:
                    continue
                r = sm.ratio()
                if r >= MOVED_SIMILARITY and (best is None or r > best[2]):
                    best = (rel, q, r)
        return best


def _nb(buffer: Optional[str]) -> str:
    """A buffer expression without its layout (a reformat keeps the identity)."""
    return re.sub(r",\)", ")", re.sub(r"\s+", "", buffer or ""))


def _site_tiers(t: Trees) -> List[Callable]:
    direct = lambda s: s.form == "direct"  # noqa: E731 - a pool with no cast pairs only with its kind
    return [
        lambda s, old: (s.file, s.qualname, s.rule, _nb(s.buffer), direct(s)),
        lambda s, old: (s.file, s.qualname, _nb(s.buffer), direct(s)),  # the rule changed
        lambda s, old: (s.file, s.qualname, s.rule, _getter(s.buffer), direct(s)),  # the buffer expression changed
        # the file moved: an old record whose file is gone, a new one whose file is new
        lambda s, old: (s.qualname, s.rule, _nb(s.buffer), direct(s)) if t.only_here(s, old) else None,
        # the function moved or was renamed, the statement kept
        lambda s, old: (s.rule, _nb(s.buffer), direct(s), normalize_statement(s.statement))
        if t.fn_only_here(s, old) else None,
        # a cast that needed action is gone and the same pool now reaches the kernel uncast:
        # fixed upstream (the other way round, a cast arriving, stays a new site)
        lambda s, old: (s.file, s.qualname, _nb(s.buffer))
        if (old and not direct(s) and s.status in _ACTION + _HANDLED) or (not old and direct(s)) else None,
    ]


def _plan_tiers(t: Trees) -> List[Callable]:
    return [
        lambda p, old: (p.file, p.qualname, p.receiver),
        lambda p, old: (p.file, p.qualname, p.form),
        lambda p, old: (p.qualname, p.receiver, p.form) if t.only_here(p, old) else None,
        lambda p, old: (p.receiver, normalize_statement(p.statement)) if t.fn_only_here(p, old) else None,
    ]


def _needs(rec) -> bool:
    """Needs a person: hot/unsupported and not something apply rewrites."""
    return rec.status in _ACTION and not rec.fixable


def _s(rec) -> str:
    return f"{rec.status}{', ' + rec.rule if rec.rule else ''}{', apply rewrites it' if rec.fixable else ''}"


def _one(text: Optional[str]) -> str:
    return " ".join((text or "").split())


def _relocated(o, n) -> str:
    if o.file != n.file:
        return f"moved from {o.file}::{o.qualname}" if o.qualname != n.qualname else f"file moved from {o.file}"
    if o.qualname != n.qualname:
        return f"function renamed from {o.qualname}"
    return ""


def compare_sites(old_sites: List, new_sites: List, t: Trees) -> List[Entry]:
    pairs, only_old, only_new = _pair(old_sites, new_sites, _site_tiers(t))
    out: List[Entry] = []
    for o, n in pairs:
        same = _same(o, n)
        e = Entry(UNCHANGED, o, n, statement_changed=not same)
        where = _relocated(o, n)
        if (o.status in _ACTION + _HANDLED) and n.status in _RESOLVED:
            e.category = FIXED
            e.why = f"{o.status} -> {n.status}: {_one(n.reason)}"
        elif same:
            e.category = UNCHANGED if o.line == n.line and not where else MOVED
            e.why = "same statement" + (f", line {o.line} -> {n.line}" if o.line != n.line else "")
        else:
            e.category = CHANGED
            what = []
            if o.rule != n.rule:
                what.append(f"rule {o.rule} -> {n.rule}")
            if _nb(o.buffer) != _nb(n.buffer):
                what.append(f"buffer `{_one(o.buffer)}` -> `{_one(n.buffer)}`")
            e.why = "statement changed" + (f" ({'; '.join(what)})" if what else "")
        if where:
            e.why += f"; {where}"
        if o.status != n.status and e.category != FIXED:
            e.why += f"; status {o.status} -> {n.status}"
        became_action = n.status in _ACTION and o.status not in _ACTION + _HANDLED
        lost_fix = _needs(n) and (o.fixable or o.status in _HANDLED)
        if became_action or lost_fix:
            e.action = True
            e.why += f"; now {_s(n)}: {_one(n.reason)}"
            e.action_why = f"became {_s(n)}" if became_action else "apply no longer rewrites it"
        out.append(e)
    for n in only_new:
        e = Entry(NEW, None, n, statement_changed=True)
        e.why = _one(n.reason)
        e.action = n.status in _ACTION
        e.action_why = f"new {_s(n)}"
        out.append(e)
    new_by_fn: Dict[Tuple[str, str], List] = {}
    for n in new_sites:
        new_by_fn.setdefault((n.file, n.qualname), []).append(n)
    for o in only_old:
        e = Entry(REMOVED, o, None, statement_changed=True)
        file, qualname, moved = o.file, o.qualname, ""
        if not t.new.present(o.file, o.qualname):
            dest = t.moved_to(o)
            if dest is None:
                gone = "the file is gone" if not t.new.file_exists(o.file) else f"`{o.qualname}` is gone from {o.file}"
                e.why = f"{gone} (was {o.status})"
                out.append(e)
                continue
            file, qualname = dest[0], dest[1]
            moved = f"`{o.qualname}` is gone, and {file}::{qualname} ({dest[2]:.0%} like it) "
        others = new_by_fn.get((file, qualname), [])
        if others:
            e.replaced_by = [s.key for s in others]
            if o.status in _ACTION + _HANDLED and not any(s.status in _ACTION for s in others):
                e.category = FIXED
                e.why = (f"was {o.status}; {moved or f'`{qualname}` '}now holds only "
                         + ", ".join(f"a {s.status} site (line {s.line})" for s in others))
            else:
                e.category = REPLACED
                e.why = f"was {o.status}; {moved or f'`{qualname}` '}now holds " + ", ".join(
                    f"a {s.status} site (line {s.line})" for s in others)
            out.append(e)
            continue
        info = t.new.info(file, qualname)
        if info is not None and info.casts:
            e.category = UNMATCHED
            e.function = info
            e.action = True
            e.why = (f"was {o.status}; {moved or f'`{qualname}` '}still "
                     f"{'reads a KV buffer and ' if info.reads_kv_buffer else ''}casts ({len(info.casts)} cast "
                     f"call(s), first at line {info.casts[0][0]}) but no rule finds a site: check by hand")
            e.action_why = "no rule matches it any more, and the function still casts: check by hand"
        else:
            e.category = FIXED if o.status in _ACTION + _HANDLED else REPLACED
            e.why = (f"was {o.status}; {moved or f'`{qualname}` is still there and '}casts nothing"
                     + (" (it still reads the KV buffer)" if info is not None and info.reads_kv_buffer else ""))
        out.append(e)
    return _order(out, SITE_CATEGORIES)


def compare_plans(old_plans: List, new_plans: List, t: Trees) -> List[Entry]:
    pairs, only_old, only_new = _pair(old_plans, new_plans, _plan_tiers(t))
    out: List[Entry] = []
    for o, n in pairs:
        same = _same(o, n)
        e = Entry(UNCHANGED if same and o.line == n.line and not _relocated(o, n) else MOVED if same else CHANGED,
                  o, n, statement_changed=not same)
        e.why = "same call" if same else "call changed" + (
            f" (receiver `{o.receiver}` -> `{n.receiver}`)" if o.receiver != n.receiver else "") + (
            f" (form {o.form} -> {n.form})" if o.form != n.form else "")
        if _relocated(o, n):
            e.why += f"; {_relocated(o, n)}"
        if o.status != n.status:
            e.why += f"; status {o.status} -> {n.status}"
        if n.status == "unsupported" and o.status != "unsupported":
            e.action = True
            e.why += f": {_one(n.reason)}"
            e.action_why = f"plan call now unsupported: {_one(n.reason)}"
        out.append(e)
    for n in only_new:
        e = Entry(NEW, None, n, statement_changed=True, why=_one(n.reason))
        e.action = n.status == "unsupported"
        e.action_why = f"new unsupported plan call: {_one(n.reason)}"
        out.append(e)
    new_by_fn: Dict[Tuple[str, str], List] = {}
    for n in new_plans:
        new_by_fn.setdefault((n.file, n.qualname), []).append(n)
    for o in only_old:
        e = Entry(REMOVED, o, None, statement_changed=True)
        if not t.new.present(o.file, o.qualname):
            e.why = f"`{o.qualname}` is gone" + (" (the file is gone)" if not t.new.file_exists(o.file) else "")
        elif new_by_fn.get((o.file, o.qualname)):
            e.category = REPLACED
            e.replaced_by = [p.key for p in new_by_fn[(o.file, o.qualname)]]
            e.why = f"`{o.qualname}` now makes other plan calls"
        else:
            info = t.new.info(o.file, o.qualname)
            if info is not None and info.plan_calls:
                e.category, e.function, e.action = UNMATCHED, info, True
                e.why = (f"`{o.qualname}` still calls plan() ({info.plan_calls} call(s)) but none is recognised "
                         f"as a FlashInfer MLA plan: check by hand")
                e.action_why = "no plan call recognised any more, and the function still calls plan(): check by hand"
            else:
                e.why = f"the plan call is gone; `{o.qualname}` is still there"
        out.append(e)
    return _order(out, PLAN_CATEGORIES)


def _order(entries: List[Entry], cats: Sequence[str]) -> List[Entry]:
    rank = {c: i for i, c in enumerate(cats)}
    return sorted(entries, key=lambda e: (rank.get(e.category, 99), e.rec.file,
                                          e.new.line if e.new is not None else e.old.line))


# -- the patch on the new tree ---------------------------------------------------------
def _diffstat(old: Optional[str], new: str) -> Tuple[int, int]:
    added = removed = 0
    for ln in difflib.unified_diff((old or "").splitlines(), new.splitlines(), lineterm="", n=0):
        if ln.startswith("+") and not ln.startswith("+++"):
            added += 1
        elif ln.startswith("-") and not ln.startswith("---"):
            removed += 1
    return added, removed


def patch_summary(p) -> Dict:
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


# -- materializing a git ref -------------------------------------------------------------
def _git(args: List[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, **kw)
    except FileNotFoundError as exc:
        raise UpgradeError("--against needs git on PATH") from exc


def git_location(root: Path) -> Tuple[Path, str]:
    """(repository top level, root's path inside it with a trailing slash or '')."""
    d = root if root.is_dir() else root.parent
    r = _git(["rev-parse", "--show-toplevel", "--show-prefix"], d, text=True)
    if r.returncode != 0:
        raise UpgradeError(f"{root}: not inside a git repository (--against REF compares with a git revision; "
                           f"to compare two trees use `kvpatch audit OLD_DIR NEW_DIR`)")
    top, prefix = (r.stdout.splitlines() + ["", ""])[:2]
    return Path(top), prefix


def resolve_ref(top: Path, ref: str) -> str:
    r = _git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"], top, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise UpgradeError(f"{ref}: not a commit in {top} (git rev-parse found no such revision)")
    return r.stdout.strip()


# The markers of discover.is_candidate as fixed strings (git grep ORs them): a
# superset of the files the scan reads (every file naming the MLA wrapper is taken,
# plan call or not). Only these are written out: creating the ~5,000 files of a
# whole checkout costs seconds, most of them in the kernel.
GREP_MARKERS = ("get_key_buffer", "get_value_buffer", "get_kv_buffer", "get_mla_kv_buffer",
                "_kvpatch_runtime", "kv_for_kernel", "plan_kv_dtype", "BatchMLAPagedAttentionWrapper")


@dataclass
class RefTree:
    """PATH at a git commit: which .py files it has, and their bytes on demand."""

    top: Path
    prefix: str  # PATH inside the repository, '' or ending in '/'
    commit: str
    blobs: Dict[str, str]  # every regular .py file under prefix (relative to it) -> blob sha

    def exists(self, rel: str) -> bool:
        return rel in self.blobs

    def read(self, rel: str) -> Optional[bytes]:
        sha = self.blobs.get(rel)
        if sha is None:
            return None
        r = _git(["cat-file", "blob", sha], self.top)
        return r.stdout if r.returncode == 0 else None


def _blobs(top: Path, shas: List[str]) -> List[bytes]:
    """The contents of blobs, through one `git cat-file --batch`."""
    if not shas:
        return []
    r = _git(["cat-file", "--batch"], top, input=("\n".join(shas) + "\n").encode())
    if r.returncode != 0:
        raise UpgradeError(f"git cat-file failed: {r.stderr.decode('utf-8', 'replace').strip()}")
    out, pos, data = [], 0, r.stdout
    for _ in shas:
        nl = data.index(b"\n", pos)
        header = data[pos:nl].split()
        if len(header) < 3 or header[1] != b"blob":
            raise UpgradeError(f"git cat-file: unexpected {data[pos:nl][:80]!r}")
        size = int(header[2])
        out.append(data[nl + 1:nl + 1 + size])
        pos = nl + 1 + size + 1
    return out


def materialize(top: Path, prefix: str, commit: str, dest: Path) -> Tuple[Path, RefTree]:
    """Write the files under prefix at commit that the audit reads into dest.
    Returns the old root and the commit's full list of .py files."""
    spec = ["--", prefix] if prefix else []
    ls = _git(["ls-tree", "-r", "-z", commit, *spec], top)
    if ls.returncode != 0:
        raise UpgradeError(f"git ls-tree {commit[:12]} failed: {ls.stderr.decode('utf-8', 'replace').strip()}")
    blobs: Dict[str, str] = {}
    for entry in ls.stdout.split(b"\0"):
        if not entry:
            continue
        meta, _, path = entry.partition(b"\t")
        mode, kind, sha = meta.split()
        name = path.decode("utf-8", "surrogateescape")
        # regular files only: links and submodules are never written (nor followed)
        if kind == b"blob" and mode in (b"100644", b"100755") and name.endswith(".py") \
                and name.startswith(prefix):
            blobs[name[len(prefix):]] = sha.decode()
    if not blobs:
        raise UpgradeError(f"{prefix or '.'}: no Python files there at {commit[:12]}")
    args = ["grep", "-l", "-z", "-F"]
    for marker in GREP_MARKERS:
        args += ["-e", marker]
    grep = _git(args + [commit, "--", f"{prefix}*.py" if prefix else "*.py"], top)
    if grep.returncode not in (0, 1):  # 1: nothing matched
        raise UpgradeError(f"git grep {commit[:12]} failed: {grep.stderr.decode('utf-8', 'replace').strip()}")
    head = f"{commit}:".encode()
    wanted = []
    for hit in grep.stdout.split(b"\0"):
        if hit.startswith(head):
            name = hit[len(head):].decode("utf-8", "surrogateescape")
            if name.startswith(prefix) and name[len(prefix):] in blobs:
                wanted.append(name[len(prefix):])
    old_root = dest / prefix if prefix else dest
    old_root.mkdir(parents=True, exist_ok=True)
    for rel, data in zip(wanted, _blobs(top, [blobs[r] for r in wanted])):
        target = old_root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return old_root, RefTree(top, prefix, commit, blobs)


# -- the flow ------------------------------------------------------------------------
def run_upgrade(old_root: Path, new_root: Path, select=None, jobs=None, progress=None, *,
                old_display: Optional[str] = None, ref: Optional[str] = None,
                commit: Optional[str] = None, ref_tree: Optional[RefTree] = None) -> Upgrade:
    from kvpatch import patch as P
    from kvpatch.engine import scan_tree

    t0 = time.perf_counter()
    old_scan = scan_tree(old_root, select, jobs, progress)
    if ref_tree is not None:
        old_scan.files_scanned = len(ref_tree.blobs)  # every .py at REF passed the prefilter
    built = P.build(new_root, select, jobs, progress)
    new_scan = built.scan
    trees = Trees(old_scan.root, new_scan.root, [f.rel for f in new_scan.files], ref_tree)
    sites = compare_sites(old_scan.sites, new_scan.sites, trees)
    plans = compare_plans(old_scan.plans, new_scan.plans, trees)
    errors = [("old", e) for e in old_scan.all_errors] + [("new", e) for e in new_scan.all_errors]
    old = Tree(old_scan.root, old_display or str(old_root), ref, commit, old_scan)
    new = Tree(new_scan.root, str(new_root), None, None, new_scan)
    return Upgrade(old, new, sites, plans, built, errors, time.perf_counter() - t0)


def upgrade_against(root: Path, ref: str, select=None, jobs=None, progress=None) -> Upgrade:
    root = root.resolve()
    top, prefix = git_location(root)
    commit = resolve_ref(top, ref)
    tmp = Path(tempfile.mkdtemp(prefix="kvpatch-audit-"))
    try:
        old_root, ref_tree = materialize(top, prefix, commit, tmp)
        up = run_upgrade(old_root, root, select, jobs, progress,
                         old_display=f"{root} @ {ref}" + (f" ({commit[:12]})" if not commit.startswith(ref) else ""),
                         ref=ref, commit=commit, ref_tree=ref_tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return up


# -- rendering -------------------------------------------------------------------------
_COLORS = {UNMATCHED: "red", NEW: "yellow", CHANGED: "yellow", FIXED: "green", REPLACED: "blue",
           REMOVED: "blue", MOVED: None, UNCHANGED: None}


def _short(text: str, width: int = 120) -> str:
    """The first sentence of a reason, at most `width` characters."""
    t = _one(text)
    cut = t.find(": ", 40)
    if 0 < cut < width and cut < len(t) - 2 and width <= 120:
        t = t[:cut] + " ..."
    return t if len(t) <= width else t[: width - 3] + "..."


def _first(stmt: str, width: int = 150) -> List[str]:
    """A statement on one line, without its comments (ast.unparse when it parses)."""
    text = ""
    for candidate in (stmt, textwrap.dedent(stmt)):
        try:
            text = " ".join(ln.strip() for ln in ast.unparse(ast.parse(candidate)).splitlines())
            break
        except (SyntaxError, ValueError):
            continue
    if not text:
        lines = [ln for ln in stmt.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        text = " ".join(ln.strip() for ln in lines)
    return [text if len(text) <= width else text[: width - 3] + "..."]


def render(up: Upgrade, style, verbose: int = 0) -> str:
    out: List[str] = [style(f"kvpatch upgrade audit: {up.old.display} -> {up.new.display}", bold=True)]
    for title, entries, cats in (("sites", up.sites, SITE_CATEGORIES), ("plan calls", up.plans, PLAN_CATEGORIES)):
        counts = up.counts(entries, cats)
        out.append("")
        out.append(style(title, bold=True) + ": " + (", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"))
        shown_fn = set()
        for e in entries:
            if e.category == UNCHANGED and not verbose:
                continue
            flag = style("  ACTION", fg="red", bold=True) if e.action else ""
            r = e.rec
            status = (f"{e.old.status} -> {e.new.status}" if e.old is not None and e.new is not None
                      and e.old.status != e.new.status else r.status)
            fix = ", apply rewrites it" if e.new is not None and e.new.fixable else ""
            out.append(f"  {style(f'{e.category:<14}', fg=_COLORS.get(e.category))} {e.where()}  {r.qualname} "
                       f"[{status}{', ' + r.rule if r.rule else ''}{fix}]{flag}")
            out.append(f"  {'':14} {_one(e.why) if verbose else _short(e.why, 240)}")
            if e.category == CHANGED and e.old is not None and e.new is not None:
                out.append(f"  {'':14} - {_first(e.old.statement)[0]}")
                out.append(f"  {'':14} + {_first(e.new.statement)[0]}")
            elif e.category in (NEW, MOVED) and verbose and e.new is not None:
                out.append(f"  {'':14}   {_first(e.new.statement)[0]}")
            if e.function is not None and (e.function.file, e.function.qualname) not in shown_fn:
                shown_fn.add((e.function.file, e.function.qualname))
                f = e.function
                out.append(f"  {'':14} {f.file}:{f.line}-{f.end_line} `{f.qualname}`"
                           f"{' (excerpt)' if f.truncated else ''}:")
                for ln in f.source.rstrip("\n").splitlines():
                    out.append(f"  {'':14} | {ln}")
        if not verbose and counts.get(UNCHANGED):
            out.append(f"  {'unchanged':<14} {counts[UNCHANGED]} (-v lists them)")
    p = up.patch
    out.append("")
    out.append(style("apply on the new tree", bold=True) + ": " + (
        style("applies", fg="green") if not p.refused else style(f"refused for {len(p.refused)} file(s)", fg="red")))
    ps = patch_summary(p)
    if not p.rewrites and not p.runtimes:
        out.append("  nothing to rewrite")
    else:
        out.append(f"  {len(p.rewrites)} file(s) rewritten: {p.sites_rewritten} site(s), {p.plans_rewritten} plan "
                   f"call(s); {len(p.runtimes)} runtime file(s)")
        for f in ps["files"]:
            out.append(f"    {f['file']}: +{f['lines_added']} -{f['lines_removed']} lines, "
                       f"{len(f['sites'])} site(s), {len(f['plan_calls'])} plan call(s)")
        for rt in ps["runtime_files"]:
            out.append(f"    {rt['file']}: runtime ({rt['action']})")
    for r in p.refused:
        out.append(f"  refused {r.file}: {r.message}")
    for s in ps["skipped"]:
        out.append(f"  left as is: {s['file']}:{s['line']} [{s['status']}] {_short(s['reason'])}")
    if up.errors:
        out.append("")
        out.append(style("errors", bold=True, fg="red"))
        for t, e in up.errors:
            out.append(f"  ({t}) {e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
    act = up.action_needed
    out.append("")
    if act:
        out.append(style(f"action needed ({len(act)})", bold=True, fg="red"))
        out += [f"  - {a}" for a in act]
    else:
        out.append(style("nothing new needs action", fg="green"))
    return "\n".join(out)


def summary_line(up: Upgrade) -> str:
    s = ", ".join(f"{n} {k}" for k, n in up.counts(up.sites, SITE_CATEGORIES).items() if n) or "none"
    p = ", ".join(f"{n} {k}" for k, n in up.counts(up.plans, PLAN_CATEGORIES).items() if n) or "none"
    patch = "applies" if not up.patch.refused else f"refused for {len(up.patch.refused)} file(s)"
    return (f"kvpatch audit (upgrade): sites: {s}; plan calls: {p}; apply {patch}; "
            f"{len(up.action_needed)} action(s) needed{f', {len(up.errors)} error(s)' if up.errors else ''}; "
            f"{up.seconds:.2f}s")


_SARIF_RULES = [
    ("KVU001", "new-site", "A KV-cache cast or MLA plan call that the old tree did not have"),
    ("KVU002", "changed-site", "A site whose statement, rule or buffer changed since the old tree"),
    ("KVU003", "unmatched-function", "A function that held a site, still casts, and no rule finds a site in it"),
    ("KVU004", "patch-refused", "kvpatch apply would refuse to rewrite this file"),
]
_SARIF_ID = {NEW: "KVU001", CHANGED: "KVU002", UNMATCHED: "KVU003"}


def to_sarif(up: Upgrade) -> str:
    ids = [r[0] for r in _SARIF_RULES]
    results = []
    for e in up.sites + up.plans:
        rid = _SARIF_ID.get(e.category)
        if rid is None:
            continue
        r = e.rec
        if e.new is not None:
            region = {"startLine": e.new.line}
            if e.is_site:
                region.update(startColumn=e.new.column + 1, endLine=e.new.end_line)
        elif e.function is not None:
            region = {"startLine": e.function.line, "endLine": e.function.end_line}
        else:
            region = {"startLine": max(1, r.line)}
        what = "site" if e.is_site else "plan call"
        results.append({
            "ruleId": rid, "ruleIndex": ids.index(rid), "level": "error" if e.action else "note",
            "message": {"text": f"[{e.category} {what}] {r.qualname}: {e.why}"},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": r.file, "uriBaseId": "SRCROOT"},
                                                "region": region}}],
            "partialFingerprints": {"kvpatchSite/v1": e.key},
            "properties": {"category": e.category, "action": e.action, "qualname": r.qualname, "rule": r.rule,
                           "old_status": e.old.status if e.old is not None else None,
                           "new_status": e.new.status if e.new is not None else None},
        })
    for f in up.patch.refused:
        results.append({
            "ruleId": "KVU004", "ruleIndex": ids.index("KVU004"), "level": "error",
            "message": {"text": f"apply would refuse {f.file}: {f.message}"},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": f.file, "uriBaseId": "SRCROOT"}}}],
        })
    notes = [{"level": "error", "message": {"text": f"({t}) {e.file}{':' + str(e.line) if e.line else ''}: "
                                                   f"{e.message}"}} for t, e in up.errors]
    rules = [{"id": i, "name": n, "shortDescription": {"text": d},
              "defaultConfiguration": {"level": "error" if i in ("KVU003", "KVU004") else "warning"}}
             for i, n, d in _SARIF_RULES]
    from kvpatch.report import sarif_document

    return sarif_document(rules, results, notes, up.new.root,
                                 {"old": up.old.display, "new": up.new.display, "exit_code": up.exit_code})


# -- the command -------------------------------------------------------------------------
def _check_tree(path: str, what: str) -> Path:
    from kvpatch.discover import looks_like_sglang

    p = Path(path)
    if not p.exists():
        raise UpgradeError(f"{path}: no such file or directory")
    if not p.is_dir():
        raise UpgradeError(f"{path}: the upgrade audit compares checkout directories ({what} is not a directory)")
    why = looks_like_sglang(p)
    if why:
        raise UpgradeError(f"{path}: {why}")
    return p


def cli_audit(out, root: Path, new_path: Optional[str], against: Optional[str], as_json: bool, as_sarif: bool,
              output: Optional[str], select, jobs) -> int:
    """`kvpatch audit OLD NEW` / `kvpatch audit PATH --against REF`; returns the exit code."""
    try:
        if new_path and against:
            raise UpgradeError("give either NEW_PATH or --against REF, not both")
        if against:
            if not root.is_dir():
                raise UpgradeError(f"{root}: --against compares a checkout directory with a git revision")
            up = upgrade_against(root, against, select, jobs, out.progress())
        else:
            old = _check_tree(str(root), "OLD")
            new = _check_tree(new_path, "NEW")
            up = run_upgrade(old, new, select, jobs, out.progress())
    except UpgradeError as exc:
        out.error(str(exc))
        return EXIT_ERROR
    except KeyError as exc:  # an unknown rule, from load_rules
        out.error(exc.args[0] if exc.args else str(exc))
        return EXIT_ERROR
    except OSError as exc:
        out.error(f"upgrade audit failed: {exc}")
        return EXIT_ERROR
    if as_json:
        text = json.dumps(up.to_dict(), indent=2) + "\n"
    elif as_sarif:
        text = to_sarif(up)
    else:
        plain = lambda t, **k: t  # noqa: E731 - no colour in files
        text = render(up, plain if output else out.style, out.verbose)
    if output:
        Path(output).write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    elif text:
        out.echo(text.rstrip("\n"))
    for t, e in up.errors:
        out.error(f"({t} tree) {e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
    out.info(summary_line(up))
    return up.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `kvpatch audit OLD NEW` or `kvpatch audit PATH --against REF`")
