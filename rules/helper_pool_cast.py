"""KVP105 helper-sparse-pool-cast: a pool cast handed to helper methods whose kernels read
only the rows of an index (issue 20, kind 2: NSA's `self._forward_*`).

NSA's forward_extend casts the whole pool (`kv_cache = kv_cache.to(q.dtype)`) and hands it
to `self._forward_flashmla_sparse`, `_forward_flashmla_kv`, `_forward_tilelang`,
`_forward_fa3` (and `dequantize_k_cache_paged` inline); each helper calls a kernel that is
told exactly which rows it reads: top-k slot indices (-1: none) or a page table. The value
is followed into each helper (kvpatch/analysis/helpers.py: same class only, a helper that
is redefined, overridden in a subclass of the file, assigned, or reachable through
getattr is not followed). When every use of the cast is such a kernel, directly or in a
followed helper, the cast is moved next to the kernels:

    kv_cache = _kvpatch_rt.kv_rows_deferred(kv_cache, q.dtype)      # casts nothing yet
    ...
    o, _, _ = flash_mla_sparse_fwd(q=q_all,
        kv=_kvpatch_rt.kv_rows_at_kernel(kv_cache, page_table_1.unsqueeze(1), 1), ...)

kv_rows_at_kernel casts, from the pool, the rows that kernel reads, in the kernel's own
view of the buffer, before it runs (a row-wise call such as quantize_k_cache on the way is
wrapped too: it reads the rows first). A value that reaches anything else, a function with
a second pool cast (two deferred casts of one shape would share a buffer), or a pool write
(`set_*buffer`) after the cast (the kernel would then see rows the cast did not) is left
as is, with the reason.
"""

from __future__ import annotations

import ast
from typing import List, Optional, Tuple

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.analysis.helpers import (LEAD, POOL_WRITE, SPARSE_KERNELS, WrapPoint, _simple, follow,
                                      wrap_points)
from kvpatch.analysis.match import Consumer, UnitContext, attr_call, consumer_names, describe
from kvpatch.analysis.stable import unit_calls
from kvpatch.analysis.units import preorder
from kvpatch.rewrite.codegen import RUNTIME_ALIAS, cast_builder, parse_expr
from kvpatch.rule import Decision, NeedRuntime, Patched, ReplaceNode, Rule, refuse_unless_plain_cast
from kvpatch.sites import HOT

from ._helper_examples import INVALID, VALID


