"""locate: which functions of a candidate file need the full (libcst) analysis.

Python's C ``ast`` parser is ~20x faster than libcst with metadata, so it picks
the functions that touch a KV buffer or an MLA plan, and gathers the few
class- and module-level facts the rules need. libcst then parses only those
functions (see ``units``). Nothing here decides what a site *is*.
"""

from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

from kvpatch.names import CAST_CALLS, KV_GETTERS, MLA_PLAN_FUNCTIONS, MLA_WRAPPER, PLAN_METHOD, RUNTIME_MODULE

# FlashInfer's MLA plan takes 12 required arguments; its other wrappers' plans
# take fewer, or none of these MLA-only keywords.
MLA_PLAN_KEYWORDS = {"head_dim_ckv", "head_dim_kpe", "kv_len_arr"}
MLA_PLAN_ARITY = 12
# BatchMLAPagedAttentionWrapper.plan takes at most 13 positional arguments (the
# 12 above + use_profiler). More is another plan(): e.g. the JIT module's
# `self._cached_module.plan(...)` of a decode wrapper (16 arguments, with
# logits_soft_cap and head_dim where the MLA dtypes would be).
MLA_PLAN_MAX_POSITIONAL = 13


@dataclass
class Unit:
    """A top-level function or a method: the region libcst parses on its own."""

    qualname: str
    class_qualname: Optional[str]
    name: str
    start: int  # first line, 1-based, decorators included
    end: int  # last line, inclusive
    first_param: Optional[str]
    why: Set[str] = field(default_factory=set)


@dataclass
class ClassFacts:
    qualname: str
    self_attrs: Set[str] = field(default_factory=set)
    init: Optional[Unit] = None
    init_params: List[str] = field(default_factory=list)
    init_annotations: Dict[str, str] = field(default_factory=dict)
    has_mla_plan: bool = False
    # For following a cast into `self.<helper>(...)` (analysis/helpers.py): every def of
    # each method name in the class body, the bases as written, and the names bound in
    # the class body otherwise (`_forward = other`).
    methods: Dict[str, List[ast.AST]] = field(default_factory=dict)
    bases: List[str] = field(default_factory=list)
    class_names: Set[str] = field(default_factory=set)


@dataclass
class ModuleFacts:
    uses_mla_wrapper: bool = False
    runtime_alias: Optional[str] = None  # the name our runtime import binds
    import_after_line: int = 0  # our import goes after this line (0: top)


@dataclass
class Located:
    units: List[Unit]
    classes: Dict[str, ClassFacts]
    module: ModuleFacts


def mla_plan_shape(keywords: Set[str], positional: int, starred: bool) -> bool:
    """Whether a `.plan(...)` call with these keyword names, this many positional
    arguments and (or not) a `*`/`**` argument is an MLA wrapper's plan. Used on
    Python's ast here and on libcst nodes by the engine."""
    if keywords & MLA_PLAN_KEYWORDS:
        return True
    return not starred and positional + len(keywords) >= MLA_PLAN_ARITY and 8 <= positional <= MLA_PLAN_MAX_POSITIONAL


def is_mla_plan_call(node: ast.Call) -> bool:
    if not (isinstance(node.func, ast.Attribute) and node.func.attr == PLAN_METHOD):
        return False
    starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
    return mla_plan_shape({k.arg for k in node.keywords if k.arg}, len(node.args), starred)


_AST_FIELDS: Dict[type, Tuple[str, ...]] = {}


def walk(node: ast.AST) -> List[ast.AST]:
    """The nodes of ast.walk(node), in its order (breadth first, fields in order),
    as a list: one loop over cached field names instead of a generator per node
    (~3x faster; locate's walks were most of its time)."""
    todo = [node]
    i = 0
    fields = _AST_FIELDS
    ast_type = ast.AST
    while i < len(todo):
        n = todo[i]
        i += 1
        names = fields.get(type(n))
        if names is None:
            names = fields[type(n)] = type(n)._fields
        for name in names:
            v = getattr(n, name, None)
            if isinstance(v, list):
                todo.extend([x for x in v if isinstance(x, ast_type)])
            elif isinstance(v, ast_type):
                todo.append(v)
    return todo


def _call_name(node: ast.Call) -> Optional[str]:
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return None


def _names_in(node: ast.AST) -> Set[str]:
    return {n.id for n in walk(node) if isinstance(n, ast.Name)}


def _has_getter(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _call_name(n) in KV_GETTERS for n in walk(node))


def _value_facts(value: ast.AST) -> Tuple[bool, Set[str]]:
    """(_has_getter(value), _names_in(value)) from one walk."""
    nodes = walk(value)
    return (any(isinstance(n, ast.Call) and _call_name(n) in KV_GETTERS for n in nodes),
            {n.id for n in nodes if isinstance(n, ast.Name)})


def _target_names(target: ast.AST) -> Set[str]:
    return {target.id} if isinstance(target, ast.Name) else _names_in(target)


