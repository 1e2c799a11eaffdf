"""pagedcall: which arguments of a page-table attention call are its caches, its page
table and its lengths.

A page-table kernel reads, for request b, the pages `table[b, :ceil(lengths[b] / page_size)]`
of the caches it is handed. Two calling conventions name those arguments:
- by keyword, FA3/FA4's `flash_attn_with_kvcache(k_cache=, v_cache=, page_table=,
  cache_seqlens=)` (MUSA's port too): any call with a cache keyword, a table keyword and
  a lengths keyword;
- by position, sgl-kernel's paged MLA kernels, whose parameters are known by name and
  order (`PAGED_KERNELS`): the call is bound to that signature, keywords and positions alike.
A closure that hands the caches to such a call (context parallel) adds its table too
(`closure_tables`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import libcst as cst

from kvpatch.analysis.dataflow import loads_in
from kvpatch.analysis.stable import nested_scopes, stored_in
from kvpatch.analysis.tensorops import PAGED_KEYWORDS, VIEW_FUNCTIONS

CACHE_KEYWORDS = ("k_cache", "v_cache")  # flash_attn_with_kvcache's paged caches
SEQLENS_KEYWORD = "cache_seqlens"
# sgl-kernel's paged MLA kernels (XPU build: sgl-project/sgl-kernel-xpu, python/sgl_kernel/
# attention.py): parameters in order. The cache is [pages, page_size, 576], the table
# [batch, max_pages] and the lengths are each request's KV length.
MLA_CACHE = "kv_c_and_k_pe_cache"
PAGED_KERNELS: Dict[str, tuple] = {
    "flash_mla_decode": ("q_nope", "q_pe", MLA_CACHE, "seq_lens", "page_table", "workspace", "sm_scale",
                         "num_kv_splits"),
    "flash_mla_prefill": ("q_nope", "q_pe", MLA_CACHE, "cu_seqlens_q", "seq_lens_k", "max_seqlen_q", "page_table",
                          "workspace", "sm_scale", "causal", "num_kv_splits"),
}
KERNEL_SEQLENS = ("seq_lens", "seq_lens_k")  # the lengths parameter of a PAGED_KERNELS signature
# Keyword-only page-table kernels other than flash_attn_with_kvcache: (cache keywords, lengths
# keyword). aiter's triton unified_attention (vLLM's): k=, v=, block_table=, seqused_k=.
KEYWORD_KERNELS: Dict[str, tuple] = {"unified_attention": (("k", "v"), "seqused_k")}
# Kernels that take FlashInfer's ragged page list: request b reads the pages
# kv_page_indices[kv_indptr[b]:kv_indptr[b + 1]] of block_size slots. aiter's
# paged_attention_ragged (ROCm/aiter, aiter/ops/attention.py), parameters in order; its
# caches are [blocks, block_size, heads, dim] in the "NHD" layout SGLang passes.
AITER_DECODE_KERNEL, AITER_EXTEND_KERNEL = "paged_attention_ragged", "mha_batch_prefill_func"
RAGGED_KERNELS: Dict[str, tuple] = {
    AITER_DECODE_KERNEL: ("out", "workspace_buffer", "query", "key_cache", "value_cache", "scale", "kv_indptr",
                               "kv_page_indices", "kv_last_page_lens", "block_size", "max_num_partitions",
                               "alibi_slopes", "kv_cache_dtype", "kv_cache_layout", "logits_soft_cap", "k_scale",
                               "v_scale", "fp8_out_scale", "partition_size", "mtp"),
}
# Page-table kernels whose whole call the runtime can serve (runtime paged_attention: the
# fused FP8 attention, else the gathered pages and the kernel itself), with the keyword
# that marks the call it serves: FA3's absorbed-MLA form, the latent cache as v_cache and
# the latent query as qv.
ROUTABLE_KERNELS: Dict[str, str] = {"flash_attn_with_kvcache": "qv"}
# PAGED_KERNELS whose whole call the runtime can serve (runtime paged_mla): decode, one
# query token a request, which the fused FP8 attention computes, else the pages of the
# call's own table cast and the kernel run on them. flash_mla_prefill is not among them:
# its ragged, causal queries are not the fused path's contract, so KVP103 casts its pages.
ROUTABLE_PAGED_KERNELS = ("flash_mla_decode",)
# The view methods a routed call's caches may pass through (with tensorops.VIEW_FUNCTIONS):
# each keeps a view of the pool (no copy), so the runtime can recover the pool from the
# two caches.
ROUTABLE_VIEWS = ("view",)


def routable_view(call: cst.Call) -> bool:
    """`x.view(...)` or SGLang's `paged_view(x, page_size)` (an as_strided view): both keep
    the pool's storage and row stride, from which the runtime finds the pool again."""
    f = call.func
    return (isinstance(f, cst.Attribute) and f.attr.value in ROUTABLE_VIEWS) or (
        isinstance(f, cst.Name) and f.value in VIEW_FUNCTIONS)
