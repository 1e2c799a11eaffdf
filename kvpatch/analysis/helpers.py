"""helpers: follow a cast value into `self.<helper>(...)`, a method of the same class.

Issue 20, kind 2: NSA/DSA and Ascend backends cast the pool in forward_extend/decode and
hand the result to `self._forward_xxx(...)`, where the kernel and its indices sit. This
follows the value, within the one class only, and says for each helper which kernel it
reaches and with which rows. It stays sound: a helper is followed only when

- the class body defines it once, with a plain `def` (no second def, no class-level
  name of that spelling, nothing else in the class body that could bind names);
- no class of the same file that names this class as a base defines it again;
- no method of the class assigns `self.<helper>` or reaches attributes by `getattr`,
  `setattr`, `__dict__` or `vars` (the call could land elsewhere);
- the value reaches the helper as a plain argument (no `*args`/`**kwargs`).

Inside the helper the parameter may flow through views (`.view`, `.reshape`, slices,
`.unsqueeze`, ...) and names; each use must be an argument of a kernel whose row
contract is in SPARSE_KERNELS or ROW_WISE, else the helper `escapes`. The helper's
source is Python's ast (locate keeps each class's method nodes): helpers are not
parsed with libcst, so following one costs no parse. Nothing here rewrites.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from kvpatch.analysis.locate import ClassFacts, walk

# Kernels that read, of the cache they are handed, exactly the rows (or pages) named by an
# index tensor (negative entries: none): kernel -> (cache parameters as (position,
# keyword), index parameter, row rule). Positions count from 0; None: keyword only.
SPARSE_KERNELS: Dict[str, Tuple[Tuple[Tuple[Optional[int], str], ...], Tuple[Optional[int], str], str]] = {
    # sgl-kernel/FlashMLA: kv [s_kv, h_kv, d]; indices [s_q, h_kv, topk], each a row of
    # kv; -1 (or >= s_kv) is invalid and skipped.
    "flash_mla_sparse_fwd": (((1, "kv"),), (2, "indices"), "rows kv[i] for i in indices, -1 skipped"),
    # SGLang's tilelang NSA kernel: the same interface as flash_mla_sparse_fwd.
    "tilelang_sparse_fwd": (((1, "kv"),), (2, "indices"), "rows kv[i] for i in indices, -1 skipped"),
    # FlashMLA's sparse decode: k_cache [blocks, block_size, h_k, d]; token i of indices is
    # block i // block_size, offset i % block_size (a flat slot index); -1 skipped.
    "flash_mla_with_kvcache": (((1, "k_cache"),), (None, "indices"),
                               "flat slots i of k_cache (block i // block_size, offset i % block_size), -1 skipped"),
    # SGLang NSA: dequantize the rows quant_k_cache.view(-1, 656)[page_table_1_flattened].
    "dequantize_k_cache_paged": (((0, "quant_k_cache"),), (1, "page_table_1_flattened"),
                                 "rows i of the cache viewed as [slots, 656], for i in the index"),
    # FA3/FA4 (the page-table family, KVP103): pages page_table[b, :] of k_cache/v_cache.
    "flash_attn_with_kvcache": (((None, "k_cache"), (None, "v_cache")), (None, "page_table"),
                                "pages page_table[b, :ceil(cache_seqlens[b] / page_size)] of the caches"),
}
# How many leading dims of the cache, flattened, the index addresses (-1: all but the last).
LEAD = {"flash_mla_sparse_fwd": 1, "tilelang_sparse_fwd": 1, "flash_mla_with_kvcache": 2,
        "dequantize_k_cache_paged": -1, "flash_attn_with_kvcache": 1}
# Calls whose output row r is a function of input row r only: the value goes on through them.
ROW_WISE = frozenset({"quantize_k_cache"})
# Methods and subscripts that view a tensor without reading it.
VIEWS = frozenset({"view", "reshape", "unsqueeze", "squeeze", "contiguous", "flatten", "unflatten"})
DYNAMIC = frozenset({"getattr", "setattr", "delattr", "vars"})
# Reads of a tensor's metadata, not of its rows.
META = frozenset({"shape", "dtype", "device", "ndim", "size", "dim", "stride", "is_contiguous", "numel"})


@dataclass
class KernelUse:
    kernel: str
    index: Optional[str]  # the index argument as written in the helper, or None if absent
    rows: str  # the row contract
    cache: Optional[ast.AST] = field(default=None, compare=False)  # the cache argument's node
    index_node: Optional[ast.AST] = field(default=None, compare=False)


@dataclass
class HelperPath:
    method: str
    followed: bool
    why_not: str = ""
    uses: List[KernelUse] = field(default_factory=list)
    escapes: List[str] = field(default_factory=list)  # uses that are no known kernel
    params: List[str] = field(default_factory=list)  # the helper parameter that receives the value

    def describe(self) -> str:
        if not self.followed:
            return f"`self.{self.method}` not followed ({self.why_not})"
        parts = list(dict.fromkeys(f"`{u.kernel}`" + (f" (rows from {u.index}: {u.rows})" if u.index else " (no index argument: "
                                      "a dense read)") for u in self.uses))
        text = f"`self.{self.method}` -> " + (", ".join(parts) if parts else "no kernel")
        if self.escapes:
            text += f"; the value also reaches {', '.join(self.escapes)}"
        return text

    @property
    def sparse(self) -> bool:
        """Every use is a known sparse kernel with its index argument present."""
        return self.followed and bool(self.uses) and not self.escapes and all(u.index for u in self.uses)


def _dynamic(facts: ClassFacts, method: str) -> str:
    for defs in facts.methods.values():
        for fn in defs:
            for n in walk(fn):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in DYNAMIC:
                    return f"the class calls `{n.func.id}` (line {n.lineno}): a call may land elsewhere"
                if isinstance(n, ast.Attribute) and n.attr == "__dict__":
                    return f"the class reads `__dict__` (line {n.lineno})"
                if isinstance(n, ast.Attribute) and n.attr == method and isinstance(n.ctx, (ast.Store, ast.Del)):
                    return f"`self.{method}` is assigned (line {n.lineno})"
    return ""


def _why_not(method: str, facts: ClassFacts, classes: Dict[str, ClassFacts]) -> str:
    defs = facts.methods.get(method, [])
    if not defs:
        return f"`{method}` is not defined in the class body (inherited, or bound at run time)"
    if len(defs) > 1:
        return f"`{method}` is defined {len(defs)} times in the class"
    if method in facts.class_names or "*" in facts.class_names:
        return f"the class body binds names other than by `def` (`{method}` may be rebound)"
    if not isinstance(defs[0], ast.FunctionDef) or defs[0].decorator_list:
        return f"`{method}` is async or decorated"
    short = facts.qualname.rsplit(".", 1)[-1]
    for other in classes.values():
        if short in other.bases and method in other.methods:
            return f"`{other.qualname}` in this file overrides `{method}`"
    return _dynamic(facts, method)


def _param(fn: ast.FunctionDef, index: Optional[int], keyword: Optional[str]) -> Optional[str]:
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args][1:]  # self first
    if keyword is not None:
        names = [p.arg for p in a.args + a.kwonlyargs]
        return keyword if keyword in names[1:] else None
    if index is not None and index < len(positional):
        return positional[index]
    return None


def _bound(call: ast.Call, pos: Optional[int], kw: str) -> Optional[ast.AST]:
    for k in call.keywords:
        if k.arg == kw:
            return k.value
    if pos is not None and pos < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[:pos + 1]):
        return call.args[pos]
    return None


def _name_of(call: ast.Call) -> Optional[str]:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _carries(expr: ast.AST, names: set) -> bool:
    """expr is one of `names`, or a view/slice/row-wise call of one."""
    while True:
        if isinstance(expr, ast.Name):
            return expr.id in names
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in VIEWS:
            expr = expr.func.value
        elif isinstance(expr, ast.Call) and _name_of(expr) in ROW_WISE and len(expr.args) == 1 and not expr.keywords:
            expr = expr.args[0]
        else:
            return False


def follow(method: str, index: Optional[int], keyword: Optional[str], starred: bool,
           facts: Optional[ClassFacts], classes: Dict[str, ClassFacts]) -> HelperPath:
    """Where the value passed to `self.<method>(...)` (as argument `index`, or `keyword=`) goes."""
    if facts is None:
        return HelperPath(method, False, "the call is not inside a class")
    if starred:
        return HelperPath(method, False, "the value is passed through `*args`/`**kwargs`")
    why = _why_not(method, facts, classes)
    if why:
        return HelperPath(method, False, why)
    fn = facts.methods[method][0]
    param = _param(fn, index, keyword)
    if param is None:
        return HelperPath(method, False, "no parameter of the helper receives the value")
    names = {param}
    for n in walk(fn):  # names bound to views of the value (flow-insensitive: a superset)
        if isinstance(n, ast.Assign) and _carries(n.value, names):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                else:
                    return HelperPath(method, False, f"the value is stored into `{ast.unparse(t)}` "
                                                     f"(line {n.lineno})")
    path = HelperPath(method, True, params=[param])
    consumed = set()
    for n in walk(fn):
        if not isinstance(n, ast.Call):
            continue
        kernel = _name_of(n)
        if kernel in SPARSE_KERNELS:
            caches, (ipos, ikw), rows = SPARSE_KERNELS[kernel]
            for cpos, ckw in caches:
                cache = _bound(n, cpos, ckw)
                if cache is not None and _carries(cache, names):
                    idx = _bound(n, ipos, ikw)
                    use = KernelUse(kernel, f"`{ast.unparse(idx)}`" if idx is not None else None, rows,
                                    cache, idx)
                    path.uses.append(use)
                    consumed.add(id(cache))
    meta = {id(n.value) for n in walk(fn) if isinstance(n, ast.Attribute) and n.attr in META}
    for n in walk(fn):  # every other read of the value is an escape
        if isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Load) and id(n) not in meta:
            if not _inside_consumed(fn, n, consumed, names):
                path.escapes.append(f"line {n.lineno} (`{n.id}` used otherwise)")
    path.escapes = list(dict.fromkeys(path.escapes))
    return path


def _inside_consumed(fn: ast.AST, name: ast.Name, consumed: set, names: set) -> bool:
    """The load is part of a kernel's cache argument, or of a view bound to a carried name."""
    for n in walk(fn):
        roots = []
        if id(n) in consumed:
            roots = [n]
        elif isinstance(n, ast.Assign) and _carries(n.value, names):
            roots = [n.value]
        for r in roots:
            if any(x is name for x in walk(r)):
                return True
    return False


