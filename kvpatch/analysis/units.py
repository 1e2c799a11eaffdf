"""units: parse one function of a file with libcst, and put it back.

Parsing a 170 kB backend with libcst and resolving positions takes ~1 s; the
functions that matter are a few hundred lines. A method's lines are parsed on
their own, under a synthetic ``if 1:`` header that makes their indentation
legal, so they round-trip byte for byte; positions are shifted back to file
lines. The rewritten unit replaces exactly its own line range.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import libcst as cst
from libcst._nodes.internal import CodegenState
from libcst.metadata import MetadataWrapper, PositionProvider
from libcst.metadata.position_provider import CodePosition, CodeRange

from kvpatch.analysis.locate import Unit


class UnitParseError(Exception):
    pass


# Node kinds whose positions the rules report; recording only these keeps the
# position pass ~3x cheaper than libcst's PositionProvider on big functions.
_POSITIONED = (cst.Call, cst.Arg, cst.BaseSmallStatement,
               cst.SimpleStatementLine, cst.Param)


class _PositionState(CodegenState):
    """libcst's codegen, recording PositionProvider-equal ranges for a few node kinds."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.ranges: Dict[cst.CSTNode, CodeRange] = {}
        self._line, self._col, self._seen = 1, 0, 0

    def _pos(self) -> CodePosition:
        toks = self.tokens
        for i in range(self._seen, len(toks)):
            t = toks[i]
            nl = t.count("\n") + t.count("\r") - t.count("\r\n")
            if nl:
                self._line += nl
                self._col = len(t) - max(t.rfind("\n"), t.rfind("\r")) - 1
            else:
                self._col += len(t)
        self._seen = len(toks)
        return CodePosition(self._line, self._col)

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        positioned = _IS_POSITIONED.get(type(node))
        if positioned is None:
            positioned = _IS_POSITIONED[type(node)] = isinstance(node, _POSITIONED)
        if not positioned:
            return _NOTHING  # most nodes: no generator-based context per node
        return self._record(node, start_node, end_node)

    @contextmanager
    def _record(self, node, start_node, end_node):
        start = self._pos()
        try:
            yield
        finally:
            end = self._pos()
            if start_node is not None and start_node in self.ranges:
                start = self.ranges[start_node].start
            if end_node is not None and end_node in self.ranges:
                end = self.ranges[end_node].end
            self.ranges[node] = CodeRange(start, end)


_IS_POSITIONED: Dict[type, bool] = {}
_NOTHING = nullcontext()


def ranges(module: cst.Module) -> Dict[cst.CSTNode, CodeRange]:
    """The ranges of the positioned node kinds in `module` (one codegen pass;
    libcst's PositionProvider would build metadata for every node)."""
    state = _PositionState(default_indent=module.default_indent, default_newline=module.default_newline)
    module._codegen(state)
    return state.ranges


_FIELDS: Dict[type, Tuple[str, ...]] = {}
_IS_NODE: Dict[type, bool] = {}


def is_node_type(t: type) -> bool:
    """issubclass(t, cst.CSTNode), cached: libcst's nodes are ABCs, and an
    isinstance through ABCMeta per field was a large share of every walk."""
    got = _IS_NODE.get(t)
    if got is None:
        got = _IS_NODE[t] = issubclass(t, cst.CSTNode)
    return got


def parent_map(root: cst.CSTNode) -> Dict[cst.CSTNode, cst.CSTNode]:
    """child -> parent for every node under root: the map `_Parents` builds,
    read straight from the nodes' dataclass fields (~4x faster than a visitor,
    which rebuilds every node it leaves)."""
    parents: Dict[cst.CSTNode, cst.CSTNode] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        for v in _child_fields(n):
            tv = type(v)
            if tv is list or tv is tuple:
                for x in v:
                    if _IS_NODE.get(type(x)) or is_node_type(type(x)):
                        parents[x] = n
                        stack.append(x)
            elif _IS_NODE.get(tv) or is_node_type(tv):
                parents[v] = n
                stack.append(v)
    return parents


def _child_fields(n: cst.CSTNode) -> List[object]:
    names = _FIELDS.get(type(n))
    if names is None:
        names = _FIELDS[type(n)] = tuple(f.name for f in dataclasses.fields(n))
    return [getattr(n, name) for name in names]


def _kids(n: cst.CSTNode, values) -> List[cst.CSTNode]:
    kids: List[cst.CSTNode] = []
    for v in values:
        tv = type(v)
        if tv is list or tv is tuple:
            kids.extend([x for x in v if _IS_NODE.get(type(x)) or is_node_type(type(x))])
        elif _IS_NODE.get(tv) or is_node_type(tv):
            kids.append(v)
    return kids


def preorder(root: cst.CSTNode):
    """Every node under root, parents first and children in field order, read straight from
    the nodes' dataclass fields (as units.parent_map: no visitor)."""
    stack = [root]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(_kids(n, _child_fields(n))))


_ORDER: Dict[type, Optional[Tuple[str, ...]]] = {}


class _FieldOrder(cst.CSTVisitor):
    """Records the fields libcst visits on one node, in its (source) order."""

    def __init__(self, root: cst.CSTNode) -> None:
        self.root = root
        self.names: List[str] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        return node is self.root

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        if node is self.root and attribute not in self.names:
            self.names.append(attribute)


