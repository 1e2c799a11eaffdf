"""stable: is an expression the same value at two places of one function?

A rewrite that moves the reading of a value earlier (a wrapper, a page table
read at the cast instead of at the kernel call) is right only if nothing in
between can change it: no name it loads is rebound, and nothing in the
function stores to an attribute path it reads.
"""

from __future__ import annotations

from typing import List, Tuple

import libcst as cst

from kvpatch.analysis.dataflow import loads_in
from kvpatch.analysis.match import UnitContext
from kvpatch.analysis.units import preorder


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
    for target, node in attribute_stores(ctx):
        if code == target or code.startswith(target + ".") or code.startswith(target + "["):
            return f"`{target}` is assigned in this function (line {ctx.line(node)}): `{code}` may change " \
                   f"between the cast and {use}"
    return ""


_SCAN = "_kvpatch_unit_scan"


def _scan(ctx: UnitContext) -> Tuple[list, list, list]:
    """(attribute/item store targets and nested defs and lambdas of the function body, every
    call of the function) from one walk per unit (every table and length of every site asks;
    a visitor walk per question was most of audit's time)."""
    got = ctx.__dict__.get(_SCAN)
    if got is None:
        stores, scopes, calls = [], [], []
        func = ctx.func
        outside = {id(n) for part in (func.decorators, [func.params], [func.returns] if func.returns else [])
                   for root in part for n in preorder(root)}
        # Exact kinds (libcst's concrete nodes have no subclasses): isinstance goes
        # through ABCMeta, for every node of the function.
        for n in preorder(func):
            t = type(n)
            if t is cst.Call:
                calls.append(n)
            if n is func or id(n) in outside:
                continue
            if (t is cst.AssignTarget or t is cst.AugAssign) and type(n.target) in (cst.Attribute, cst.Subscript):
                stores.append(n.target)
            elif t is cst.FunctionDef or t is cst.Lambda:
                scopes.append(n)
        got = ctx.__dict__[_SCAN] = ([(ctx.code(n), n) for n in stores], scopes, calls)
    return got


def unit_calls(ctx: UnitContext) -> List[cst.Call]:
    """Every call of the unit's function (decorators and defaults too), in field order."""
    return _scan(ctx)[2]


def attribute_stores(ctx: UnitContext) -> List[Tuple[str, cst.CSTNode]]:
    """(code, node) of every attribute or item store in the unit's function, in source order."""
    return _scan(ctx)[0]


def nested_scopes(ctx: UnitContext) -> List[cst.CSTNode]:
    """The defs and lambdas inside the unit's function body, in source order."""
    return _scan(ctx)[1]
