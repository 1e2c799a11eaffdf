"""stable: is an expression the same value at two places of one function?

A rewrite that moves the reading of a value earlier (a wrapper, a page table
read at the cast instead of at the kernel call) is right only if nothing in
between can change it: no name it loads is rebound, and nothing in the
function stores to an attribute path it reads.
"""

from __future__ import annotations

from typing import List

import libcst as cst

from kvpatch.analysis.dataflow import loads_in
from kvpatch.analysis.match import UnitContext


def differs_at(ctx: UnitContext, expr: cst.BaseExpression, at: cst.CSTNode, use: str) -> str:
    """Why `expr` may not mean at the statement of `at` what it means where it is
    used (`use` names that place), or "": every name it loads has the same
    definitions in both places, and nothing in the function stores to an attribute
    path it reads (`self.meta = ...` before a later `self.meta.page_table`)."""
    stmt = ctx.statement_of(at)
    for name in loads_in(expr):
        at_use = set(d.id for d in ctx.flow.defs_of(name))
        at_stmt = set(d.id for d in ctx.flow.defs_at(stmt, name.value))
        if not at_stmt:
            bound = [d for d in ctx.flow.defs if d.name == name.value and d.stmt is not None]
            where = f" (line {ctx.line(bound[0].stmt)})" if bound else ""
            return f"`{ctx.code(expr)}` is bound after the cast{where}"
        if at_use != at_stmt:
            return f"`{name.value}` is rebound between the cast and {use}"
    return stored_in(ctx, expr, use)


def stored_in(ctx: UnitContext, expr: cst.BaseExpression, use: str) -> str:
    """Why `expr` may change between the cast and `use` through an attribute or item
    store in the function (`self.meta = ...` before a later `self.meta.page_table`)."""
    code = ctx.code(expr)
    for node in _attribute_stores(ctx.func):
        target = ctx.code(node)
        if code == target or code.startswith(target + ".") or code.startswith(target + "["):
            return f"`{target}` is assigned in this function (line {ctx.line(node)}): `{code}` may change " \
                   f"between the cast and {use}"
    return ""


def _attribute_stores(func: cst.CSTNode) -> List[cst.CSTNode]:
    found: List[cst.CSTNode] = []

    class _V(cst.CSTVisitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            if isinstance(node.target, (cst.Attribute, cst.Subscript)):
                found.append(node.target)

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            if isinstance(node.target, (cst.Attribute, cst.Subscript)):
                found.append(node.target)

    func.visit(_V())
    return found
