"""classify: is a pool cast real, or provably a no-op? Is its result dead?

A cast `buf.to(D)` is a no-op when D is, on every path, the pool's own dtype:
D names the KV dtype itself, or D is `q.dtype` and every definition of `q`
that reaches the cast is `q = <...>.to(<KV dtype>)`. A cast of `q` to the KV
dtype that only happens under a condition proves nothing: FA3, XPU and MUSA
cast q only when `layer.head_dim <= 256`, and the absorbed-MLA layer has
head_dim 576, so their later pool cast is real. A kernel argument that reads
the cast may also be reached by other values (SGLang's DCP branch): those that
are not pool-wide are named, to be left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import libcst as cst

from kvpatch.analysis.dataflow import Definition, loads_in
from kvpatch.analysis.match import CastForm, Consumer, UnitContext, contains, is_kv_dtype_expr


@dataclass
class NoopVerdict:
    noop: bool
    reason: str  # why it is a no-op, or why an earlier cast does not prove it


def _to_kv_dtype(d: Definition, ctx: UnitContext) -> bool:
    v = d.value
    if d.kind != "assign" or not isinstance(v, cst.Call) or not isinstance(v.func, cst.Attribute):
        return False
    form = ctx.cast_form(v)
    return form is not None and form.dtype is not None and is_kv_dtype_expr(form.dtype, ctx)


def _guard_text(d: Definition, ctx: UnitContext) -> str:
    if not d.guards:
        return "on some path"
    test, polarity = d.guards[-1]
    if isinstance(test, (cst.For, cst.While)):
        return "inside a loop"
    code = " ".join(ctx.code(test).split())  # one line: a reason is one line of the table
    return f"under `if {code}`" if polarity else f"in the else of `if {code}`"


def resolve_alias(expr: cst.BaseExpression, ctx: UnitContext, depth: int = 0) -> cst.BaseExpression:
    """`dtype = q.dtype; buf.to(dtype)` -> `q.dtype` (single definition only)."""
    if depth < 5 and isinstance(expr, cst.Name):
        defs = ctx.flow.defs_of(expr)
        if len(defs) == 1 and defs[0].kind == "assign" and defs[0].value is not None:
            return resolve_alias(defs[0].value, ctx, depth + 1)
    return expr


def prove_noop(form: CastForm, ctx: UnitContext) -> NoopVerdict:
    if form.dtype is None:
        return NoopVerdict(False, "")
    d = resolve_alias(form.dtype, ctx)
    if is_kv_dtype_expr(d, ctx):
        return NoopVerdict(True, f"casts to the KV dtype itself (`{ctx.code(d)}`)")
    if isinstance(d, cst.Attribute) and d.attr.value == "dtype" and isinstance(d.value, cst.Name):
        name = d.value.value
        defs: List[Definition] = ctx.flow.defs_of(d.value)
        proofs = [x for x in defs if _to_kv_dtype(x, ctx)]
        if defs and len(proofs) == len(defs):
            x = proofs[0]
            return NoopVerdict(True, f"`{name}` is cast to the KV dtype on every path before this cast "
                                     f"(`{ctx.code(x.stmt)}`, line {ctx.line(x.stmt)})")
        if proofs:
            x = proofs[0]
            return NoopVerdict(False, f"`{name}` is cast to the KV dtype only {_guard_text(x, ctx)} "
                                      f"(line {ctx.line(x.stmt)}); a guarded earlier cast proves nothing, "
                                      f"so this cast is real on the other paths")
    return NoopVerdict(False, "")


def unreachable(cast: cst.Call, ctx: UnitContext) -> str:
    """Why `cast` never runs (every path leaves its block first), or "". Such a cast
    costs nothing: it is not a dead store, whose cast runs on every call."""
    if ctx.flow.reachable(ctx.statement_of(cast)):
        return ""
    return "unreachable: a return, raise, break or continue comes first on every path, so this cast never runs"


def dead_result(cast: cst.Call, consumers: List[Consumer], ctx: UnitContext) -> str:
    """Why the result of `cast` is never read as data (a dead store), or "" when
    something may read it. A dead cast still casts the whole pool every call."""
    stmt = ctx.statement_of(cast)
    if isinstance(stmt, cst.Expr):
        if consumers and all(c.kind == "discard" for c in consumers):
            return "its result is discarded (the cast is an expression statement)"
        return ""
    if consumers or not isinstance(stmt, (cst.Assign, cst.AnnAssign)):
        return ""
    defs = [d for d in ctx.flow.defs if d.stmt is stmt]
    if not defs or any(d.kind == "unpack" for d in defs):
        return ""  # unpacked pieces: the data flow does not follow them, so nothing is proven
    names = ", ".join(sorted({f"`{d.name}`" for d in defs}))
    if any(ctx.flow.uses_of(d) for d in defs):
        return f"its result {names} is read only for metadata (`.shape`, `.dtype`, ...), never as data"
    line = ctx.line(stmt)
    later = sorted(ctx.line(d.stmt) for d in ctx.flow.defs
                   if d.stmt is not None and d.name in {x.name for x in defs} and ctx.line(d.stmt) > line)
    if later:
        return f"{names} is overwritten at line {later[0]} before any read"
    return f"{names} is never read"


def other_values(consumers: List[Consumer], cast: cst.Call, ctx: UnitContext) -> List[str]:
    """One line for each other value that may reach the argument a consumer call
    reads the cast through (another definition of a name it loads) and is not
    pool-wide (e.g. the DCP branch's gathered buffer); another pool cast is a
    site of its own, so not named here."""
    notes: List[str] = []
    for c in consumers:
        arg = c.call.args[c.arg_index] if c.arg_index is not None else None
        if arg is None:
            continue
        for name in loads_in(arg.value):
            for d in ctx.flow.defs_of(name):
                if d.value is None or d.kind != "assign" or contains(d.value, cast):
                    continue
                form = ctx.cast_form(d.value) if isinstance(d.value, cst.Call) else None
                if form is not None and ctx.origin(d.value.func.value).kind == "pool":
                    continue  # another pool cast: a site of its own
                if ctx.origin(d.value).kind != "pool":
                    text = f"`{name.value}` may also be `{ctx.code(d.value)}` (line {ctx.line(d.stmt)}): " \
                           f"not pool-wide, left as is"
                    if text not in notes:
                        notes.append(text)
    return notes
