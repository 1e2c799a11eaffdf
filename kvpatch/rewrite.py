"""rewrite: turn a file's decisions into its new text, or refuse.

Edits are applied per unit with one libcst transformer (so an edit inside
another edit's node composes), units are spliced back bottom-up, the runtime
import is added, and the result must parse, compile and re-analyse with no
fixable site left before anyone may write it. Any failure drops the whole
file's rewrite and says why: a site is never half-rewritten.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import libcst as cst

from kvpatch.codegen import IMPORT_LINE
from kvpatch.engine import FileAnalysis, analyze_source
from kvpatch.rule import InsertStatement, NeedRuntime, ReplaceNode, Rule
from kvpatch.sites import PlanCall, Site
from kvpatch.units import encode, splice


class RewriteError(Exception):
    pass


@dataclass
class FileRewrite:
    rel: str
    old_text: str
    new_text: str
    new_bytes: bytes
    needs_runtime: bool
    sites: List = field(default_factory=list)  # Site records rewritten
    plans: List = field(default_factory=list)  # PlanCall records rewritten
    after: Optional[FileAnalysis] = field(default=None, repr=False)  # the check's audit of new_text

    @property
    def changed(self) -> bool:
        return self.old_text != self.new_text


class _Apply(cst.CSTTransformer):
    def __init__(self, replaces: Dict[cst.CSTNode, List], inserts: List[InsertStatement], func: cst.FunctionDef,
                 newline: str) -> None:
        super().__init__()
        self.replaces = replaces
        self.inserts = inserts
        self.func = func
        self.newline = newline

    def on_leave(self, original, updated):
        for build in self.replaces.get(original, ()):
            updated = build(updated)
        if original is self.func:
            updated = self._insert(original, updated)
        return updated

    def _insert(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        if original is not self.func or not self.inserts or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        body = list(updated.body.body)
        orig_body = list(original.body.body)
        assigned = _assigned_self_attrs(orig_body)
        for ins in self.inserts:
            if ins.unless_assigned and ins.unless_assigned in assigned:
                continue
            stmt = cst.parse_statement(ins.code + self.newline)
            if ins.after is not None and ins.after in orig_body:
                idx = orig_body.index(ins.after) + 1
                # Keep positions aligned for later inserts.
                orig_body.insert(idx, stmt)
            else:
                idx = len(body)
                orig_body.append(stmt)
            body.insert(idx, stmt)
            assigned.add(ins.unless_assigned)
        return updated.with_changes(body=updated.body.with_changes(body=body))


def _assigned_self_attrs(body) -> set:
    out = set()
    for stmt in body:
        for node in _walk(stmt):
            if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name):
                out.add(node.attr.value)
    return out


def _walk(node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children)


def _newline(lines: Sequence[str]) -> str:
    for ln in lines:
        if ln.endswith("\r\n"):
            return "\r\n"
        if ln.endswith("\n"):
            return "\n"
        if ln.endswith("\r"):
            return "\r"
    return "\n"


def plan_rewrite(fa: FileAnalysis, rules: Sequence[Rule], keep: Optional[Sequence] = None) -> Optional[FileRewrite]:
    """The file's rewrite, or None when nothing in it is fixable.

    `keep` (apply -i): only these decided candidates are rewritten; the file's
    other fixable ones must then be exactly what is still fixable after it."""
    fixable = [d for d in fa.decided if d.decision is not None and d.decision.fixable]
    kept = {id(d) for d in keep} if keep is not None else {id(d) for d in fixable}
    left = [d for d in fixable if id(d) not in kept]
    edits = [(d, e) for d in fixable if id(d) in kept for e in d.decision.edits]
    if not edits:
        return None
    nl = _newline(fa.lines)
    by_unit: Dict[str, Dict[cst.CSTNode, List]] = {}
    inserts: Dict[str, List[InsertStatement]] = {}
    needs_runtime = False
    for _, e in edits:
        if isinstance(e, ReplaceNode):
            by_unit.setdefault(e.unit, {}).setdefault(e.node, []).append(e.build)
        elif isinstance(e, InsertStatement):
            if all(x.code != e.code for x in inserts.get(e.unit, [])):
                inserts.setdefault(e.unit, []).append(e)
        elif isinstance(e, NeedRuntime):
            needs_runtime = True
    lines = list(fa.lines)
    touched = sorted(set(by_unit) | set(inserts), key=lambda q: fa.units[q].unit.start, reverse=True)
    for q in touched:
        pu = fa.units[q]
        try:
            new_module = pu.module.visit(_Apply(by_unit.get(q, {}), inserts.get(q, []), pu.func, nl))
        except Exception as exc:  # a builder failed: refuse the whole file
            raise RewriteError(f"{fa.rel}: rewriting {q} failed: {exc}") from exc
        lines = splice(lines, pu.unit, pu.render(new_module))
    if needs_runtime and not fa.has_runtime_import:
        lines = _add_import(lines, fa, nl)
    new_text = "".join(lines)
    after = _check(fa, new_text, rules, [d.record for d in left])
    sites = [d.record for d, _ in edits if isinstance(d.record, Site)]
    plans = [d.record for d, _ in edits if isinstance(d.record, PlanCall)]
    uniq = lambda xs: list({id(x): x for x in xs}.values())  # noqa: E731
    return FileRewrite(fa.rel, fa.text, new_text, encode(new_text, fa.encoding, fa.bom), needs_runtime,
                       uniq(sites), uniq(plans), after)


def _add_import(lines: List[str], fa: FileAnalysis, nl: str) -> List[str]:
    at = fa.import_after_line or fa.first_stmt_docstring_end
    # A multi-line import ends on the line ast reports; insert after it.
    if at:
        return lines[:at] + [nl, IMPORT_LINE + nl] + lines[at:]
    return [IMPORT_LINE + nl, nl] + lines


def _fix_key(rec) -> tuple:
    return type(rec).__name__, rec.qualname, rec.rule


def _check(fa: FileAnalysis, new_text: str, rules: Sequence[Rule], left: Sequence = ()) -> FileAnalysis:
    """The rewritten file must parse, compile and leave nothing to fix but the
    `left` records (the sites apply -i was told to leave); returns its audit
    (apply records the rewritten statements from it)."""
    try:
        compile(ast.parse(new_text), fa.rel, "exec")
    except SyntaxError as exc:
        raise RewriteError(f"{fa.rel}: the rewrite does not compile ({exc.msg}, line {exc.lineno})") from exc
    again = analyze_source(fa.rel, encode(new_text, fa.encoding, fa.bom), rules)
    if again.errors:
        raise RewriteError(f"{fa.rel}: the rewrite cannot be re-analysed: {again.errors[0].message}")
    still = [d.record for d in again.decided if d.decision and d.decision.fixable]
    if sorted(map(_fix_key, still)) != sorted(map(_fix_key, left)):
        if left:
            raise RewriteError(f"{fa.rel}: rewriting only the accepted sites changes what the others need "
                               f"({len(still)} site(s) still fixable, {len(left)} left by choice): "
                               f"they go together")
        raise RewriteError(f"{fa.rel}: the rewrite is not idempotent ({len(still)} site(s) still fixable, "
                           f"first at line {still[0].line})")
    return again
