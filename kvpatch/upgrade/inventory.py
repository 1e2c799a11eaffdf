"""What a tree holds: its functions, their KV casts and plan calls."""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple
from kvpatch.analysis.locate import kv_tainted, reads_kv
from kvpatch.names import CAST_TO, CAST_TYPE, DTYPE_CAST_METHODS, KV_GETTERS, MLA_PLAN_FUNCTIONS, PLAN_METHOD
from kvpatch.upgrade.gitref import RefTree
from kvpatch.upgrade.model import FunctionInfo, SOURCE_LINES

# -- statements and functions ------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def normalize_statement(text: str) -> str:
    """A statement's meaning without its layout or comments: `ast.dump` when it
    parses, else its tokens with whitespace collapsed."""
    for candidate in (text, textwrap.dedent(text), "if 1:\n" + textwrap.indent(text, "    ")):
        try:
            return ast.dump(ast.parse(candidate))
        except (SyntaxError, ValueError):
            continue
    no_comments = re.sub(r"#[^\n]*", "", text)
    return " ".join(no_comments.split())


def _function_nodes(tree: ast.Module) -> Dict[str, ast.AST]:
    """qualname -> def node, with the nesting locate uses (classes, module-level if/try/with)."""
    out: Dict[str, ast.AST] = {}

    def visit(body, chain: Tuple[str, ...], top: bool) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                visit(stmt.body, chain + (stmt.name,), False)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(".".join(chain + (stmt.name,)), stmt)
            elif top and isinstance(stmt, (ast.If, ast.Try, ast.With)):
                for sub in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, sub, []) or [], chain, top)
                for h in getattr(stmt, "handlers", []) or []:
                    visit(h.body, chain, top)

    visit(tree.body, (), True)
    return out


def _device_like(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int)):
        return True
    if isinstance(node, ast.Attribute) and node.attr == "device":
        return True
    if isinstance(node, ast.Name) and "device" in node.id.lower():
        return True
    if isinstance(node, ast.Call):
        f = node.func
        return (isinstance(f, ast.Name) and f.id == "device") or (isinstance(f, ast.Attribute) and f.attr == "device")
    return False


# Identifiers that name KV-cache data even when no known getter is in sight
# (a renamed getter, `self.token_to_kv_pool.fetch(...)`, a `k_buffer`): the
# upgrade audit must still flag such a cast for a look by hand.
_KV_WORD = re.compile(r"kv|k_buf|v_buf|key_buffer|value_buffer|kpe", re.IGNORECASE)


def _of_kv_data(node: ast.AST, tainted) -> bool:
    if reads_kv(node, tainted):
        return True
    return any(_KV_WORD.search(n.id if isinstance(n, ast.Name) else n.attr)
               for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute)))


def is_cast_call(node: ast.AST) -> bool:
    """`x.to(<dtype>)` (not a device move), `x.float()` and friends, `x.type(T)`."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    attr = node.func.attr
    if attr in DTYPE_CAST_METHODS:
        return not node.args and not node.keywords
    if attr == CAST_TYPE:
        return len(node.args) == 1 and not node.keywords
    if attr != CAST_TO:
        return False
    if any(k.arg == "dtype" for k in node.keywords):
        return True
    if not node.args:
        return False
    if len(node.args) == 1:
        return not _device_like(node.args[0])
    return not _device_like(node.args[1])


def _excerpt(lines: List[str], start: int, end: int, marks: Iterable[int], limit: int = SOURCE_LINES) -> Tuple[str, bool]:
    """The function's source (lines start..end, 1-based); a long one as its
    header plus windows around the marked lines."""
    body = lines[start - 1:end]
    if len(body) <= limit:
        return "".join(body).rstrip("\n") + "\n", False
    keep = set(range(start, min(start + 3, end + 1)))
    for ln in sorted(set(marks)):
        keep |= set(range(max(start, ln - 3), min(end, ln + 3) + 1))
    out: List[str] = []
    last = start - 1
    shown = 0
    for ln in sorted(keep):
        if shown >= limit * 2:
            break
        if ln > last + 1:
            out.append(f"    ... ({ln - last - 1} lines)\n")
        out.append(lines[ln - 1] if lines[ln - 1].endswith("\n") else lines[ln - 1] + "\n")
        last, shown = ln, shown + 1
    if last < end:
        out.append(f"    ... ({end - last} lines)\n")
    return "".join(out), True


class Functions:
    """The functions of one tree's files, parsed on demand."""

    def __init__(self, root: Path, ref_tree: Optional["RefTree"] = None) -> None:
        self.root = root
        self.ref_tree = ref_tree  # a git commit written out in part: the rest is read from git
        self._files: Dict[str, Optional[Tuple[List[str], Dict[str, ast.AST], str]]] = {}

    def _load(self, rel: str):
        if rel not in self._files:
            got = None
            p = self.root / rel
            try:
                data = p.read_bytes() if self.ref_tree is None or p.is_file() else self.ref_tree.read(rel)
                if data is None:
                    raise OSError(rel)
                text = data.decode("utf-8", errors="replace")
                tree = ast.parse(data)
                got = (text.splitlines(True), _function_nodes(tree), text)
            except (OSError, SyntaxError, ValueError):
                got = None
            self._files[rel] = got
        return self._files[rel]

    def file_exists(self, rel: str) -> bool:
        if self.ref_tree is not None:
            return self.ref_tree.exists(rel)
        return (self.root / rel).is_file()

    def present(self, rel: str, qualname: str) -> bool:
        got = self._load(rel)
        return got is not None and qualname in got[1]

    def qualnames(self, rel: str) -> List[str]:
        got = self._load(rel)
        return list(got[1]) if got is not None else []

    def lines_of(self, rel: str, qualname: str) -> List[str]:
        """The function's lines, stripped (for similarity)."""
        got = self._load(rel)
        if got is None or qualname not in got[1]:
            return []
        fn = got[1][qualname]
        return [ln.strip() for ln in got[0][fn.lineno - 1:fn.end_lineno] if ln.strip()]

    def info(self, rel: str, qualname: str) -> Optional[FunctionInfo]:
        got = self._load(rel)
        if got is None or qualname not in got[1]:
            return None
        lines, nodes, text = got
        fn = nodes[qualname]
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        end = fn.end_lineno or fn.lineno
        reads = False
        casts: List[Tuple[int, str]] = []
        plans = 0
        marks: List[int] = []
        nodes = list(ast.walk(fn))
        tainted = kv_tainted(fn, nodes)
        for n in nodes:
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else "")
            if name in KV_GETTERS:
                reads = True
                marks.append(n.lineno)
            if name == PLAN_METHOD or name in MLA_PLAN_FUNCTIONS:
                plans += 1
                marks.append(n.lineno)
            if name == "run":
                marks.append(n.lineno)
            # Only a cast of KV data can be a site no rule finds; a cast of q or o is not.
            if is_cast_call(n) and _of_kv_data(n.func.value, tainted):
                code = ast.get_source_segment(text, n) or ""
                casts.append((n.lineno, " ".join(code.split())[:160]))
                marks.append(n.lineno)
        casts.sort()
        source, truncated = _excerpt(lines, start, end, marks)
        return FunctionInfo(rel, qualname, start, end, reads, casts, plans, source, truncated)


