"""transform: turn a file's decisions into its new text, or refuse.

Edits are applied per unit with one libcst transformer (so an edit inside
another edit's node composes), units are spliced back bottom-up, the runtime
import is added, and the result must parse, compile and re-analyse with no
fixable site left before anyone may write it. Any failure drops the whole
file's rewrite and says why: a site is never half-rewritten.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import libcst as cst

from kvpatch.analysis.match import line_statement_in
from kvpatch.rewrite.codegen import IMPORT_LINE
from kvpatch.engine import FileAnalysis, analyze_source
from kvpatch.rewrite.removal import removed_line
from kvpatch.rule import InsertStatement, NeedRuntime, ReplaceNode, Rule
from kvpatch.sites import PlanCall, Site
from kvpatch.analysis.units import encode, ranges, splice


class RewriteError(Exception):
    pass


@dataclass
class Rewritten:
    """One rewritten site or plan call, followed through the transform: its
    line in the new file and its statement as it now reads (apply records them
    in the state, so status can tell a drifted edit from a kept one)."""

    record: Union[Site, PlanCall]
    line: int
    statement: str
    # The other statements its decision changed (a routed kernel call), as they now read.
    also: List[str] = field(default_factory=list)


@dataclass
class FileRewrite:
    rel: str
    old_text: str
    new_text: str
    new_bytes: bytes
    needs_runtime: bool
    done: List[Rewritten] = field(default_factory=list)  # each record rewritten (sites first), where it went

    @property
    def sites(self) -> List[Site]:
        return [d.record for d in self.done if isinstance(d.record, Site)]

    @property
    def plans(self) -> List[PlanCall]:
        return [d.record for d in self.done if isinstance(d.record, PlanCall)]

    @property
    def changed(self) -> bool:
        return self.old_text != self.new_text


class _Apply(cst.CSTTransformer):
    def __init__(self, replaces: Dict[cst.CSTNode, List], inserts: List[InsertStatement], func: cst.FunctionDef,
                 newline: str, follow: Set[cst.CSTNode]) -> None:
        super().__init__()
        self.replaces = replaces
        self.inserts = inserts
        self.func = func
        self.newline = newline
        self.follow = follow
        self.became: Dict[cst.CSTNode, cst.CSTNode] = {}  # followed node -> what it became

    def on_leave(self, original, updated):
        for build in self.replaces.get(original, ()):
            updated = build(updated)
        if original is self.func:
            updated = self._insert(original, updated)
        if original in self.follow:
            self.became[original] = updated
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


def _other_statements(d, pu) -> List[cst.CSTNode]:
    """The statement lines of a decision's edits other than its own site's statement,
    once each, in edit order: status checks them too (a routed call edited by hand is
    drift as much as its cast)."""
    parents = pu.parents()
    out: List[cst.CSTNode] = []
    for e in d.decision.edits:
        if not isinstance(e, ReplaceNode) or e.node is d.node:
            continue
        cur = line_statement_in(parents, e.node)
        if cur is not None and cur is not d.statement and all(cur is not o for o in out):
            out.append(cur)
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
    # Sites first, then plan calls, each once: the order apply records them in.
    done = list({id(d.record): d for d, _ in edits}.values())
    done.sort(key=lambda d: isinstance(d.record, PlanCall))
    # Every change as (first line, last line, new lines), applied bottom-up so
    # each one's line numbers still hold when it is applied.
    changes: List[Tuple[int, int, List[str]]] = []
    found: Dict[int, Tuple[str, int, str]] = {}  # id(decided) -> (unit, line in its new module, statement)
    for q in set(by_unit) | set(inserts):
        pu = fa.units[q]
        mine = [d for d in done if d.record.qualname == q]
        others = {id(d): _other_statements(d, pu) for d in mine}
        follow = {n for d in mine for n in (d.node, d.statement, *others[id(d)]) if n is not None}
        apply = _Apply(by_unit.get(q, {}), inserts.get(q, []), pu.func, nl, follow)
        try:
            new_module = pu.module.visit(apply)
        except Exception as exc:  # a builder failed: refuse the whole file
            raise RewriteError(f"{fa.rel}: rewriting {q} failed: {exc}") from exc
        where = ranges(new_module)
        for d in mine:
            node, stmt = apply.became.get(d.node), apply.became.get(d.statement)
            at = where.get(node) or where.get(stmt)
            if at is None and stmt is not None and d.rule is not None and d.rule.REMOVES:
                found[id(d)] = (q, removed_line(pu, d.statement), "", [])  # deleted: no statement to keep
                continue
            if at is None or stmt is None:
                raise RewriteError(f"{fa.rel}: the rewrite of {q} lost the statement at line {d.record.line}")
            also = [new_module.code_for_node(apply.became[n]).strip() for n in others[id(d)] if n in apply.became]
            found[id(d)] = (q, at.start.line, new_module.code_for_node(stmt).strip(), also)
        changes.append((pu.unit.start, pu.unit.end, pu.render(new_module)))
    if needs_runtime and not fa.has_runtime_import:
        at = fa.import_after_line or fa.first_stmt_docstring_end
        # After a line (a multi-line import ends on the line ast reports), else on top.
        changes.append((at + 1, at, [nl, IMPORT_LINE + nl]) if at else (1, 0, [IMPORT_LINE + nl, nl]))
    lines = list(fa.lines)
    for first, last, new in sorted(changes, key=lambda c: (c[0], c[1]), reverse=True):
        lines = splice(lines, first, last, new)
    new_text = "".join(lines)
    _check(fa, new_text, rules, [d.record for d in left])

    def moved(line: int) -> int:  # where an untouched line of the old file is now
        return line + sum(len(new) - (last - first + 1) for first, last, new in changes if last < line)

    rewritten = []
    for d in done:
        q, rel_line, statement, also = found[id(d)]
        pu = fa.units[q]
        rewritten.append(Rewritten(d.record, pu.file_line(rel_line, moved(pu.unit.start)), statement, also))
    return FileRewrite(fa.rel, fa.text, new_text, encode(new_text, fa.encoding, fa.bom), needs_runtime, rewritten)


def _fix_key(rec) -> tuple:
    return type(rec).__name__, rec.qualname, rec.rule


def _check(fa: FileAnalysis, new_text: str, rules: Sequence[Rule], left: Sequence = ()) -> None:
    """The rewritten file must parse, compile and leave nothing to fix but the
    `left` records (the sites apply -i was told to leave)."""
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
