"""dataflow: reaching definitions of local names inside one libcst function.

Enough flow sensitivity to answer the questions the rules ask: which
assignments can a name's value come from at this point (the buffer bound first
and cast later, under a guard or in both arms of an if/else), and does one
assignment hold on *every* path (a guarded earlier cast proves nothing).
Branches are merged, loops iterated to a fixed point, ``return``/``raise``
end a path. Nested functions and classes are opaque.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import libcst as cst

from kvpatch.analysis.units import lexical_children

State = Optional[Dict[str, FrozenSet[int]]]  # None: unreachable


@dataclass(eq=False)
class Definition:
    id: int
    name: str
    kind: str  # param | assign | unpack | aug | for | with | import | def | except | del
    stmt: Optional[cst.CSTNode]
    value: Optional[cst.BaseExpression] = None  # what the name is bound to, if known
    source: Optional[cst.BaseExpression] = None  # for unpack: the whole right-hand side
    index: Optional[int] = None  # for unpack: the element position
    guards: Tuple[Tuple[cst.BaseExpression, bool], ...] = ()


def loads_in(node: Optional[cst.CSTNode]) -> List[cst.Name]:
    """Name nodes an expression reads (not attribute names, not keywords, not the
    parameters of a lambda, nothing inside a nested def or class), in source order:
    what a libcst visitor with those rules collects, read from the fields directly
    (a visitor rebuilds every node it leaves)."""
    names: List[cst.Name] = []
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop()
        t = type(n)
        if t is cst.Name:
            names.append(n)
        elif t is cst.Attribute or t is cst.Arg:
            stack.append(n.value)
        elif t is cst.Lambda:
            stack.append(n.body)
        elif t is cst.Param or t is cst.FunctionDef or t is cst.ClassDef:
            continue
        else:
            stack.extend(reversed(lexical_children(n)))
    return names


def _merge(a: State, b: State) -> State:
    if a is None:
        return dict(b) if b is not None else None
    if b is None:
        return dict(a)
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, frozenset()) | v
    return out


def _target_names(t: cst.BaseExpression) -> List[cst.Name]:
    if isinstance(t, cst.Name):
        return [t]
    if isinstance(t, (cst.Tuple, cst.List)):
        out: List[cst.Name] = []
        for el in t.elements:
            out += _target_names(el.value)
        return out
    if isinstance(t, cst.StarredElement):
        return _target_names(t.value)
    return []


@dataclass
class FunctionFlow:
    """Reaching definitions for every name load of one function."""

    func: cst.FunctionDef
    defs: List[Definition] = field(default_factory=list)
    reaching: Dict[cst.Name, FrozenSet[int]] = field(default_factory=dict)
    stmt_state: Dict[cst.CSTNode, Dict[str, FrozenSet[int]]] = field(default_factory=dict)
    dead: Set[cst.CSTNode] = field(default_factory=set)  # statements the walk met with no path in

    # -- queries ---------------------------------------------------------
    def defs_of(self, name_node: cst.Name) -> List[Definition]:
        return [self.defs[i] for i in sorted(self.reaching.get(name_node, ()))]

    def uses_of(self, d: Definition) -> List[cst.Name]:
        return [n for n, ids in self.reaching.items() if d.id in ids]

    def reachable(self, stmt: cst.CSTNode) -> bool:
        """False only for a statement every path skips: one after a return, raise, break or
        continue in its block (a statement the walk never met, in a nested def, counts as
        reachable: nothing is proven about it)."""
        return not (stmt in self.dead and stmt not in self.stmt_state)

    def defs_at(self, stmt: cst.CSTNode, name: str) -> List[Definition]:
        """Definitions of `name` reaching the start of statement `stmt`."""
        st = self.stmt_state.get(stmt)
        if st is None:
            return []
        return [self.defs[i] for i in sorted(st.get(name, ()))]


class _Builder:
    def __init__(self, func: cst.FunctionDef) -> None:
        self.flow = FunctionFlow(func)
        self.guards: List[Tuple[cst.BaseExpression, bool]] = []

    # -- definitions -----------------------------------------------------
    def new_def(self, state: State, name: str, kind: str, stmt, **kw) -> None:
        d = Definition(len(self.flow.defs), name, kind, stmt, guards=tuple(self.guards), **kw)
        self.flow.defs.append(d)
        if state is not None:
            state[name] = frozenset([d.id])

    def read(self, state: State, node: Optional[cst.CSTNode]) -> None:
        for n in loads_in(node):
            self.flow.reaching[n] = state.get(n.value, frozenset()) if state is not None else frozenset()

    def bind_target(self, state: State, target, value, stmt, kind="assign") -> None:
        if isinstance(target, cst.Name):
            self.new_def(state, target.value, kind, stmt, value=value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            els = target.elements
            pairwise = (
                isinstance(value, (cst.Tuple, cst.List))
                and len(value.elements) == len(els)
                and not any(isinstance(e, cst.StarredElement) for e in list(els) + list(value.elements))
            )
            for i, el in enumerate(els):
                sub = el.value
                if pairwise:
                    self.bind_target(state, sub, value.elements[i].value, stmt, kind)
                else:
                    for n in _target_names(sub):
                        self.new_def(state, n.value, "unpack", stmt, source=value, index=i)
        else:
            # self.x = ..., a[i] = ...: reads, binds no local name.
            self.read(state, target)

    # -- statements ------------------------------------------------------
    def block(self, state: State, body: Sequence[cst.CSTNode]) -> State:
        for stmt in body:
            if state is not None:
                self.flow.stmt_state[stmt] = dict(state)
            else:
                self.flow.dead.add(stmt)
            state = self.stmt(state, stmt)
        return state

    def suite(self, state: State, suite) -> State:
        if isinstance(suite, cst.IndentedBlock):
            return self.block(state, suite.body)
        if isinstance(suite, cst.SimpleStatementSuite):
            return self.block(state, suite.body)
        return state

    def stmt(self, state: State, s: cst.CSTNode) -> State:
        if isinstance(s, cst.SimpleStatementLine):
            return self.block(state, s.body)
        if isinstance(s, cst.Assign):
            self.read(state, s.value)
            for t in s.targets:
                self.bind_target(state, t.target, s.value, s)
            return state
        if isinstance(s, cst.AnnAssign):
            self.read(state, s.value)
            if s.value is not None:
                self.bind_target(state, s.target, s.value, s)
            return state
        if isinstance(s, cst.AugAssign):
            self.read(state, s.value)
            self.read(state, s.target)
            if isinstance(s.target, cst.Name):
                self.new_def(state, s.target.value, "aug", s, value=s.value)
            return state
        if isinstance(s, (cst.Return, cst.Raise)):
            self.read(state, getattr(s, "value", None) if isinstance(s, cst.Return) else s.exc)
            return None
        if isinstance(s, (cst.Break, cst.Continue)):
            return None
        if isinstance(s, cst.Del):
            for n in _target_names(s.target):
                if state is not None:
                    state[n.value] = frozenset()
            return state
        if isinstance(s, (cst.Import, cst.ImportFrom)):
            names = s.names if isinstance(s.names, (list, tuple)) else []
            for a in names:
                bound = a.asname.name if a.asname else a.name
                if isinstance(bound, cst.Name):
                    self.new_def(state, bound.value, "import", s)
                elif isinstance(bound, cst.Attribute):
                    root = bound
                    while isinstance(root, cst.Attribute):
                        root = root.value
                    if isinstance(root, cst.Name):
                        self.new_def(state, root.value, "import", s)
            return state
        if isinstance(s, cst.If):
            self.read(state, s.test)
            self.guards.append((s.test, True))
            a = self.suite(dict(state) if state is not None else None, s.body)
            self.guards[-1] = (s.test, False)
            b = state if s.orelse is None else self._orelse(dict(state) if state is not None else None, s.orelse)
            self.guards.pop()
            return _merge(a, b)
        if isinstance(s, (cst.For, cst.While)):
            if isinstance(s, cst.For):
                self.read(state, s.iter)
            else:
                self.read(state, s.test)
            entry = state
            out: State = entry
            for _ in range(3):  # names, not values: a few passes reach the fixpoint
                loop_state = _merge(entry, out) if out is not None else (dict(entry) if entry is not None else None)
                if isinstance(s, cst.For) and loop_state is not None:
                    self.bind_target(loop_state, s.target, None, s, kind="for")
                self.guards.append((s, True))
                body_out = self.suite(loop_state, s.body)
                self.guards.pop()
                out = _merge(entry, body_out)
            if s.orelse is not None:
                out = _merge(out, self._orelse(dict(out) if out is not None else None, s.orelse))
            return out
        if isinstance(s, cst.With):
            for item in s.items:
                self.read(state, item.item)
                if item.asname is not None:
                    self.bind_target(state, item.asname.name, None, s, kind="with")
            return self.suite(state, s.body)
        if isinstance(s, (cst.Try, getattr(cst, "TryStar", cst.Try))):
            entry = dict(state) if state is not None else None
            body_out = self.suite(state, s.body)
            anywhere = _merge(entry, body_out)
            outs = []
            if s.orelse is not None:
                body_out = self._orelse(body_out, s.orelse)
            outs.append(body_out)
            for h in s.handlers:
                hs = dict(anywhere) if anywhere is not None else None
                self.read(hs, h.type)
                if h.name is not None:
                    self.bind_target(hs, h.name.name, None, h, kind="except")
                outs.append(self.suite(hs, h.body))
            merged: State = None
            for o in outs:
                merged = _merge(merged, o)
            if s.finalbody is not None:
                merged = self.suite(_merge(merged, anywhere), s.finalbody.body)
            return merged
        if isinstance(s, (cst.FunctionDef, cst.ClassDef)):
            self.new_def(state, s.name.value, "def", s)
            return state
        if isinstance(s, cst.Match):
            self.read(state, s.subject)
            merged = None
            for case in s.cases:
                merged = _merge(merged, self.suite(dict(state) if state is not None else None, case.body))
            return _merge(merged, state)
        # Expr, Assert, Global, Pass, ...: only reads.
        self.read(state, s)
        return state

    def _orelse(self, state: State, orelse) -> State:
        if isinstance(orelse, cst.If):
            return self.stmt(state, orelse)
        return self.suite(state, orelse.body)


def analyze(func: cst.FunctionDef) -> FunctionFlow:
    b = _Builder(func)
    state: Dict[str, FrozenSet[int]] = {}
    p = func.params
    for param in list(p.posonly_params) + list(p.params) + list(p.kwonly_params):
        b.new_def(state, param.name.value, "param", param)
    for star in (p.star_arg, p.star_kwarg):
        if isinstance(star, cst.Param):
            b.new_def(state, star.name.value, "param", star)
    b.suite(state, func.body)
    return b.flow

