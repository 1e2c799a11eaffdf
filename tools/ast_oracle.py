#!/usr/bin/env python3
"""ast_oracle: an independent checker for `kvpatch audit`.

It shares no code with kvpatch (only the standard library's `ast`), and it
answers one question the simple way: where, in a tree of Python files, is a
KV-cache buffer cast?

    KV buffer   the result of `X.get_key_buffer(...)`, `X.get_value_buffer(...)`,
                an element of `X.get_kv_buffer(...)` (it returns (k, v)), or a
                local name bound to one, through views and slices
                (`.view()`, `[:, :, :512]`, `.reshape()`, ...); indexing by
                anything but a whole-row slice, or `index_select`/`gather`,
                makes it *gathered* (only the picked rows are cast).
    cast        `B.to(...)`, `B.float()`, `B.half()`, `B.bfloat16()`,
                `B.double()`, `B.type(...)` (and `.int()`, `.long()`, ...)
                on a KV buffer B.

Deliberately simple, and over-approximating where kvpatch is precise: name
bindings are tracked flow-insensitively per function (a name that is *ever*
bound to a KV buffer in the function counts everywhere in it), nested
functions see their enclosing function's names, and every `.py` file is
parsed (no byte prefilter). `.to()` calls that only move the buffer (a string
/ int / device argument, no dtype) are reported too, tagged `device_only`,
because kvpatch deliberately leaves them out.

Usage:
    python tools/ast_oracle.py ROOT                      # table of casts
    python tools/ast_oracle.py ROOT --json               # JSON list
    python tools/ast_oracle.py ROOT --compare AUDIT.json # diff with `kvpatch audit --json`
    python tools/ast_oracle.py ROOT --extra-getters get_mla_kv_buffer,get_raw_kv_buffer

Exit code of --compare: 0 when every dtype cast the oracle sees is a kvpatch
site and vice versa, 1 otherwise (the differences are printed).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List, Optional, Set, Tuple

POOL_GETTERS = {"get_key_buffer", "get_value_buffer"}
TUPLE_GETTERS = {"get_kv_buffer"}
# Methods whose result still holds every row of the buffer (views, layout).
KEEP_METHODS = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "contiguous",
                "permute", "transpose", "narrow", "expand", "expand_as", "as_strided", "t", "detach",
                "select", "view_as", "movedim", "swapaxes", "clone", "__getitem__"}
# Methods splitting the buffer into pieces that together are still the whole buffer.
SPLIT_METHODS = {"split", "chunk", "unbind", "tensor_split"}
# Methods (or torch functions taking the buffer first) that pick rows.
GATHER_METHODS = {"index_select", "gather", "take", "masked_select", "take_along_dim"}
CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "type",
                "int", "long", "short", "char", "byte", "bool"}
SKIP_DIRS = {".git", ".kvpatch", "__pycache__"}


@dataclass
class Hit:
    file: str
    line: int
    end_line: int
    col: int
    scope: str
    method: str  # to / float / ...
    args: str  # the cast's arguments, as source
    receiver: str
    kind: str  # pool | gathered | mixed
    device_only: bool  # a .to() that moves but does not cast
    getters: List[str] = field(default_factory=list)


# -- buffer expressions --------------------------------------------------------
def _call_attr(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute):
            return node.func.attr
        if isinstance(node.func, ast.Name):
            return node.func.id
    return None


def _whole_rows(sl: ast.AST) -> bool:
    """`buf[:, :, :512]`, `buf[...]`: every row; `buf[idx]`, `buf[2:5]`: not."""
    first = sl.elts[0] if isinstance(sl, ast.Tuple) and sl.elts else sl
    if isinstance(first, ast.Slice):
        return first.lower is None and first.upper is None and first.step is None
    return isinstance(first, ast.Constant) and first.value is Ellipsis


def _row_gather(meth: str, args: List[ast.AST], keywords: List[ast.keyword]) -> bool:
    """index_select along a literal dim other than 0 keeps every row."""
    if meth != "index_select":
        return True
    dims = [k.value for k in keywords if k.arg == "dim"] + list(args[:1])
    if not dims:
        return True
    try:
        return ast.literal_eval(dims[0]) == 0
    except ValueError:
        return True  # a computed dim: assume rows


def _int_index(sl: ast.AST) -> bool:
    return isinstance(sl, ast.Constant) and isinstance(sl.value, int)


def _join(kinds: Set[str]) -> Optional[str]:
    kinds = {k for k in kinds if k}
    if not kinds:
        return None
    if kinds == {"pool"}:
        return "pool"
    if kinds == {"gathered"}:
        return "gathered"
    if kinds == {"tuple"}:
        return "tuple"
    return "mixed"


class Scope:
    """Flow-insensitive KV taint for the names of one function (or module)."""

    def __init__(self, getters: Set[str], tuple_getters: Set[str], parent: Optional["Scope"] = None):
        self.getters = getters
        self.tuple_getters = tuple_getters
        self.parent = parent
        self.names: Dict[str, Set[str]] = {}  # name -> {pool, gathered, tuple, other}
        self.name_getters: Dict[str, List[str]] = {}

    def lookup(self, name: str) -> Optional[Set[str]]:
        s: Optional[Scope] = self
        while s is not None:
            if name in s.names:
                return s.names[name]
            s = s.parent
        return None

    def kind(self, e: ast.AST, depth: int = 0) -> Tuple[Optional[str], List[str]]:
        """(pool | gathered | mixed | tuple | None, getter sources)."""
        if depth > 20:
            return None, []
        name = _call_attr(e)
        if name in self.getters:
            return "pool", [ast.unparse(e)]
        if name in self.tuple_getters:
            return "tuple", [ast.unparse(e)]
        if isinstance(e, ast.Name):
            ks = self.lookup(e.id)
            if not ks:
                return None, []
            kv = {k for k in ks if k != "other"}
            if not kv:
                return None, []
            srcs = self._getters_of(e.id)
            if "other" in ks:
                return "mixed", srcs
            return _join(kv), srcs
        if isinstance(e, ast.Subscript):
            k, g = self.kind(e.value, depth + 1)
            if _call_attr(e.value) in SPLIT_METHODS:
                return k, g  # a piece of a split: not a row gather
            if k == "tuple":
                return ("pool", g) if _int_index(e.slice) else ("mixed", g)
            if k in ("pool", "mixed") and not _whole_rows(e.slice):
                return "gathered", g
            return k, g
        if isinstance(e, ast.Attribute):
            if e.attr in ("T", "mT", "data"):
                return self.kind(e.value, depth + 1)
            return None, []
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
            meth = e.func.attr
            if meth not in KEEP_METHODS | SPLIT_METHODS | GATHER_METHODS:
                return None, []
            rest = e.args
            if isinstance(e.func.value, ast.Name) and e.func.value.id == "torch" and e.args:
                k, g = self.kind(e.args[0], depth + 1)  # torch.split(buf, ...), torch.index_select(buf, ...)
                rest = e.args[1:]
            else:
                k, g = self.kind(e.func.value, depth + 1)
            if meth in GATHER_METHODS and k in ("pool", "mixed", "gathered") and _row_gather(meth, rest, e.keywords):
                return "gathered", g
            return k, g
        if isinstance(e, ast.IfExp):
            a, ga = self.kind(e.body, depth + 1)
            b, gb = self.kind(e.orelse, depth + 1)
            if a is None and b is None:
                return None, []
            if a is None or b is None:
                return "mixed", ga + gb
            return _join({a, b}), ga + gb
        if isinstance(e, ast.NamedExpr):
            return self.kind(e.value, depth + 1)
        return None, []

    def _getters_of(self, name: str) -> List[str]:
        s: Optional[Scope] = self
        while s is not None:
            if name in s.name_getters:
                return s.name_getters[name]
            s = s.parent
        return []


def _own_nodes(body: List[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of a body, not descending into nested defs/classes/lambdas."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    stack: List[ast.AST] = list(reversed(body))
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, nested):
            continue  # a def in this body: seen, not entered
        for c in reversed(list(ast.iter_child_nodes(n))):
            if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                yield c  # seen, not entered
                continue
            stack.append(c)


def _bindings(nodes: List[ast.AST]) -> List[Tuple[ast.AST, ast.AST, str]]:
    """(target, value, how) for every binding among nodes."""
    out = []
    for n in nodes:
        if isinstance(n, ast.Assign):
            out += [(t, n.value, "assign") for t in n.targets]
        elif isinstance(n, ast.AnnAssign) and n.value is not None:
            out.append((n.target, n.value, "assign"))
        elif isinstance(n, ast.AugAssign):
            out.append((n.target, n.value, "aug"))
        elif isinstance(n, ast.NamedExpr):
            out.append((n.target, n.value, "assign"))
        elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
            out.append((n.target, n.iter, "for"))
        elif isinstance(n, (ast.With, ast.AsyncWith)):
            out += [(i.optional_vars, i.context_expr, "with") for i in n.items if i.optional_vars is not None]
    return out


def _solve(scope: Scope, binds) -> None:
    """Fixpoint of the name -> kinds map over the bindings."""
    for _ in range(12):
        before = {k: set(v) for k, v in scope.names.items()}

        def add(name: str, kind: str, getters: List[str]) -> None:
            scope.names.setdefault(name, set()).add(kind)
            if getters:
                have = scope.name_getters.setdefault(name, [])
                for g in getters:
                    if g not in have:
                        have.append(g)

        for target, value, how in binds:
            if how in ("for", "with"):
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        add(n.id, "other", [])
                continue
            if isinstance(target, ast.Name):
                if how == "aug":
                    continue  # x += y keeps x's kind
                k, g = scope.kind(value)
                add(target.id, k or "other", g)
            elif isinstance(target, (ast.Tuple, ast.List)):
                k, g = scope.kind(value)
                pairwise = isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
                for i, el in enumerate(target.elts):
                    el = el.value if isinstance(el, ast.Starred) else el
                    if pairwise:
                        ek, eg = scope.kind(value.elts[i])
                    elif k == "tuple":
                        ek, eg = "pool", g
                    elif k in ("pool", "gathered", "mixed") and isinstance(value, ast.Call) and \
                            isinstance(value.func, ast.Attribute) and value.func.attr in SPLIT_METHODS:
                        ek, eg = k, g
                    else:
                        ek, eg = None, []
                    for n in ast.walk(el):
                        if isinstance(n, ast.Name):
                            add(n.id, ek or "other", eg)
        if {k: set(v) for k, v in scope.names.items()} == before:
            break


def _device_only(call: ast.Call) -> bool:
    """`.to("cpu")`, `.to(device)`, `.to(x.device)`, `.to(device=...)`: no dtype."""
    kws = {k.arg for k in call.keywords if k.arg}
    if "dtype" in kws:
        return False
    if not call.args:
        return bool(kws) and kws <= {"device", "non_blocking", "copy", "memory_format"}
    if len(call.args) >= 2:
        return False
    a = call.args[0]
    if isinstance(a, ast.Constant) and isinstance(a.value, (str, int)):
        return True
    if isinstance(a, ast.Attribute) and a.attr == "device":
        return True
    if isinstance(a, ast.Name) and "device" in a.id.lower():
        return True
    if isinstance(a, ast.Call) and (_call_attr(a) == "device"):
        return True
    return False


def scan_source(rel: str, text: str, getters: Set[str], tuple_getters: Set[str]) -> List[Hit]:
    tree = ast.parse(text)
    hits: List[Hit] = []

    def visit(body, name: str, parent: Optional[Scope]):
        scope = Scope(getters, tuple_getters, parent)
        own = list(_own_nodes(body))
        _solve(scope, _bindings(own))
        for n in own:
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CAST_METHODS:
                k, g = scope.kind(n.func.value)
                if k in ("pool", "gathered", "mixed", "tuple"):
                    if n.func.attr not in ("to", "type") and n.args:
                        continue  # x.float(3)? not a cast
                    args = ", ".join([ast.unparse(a) for a in n.args]
                                     + [f"{kw.arg}={ast.unparse(kw.value)}" if kw.arg else f"**{ast.unparse(kw.value)}"
                                        for kw in n.keywords])
                    hits.append(Hit(rel, n.lineno, n.end_lineno or n.lineno, n.col_offset, name, n.func.attr,
                                    args, ast.unparse(n.func.value), k,
                                    n.func.attr == "to" and _device_only(n), g))
        for n in own:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(n.body, f"{name}.{n.name}" if name else n.name, scope)
            elif isinstance(n, ast.ClassDef):
                visit(n.body, f"{name}.{n.name}" if name else n.name, None)  # class bodies do not enclose
            elif isinstance(n, ast.Lambda):
                visit([ast.Expr(n.body)], f"{name}.<lambda>" if name else "<lambda>", scope)

    visit(tree.body, "", None)
    hits.sort(key=lambda h: (h.line, h.col))
    return hits


def iter_py(root: str) -> Iterator[str]:
    if os.path.isfile(root):
        yield root
        return
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(d, f)


def scan_tree(root: str, getters: Set[str], tuple_getters: Set[str]):
    hits: List[Hit] = []
    errors: List[Tuple[str, str]] = []
    n = 0
    for p in iter_py(root):
        n += 1
        rel = os.path.basename(p) if os.path.isfile(root) else os.path.relpath(p, root).replace(os.sep, "/")
        try:
            with open(p, "rb") as fh:
                data = fh.read()
            text = data.decode("utf-8-sig")
            if not any(g in text for g in getters | tuple_getters):
                continue  # no getter spelled in the file: no KV buffer in it (by this definition)
            hits += scan_source(rel, text, getters, tuple_getters)
        except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
            errors.append((rel, f"{exc.__class__.__name__}: {exc}"))
    return n, hits, errors


# -- comparison with `kvpatch audit --json` ----------------------------------
CAST_FORMS = {"assignment", "inline", "two-statement"}


def compare(hits: List[Hit], audit: dict) -> dict:
    sites = [s for s in audit["sites"] if s["form"] in CAST_FORMS]
    others = [s for s in audit["sites"] if s["form"] not in CAST_FORMS]
    oracle = [h for h in hits if not h.device_only]
    key_s = {}
    for s in sites:
        key_s.setdefault((s["file"], s["line"]), []).append(s)
    matched, only_oracle = [], []
    used = set()
    for h in oracle:
        cands = [s for s in key_s.get((h.file, h.line), []) if id(s) not in used]
        # same line: match on the cast method (`.to(` vs `.float()`)
        pick = next((s for s in cands if (s["dtype"] == f".{h.method}()") == (h.method not in ("to", "type"))),
                    cands[0] if cands else None)
        if pick is None:
            only_oracle.append(h)
        else:
            used.add(id(pick))
            matched.append((h, pick))
    only_kvpatch = [s for s in sites if id(s) not in used]
    return {
        "matched": [{"file": h.file, "line": h.line, "oracle_kind": h.kind, "status": s["status"],
                     "rule": s["rule"], "qualname": s["qualname"]} for h, s in matched],
        "only_oracle": [asdict(h) for h in only_oracle],
        "only_kvpatch": sites and [{"file": s["file"], "line": s["line"], "status": s["status"],
                                    "qualname": s["qualname"], "statement": s["statement"]} for s in only_kvpatch],
        "device_only": [asdict(h) for h in hits if h.device_only],
        "kvpatch_non_cast_sites": [{"file": s["file"], "line": s["line"], "form": s["form"], "status": s["status"]}
                                   for s in others],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--json", action="store_true", help="print the hits as JSON")
    ap.add_argument("--compare", metavar="AUDIT_JSON", help="compare with `kvpatch audit --json` output")
    ap.add_argument("--extra-getters", default="", help="comma-separated extra getter names (pool-like)")
    ns = ap.parse_args(argv)
    getters = POOL_GETTERS | {g for g in ns.extra_getters.split(",") if g}
    t0 = time.perf_counter()
    n, hits, errors = scan_tree(ns.root, getters, TUPLE_GETTERS)
    secs = time.perf_counter() - t0
    if ns.compare:
        with open(ns.compare, encoding="utf-8") as fh:
            audit = json.load(fh)
        res = compare(hits, audit)
        res.update({"files": n, "oracle_seconds": round(secs, 2), "oracle_errors": errors})
        if ns.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"oracle: {n} files, {len(hits)} casts ({len(res['device_only'])} device-only), "
                  f"{len(errors)} unparsable, {secs:.2f}s")
            print(f"matched: {len(res['matched'])}")
            for mt in res["matched"]:
                print(f"  {mt['file']}:{mt['line']}  oracle={mt['oracle_kind']}  kvpatch={mt['status']} "
                      f"({mt['rule']})")
            print(f"only oracle: {len(res['only_oracle'])}")
            for h in res["only_oracle"]:
                print(f"  {h['file']}:{h['line']}  {h['scope']}  {h['receiver']}.{h['method']}({h['args']}) "
                      f"[{h['kind']}]")
            print(f"only kvpatch: {len(res['only_kvpatch'] or [])}")
            for s in res["only_kvpatch"] or []:
                print(f"  {s['file']}:{s['line']}  {s['qualname']} [{s['status']}]  {s['statement']}")
            print(f"device-only moves (kvpatch ignores by design): {len(res['device_only'])}")
            for h in res["device_only"]:
                print(f"  {h['file']}:{h['line']}  {h['receiver']}.to({h['args']})")
            if res["kvpatch_non_cast_sites"]:
                print(f"kvpatch sites that are not casts: {len(res['kvpatch_non_cast_sites'])}")
                for s in res["kvpatch_non_cast_sites"]:
                    print(f"  {s['file']}:{s['line']} [{s['form']}/{s['status']}]")
            for rel, msg in errors:
                print(f"  unparsable: {rel}: {msg}")
        return 0 if not res["only_oracle"] and not res["only_kvpatch"] else 1
    if ns.json:
        print(json.dumps([asdict(h) for h in hits], indent=2))
    else:
        for h in hits:
            tag = " device-only" if h.device_only else ""
            print(f"{h.file}:{h.line}  {h.scope}  {h.receiver}.{h.method}({h.args})  [{h.kind}{tag}]")
        print(f"{n} files, {len(hits)} casts, {len(errors)} unparsable, {secs:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