# -- where a rewrite wraps the value: each kernel's cache argument, and the input of each
# row-wise call on the way (it reads the rows before the kernel does) -------------------
@dataclass
class WrapPoint:
    node: ast.AST  # the expression to wrap in kv_rows_at_kernel(node, index, lead)
    index: str  # the index, as code valid anywhere in the helper
    lead: int


POOL_WRITE = ("set_", "buffer")  # SGLang writes a pool only through set_*_buffer calls


def writes_pool(fn: ast.AST) -> Optional[ast.Call]:
    for n in walk(fn):
        if isinstance(n, ast.Call):
            name = _name_of(n) or ""
            if name.startswith(POOL_WRITE[0]) and POOL_WRITE[1] in name:
                return n
    return None


def _assigned(fn: ast.AST) -> Dict[str, List[ast.AST]]:
    out: Dict[str, List[ast.AST]] = {}
    for n in walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.setdefault(n.id, []).append(n)
    return out


def _simple(e: ast.AST) -> bool:
    """Pure and cheap to evaluate twice: a name, an attribute chain, a constant, or a view
    method of one with constant arguments."""
    if isinstance(e, (ast.Name, ast.Constant)):
        return True
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        return isinstance(e.operand, ast.Constant)
    if isinstance(e, ast.Attribute):
        return _simple(e.value)
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in VIEWS:
        return _simple(e.func.value) and not e.keywords and all(
            isinstance(a, ast.Constant) or (isinstance(a, ast.UnaryOp) and isinstance(a.operand, ast.Constant))
            for a in e.args)
    return False