def reads_kv(node: ast.AST, tainted: Set[str]) -> bool:
    """`node` holds a KV getter call or a name that may hold a KV buffer."""
    return _has_getter(node) or bool(_names_in(node) & tainted)


def kv_tainted(fn: ast.AST, nodes: Optional[List[ast.AST]] = None) -> Set[str]:
    return _tainted(fn, nodes)


def _tainted(fn: ast.AST, nodes: Optional[List[ast.AST]] = None) -> Set[str]:
    """Names that may hold (a view of) a KV buffer: flow-insensitive, so it
    over-approximates the libcst analysis and never drops a real site.
    `nodes`: ast.walk(fn), when the caller has it already."""
    pairs = []
    for n in (nodes if nodes is not None else walk(fn)):
        if isinstance(n, ast.Assign):
            pairs += [(t, n.value) for t in n.targets]
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)) and n.value is not None:
            pairs.append((n.target, n.value))
        elif isinstance(n, (ast.For, ast.AsyncFor)):
            pairs.append((n.target, n.iter))
        elif isinstance(n, ast.NamedExpr):
            pairs.append((n.target, n.value))
    # Each side is walked once; the fixed point then only intersects sets.
    facts = [_value_facts(value) + (_target_names(target),) for target, value in pairs]
    tainted: Set[str] = set()
    changed = True
    while changed:
        changed = False
        for getter, reads, binds in facts:
            if getter or reads & tainted:
                new = binds - tainted
                if new:
                    tainted |= new
                    changed = True
    return tainted


class MarkerLines:
    """The lines of a file's text that spell a name `_why` looks for. A
    function none of whose lines does cannot get a reason, so it is not
    walked at all (most functions of a candidate file)."""

    _BREAK = re.compile(r"\r\n|\r|\n")

    def __init__(self, text: str, runtime_calls: FrozenSet[str]) -> None:
        names = re.compile("|".join(sorted(KV_GETTERS | runtime_calls)) + r"|plan")
        starts = [0] + [m.end() for m in self._BREAK.finditer(text)]
        self.lines = sorted({bisect.bisect_right(starts, m.start()) for m in names.finditer(text)})

    def any_in(self, start: int, end: int) -> bool:
        i = bisect.bisect_left(self.lines, start)
        return i < len(self.lines) and self.lines[i] <= end


def _why(fn: ast.AST, uses_mla_wrapper: bool, runtime_calls: FrozenSet[str]) -> Set[str]:
    why: Set[str] = set()
    nodes = walk(fn)
    calls = [n for n in nodes if isinstance(n, ast.Call)]
    if any(_call_name(n) in KV_GETTERS for n in calls):
        tainted = _tainted(fn, nodes)
        for n in calls:
            name = _call_name(n)
            if isinstance(n.func, ast.Attribute) and (
                (name in CAST_CALLS and reads_kv(n.func.value, tainted))
                or (name == "run" and uses_mla_wrapper
                    and any(_has_getter(a) or _names_in(a) & tainted
                            for a in list(n.args) + [k.value for k in n.keywords]))
            ):
                why.add("kvbuf")
                break
    for n in calls:
        name = _call_name(n)
        if name in runtime_calls:
            why.add("patched")
        elif uses_mla_wrapper and (name in MLA_PLAN_FUNCTIONS or (name == PLAN_METHOD and is_mla_plan_call(n))):
            why.add("plan")
    return why


def _cast_helpers(fn: ast.AST, self_name: str) -> Set[str]:
    """Methods `self.<m>(...)` handed a name bound to a cast of a KV buffer in fn: the
    helpers a cast may be followed into (analysis/helpers.py), parsed so that a rule
    can rewrite their kernel calls."""
    nodes = walk(fn)
    tainted = _tainted(fn, nodes)
    cast_names: Set[str] = set()
    for n in nodes:
        if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute)
                and n.value.func.attr in CAST_CALLS and reads_kv(n.value.func.value, tainted)):
            cast_names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    out: Set[str] = set()
    for n in nodes:
        if (cast_names and isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Name) and n.func.value.id == self_name
                and any(isinstance(a, ast.Name) and a.id in cast_names
                        for a in list(n.args) + [k.value for k in n.keywords])):
            out.add(n.func.attr)
    return out


def _statements(fn: ast.AST):
    """fn and every statement under it (nested bodies included), skipping
    expressions: assignments are statements, so nothing they hold is missed."""
    stack = [fn]
    while stack:
        n = stack.pop()
        yield n
        for name in n._fields:
            v = getattr(n, name, None)
            if isinstance(v, list):
                stack.extend(x for x in v if isinstance(x, (ast.stmt, ast.excepthandler, ast.match_case)))


def _self_attrs(fn: ast.AST, self_name: str) -> Set[str]:
    attrs: Set[str] = set()
    for n in _statements(fn):
        targets: List[ast.AST] = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
            targets = [n.target]
        for t in targets:
            for e in walk(t):
                if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                        and e.value.id == self_name):
                    attrs.add(e.attr)
    return attrs