class HelperPoolCast(Rule):
    ID = "KVP105"
    NAME = "helper-sparse-pool-cast"
    SUMMARY = "Cast only the rows each sparse kernel reads, where a pool cast goes to helper methods"
    KIND = "cast"
    PRIORITY = 25
    EMITS = ("kv_rows_deferred", "kv_rows_at_kernel")
    CHECKED_ON = ("sglang nsa_backend.py 0d244116d (2026-01), efbc687c2 (2025-10)",)
    VALID = VALID
    INVALID = INVALID

    def patched(self, call: cst.Call, ctx: UnitContext) -> Optional[Patched]:
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == self.EMITS[0] and len(call.args) == 2:
            return Patched(call, call.args[0].value, call.args[1].value,
                           f"kvpatch's deferred cast ({self.EMITS[0]}) is in place: each kernel casts its rows")
        return None

    def decide(self, cand: CastCandidate, ctx: UnitContext) -> Optional[Decision]:
        if cand.origin.kind != "pool" or refuse_unless_plain_cast(cand, ctx) is not None:
            return None
        if not any(_own_method(c) for c in cand.consumers):
            return None  # no helper: the page-table and MLA rules, or the report, decide
        if not all(self._known(c, ctx) for c in cand.consumers):
            return None  # a use no kernel contract covers: the report (KVP201) names it and what is needed
        edits, why = self._edits(cand, ctx)
        kernels = consumer_names(cand.consumers, ctx)
        if why:
            return Decision(HOT, f"full-pool cast consumed by {kernels}: not rewritten (KVP105): {why}; a rewrite "
                                 f"needs every use to be a kernel whose rows kvpatch knows, its index a plain "
                                 f"expression of the helper's parameters")
        return Decision(HOT, f"full-pool cast consumed by {kernels}, helpers of this class whose kernels read "
                             f"only indexed rows: rewritten to a deferred cast, each kernel's rows cast next to it",
                        edits + [ReplaceNode(ctx.unit.qualname, cand.call,
                                             cast_builder(cand, ctx, f"{RUNTIME_ALIAS}.{self.EMITS[0]}")),
                                 NeedRuntime()])

    def _known(self, c: Consumer, ctx: UnitContext) -> bool:
        """The use is a kernel with a known row contract, or a helper followed to such kernels."""
        if c.kind not in ("call", "method") or c.call is None or _arg_of(c) is None:
            return False
        if not _own_method(c):
            return _callee(c.call) in SPARSE_KERNELS
        arg = _arg_of(c)
        keyword = arg.keyword.value if arg.keyword is not None else None
        index = None if keyword else sum(1 for a in c.call.args[: c.call.args.index(arg)] if a.keyword is None)
        return follow(c.call.func.attr.value, index, keyword, arg.star != "", ctx.class_facts,
                      ctx.file.classes).sparse

    def _edits(self, cand: CastCandidate, ctx: UnitContext) -> Tuple[List[ReplaceNode], str]:
        line = ctx.line(cand.call)
        for call in unit_calls(ctx):
            if call is cand.call:
                continue
            if ctx.cast_form(call) is not None and ctx.origin(call.func.value).kind == "pool":
                return [], f"a second pool cast in this function (line {ctx.line(call)}) would share the deferred buffer"
            name = _callee(call)
            if name.startswith(POOL_WRITE[0]) and POOL_WRITE[1] in name and ctx.line(call) > line:
                return [], f"`{ctx.code(call.func)}` (line {ctx.line(call)}) may write the pool after the cast"
        edits: List[ReplaceNode] = []
        for c in cand.consumers:
            if c.kind not in ("call", "method") or c.call is None or _arg_of(c) is None:
                return [], f"the value reaches {describe(c, ctx)}: only kernel arguments are rewritten"
            if _own_method(c):
                got, why = self._helper_edits(c, ctx)
            else:
                got, why = self._kernel_edit(c, ctx)
            if why:
                return [], why
            edits += got
        return edits, ""

    def _helper_edits(self, c: Consumer, ctx: UnitContext) -> Tuple[List[ReplaceNode], str]:
        method = c.call.func.attr.value
        arg = _arg_of(c)
        at = c.call.args.index(arg)
        keyword = arg.keyword.value if arg.keyword is not None else None
        index = None if keyword else sum(1 for a in c.call.args[:at] if a.keyword is None)
        path = follow(method, index, keyword, arg.star != "", ctx.class_facts, ctx.file.classes)
        if not path.followed:
            return [], path.describe()
        fn = ctx.class_facts.methods[method][0]
        points, why = wrap_points(path, fn)
        if why:
            return [], f"`self.{method}`: {why}"
        unit = ctx.file.units.get(f"{ctx.unit.class_qualname}.{method}")
        if unit is None:
            return [], f"`self.{method}` was not parsed"
        edits = []
        for p in points:
            node = _arg_at(unit, fn, p.node)
            if node is None:
                return [], f"`self.{method}`: cannot place the kernel argument at line {p.node.lineno}"
            edits.append(ReplaceNode(unit.unit.qualname, node, _wrap(p)))
        return edits, ""

    def _kernel_edit(self, c: Consumer, ctx: UnitContext) -> Tuple[List[ReplaceNode], str]:
        name = _callee(c.call)
        if name not in SPARSE_KERNELS:
            return [], f"{describe(c, ctx)} is no kernel whose rows kvpatch knows"
        caches, (ipos, ikw), _ = SPARSE_KERNELS[name]
        arg = _arg_of(c)
        positional = sum(1 for a in c.call.args[: c.call.args.index(arg)] if a.keyword is None)
        at_cache = any((arg.keyword is not None and arg.keyword.value == kw)
                       or (arg.keyword is None and positional == pos) for pos, kw in caches)
        idx = next((a.value for a in c.call.args if a.keyword is not None and a.keyword.value == ikw), None)
        if idx is None and ipos is not None:
            plain = [a for a in c.call.args if a.keyword is None and not a.star]
            idx = plain[ipos].value if ipos < len(plain) else None
        if not at_cache or idx is None or any(a.star for a in c.call.args):
            return [], f"{describe(c, ctx)} is not handed the value as its cache with its index argument"
        code = ctx.code(idx)
        try:
            simple = _simple(ast.parse(code, mode="eval").body)
        except SyntaxError:
            simple = False
        if not simple:
            return [], f"{describe(c, ctx)}: the index `{code}` is not a plain expression"
        return [ReplaceNode(ctx.unit.qualname, arg, _wrap(WrapPoint(None, code, LEAD[name])))], ""


def _arg_of(c: Consumer) -> Optional[cst.Arg]:
    """The argument of c.call that carries the value."""
    if c.arg_index is not None and c.arg_index < len(c.call.args):
        return c.call.args[c.arg_index]
    return next((a for a in c.call.args if a.keyword is not None and a.keyword.value == c.keyword), None)


def _own_method(c: Consumer) -> bool:
    f = c.call.func if c.call is not None else None
    return isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and f.value.value == "self"


def _callee(call: cst.Call) -> str:
    f = call.func
    return f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else ""


def _arg_at(unit, fn: ast.FunctionDef, expr: ast.AST) -> Optional[cst.Arg]:
    """The libcst Arg of the helper's unit holding `expr` (an ast node of the same source)."""
    start = (expr.lineno, expr.col_offset)
    for n in walk_args(fn):
        if n[1] is expr:
            start = n[0]
    pos = unit.positions()
    for node in preorder(unit.func):
        if isinstance(node, cst.Arg):
            r = pos[node]
            if (unit.file_line(r.start.line), r.start.column) == start:
                return node
    return None


def walk_args(fn: ast.AST):
    """((line, column) where each call argument starts, its value) for every call in fn."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            for a in n.args:
                yield (a.lineno, a.col_offset), a
            for k in n.keywords:
                yield (k.lineno, k.col_offset), k.value


def _wrap(p: WrapPoint):
    func = f"{RUNTIME_ALIAS}.{HelperPoolCast.EMITS[1]}"

    def build(updated: cst.Arg) -> cst.Arg:
        if attr_call(updated.value, {HelperPoolCast.EMITS[1]}):
            return updated
        value = cst.Module(body=[]).code_for_node(updated.value)
        return updated.with_changes(value=parse_expr(f"{func}({value}, {p.index}, {p.lead})"))

    return build
