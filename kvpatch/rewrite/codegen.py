"""codegen: build the nodes a rewrite inserts, formatted like the code around.

New calls are laid out the way black would: on one line when they fit in 88
columns and carry no comment, else one argument per line at the indentation of
the surrounding statement. Comments found inside the replaced call are kept,
after the argument they followed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import libcst as cst

from kvpatch.analysis.match import attr_call
from kvpatch.names import RUNTIME_ALIAS, RUNTIME_MODULE
from kvpatch.analysis.units import leading_ws

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


# -- ReplaceNode builders: each leaves alone what it already made (a second apply
# changes nothing), recognised as a call of the runtime function it writes.
def _last_name(func: str) -> str:
    return func.rsplit(".", 1)[-1]


def wrap_arg_builder(func: str, before: Sequence[str]) -> Callable[[cst.Arg], cst.Arg]:
    """A call argument's value V becomes `func(*before, V)`, V's node kept as written."""
    def build(updated: cst.Arg) -> cst.Arg:
        if attr_call(updated.value, {_last_name(func)}):
            return updated
        space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        call = cst.Call(func=parse_expr(func),
                        args=[*(cst.Arg(parse_expr(b), comma=space) for b in before), cst.Arg(updated.value)])
        return updated.with_changes(value=call)

    return build


def replace_arg_builder(text: str, func: str) -> Callable[[cst.Arg], cst.Arg]:
    """A call argument's value becomes the expression `text`, a call of `func`."""
    def build(updated: cst.Arg) -> cst.Arg:
        if attr_call(updated.value, {_last_name(func)}):
            return updated
        return updated.with_changes(value=parse_expr(text))

    return build


def star_kwargs_builder(text: str, func: str) -> Callable[[cst.Call], cst.Call]:
    """A call gets `**text` (a call of `func`) as its last argument."""
    def build(updated: cst.Call) -> cst.Call:
        if has_star_kwargs_call(updated, _last_name(func)):
            return updated
        return append_star_kwargs(updated, parse_expr(text))

    return build


# -- where a rewritten node sits: the one place rules get their layout from ----
@dataclass(frozen=True)
class Layout:
    """How the code around a node is laid out (rules never read raw lines)."""

    indent: str  # leading whitespace of the line the node starts on
    block_indent: str  # leading whitespace of the statement holding it
    unit: str  # one indentation level there: a tab or four spaces
    column: int  # where the node starts
    multiline: bool  # the node spans several lines
    own_line: bool  # only whitespace precedes the node on its line


def layout_of(node: cst.CSTNode, ctx) -> Layout:
    """`ctx` is a match.UnitContext (positions of the function's nodes)."""
    line = ctx.file.lines[ctx.line(node) - 1]
    indent = leading_ws(line)
    return Layout(indent=indent,
                  block_indent=leading_ws(ctx.file.lines[ctx.line(ctx.line_statement(node)) - 1]),
                  unit="\t" if indent.startswith("\t") else "    ",
                  column=ctx.column(node),
                  multiline=ctx.line(node) != ctx.end_line(node),
                  own_line=line[:ctx.column(node)].strip() == "")


def argument_call_text(func: str, args: Sequence[str], arg: cst.Arg, ctx) -> str:
    """`func(args...)` to replace the value of call argument `arg`: one argument per
    line where `arg` already has a line of its own, else on one line."""
    lay = layout_of(arg, ctx)
    if not lay.own_line:
        return f"{func}({', '.join(args)})"
    return call_text(func, [(a, None) for a in args], lay.indent, lay.unit, ctx.column(arg.value))


def lambda_tuple(items: Sequence[str], lay: Layout, width: int = 100) -> str:
    """`lambda: (a, b)` as one argument of an exploded call at `lay`; exploded
    itself, one item per line, where it would pass `width` columns."""
    inner = lay.indent + lay.unit
    one = f"lambda: ({', '.join(items)})"
    if len(inner) + len(lay.unit) + len(one) + 1 <= width:
        return one
    body = "".join(f"{inner}{lay.unit}{item},\n" for item in items)
    return f"lambda: (\n{body}{inner})"


def cast_builder(cand, ctx, func: str, before: Sequence[str] = (),
                 after: Callable[[Layout], Sequence[str]] = lambda lay: (), explode: bool = False):
    """A ReplaceNode builder turning the cast `cand.call` (a candidates.CastCandidate:
    `R.to(D)`) into `func(R, *before, D, *after(layout))`. R keeps its layout one level
    deeper; comments inside the cast follow D. The call is exploded, one argument per
    line, when `explode`, when the cast spanned several lines or when it held a comment."""
    lay = layout_of(cand.call, ctx)
    comment = "  ".join(comments_in(cand.call, exclude=[cand.receiver, cand.form.dtype_arg.value])) or None
    positional = cand.form.dtype_arg.keyword is None

    def build(updated: cst.Call) -> cst.BaseExpression:
        dtype = next(a for a in updated.args if a.value is not None and (
            (positional and a.keyword is None) or (a.keyword is not None and a.keyword.value == "dtype")))
        args = [(moved_code(updated.func.value, lay.block_indent, lay.unit), None),
                *((b, None) for b in before),
                (cst.Module(body=[]).code_for_node(dtype.value).strip(), comment),
                *((a, None) for a in after(lay))]
        text = call_text(func, args, lay.indent, lay.unit, lay.column,
                         force_explode=explode or lay.multiline or comment is not None)
        return parse_expr(text).with_changes(lpar=updated.lpar, rpar=updated.rpar)

    return build


def route_call_builder(func: str) -> Callable[[cst.Call], cst.Call]:
    """`kernel(args)` -> `func(kernel, args)` (a routed call: the runtime gets the kernel,
    or a bound run(), first), the kernel on its own line where the arguments start on a
    new line, else in front of them on the same line."""
    alias, name = func.split(".")

    def build(updated: cst.Call) -> cst.Call:
        f = updated.func
        if isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and (f.value.value, f.attr.value) == (
                alias, name):
            return updated  # routed already: two casts (an if and its else) reach this one call
        ws = updated.whitespace_before_args
        if isinstance(ws, cst.ParenthesizedWhitespace):
            after = ws.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
        else:
            after = cst.SimpleWhitespace(" ")
        first = cst.Arg(value=updated.func, comma=cst.Comma(whitespace_after=after))
        return updated.with_changes(func=cst.Attribute(value=cst.Name(alias), attr=cst.Name(name)),
                                    args=[first, *updated.args])

    return build