def _first_line(node) -> int:
    decs = getattr(node, "decorator_list", None) or []
    return min([node.lineno] + [d.lineno for d in decs])


def locate(tree: ast.Module, text: Optional[str] = None, runtime_calls: FrozenSet[str] = frozenset()) -> Located:
    """`text`, the module's source, lets locate skip the functions (and the
    module-wide walk) that cannot matter; the result is the same.
    `runtime_calls`: the runtime functions the loaded rules emit (Rule.EMITS);
    a function calling one holds a patched site."""
    units: List[Unit] = []
    classes: Dict[str, ClassFacts] = {}
    mod = ModuleFacts()
    marks = MarkerLines(text, runtime_calls) if text is not None else None
    method_nodes: Dict[str, List[Tuple[ast.AST, str]]] = {}
    module_walk = text is None or MLA_WRAPPER in text or RUNTIME_MODULE in text

    for n in (walk(tree) if module_walk else ()):
        if isinstance(n, ast.Name) and n.id == MLA_WRAPPER:
            mod.uses_mla_wrapper = True
        elif isinstance(n, ast.Attribute) and n.attr == MLA_WRAPPER:
            mod.uses_mla_wrapper = True
        elif isinstance(n, ast.alias) and (n.name == MLA_WRAPPER or n.name.endswith("." + MLA_WRAPPER)):
            mod.uses_mla_wrapper = True
        elif isinstance(n, ast.ImportFrom) and any(a.name == RUNTIME_MODULE for a in n.names):
            a = next(a for a in n.names if a.name == RUNTIME_MODULE)
            mod.runtime_alias = a.asname or a.name

    # Our import goes after the last top-level import that precedes the first
    # def/class: below `from __future__` and the module's own imports.
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            break
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            mod.import_after_line = stmt.end_lineno or stmt.lineno

    def visit_body(body, class_chain: Tuple[str, ...]):
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                chain = class_chain + (stmt.name,)
                cq = ".".join(chain)
                facts = classes.setdefault(cq, ClassFacts(cq))
                facts.bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                               for b in stmt.bases]
                for sub in stmt.body:
                    if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                        for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                            facts.class_names |= {n.id for n in walk(t) if isinstance(n, ast.Name)}
                    elif not isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Expr,
                                              ast.Pass)):
                        facts.class_names.add("*")  # anything else may bind names: follow no helper
                visit_body(stmt.body, chain)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                cq = ".".join(class_chain) if class_chain else None
                args = stmt.args.posonlyargs + stmt.args.args
                first = args[0].arg if args else None
                start, end = _first_line(stmt), stmt.end_lineno or stmt.lineno
                unit = Unit(
                    qualname=(cq + "." if cq else "") + stmt.name,
                    class_qualname=cq,
                    name=stmt.name,
                    start=start,
                    end=end,
                    first_param=first,
                    why=_why(stmt, mod.uses_mla_wrapper, runtime_calls) if marks is None or marks.any_in(start, end) else set(),
                )
                if cq:
                    facts = classes[cq]
                    facts.methods.setdefault(stmt.name, []).append(stmt)
                    if first:
                        method_nodes.setdefault(cq, []).append((stmt, first))
                    if "plan" in unit.why:
                        facts.has_mla_plan = True
                    if stmt.name == "__init__":
                        facts.init = unit
                        facts.init_params = [a.arg for a in args[1:] + stmt.args.kwonlyargs]
                        facts.init_annotations = {
                            a.arg: ast.unparse(a.annotation)
                            for a in args[1:] + stmt.args.kwonlyargs
                            if a.annotation is not None
                        }
                units.append(unit)
            elif isinstance(stmt, (ast.If, ast.Try, ast.With)) and not class_chain:
                # Definitions under `if TYPE_CHECKING:`/try-import at module level.
                for sub in ("body", "orelse", "finalbody"):
                    visit_body(getattr(stmt, sub, []) or [], class_chain)
                for h in getattr(stmt, "handlers", []) or []:
                    visit_body(h.body, class_chain)

    visit_body(tree.body, ())

    for facts in classes.values():
        if facts.has_mla_plan and facts.init is not None:
            facts.init.why.add("init")
    by_name = {u.qualname: u for u in units}
    for u in [u for u in units if "kvbuf" in u.why and u.class_qualname]:
        for stmt, first in method_nodes.get(u.class_qualname, ()):
            if by_name.get(f"{u.class_qualname}.{stmt.name}") is u:
                for m in _cast_helpers(stmt, first):
                    helper = by_name.get(f"{u.class_qualname}.{m}")
                    if helper is not None and helper is not u:
                        helper.why.add("helper")
    # Only the classes of the units that matter are asked about their attributes.
    for cq in {u.class_qualname for u in units if u.why and u.class_qualname}:
        for stmt, first in method_nodes.get(cq, ()):
            classes[cq].self_attrs |= _self_attrs(stmt, first)
    return Located([u for u in units if u.why], classes, mod)
