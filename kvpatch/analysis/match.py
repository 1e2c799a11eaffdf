"""match: libcst matchers plus data flow for KV buffers, casts and kernels.

Everything here answers structural questions about one function:
- which expressions are a layer's whole KV pool (``R.get_key_buffer(L)``, a
  name bound to one, a view or slice of one), and which are gathered rows;
- which calls cast such a buffer (``.to(D)``, ``.float()``, ...);
- which call finally consumes the result (the kernel), following names,
  views and slices forward.
Rules combine these answers; they never look at source text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from kvpatch.analysis.dataflow import Definition, FunctionFlow, analyze
from kvpatch.analysis.locate import ClassFacts, ModuleFacts, Unit
from kvpatch.names import CAST_TO, CAST_TYPE, DTYPE_CAST_METHODS, POOL_GETTERS, TUPLE_GETTERS
from kvpatch.analysis.tensorops import (GATHER_METHODS, TUPLE_VIEWS, VIEW_FUNCTIONS, VIEW_METHODS, device_like,
                               gathers_rows, int_subscript, whole_rows)
from kvpatch.analysis.units import ParsedUnit



# Plain isinstance tests instead of libcst.matchers: importing that module costs
# ~0.2 s, a tenth of a whole-checkout audit, and these are all the shapes needed.
def is_attr(node: Optional[cst.CSTNode], names) -> bool:
    """`X.<name>` for a name in `names` (m.Attribute(attr=m.OneOf(m.Name(...))))."""
    return isinstance(node, cst.Attribute) and node.attr.value in names


def attr_call(node: Optional[cst.CSTNode], names) -> bool:
    """`X.<name>(...)` for a name in `names` (m.Call(func=m.Attribute(attr=m.OneOf(...))))."""
    return isinstance(node, cst.Call) and is_attr(node.func, names)


@dataclass
class Origin:
    """Where a buffer expression's value comes from."""

    kind: Optional[str]  # pool | gathered | mixed | None (not a KV buffer)
    getters: List[cst.Call] = field(default_factory=list)
    others: List[Tuple[Definition, str]] = field(default_factory=list)  # non-pool defs
    via_names: bool = False  # bound to a name first (two-statement form)


@dataclass
class CastForm:
    kind: str  # to | type | method
    dtype: Optional[cst.BaseExpression]  # None for .float() etc.
    dtype_arg: Optional[cst.Arg]
    simple: bool  # exactly one dtype argument (plus harmless keywords)
    method: str


@dataclass
class Consumer:
    kind: str  # call | return | yield | store | method | discard | unknown
    node: Optional[cst.CSTNode]
    call: Optional[cst.Call] = None
    arg_index: Optional[int] = None
    keyword: Optional[str] = None
    via: List[str] = field(default_factory=list)  # names the value flowed through
    views: List[cst.Call] = field(default_factory=list)  # the view/reshape calls on the way


@dataclass
class FileContext:
    rel: str
    module: ModuleFacts
    classes: Dict[str, ClassFacts]
    units: Dict[str, ParsedUnit]  # by qualname, the ones parsed
    lines: List[str] = field(default_factory=list)  # the file's lines, with endings


