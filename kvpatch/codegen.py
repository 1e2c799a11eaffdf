"""codegen: build the nodes a rewrite inserts, formatted like the code around.

New calls are laid out the way black would: on one line when they fit in 88
columns and carry no comment, else one argument per line at the indentation of
the surrounding statement. Comments found inside the replaced call are kept,
after the argument they followed.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import libcst as cst

from kvpatch.names import RUNTIME_ALIAS, RUNTIME_MODULE

IMPORT_LINE = f"from . import {RUNTIME_MODULE} as {RUNTIME_ALIAS}  # kvpatch: FP8 KV-cache runtime"
MAX_LINE = 88


def comments_in(node: cst.CSTNode, exclude: Sequence[cst.CSTNode] = ()) -> List[str]:
    """Comment texts inside node's own whitespace (not inside `exclude`)."""
    out: List[str] = []
    skip = set(map(id, exclude))

    class V(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if id(n) in skip:
                return False
            if isinstance(n, cst.Comment):
                out.append(n.value)
            return True

    node.visit(V())
    return out


def call_text(func: str, args: Sequence[Tuple[str, Optional[str]]], indent: str, unit: str,
              column: int, force_explode: bool = False) -> str:
    """`func(a, b, ...)`; args are (code, trailing comment or None)."""
    one = f"{func}({', '.join(a for a, _ in args)})"
    if not force_explode and column + len(one) <= MAX_LINE and "\n" not in one \
            and not any(c for _, c in args):
        return one
    lines = [f"{func}("]
    for code, comment in args:
        lines.append(f"{indent}{unit}{code}," + (f"  {comment}" if comment else ""))
    lines.append(f"{indent})")
    return "\n".join(lines)


class _Absolute(cst.CSTTransformer):
    """Parsed on its own, a multi-line expression's whitespace is absolute;
    libcst would add the enclosing block's indentation on top of it."""

    def leave_ParenthesizedWhitespace(self, original, updated):
        return updated.with_changes(indent=False)


def moved_code(node: cst.CSTNode, block_indent: str, shift: str) -> str:
    """Source of `node` (from a statement indented `block_indent`) as it reads
    when moved one level deeper, e.g. into an argument list: continuation lines
    keep their layout, `shift` further in. Multi-line strings are left alone."""

    class Absolute(cst.CSTTransformer):
        def leave_ParenthesizedWhitespace(self, original, updated):
            if not updated.indent:
                return updated
            return updated.with_changes(indent=False, last_line=cst.SimpleWhitespace(
                block_indent + updated.last_line.value))

    code = cst.Module(body=[]).code_for_node(node.visit(Absolute())).strip()
    if "\n" not in code or any("\n" in s.value for s in _strings(node)):
        return code
    first, *rest = code.split("\n")
    return "\n".join([first] + [shift + ln if ln.strip() else ln for ln in rest])


def _strings(node: cst.CSTNode) -> List[cst.SimpleString]:
    out: List[cst.SimpleString] = []

    class V(cst.CSTVisitor):
        def visit_SimpleString(self, n):
            out.append(n)

    node.visit(V())
    return out


def parse_expr(text: str) -> cst.BaseExpression:
    node = cst.parse_expression(text)
    return node.visit(_Absolute()) if "\n" in text else node


def append_star_kwargs(call: cst.Call, value: cst.BaseExpression) -> cst.Call:
    """Add `**value` as the last argument, keeping the call's layout."""
    args = list(call.args)
    new = cst.Arg(value=value, star="**")
    if not args:
        return call.with_changes(args=[new])
    last = args[-1]
    if len(args) >= 2 and isinstance(args[-2].comma, cst.Comma):
        sep = args[-2].comma
        ws = sep.whitespace_after
        if isinstance(ws, cst.ParenthesizedWhitespace):
            # Copy the layout (newline + indent), never the comments in it: they
            # belong to the arguments around that comma.
            sep = sep.with_changes(whitespace_after=ws.with_changes(
                first_line=cst.TrailingWhitespace(), empty_lines=[]))
    else:
        sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    if isinstance(last.comma, cst.Comma) and isinstance(last.comma.whitespace_after, cst.ParenthesizedWhitespace) \
            and isinstance(sep.whitespace_after, cst.ParenthesizedWhitespace):
        # Exploded call with a magic trailing comma: the last argument keeps its
        # own trailing comment; the new one goes on the next line, and the
        # comments before `)` stay before `)`.
        ws = last.comma.whitespace_after
        args[-1] = last.with_changes(comma=last.comma.with_changes(
            whitespace_after=sep.whitespace_after.with_changes(first_line=ws.first_line)))
        args.append(new.with_changes(comma=last.comma.with_changes(
            whitespace_after=ws.with_changes(first_line=cst.TrailingWhitespace()))))
    elif isinstance(last.comma, cst.Comma):
        # Exploded call with a magic trailing comma: the new arg inherits it.
        args[-1] = last.with_changes(comma=sep)
        args.append(new.with_changes(comma=last.comma))
    else:
        args[-1] = last.with_changes(comma=sep, whitespace_after_arg=cst.SimpleWhitespace(""))
        args.append(new.with_changes(whitespace_after_arg=last.whitespace_after_arg))
    return call.with_changes(args=args)


def has_star_kwargs_call(call: cst.Call, func_attr: str) -> bool:
    for a in call.args:
        if a.star == "**" and isinstance(a.value, cst.Call) and isinstance(a.value.func, cst.Attribute) \
                and a.value.func.attr.value == func_attr:
            return True
    return False