def index_in_helper(fn: ast.FunctionDef, idx: ast.AST) -> Tuple[Optional[str], str]:
    """(code, "") for the index as an expression of parameters the helper never rebinds
    (a local bound once to one is replaced by its value), or (None, why not)."""
    stores = _assigned(fn)
    if isinstance(idx, ast.Name) and len(stores.get(idx.id, ())) == 1:
        bound = [n for n in walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
                 and isinstance(n.targets[0], ast.Name) and n.targets[0].id == idx.id]
        if len(bound) == 1:
            idx = bound[0].value
    if not _simple(idx):
        return None, f"the index `{ast.unparse(idx)}` is not a plain expression of the helper's parameters"
    params = {p.arg for p in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
    for n in walk(idx):
        if isinstance(n, ast.Name) and (n.id not in params or n.id in stores):
            return None, f"the index `{ast.unparse(idx)}` reads `{n.id}`, not a parameter the helper keeps"
    return ast.unparse(idx), ""


def wrap_points(path: HelperPath, fn: ast.FunctionDef) -> Tuple[List[WrapPoint], str]:
    """Where a rewrite wraps the value in this followed helper, or ([], why it cannot)."""
    if not path.sparse:
        return [], "not every use of the value is a kernel with its index argument"
    w = writes_pool(fn)
    if w is not None:
        return [], f"`{ast.unparse(w.func)}` (line {w.lineno}) may write the pool before the kernel reads it"
    points: List[WrapPoint] = []
    local = False  # an index valid only at its kernel's call (a local of the helper)
    for u in path.uses:
        code, why = index_in_helper(fn, u.index_node)
        if code is None and _simple(u.index_node):
            # The kernel's own index argument, evaluated again in the same argument list:
            # the same value (a plain expression), valid there whatever it reads.
            code, local = ast.unparse(u.index_node), True
        if code is None:
            return [], why
        points.append(WrapPoint(u.cache, code, LEAD[u.kernel]))
    row_wise = [n for n in walk(fn) if isinstance(n, ast.Call) and _name_of(n) in ROW_WISE and n.args]
    if row_wise and any(_carries(c.args[0], _carried_names(fn, path)) for c in row_wise):
        if local:
            return [], ("a row-wise call reads the value before the kernel, and the kernel's index is a "
                        "local of the helper, not known there")
        if len({(p.index, p.lead) for p in points}) != 1:
            return [], "a row-wise call reads the value on the way to kernels with different rows"
        names = _carried_names(fn, path)
        for call in row_wise:
            if _carries(call.args[0], names):
                points.append(WrapPoint(call.args[0], points[0].index, points[0].lead))
    return points, ""


def _carried_names(fn: ast.FunctionDef, path: HelperPath) -> set:
    names = set(path.params)
    for n in walk(fn):
        if isinstance(n, ast.Assign) and _carries(n.value, names):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names
