"""KVP104 dead-pool-cast: delete a full-pool cast whose result nothing reads.

A cast of a whole layer pool that is overwritten before any read, never read,
or discarded (an expression statement) still casts the whole pool on every
call, for nothing. This rule deletes the statement, and only when that changes
nothing but the wasted cast: no path reads the result (reading it only for
`.shape` or `.dtype` is a read), the statement is a plain assignment to one
local name (or a bare expression), and the expression is nothing but the pool
getter, views and the cast, whose arguments are names, attributes and literals
(no other call that could have an effect). The function must not read its
locals by name (`locals()`, `eval`, ...), `del` the name, declare it global or
nonlocal, or close over it in a nested scope. Comments on and above the line
are kept; a block left empty gets `pass`. Revert restores the file's bytes.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.analysis.classify import dead_result
from kvpatch.analysis.match import UnitContext
from kvpatch.names import CAST_CALLS, KV_GETTERS
from kvpatch.rewrite.removal import LOCALS_READERS, block_of, remove_statement
from kvpatch.rule import Decision, Invalid, Rule, Valid
from kvpatch.sites import HOT
from kvpatch.analysis.tensorops import VIEW_METHODS

_SIMPLE = (cst.Name, cst.Integer, cst.Float, cst.SimpleString, cst.Ellipsis)


def _inert(e: cst.BaseExpression) -> bool:
    """An argument whose evaluation has no effect: a name, an attribute of one, a literal, a slice."""
    if isinstance(e, _SIMPLE):
        return True
    if isinstance(e, cst.Attribute):
        return _inert(e.value)
    if isinstance(e, cst.UnaryOperation):
        return _inert(e.expression)
    if isinstance(e, (cst.Tuple, cst.List)):
        return all(_inert(el.value) for el in e.elements)
    if isinstance(e, cst.Subscript):
        return _inert(e.value) and all(_inert_slice(s.slice) for s in e.slice)
    return False


def _inert_slice(s) -> bool:
    if isinstance(s, cst.Index):
        return _inert(s.value)
    return all(p is None or _inert(p) for p in (s.lower, s.upper, s.step))


def effect(e: cst.BaseExpression, ctx: UnitContext) -> str:
    """"" when `e` is only pool getters, views and casts over inert arguments; else the part that is not."""
    while True:
        if isinstance(e, cst.Subscript):
            if not all(_inert_slice(s.slice) for s in e.slice):
                return ctx.code(e)
            e = e.value
            continue
        if isinstance(e, cst.Call):
            f = e.func
            if not (isinstance(f, cst.Attribute) and f.attr.value in CAST_CALLS | VIEW_METHODS | KV_GETTERS):
                return ctx.code(e)
            bad = next((a for a in e.args if a.star or not _inert(a.value)), None)
            if bad is not None:
                return ctx.code(bad.value)
            if f.attr.value in KV_GETTERS:
                return "" if _inert(f.value) else ctx.code(f.value)
            e = f.value
            continue
        return "" if _inert(e) else ctx.code(e)


def _reads_by_name(name: str, func: cst.FunctionDef) -> str:
    """How `func` may still reach local `name` where the data flow does not look, or ""."""
    found = []

    class V(cst.CSTVisitor):
        depth = 0

        def visit_Call(self, node: cst.Call) -> None:
            if isinstance(node.func, cst.Name) and node.func.value in LOCALS_READERS:
                found.append(f"the function calls `{node.func.value}()`")

        def visit_Del(self, node: cst.Del) -> None:
            if name in {n.value for n in _names(node.target)}:
                found.append(f"`del {name}` follows")

        def visit_Global(self, node) -> None:
            if name in {n.name.value for n in node.names}:
                found.append(f"`{name}` is declared global or nonlocal")

        visit_Nonlocal = visit_Global

        def _nested(self, node) -> bool:
            if name in {n.value for n in _names(node)} and not found:
                found.append(f"a nested scope reads `{name}`")
            return False

        visit_FunctionDef = visit_ClassDef = visit_Lambda = _nested
        visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _nested

    for stmt in func.body.body if isinstance(func.body, cst.IndentedBlock) else ():
        stmt.visit(V())
    return found[0] if found else ""


def _names(node: cst.CSTNode):
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, cst.Name):
            yield n
        stack.extend(n.children)


class DeadPoolCast(Rule):
    ID = "KVP104"
    NAME = "dead-pool-cast"
    SUMMARY = "Delete a full-pool cast whose result is overwritten, never read, or discarded"
    KIND = "cast"
    PRIORITY = 5  # a dead cast is dead whatever reads the name later
    REMOVES = True
    CHECKED_ON = ("sglang 4ad990ba7 (2026-08-06)", "fzyzcjy/sglang nsa_backend.py (2026-11)")

    VALID = (
        Valid(
            """
def forward_decode(self, q, layer, forward_batch):
    kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
    if q is None:
        kv = forward_batch.other
    return self.kernel(q, kv)