class UnitContext:
    """One parsed function, with its metadata and data flow, for the rules."""

    def __init__(self, pu: ParsedUnit, file: FileContext) -> None:
        self.pu = pu
        self.file = file
        self.func = pu.func
        self.flow: FunctionFlow = analyze(self.func)
        self.parents = pu.parents()
        self._positions = pu.positions()

    # -- helpers ---------------------------------------------------------
    @property
    def unit(self) -> Unit:
        return self.pu.unit

    @property
    def class_facts(self) -> Optional[ClassFacts]:
        cq = self.unit.class_qualname
        return self.file.classes.get(cq) if cq else None

    def code(self, node: cst.CSTNode) -> str:
        return self.pu.code_for(node).strip()

    def line(self, node: cst.CSTNode) -> int:
        return self.pu.line_of(node)

    def end_line(self, node: cst.CSTNode) -> int:
        return self.pu.file_line(self._positions[node].end.line)

    def column(self, node: cst.CSTNode) -> int:
        return self._positions[node].start.column

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self.parents.get(node)

    def statement_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The innermost small or compound statement holding node."""
        cur = node
        while cur is not None and not isinstance(cur, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            cur = self.parents.get(cur)
        return cur

    def line_statement(self, node: cst.CSTNode) -> cst.CSTNode:
        """The statement *line* (SimpleStatementLine or compound) holding node."""
        return line_statement_in(self.parents, node)

    def in_nested_scope(self, node: cst.CSTNode) -> Optional[str]:
        cur = self.parents.get(node)
        while cur is not None and cur is not self.func:
            if isinstance(cur, cst.Lambda):
                return "a lambda"
            if isinstance(cur, (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)):
                return "a comprehension"
            if isinstance(cur, cst.FunctionDef):
                return f"the nested function {cur.name.value}"
            cur = self.parents.get(cur)
        return None

    # -- buffers ---------------------------------------------------------
    def origin(self, expr: cst.BaseExpression, depth: int = 0) -> Origin:
        if depth > 12:
            return Origin(None)
        if attr_call(expr, POOL_GETTERS):
            return Origin("pool", [expr])
        if isinstance(expr, cst.Subscript):
            inner = self.origin(expr.value, depth + 1)
            if attr_call(expr.value, TUPLE_VIEWS):
                return inner  # one piece of a split, not a row gather
            if inner.kind is None and attr_call(expr.value, TUPLE_GETTERS):
                return Origin("pool", [expr.value]) if int_subscript(expr) else Origin(None)
            if inner.kind in ("pool", "mixed") and not whole_rows(expr):
                return Origin("gathered", inner.getters, inner.others, inner.via_names)
            return inner
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            meth = expr.func.attr.value
            if meth not in VIEW_METHODS and meth not in GATHER_METHODS:
                return Origin(None)
            source, args = self.tensor_operand(expr)
            inner = self.origin(source, depth + 1) if source is not None else Origin(None)
            if meth in VIEW_METHODS or not gathers_rows(meth, args):
                return inner
            if inner.kind in ("pool", "mixed"):
                return Origin("gathered", inner.getters, inner.others, inner.via_names)
            return Origin(None)
        if isinstance(expr, cst.Name):
            defs = self.flow.defs_of(expr)
            if not defs:
                return Origin(None)
            kinds: Set[Optional[str]] = set()
            getters: List[cst.Call] = []
            others: List[Tuple[Definition, str]] = []
            for d in defs:
                o = self._origin_of_def(d, depth + 1)
                kinds.add(o.kind)
                getters += o.getters
                if o.kind is None:
                    others.append((d, "not a KV buffer"))
                others += o.others
            if kinds == {"pool"}:
                return Origin("pool", getters, others, True)
            if kinds == {"gathered"}:
                return Origin("gathered", getters, others, True)
            if kinds & {"pool", "gathered", "mixed"}:
                return Origin("mixed", getters, others, True)
            return Origin(None)
        return Origin(None)

    def tensor_operand(self, call: cst.Call) -> Tuple[Optional[cst.BaseExpression], List[cst.Arg]]:
        """The tensor a tensor op reads, and the op's other arguments: `x` and
        `(args)` for the method form `x.split(args)`, and for the function form
        `torch.split(x, args)` (the receiver is a module: a dotted name whose
        root is not a local variable, or one bound only by a local import)."""
        receiver = call.func.value
        root = receiver
        while isinstance(root, cst.Attribute):
            root = root.value
        if isinstance(root, cst.Name) and all(d.kind == "import" for d in self.flow.defs_of(root)):
            pos = [a for a in call.args if a.keyword is None and not a.star]
            if not pos:
                return None, []
            return pos[0].value, [a for a in call.args if a is not pos[0]]
        return receiver, list(call.args)

    def _origin_of_def(self, d: Definition, depth: int) -> Origin:
        if d.kind in ("assign", "aug") and d.value is not None:
            return self.origin(d.value, depth)
        if d.kind == "unpack" and d.source is not None:
            if attr_call(d.source, TUPLE_GETTERS):
                return Origin("pool", [d.source])
            if attr_call(d.source, TUPLE_VIEWS):
                source, _ = self.tensor_operand(d.source)
                return self.origin(source, depth) if source is not None else Origin(None)
        return Origin(None)

    # -- casts -----------------------------------------------------------
    @staticmethod
    def cast_form(call: cst.Call) -> Optional[CastForm]:
        if not isinstance(call.func, cst.Attribute):
            return None
        meth = call.func.attr.value
        if meth in DTYPE_CAST_METHODS and not call.args:
            return CastForm("method", None, None, False, meth)
        if meth == CAST_TYPE and len(call.args) == 1 and call.args[0].keyword is None:
            return CastForm(CAST_TYPE, call.args[0].value, call.args[0], False, meth)
        if meth != CAST_TO:
            return None
        pos = [a for a in call.args if a.keyword is None and not a.star]
        kws = {a.keyword.value: a for a in call.args if a.keyword is not None}
        if any(a.star for a in call.args):
            return None
        if "dtype" in kws:
            return CastForm(CAST_TO, kws["dtype"].value, kws["dtype"], not pos and set(kws) <= {"dtype", "non_blocking"}, meth)
        if len(pos) == 1:
            if device_like(pos[0].value):
                return None
            return CastForm(CAST_TO, pos[0].value, pos[0], set(kws) <= {"non_blocking"}, meth)
        if len(pos) >= 2 and not device_like(pos[1].value):
            return CastForm(CAST_TO, pos[1].value, pos[1], False, meth)
        return None

    # -- consumers -------------------------------------------------------
    def consumers(self, expr: cst.CSTNode, _seen: Optional[Set[int]] = None,
                  via: Tuple[str, ...] = (), views: Tuple[cst.Call, ...] = ()) -> List[Consumer]:
        seen = _seen if _seen is not None else set()
        node = expr
        while True:
            par = self.parents.get(node)
            if par is None:
                return [Consumer("unknown", node, via=list(via), views=list(views))]
            if isinstance(par, cst.Subscript) and par.value is node:
                node = par
                continue
            if isinstance(par, cst.Attribute) and par.value is node:
                call = self.parents.get(par)
                if isinstance(call, cst.Call) and call.func is par:
                    if par.attr.value in VIEW_METHODS:
                        views = views + (call,)
                        node = call
                        continue
                    return [Consumer("method", par, call=call, via=list(via), views=list(views))]
                return []  # .shape, .dtype, .device: metadata, not data
            if isinstance(par, cst.Arg):
                call = self.parents.get(par)
                if isinstance(call, cst.Call):
                    pos = [a for a in call.args if a.keyword is None]
                    idx = pos.index(par) if par in pos else None
                    if idx == 0 and isinstance(call.func, cst.Name) and call.func.value in VIEW_FUNCTIONS:
                        views = views + (call,)
                        node = call
                        continue
                    kw = par.keyword.value if par.keyword is not None else None
                    return [Consumer("call", call, call=call, arg_index=idx, keyword=kw, via=list(via),
                                     views=list(views))]
                return [Consumer("unknown", par, via=list(via))]
            if isinstance(par, (cst.Element, cst.Tuple, cst.List)):
                # A tuple on the right of an unpacking assignment: follow the target.
                node = par
                continue
            if isinstance(par, cst.Assign) and par.value is node:
                return self._consumers_of_assign(par, expr, seen, via, views)
            if isinstance(par, cst.AnnAssign) and par.value is node:
                return self._consumers_of_assign(par, expr, seen, via, views)
            if isinstance(par, cst.Return):
                return [Consumer("return", par, via=list(via))]
            if isinstance(par, (cst.Yield,)):
                return [Consumer("yield", par, via=list(via))]
            if isinstance(par, cst.Expr):
                return [Consumer("discard", par, via=list(via))]
            return [Consumer("unknown", par, via=list(via))]

    def _consumers_of_assign(self, stmt, expr, seen, via, views=()) -> List[Consumer]:
        targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
        out: List[Consumer] = []
        for t in targets:
            if not isinstance(t, (cst.Name, cst.Tuple, cst.List)):
                out.append(Consumer("store", stmt, via=list(via)))
                continue
            for d in self.flow.defs:
                if d.stmt is stmt and d.id not in seen:
                    if d.kind == "unpack" or (d.value is not None and not contains(d.value, expr)):
                        continue
                    seen.add(d.id)
                    for use in self.flow.uses_of(d):
                        out += self.consumers(use, seen, via + (d.name,), views)
        return out


# -- consumers, as rules and reports name them ------------------------------
def describe(c: Consumer, ctx: UnitContext) -> str:
    if c.kind in ("call", "method") and c.call is not None:
        return f"`{ctx.code(c.call.func)}`"
    if c.kind == "return":
        return f"a `return` (line {ctx.line(c.node)})"
    if c.kind == "yield":
        return f"a `yield` (line {ctx.line(c.node)})"
    if c.kind == "discard":
        return f"nothing (the result is discarded, line {ctx.line(c.node)})"
    if c.kind == "store":
        return f"an attribute or item store (line {ctx.line(c.node)})"
    return f"`{ctx.code(c.node)}` (line {ctx.line(c.node)})"


def consumer_names(consumers: List[Consumer], ctx: UnitContext) -> str:
    seen = []
    for c in consumers:
        d = describe(c, ctx)
        if d not in seen:
            seen.append(d)
    return ", ".join(seen) if seen else "nothing"


def line_statement_in(parents: Dict[cst.CSTNode, cst.CSTNode], node: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The statement *line* (SimpleStatementLine or compound) holding node, by a parent map."""
    cur = node
    while cur is not None and not isinstance(cur, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
        cur = parents.get(cur)
    if isinstance(cur, cst.BaseSmallStatement):
        par = parents.get(cur)
        if isinstance(par, cst.SimpleStatementLine):
            return par
    return cur


def is_mla_run(c: Consumer) -> bool:
    """The buffer reaches a wrapper's run() as ckv_cache or kpe_cache."""
    return (
        c.kind == "call"
        and c.call is not None
        and isinstance(c.call.func, cst.Attribute)
        and c.call.func.attr.value == "run"
        and (c.arg_index in (2, 3) or c.keyword in ("ckv_cache", "kpe_cache"))
    )


def contains(root: cst.CSTNode, node: cst.CSTNode) -> bool:
    """Whether `node` (this very node) is `root` or inside it."""
    found = []

    class V(cst.CSTVisitor):
        def on_visit(self, n):
            if n is node:
                found.append(n)
            return not found

    root.visit(V())
    return bool(found)


def is_kv_dtype_expr(e: cst.BaseExpression, ctx: UnitContext) -> bool:
    """An expression naming the KV cache's dtype: `<kv buffer>.dtype` or an
    attribute/name called kv_cache_dtype."""
    if isinstance(e, cst.Attribute) and e.attr.value == "dtype":
        return ctx.origin(e.value).kind in ("pool", "gathered")
    if isinstance(e, cst.Attribute) and e.attr.value == "kv_cache_dtype":
        return True
    if isinstance(e, cst.Name) and e.value == "kv_cache_dtype":
        return True
    return False


def simple_expr(e: cst.BaseExpression) -> bool:
    """Safe to evaluate twice: a name, an attribute chain, or a constant."""
    if isinstance(e, (cst.Name, cst.Integer, cst.Float)):
        return True
    if isinstance(e, cst.Attribute):
        return simple_expr(e.value)
    return False
