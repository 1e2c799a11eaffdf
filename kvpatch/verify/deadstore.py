"""Verify a deleted dead cast (KVP104): the function computes the same without it.

No torch and no GPU: each function that differs between the original file and the
patched one runs on symbolic values. Every parameter, global and attribute is a `Sym`
that records how it was made (`self.token_to_kv_pool.get_key_buffer(layer.layer_id)`),
and every call returns a new `Sym` named after the call and its arguments, so the value
a function returns spells out the whole computation that reached it: which buffer, cast
or uncast, reached which kernel. Both sides run with every branch condition true, then
every one false, and the returned spellings, and every call other than a pool read, a
view or a cast (the calls a deletion may drop), must match. A deleted cast that some path
still reads changes a spelling there, or raises (UnboundLocalError): verify fails.
"""

from __future__ import annotations

import ast
import builtins
import copy
import difflib
from dataclasses import dataclass, field
from typing import List, Optional

from kvpatch.names import CAST_CALLS, KV_GETTERS
from kvpatch.analysis.tensorops import VIEW_METHODS

_DROPPABLE = CAST_CALLS | VIEW_METHODS | KV_GETTERS  # what a deleted dead cast may stop calling


class Sym:
    """A symbolic value: its spelling; calls are logged in the run's trace."""

    def __init__(self, text: str, run: "Run"):
        object.__setattr__(self, "_text", text)
        object.__setattr__(self, "_run", run)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Sym(f"{self._text}.{attr}", self._run)

    def __setattr__(self, attr, value):
        self._run.trace.append(f"{self._text}.{attr} = {_spell(value)}")

    def __call__(self, *args, **kwargs):
        text = f"{self._text}({', '.join([_spell(a) for a in args] + [f'{k}={_spell(v)}' for k, v in kwargs.items()])})"
        name = self._text.rsplit(".", 1)[-1]
        if name not in _DROPPABLE:
            self._run.trace.append(text)
        return Sym(text, self._run)

    def __getitem__(self, key):
        return Sym(f"{self._text}[{_spell(key)}]", self._run)

    def __setitem__(self, key, value):
        self._run.trace.append(f"{self._text}[{_spell(key)}] = {_spell(value)}")

    def __bool__(self):
        return self._run.branch

    def __iter__(self):
        return iter([Sym(f"{self._text}[{i}]", self._run) for i in range(2)])

    def __len__(self):
        return 2

    def __eq__(self, other):
        return self._run.branch

    def __hash__(self):
        return hash(self._text)


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "lshift", "rshift"):
    def _bin(self, other, _op=_op):
        return Sym(f"({self._text} {_op} {_spell(other)})", self._run)

    def _rbin(self, other, _op=_op):
        return Sym(f"({_spell(other)} {_op} {self._text})", self._run)

    setattr(Sym, f"__{_op}__", _bin)
    setattr(Sym, f"__r{_op}__", _rbin)
for _op in ("lt", "le", "gt", "ge", "ne"):
    setattr(Sym, f"__{_op}__", lambda self, other: self._run.branch)
Sym.__neg__ = lambda self: Sym(f"-{self._text}", self._run)


def _spell(v) -> str:
    if isinstance(v, Sym):
        return v._text
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_spell(x) for x in v) + ")"
    return repr(v)


@dataclass
class Run:
    branch: bool
    trace: List[str] = field(default_factory=list)


def _function(source: str, qualname: str) -> Optional[ast.FunctionDef]:
    node: ast.AST = ast.parse(source)
    for part in qualname.split("."):
        node = next((n for n in getattr(node, "body", []) if isinstance(n, (ast.ClassDef, ast.FunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
    return node if isinstance(node, ast.FunctionDef) else None


def _run(fn: ast.FunctionDef, branch: bool) -> str:
    run = Run(branch)
    fn = copy.deepcopy(fn)
    fn.decorator_list = []
    fn = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    env = {n.id: Sym(n.id, run) for n in ast.walk(fn) if isinstance(n, ast.Name) and not hasattr(builtins, n.id)}
    env["__builtins__"] = builtins
    exec(compile(fn, "<kvpatch verify>", "exec"), env)
    func = env[fn.body[0].name]
    args = fn.body[0].args
    values = {a.arg: Sym(a.arg, run) for a in args.posonlyargs + args.args + args.kwonlyargs}
    try:
        out = func(**values)
        result = f"returns {_spell(out)}"
    except Exception as exc:
        result = f"raises {type(exc).__name__}"
    return result + "\n" + "\n".join(run.trace)


def compare_function(original: str, patched: str, qualname: str) -> Optional[str]:
    """None when `qualname` computes the same in both files on the all-true and all-false
    paths, else what differs."""
    a, b = _function(original, qualname), _function(patched, qualname)
    if a is None or b is None:
        return f"{qualname} is not in both files"
    for branch in (True, False):
        ra, rb = _run(a, branch), _run(b, branch)
        if ra != rb:
            first = next((x, y) for x, y in zip(ra.splitlines() + [""], rb.splitlines() + [""]) if x != y)
            return (f"{qualname}, every condition {branch}: the original {first[0] or '(ends)'}; the patched "
                    f"{first[1] or '(ends)'}")
    return None


def changed_functions(original: str, patched: str) -> List[str]:
    """Qualnames of the functions whose source differs between the two files."""
    def table(src):
        out, stack = {}, [(ast.parse(src), "")]
        while stack:
            node, prefix = stack.pop()
            for n in getattr(node, "body", []):
                if isinstance(n, (ast.ClassDef, ast.FunctionDef)):
                    q = f"{prefix}{n.name}"
                    if isinstance(n, ast.FunctionDef):
                        out[q] = ast.dump(n)
                    stack.append((n, q + "."))
        return out

    ta, tb = table(original), table(patched)
    return sorted(q for q in ta if q in tb and ta[q] != tb[q])


def only_deletions(before: str, after: str) -> bool:
    """`after` is `before` with lines deleted (a `pass` or a comment line may take their place)."""
    def code(text):
        return [ln.strip() for ln in text.splitlines() if ln.strip()]

    a, b = code(before), code(after)
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag in ("insert", "replace") and not all(x == "pass" or x.startswith("#") for x in b[j1:j2]):
            return False
    return a != b


def verify_deletions(t, report, alias: str = "") -> None:
    """Check symbolically every function of target `t` that its patch only shortened (a
    deleted dead cast), one case per function; other changes are their family's."""
    from .report import FAILED, PASSED, CaseResult

    patched = t.path.read_text(encoding="utf-8")
    for q in changed_functions(t.original, patched):
        fn = _function(patched, q)
        if fn is None or not only_deletions(ast.get_source_segment(t.original, _function(t.original, q)),
                                            ast.get_source_segment(patched, fn)):
            continue  # rewritten, not only shortened: its family's driver compares it
        c = CaseResult(file=t.rel, qualname=q, path="other", mode="delete", exec="symbolic",
                       batch="every condition true, then every one false", kernel="(symbolic)",
                       tolerance="same returned value and calls, less pool reads, views and casts")
        why = compare_function(t.original, patched, q)
        c.status, c.message = (FAILED, why) if why else (PASSED, "the deleted cast was read nowhere")
        report.cases.append(c)