RAGGED_CACHES = ("key_cache", "value_cache")
RAGGED_LAYOUT = ("kv_cache_layout", "NHD")  # the layout whose dim 1 is the block
# Kernels that take the ragged page list with rank-3 caches, one slot per page: aiter's
# mha_batch_prefill_func (ROCm/aiter, aiter/ops/mha.py) reads, for request b, the rows
# k[kv_page_indices[kv_indptr[b]:kv_indptr[b + 1]]] of its [slots, heads, dim] caches (the
# linear layout: page size 1, no block_size argument). Its first eight parameters are the
# same in every aiter version SGLang pins; the later ones moved between versions, so they
# bind by keyword only, and only those that leave the row contract alone: a keyword that
# changes the layout (block_table, kv_last_page_lens, kv_cache, kv_layout) does not bind.
SLOT_RAGGED_KERNELS: Dict[str, tuple] = {
    AITER_EXTEND_KERNEL: (("q", "k", "v", "cu_seqlens_q", "kv_indptr", "kv_page_indices", "max_seqlen_q",
                                "max_seqlen_k"),
                               ("dropout_p", "softmax_scale", "logits_soft_cap", "causal", "window_size",
                                "alibi_slopes", "deterministic", "return_lse", "return_attn_probs", "out",
                                "sink_ptr", "q_descale", "k_descale", "v_descale")),
}
SLOT_CACHES = ("k", "v")


@dataclass
class PagedArgs:
    caches: List[cst.BaseExpression]  # the arguments the kernel reads as paged caches
    table: cst.BaseExpression
    seqlens: cst.BaseExpression  # for a ragged kernel: its kv_indptr (table: its kv_page_indices)
    by_position: bool  # bound through a PAGED_KERNELS or RAGGED_KERNELS signature
    block_size: Optional[cst.BaseExpression] = None  # set for a ragged kernel: the page size it is told
    slot_rows: bool = False  # a SLOT_RAGGED_KERNELS call: it indexes the rows of the caches as handed


def kw(call: cst.Call, name: str) -> Optional[cst.Arg]:
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def kernel_name(call: cst.Call) -> str:
    f = call.func
    return f.value if isinstance(f, cst.Name) else f.attr.value if isinstance(f, cst.Attribute) else ""


def _bind_signature(call: cst.Call, params: tuple) -> Optional[Dict[str, cst.BaseExpression]]:
    """{parameter: argument} for a call of a known signature; None where it does not bind
    (a `*`/`**` argument, too many positional arguments, an unknown or repeated keyword)."""
    if any(a.star for a in call.args):
        return None
    pos = [a for a in call.args if a.keyword is None]
    if len(pos) > len(params):
        return None
    out = {p: a.value for p, a in zip(params, pos)}
    for a in call.args:
        if a.keyword is not None:
            name = a.keyword.value
            if name not in params or name in out:
                return None
            out[name] = a.value
    return out


def _bind_ragged(call: cst.Call, params: tuple) -> Optional[PagedArgs]:
    bound = _bind_signature(call, params)
    need = RAGGED_CACHES + ("kv_indptr", "kv_page_indices", "block_size", RAGGED_LAYOUT[0])
    if bound is None or not all(p in bound for p in need):
        return None
    layout = bound[RAGGED_LAYOUT[0]]
    if not (isinstance(layout, cst.SimpleString) and layout.evaluated_value == RAGGED_LAYOUT[1]):
        return None  # another layout puts the block elsewhere than the view's dim 1
    return PagedArgs([bound[p] for p in RAGGED_CACHES], bound["kv_page_indices"], bound["kv_indptr"], True,
                     bound["block_size"])


def _bind_slot_ragged(call: cst.Call, params: tuple) -> Optional[PagedArgs]:
    positional, keywords = params
    if sum(1 for a in call.args if a.keyword is None) > len(positional):
        return None  # past the eighth, positions differ between aiter versions
    bound = _bind_signature(call, positional + keywords)
    if bound is None or not all(p in bound for p in SLOT_CACHES + ("kv_indptr", "kv_page_indices")):
        return None
    return PagedArgs([bound[p] for p in SLOT_CACHES], bound["kv_page_indices"], bound["kv_indptr"], True,
                     cst.Integer("1"), slot_rows=True)


def bind_paged(call: cst.Call) -> Optional[PagedArgs]:
    """The caches, table and lengths of a page-table call, or None if it is not one."""
    name = kernel_name(call)
    if name in SLOT_RAGGED_KERNELS:
        return _bind_slot_ragged(call, SLOT_RAGGED_KERNELS[name])
    if name in RAGGED_KERNELS:
        return _bind_ragged(call, RAGGED_KERNELS[name])
    params = PAGED_KERNELS.get(name)
    if params is not None:
        bound = _bind_signature(call, params)
        if bound is None:
            return None
        table = next((bound[p] for p in PAGED_KEYWORDS if p in bound), None)
        seqlens = next((bound[p] for p in KERNEL_SEQLENS if p in bound), None)
        if MLA_CACHE not in bound or table is None or seqlens is None:
            return None
        return PagedArgs([bound[MLA_CACHE]], table, seqlens, True)
    cache_kws, seqlens_kw = KEYWORD_KERNELS.get(name, (CACHE_KEYWORDS, SEQLENS_KEYWORD))
    table = next((a.value for k in PAGED_KEYWORDS for a in [kw(call, k)] if a is not None), None)
    seqlens = kw(call, seqlens_kw)
    caches = [a.value for k in cache_kws for a in [kw(call, k)] if a is not None]
    if table is None or seqlens is None or not caches:
        return None
    return PagedArgs(caches, table, seqlens.value, False)


