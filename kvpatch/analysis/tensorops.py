"""tensorops: what a tensor op does to the rows of a KV buffer.

The vocabulary match.py's data flow reads: which ops keep every row of a
buffer (views, splits), which pick rows (gathers), and the argument shapes
that decide it (a whole-row slice, the dim of an index_select, a device
rather than a dtype). Each answer looks at one node; no data flow here.
"""

from __future__ import annotations

from typing import List

import libcst as cst

# split / chunk / unbind return a tuple of views: each element keeps every row
# (or a contiguous range of them), so `pieces[0]` is not a gather.
TUPLE_VIEWS = {"split", "chunk", "unbind"}
# Ops that keep "the whole pool" (a view, a reshape, a slice of every row).
VIEW_METHODS = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten",
                "contiguous", "permute", "transpose", "narrow", "expand", "as_strided",
                "t", "detach", "select"} | TUPLE_VIEWS
# Functions that return a view of their first argument: SGLang's page layout helper,
# `paged_view(flat, page_size)` ([slots, ...] -> [slots // page_size, page_size, ...]).
VIEW_FUNCTIONS = {"paged_view"}
# Keywords through which a kernel takes a page table (pages of page_size slots).
PAGED_KEYWORDS = ("page_table", "block_table", "block_tables", "page_table_tensor")
GATHER_METHODS = {"index_select", "gather", "take", "masked_select", "take_along_dim"}
# index_select(dim, index) gathers rows only along dim 0; along another literal dim
# every row of the pool is kept (a column selection), which is still a pool cast.
DIM_GATHERS = {"index_select"}
DEVICE = "device"  # `.to(device)`, `.to(x.device)`, `.to(torch.device(...))`: a move, not a cast


def int_subscript(sub: cst.Subscript) -> bool:
    """`pair[0]`: one element of a (k, v) tuple."""
    return len(sub.slice) == 1 and isinstance(sub.slice[0].slice, cst.Index) and isinstance(
        sub.slice[0].slice.value, cst.Integer)


def gathers_rows(meth: str, args: List[cst.Arg]) -> bool:
    """A gather op picks rows unless it is an index_select along a literal dim
    other than 0 (`torch.index_select(buf, 0, idx)` gathers; `(buf, -1, cols)` does not)."""
    if meth not in DIM_GATHERS:
        return True
    dim = next((a.value for a in args if a.keyword is not None and a.keyword.value == "dim"), None)
    if dim is None:
        pos = [a for a in args if a.keyword is None]
        dim = pos[0].value if pos else None
    if isinstance(dim, cst.UnaryOperation) and isinstance(dim.operator, cst.Minus):
        return False  # a negative literal dim counts from the last: never the row dim of a pool
    return not isinstance(dim, cst.Integer) or dim.evaluated_value == 0


def whole_rows(sub: cst.Subscript) -> bool:
    """`buf[:, :, :512]` keeps every row of the pool; `buf[kv_indices]` gathers."""
    first = sub.slice[0].slice if sub.slice else None
    if isinstance(first, cst.Slice):
        return first.lower is None and first.upper is None and first.step is None
    if isinstance(first, cst.Index) and isinstance(first.value, cst.Ellipsis):
        return True
    return False


def device_like(e: cst.BaseExpression) -> bool:
    """A `.to()` argument naming a device (a string, an ordinal, a device object)."""
    if isinstance(e, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString, cst.Integer)):
        return True
    if isinstance(e, cst.Attribute) and e.attr.value == DEVICE:
        return True
    if isinstance(e, cst.Name) and DEVICE in e.value.lower():
        return True
    if isinstance(e, cst.Call):
        func = e.func.attr if isinstance(e.func, cst.Attribute) else e.func
        return isinstance(func, cst.Name) and func.value == DEVICE
    return False