""",
            why="read on the path where it is not overwritten: not dead",
        ),
        Valid(
            """
def forward_decode(self, q, layer, forward_batch):
    kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
    return self.kernel(q, kv.shape[0], forward_batch.kv_indices)
""",
            why="read for its shape: deleting it would break the read (reported hot, not deleted)",
        ),
        Valid(
            """
def forward_decode(self, q, layer, forward_batch):
    rows = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[forward_batch.kv_indices].to(q.dtype)
    rows = None
    return self.kernel(q, forward_batch.kv_indices)
""",
            why="a dead store of gathered rows is not a pool-wide cast: not this rule's",
        ),
    )

    INVALID = (
        Invalid(
            """
class AiterAttnBackend:
    def forward_decode(self, q, layer, forward_batch):
        # the MLA kernel reads the FP8 pool itself
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)  # old path
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return mla_decode_fwd(q, k_buffer.view(-1, 1, 1, 576), self.kv_indptr, self.kv_indices)
""",
            expected="""
class AiterAttnBackend:
    def forward_decode(self, q, layer, forward_batch):
        # the MLA kernel reads the FP8 pool itself
        # old path
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return mla_decode_fwd(q, k_buffer.view(-1, 1, 1, 576), self.kv_indptr, self.kv_indices)
""",
            why="overwritten before any read (aiter's MLA decode): deleted, its comments kept",
        ),
        Invalid(
            """
class NativeSparseAttnBackend:
    def forward_extend(self, q, layer, forward_batch, topk_indices=None):
        if topk_indices is not None:
            kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype).view(-1, 1, 576)
        return self._forward_flashmla_sparse(q, forward_batch, topk_indices)
""",
            expected="""
class NativeSparseAttnBackend:
    def forward_extend(self, q, layer, forward_batch, topk_indices=None):
        if topk_indices is not None:
            pass
        return self._forward_flashmla_sparse(q, forward_batch, topk_indices)
""",
            why="never read, the only statement of its block: it becomes `pass`",
        ),
        Invalid(
            """
class NpuBackend:
    def forward_extend(self, q, layer, forward_batch):
        self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return self.kernel(q, forward_batch)
""",
            expected="""
class NpuBackend:
    def forward_extend(self, q, layer, forward_batch):
        return self.kernel(q, forward_batch)
""",
            why="a discarded cast (expression statement)",
        ),
        Invalid(
            """
class NpuBackend:
    def forward_extend(self, q, layer, forward_batch):
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype).view(self.shape())
        return self.kernel(q, forward_batch)
""",
            status=HOT,
            why="dead, but the expression calls `self.shape()`, which may do more: reported, not deleted",
        ),
        Invalid(
            """
class NpuBackend:
    def forward_extend(self, q, layer, forward_batch):
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        kv = None
        return self.kernel(q, forward_batch, **locals())
""",
            status=HOT,
            why="the function reads its locals by name: nothing is proven dead",
        ),
    )

    def decide(self, cand: CastCandidate, ctx: UnitContext) -> Optional[Decision]:
        if cand.origin.kind != "pool":
            return None
        dead = dead_result(cand.call, cand.consumers, ctx)
        if not dead or "metadata" in dead:
            return None  # read (for metadata too): the fallback reports it
        why = self._why_not(cand, ctx)
        if why:
            return Decision(HOT, f"full-pool cast that is a dead store: {dead}. It still casts the whole layer "
                                 f"pool on every call, for nothing; it is not deleted because {why}: delete it "
                                 f"by hand")
        line = ctx.line_statement(cand.call)
        edits = remove_statement(ctx.unit.qualname, line, block_of(line, ctx.parents))
        return Decision(HOT, f"full-pool cast that is a dead store: {dead}. It casts the whole layer pool on "
                             f"every call, for nothing (apply deletes the statement)", edits)

    @staticmethod
    def _why_not(cand: CastCandidate, ctx: UnitContext) -> str:
        nested = ctx.in_nested_scope(cand.call)
        if nested:
            return f"it sits inside {nested}"
        line = ctx.line_statement(cand.call)
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1 or block_of(line, ctx.parents) is None:
            return "it shares its line with another statement"
        stmt = line.body[0]
        name = ""
        if isinstance(stmt, cst.Assign):
            if len(stmt.targets) != 1 or not isinstance(stmt.targets[0].target, cst.Name):
                return "it assigns more than one plain local name"
            name, value = stmt.targets[0].target.value, stmt.value
        elif isinstance(stmt, cst.AnnAssign) and isinstance(stmt.target, cst.Name) and stmt.value is not None:
            name, value = stmt.target.value, stmt.value
        elif isinstance(stmt, cst.Expr):
            value = stmt.value
        else:
            return "it is not a plain assignment or expression statement"
        other = effect(value, ctx)
        if other:
            return f"its expression evaluates `{other}`, which may have another effect than the cast"
        return _reads_by_name(name, ctx.func) if name else ""