def reads_as_cache(call: cst.Call, node: cst.CSTNode) -> bool:
    """`node` is one of the caches of the page-table call `call`."""
    got = bind_paged(call)
    return got is not None and any(c is node for c in got.caches)


def is_cache_arg(call: cst.Call, keyword: Optional[str], index: Optional[int]) -> bool:
    """The argument at `keyword` (or positional `index`) of a page-table call is a cache."""
    if bind_paged(call) is None:
        return False
    name = kernel_name(call)
    if name in SLOT_RAGGED_KERNELS:
        return keyword in SLOT_CACHES or (keyword is None and index is not None
                                          and SLOT_RAGGED_KERNELS[name][0][index] in SLOT_CACHES)
    params = PAGED_KERNELS.get(name) or RAGGED_KERNELS.get(name)
    if params is None:
        return keyword in KEYWORD_KERNELS.get(name, (CACHE_KEYWORDS,))[0]
    caches = RAGGED_CACHES if name in RAGGED_KERNELS else (MLA_CACHE,)
    return keyword in caches or (keyword is None and index is not None and params[index] in caches)


# -- page-table calls inside closures (context parallel) --------------------------------
def closure_tables(ctx, names, cand) -> Tuple[List[Tuple[str, str]], str]:
    """The (page_table, cache_seqlens) pairs of page-table calls inside nested functions
    that read the cast result (`names`), or why they cannot be known. The data flow
    follows no value into a closure, so each read there must be a k_cache/v_cache of a
    paged call. Its table must be a value the enclosing function fixes before the cast
    (no assignment to its names after it); lengths that are the closure's own (context
    parallel splits them) become None: every entry of the table is cast, a superset."""
    pairs: List[Tuple[str, str]] = []
    for node in nested_scopes(ctx):
        scope = node.name.value if isinstance(node, cst.FunctionDef) else "<lambda>"
        local = _bound_in(node)
        for inner in walk(node):
            if not (isinstance(inner, cst.Name) and inner.value in names):
                continue
            call = _paged_call_of(inner, node)
            if call is None:
                return [], (f"`{inner.value}` is also read inside the nested function `{scope}`, not as the cache of "
                            f"a page-table call: what it reads there is not known at the cast")
            got = bind_paged(call)
            pt, sl = got.table, got.seqlens
            why = _fixed_before(ctx, pt, local, cand)
            if why:
                return [], f"`{ctx.code(call.func)}` inside `{scope}`: {why}"
            pair = (ctx.code(pt), ctx.code(sl) if not _fixed_before(ctx, sl, local, cand) else "None")
            if pair not in pairs:
                pairs.append(pair)
    return pairs, ""


def _paged_call_of(name: cst.Name, scope: cst.CSTNode) -> Optional[cst.Call]:
    """The page-table call inside `scope` that takes `name` as its k_cache/v_cache."""
    for node in walk(scope):
        if isinstance(node, cst.Call) and reads_as_cache(node, name):
            return node
    return None


def _bound_in(scope: cst.CSTNode) -> set:
    """Names a nested function binds itself (parameters and assignments)."""
    out = set()
    params = scope.params if isinstance(scope, (cst.FunctionDef, cst.Lambda)) else None
    if params is not None:
        for p in (*params.params, *params.kwonly_params, *params.posonly_params):
            out.add(p.name.value)
        for p in (params.star_arg, params.star_kwarg):
            if isinstance(p, cst.Param):
                out.add(p.name.value)
    for node in walk(scope):
        if isinstance(node, cst.AssignTarget) and isinstance(node.target, cst.Name):
            out.add(node.target.value)
    return out


def _fixed_before(ctx, expr: cst.BaseExpression, local: set, cand) -> str:
    """Why `expr` (read in a closure) may not be what it is at the cast, or ""."""
    if any(isinstance(n, cst.Call) for n in walk(expr)):
        return f"`{ctx.code(expr)}` calls a function"
    cast_line = ctx.line(cand.call)
    node = cand.call
    while node is not None and node is not ctx.func:
        if isinstance(node, (cst.For, cst.While)):
            return "the cast sits in a loop: a later iteration may rebind what the closure reads"
        node = ctx.parents.get(node)
    for name in loads_in(expr):
        if name.value in local:
            return f"`{name.value}` is the nested function's own"
        later = [d for d in ctx.flow.defs if d.name == name.value and d.stmt is not None
                 and ctx.line(d.stmt) > cast_line]
        if later:
            return f"`{name.value}` is assigned after the cast (line {ctx.line(later[0].stmt)})"
    return stored_in(ctx, expr, "the call")


def walk(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from walk(child)