def _field_order(n: cst.CSTNode) -> Optional[Tuple[str, ...]]:
    """The order in which libcst visits the fields of n's kind, learnt once per kind;
    None if it does not name every field (then n.children is asked each time)."""
    rec = _FieldOrder(n)
    n.visit(rec)
    names = _FIELDS.get(type(n)) or tuple(f.name for f in dataclasses.fields(n))
    return tuple(rec.names) if set(rec.names) >= set(names) else None


def lexical_children(n: cst.CSTNode) -> List[cst.CSTNode]:
    """n.children (libcst's visit order, which is source order) read straight from
    the fields in the order libcst visits them (n.children runs a visitor that
    rebuilds n: slow per node)."""
    t = type(n)
    order = _ORDER.get(t, ())
    if order == ():
        order = _ORDER[t] = _field_order(n)
    if order is None:
        return list(n.children)
    return _kids(n, [getattr(n, name) for name in order])


@dataclass
class ParsedUnit:
    unit: Unit
    header: str
    wrapper: MetadataWrapper
    source: str  # header + the unit's lines
    _ranges: Optional[Dict[cst.CSTNode, CodeRange]] = field(default=None, repr=False)
    _parents: Optional[Dict[cst.CSTNode, cst.CSTNode]] = field(default=None, repr=False)

    @property
    def module(self) -> cst.Module:
        return self.wrapper.module

    @property
    def func(self) -> cst.FunctionDef:
        body = self.module.body[0]
        if self.header:
            body = body.body.body[0]  # if 1: <func>
        assert isinstance(body, cst.FunctionDef)
        return body

    def positions(self) -> "_Positions":
        if self._ranges is None:
            self._ranges = ranges(self.module)
        return _Positions(self)

    def parents(self) -> Dict[cst.CSTNode, cst.CSTNode]:
        if self._parents is None:
            self._parents = parent_map(self.module)
        return self._parents

    def line_of(self, node: cst.CSTNode) -> int:
        """1-based line of node in the original file."""
        return self.file_line(self.positions()[node].start.line)

    def code_for(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def file_line(self, rel_line: int, start: Optional[int] = None) -> int:
        """A 1-based line of this unit's module (header included) as a line of the
        file, the unit starting at `start` (default: where it started when parsed)."""
        return rel_line - (1 if self.header else 0) + (self.unit.start if start is None else start) - 1

    def render(self, new_module: cst.Module) -> List[str]:
        """The unit's new lines (header removed), with their line endings."""
        lines = split_lines(new_module.code)
        if self.header:
            assert lines[0] == self.header, "synthetic header changed"
            lines = lines[1:]
        return lines


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\n|\r)|[^\r\n]+$")


# -- source bytes <-> text ----------------------------------------------
def decode(data: bytes) -> Tuple[str, str, bool]:
    """(text, encoding, had_bom); raises UnicodeDecodeError / SyntaxError."""
    enc, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    bom = enc == "utf-8-sig"
    return data.decode(enc), ("utf-8" if bom else enc), bom


def encode(text: str, encoding: str, bom: bool) -> bytes:
    data = text.encode(encoding)
    return (b"\xef\xbb\xbf" + data) if bom else data


def split_lines(text: str) -> List[str]:
    """Lines with their endings, split only where Python's tokenizer splits
    (str.splitlines also splits at form feeds and other separators)."""
    return _LINE.findall(text)


class _Positions:
    """Mapping-like view: recorded ranges, else libcst's full PositionProvider."""

    def __init__(self, pu: "ParsedUnit") -> None:
        self.pu = pu

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        r = self.pu._ranges.get(node)
        if r is None:
            r = self.pu.wrapper.resolve(PositionProvider)[node]
        return r


def _ending(line: str) -> str:
    for e in ("\r\n", "\n", "\r"):
        if line.endswith(e):
            return e
    return "\n"


def leading_ws(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def parse_unit(lines: List[str], unit: Unit) -> ParsedUnit:
    """Parse lines[unit.start-1 : unit.end] as a standalone libcst module."""
    chunk = lines[unit.start - 1 : unit.end]
    if not chunk:
        raise UnitParseError(f"{unit.qualname}: empty line range")
    first = chunk[0]
    stripped = first.lstrip(" \t")
    if not (stripped.startswith(("def ", "async ", "@"))):
        raise UnitParseError(f"{unit.qualname}: definition does not start its line")
    indent = leading_ws(first)
    header = ""
    # The file's own line ending (CRLF, LF or CR-only): libcst lays out new
    # lines with the first ending it sees, so the header must carry it.
    newline = _ending(first)
    if indent:
        header = "if 1:" + newline
    text = header + "".join(chunk)
    if not text.endswith(("\n", "\r")):
        text += newline
        # Remember that the original last line had no newline.
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise UnitParseError(f"{unit.qualname}: {exc.message}") from exc
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    pu = ParsedUnit(unit, header, wrapper, text)
    _ = pu.func  # validates the shape
    return pu


def splice(lines: List[str], first: int, last: int, new_lines: List[str]) -> List[str]:
    """Replace lines first..last (1-based, inclusive; last = first - 1 inserts
    before `first`); a replaced range that ended the file without a newline
    keeps it missing."""
    if last >= first and last == len(lines) and not lines[last - 1].endswith(("\n", "\r")) and new_lines:
        new_lines = new_lines[:-1] + [new_lines[-1].rstrip("\r\n")]
    return lines[: first - 1] + new_lines + lines[last:]
