"""removal: delete one statement line through ReplaceNode edits, keeping its comments.

A statement cannot remove itself and keep the comment lines above it, so the
removal is two edits: the statement line becomes a `pass` line that carries its
own comments (a marker), and the block that holds it drops each marker and hands
the marker's comment lines (and its trailing comment, as a comment line) to the
statement that follows. A block left with no other statement keeps one marker:
a `pass` with the comments, which is valid Python. Several removals in one block
compose: each drops its own marker, in any order.
"""

from __future__ import annotations

from typing import List, Optional

import libcst as cst

from kvpatch.rule import ReplaceNode

# Builtins through which a function reads its own locals by name: a local that
# looks unread may be read by them, so nothing is proven dead where one is called.
LOCALS_READERS = frozenset({"locals", "vars", "eval", "exec"})


def remove_statement(unit: str, line: cst.SimpleStatementLine, block: cst.CSTNode) -> List[ReplaceNode]:
    """The edits that delete `line` from `block` (its parent IndentedBlock or Module)."""
    made: List[cst.SimpleStatementLine] = []

    def to_marker(node: cst.CSTNode) -> cst.CSTNode:
        marker = cst.SimpleStatementLine(body=[cst.Pass()], leading_lines=node.leading_lines,
                                         trailing_whitespace=node.trailing_whitespace)
        made.append(marker)
        return marker

    def drop_marker(node: cst.CSTNode) -> cst.CSTNode:
        body, footer = list(node.body), list(node.footer)
        for marker in made:
            i = next((k for k, s in enumerate(body) if s is marker), None)
            if i is None or len(body) == 1:
                continue  # not there, or the block's last statement: it stays a `pass`
            carried = list(marker.leading_lines)
            comment = marker.trailing_whitespace.comment
            if comment is not None:
                carried.append(cst.EmptyLine(indent=True, comment=comment))
            del body[i]
            if i < len(body):
                body[i] = body[i].with_changes(leading_lines=carried + list(body[i].leading_lines))
            else:  # it ended the block: its comments end the block too
                footer = carried + footer
        return node.with_changes(body=body, footer=footer)

    return [ReplaceNode(unit, line, to_marker), ReplaceNode(unit, block, drop_marker)]


def block_of(line: cst.CSTNode, parents) -> Optional[cst.CSTNode]:
    """The IndentedBlock (or Module) whose body holds statement `line`, or None."""
    par = parents.get(line)
    if isinstance(par, (cst.IndentedBlock, cst.Module)) and line in par.body:
        return par
    return None


def removed_line(pu, statement: cst.CSTNode) -> int:
    """Where a deleted statement stood: its line in the unit's module as parsed (the
    record of a deletion points there; lines of edits above it in the unit may shift it)."""
    from kvpatch.analysis.units import ranges

    at = ranges(pu.module).get(statement)
    return at.start.line if at is not None else 1
