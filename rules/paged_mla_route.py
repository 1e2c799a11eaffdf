"""KVP108 paged-mla-route: sgl-kernel's positional paged MLA decode, routed through the runtime.

KVP103 casts only the pages a page-table kernel reads; the kernel still reads a bf16 copy
of each. SGLang's XPU backend does its absorbed-MLA decode with sgl-kernel's
`flash_mla_decode(q_nope, q_pe, kv_c_and_k_pe_cache, seq_lens, page_table, workspace,
sm_scale, num_kv_splits=1)`, by position. Where every reader of the cast is the cache of
such a call (position 3 or `kv_c_and_k_pe_cache=`, bound with the signature in
kvpatch.analysis.pagedcall), the cast hands the pool on as stored and each call goes
through the runtime:

    kv_cache = _kvpatch_rt.kv_for_routed_kernel(pool, q.dtype)
    ...
    o = _kvpatch_rt.paged_mla(flash_mla_decode, q_nope, q_rope, kv_cache.view(...), ...)

The call keeps its own arguments, positions and keywords alike. Per call, the runtime runs
the fused FP8 attention (on CUDA, where the call is one it computes exactly and
KVPATCH_MODE picks it), else casts the pages of the call's own table into the shadow and
runs the kernel on them (KVP103's result, one call at a time). KVPATCH_MODE=off casts the
whole pool at the cast, as the original did.

Only decode is routed (`ROUTABLE_PAGED_KERNELS`): `flash_mla_prefill`'s ragged, causal
queries are not the fused attention's contract, so its casts stay KVP103's page-gathered
casts. The cache may pass only through `.view(...)` and `paged_view`, bound to at most one
name: the runtime finds the pool again from the view, and a copy or a slice would hide it.
Anything this rule cannot prove (a starred argument, more positions than parameters, a
reader that is not such a call, a call in a nested scope, the cast read by a closure) is
not this rule's, and KVP103 decides as before.
"""

from __future__ import annotations

from typing import List, Optional

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.analysis.match import Consumer, UnitContext, consumer_names
from kvpatch.analysis.pagedcall import (MLA_CACHE, PAGED_KERNELS, ROUTABLE_PAGED_KERNELS, _bind_signature,
                                        is_cache_arg, kernel_name, routable_view)
from kvpatch.rule import Decision, Invalid, Patched, Rule, Valid, refuse_unless_plain_cast
from kvpatch.sites import HOT

from ._page_table_examples import RT, XPU_CAST, XPU_DECODE
from ._routed import ROUTED_CAST_FN, read_by_a_closure, routed_edits  # shared with KVP106

ROUTED_CALL_FN = "paged_mla"
# flash_mla_decode's parameters without a default: a call missing one is not the kernel's.
_REQUIRED = PAGED_KERNELS["flash_mla_decode"][:7]
CACHE_POSITION = PAGED_KERNELS["flash_mla_decode"].index(MLA_CACHE)

ROUTED_CAST = (f"_kvpatch_rt.{ROUTED_CAST_FN}(\n            self.token_to_kv_pool.get_key_buffer(layer.layer_id),\n"
               f"            q.dtype,\n        )")

# SGLang 0.5.23's XPU decode (xpu_backend.py, XPUAttentionBackend.forward_decode), shortened:
# the cast under the MLA branch, the queries shaped after it, the call exploded with a comment.
XPU_DECODE_0523 = '''
class XPUAttentionBackend:
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        metadata = self.forward_metadata
        if not self.use_mla:
            return self._forward_mha(q, layer, metadata)
        else:
            # Do absorbed multi-latent attention
            kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
            if q_rope is not None:
                q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
            else:
                q_all = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
                q_nope = q_all[:, :, : layer.v_head_dim]
                q_rope = q_all[:, :, layer.v_head_dim :]

            o = flash_mla_decode(
                q_nope,
                q_rope,
                kv_cache.view(-1, self.page_size, layer.head_dim),
                metadata.cache_seqlens_int32,
                metadata.page_table,
                self.workspace_decode,
                layer.scaling,
                # pinned to 1: the reduction order stays fixed
                num_kv_splits=1,
            )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
'''
XPU_DECODE_KW = '''
class XPUAttentionBackend:
    def forward_decode(self, q, q_rope, layer, metadata):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return flash_mla_decode(q_nope=q, q_pe=q_rope,
                                kv_c_and_k_pe_cache=paged_view(kv_cache.view(-1, layer.head_dim), self.page_size),
                                seq_lens=metadata.cache_seqlens_int32, page_table=metadata.page_table,
                                workspace=self.workspace, sm_scale=layer.scaling)
'''
XPU_DECODE_LENS_AFTER = (XPU_DECODE.replace("metadata.cache_seqlens_int32, metadata.page_table,",
                                            "lens, metadata.page_table,")
                                   .replace("        return", "        lens = self.lengths_of(metadata)\n        return"))
XPU_DECODE_TWO_POOLS = '''
class XPUAttentionBackend:
    def forward_decode(self, q, q_rope, layer, metadata):
        if layer.is_cross_attention:
            kv = self.cross_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        else:
            kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return flash_mla_decode(q, q_rope, kv.view(-1, self.page_size, 576), metadata.cache_seqlens_int32,
                                metadata.page_table, self.workspace, layer.scaling)
'''


def _routed(src: str, cast: str = XPU_CAST, routed_cast: str = ROUTED_CAST, indent: str = "        ") -> str:
    """An example as apply rewrites it: the cast handed on, `flash_mla_decode(` routed."""
    call = "flash_mla_decode("
    if f"{call}\n" in src:  # exploded: the kernel on its own line
        body = src.replace(f"{call}\n", f"_kvpatch_rt.{ROUTED_CALL_FN}(\n{indent}    flash_mla_decode,\n")
    else:
        body = src.replace(call, f"_kvpatch_rt.{ROUTED_CALL_FN}(flash_mla_decode, ")
    return RT + body.replace(cast, routed_cast)


class PagedMlaRoute(Rule):
    ID = "KVP108"
    NAME = "paged-mla-route"
    SUMMARY = ("sgl-kernel paged MLA decode (flash_mla_decode, by position) on a full-pool cast -> runtime-routed "
               "call (fused FP8 attention or gathered pages)")
    KIND = "cast"
    # Before KVP103 (20): a site both can rewrite is routed. Before KVP106 (15) too: both
    # emit kv_for_routed_kernel, and this rule's patched() (read by paged_mla) is the narrower.
    PRIORITY = 14
    EMITS = (ROUTED_CAST_FN, ROUTED_CALL_FN)
    CHECKED_ON = ("sglang 4ad990ba7 (2026-08-06)", "sglang 0.5.16", "sglang 0.5.20", "sglang 0.5.23")

    VALID = (
        Valid(
            '''
class XPUAttentionBackend:
    def forward_decode(self, q, q_rope, layer, metadata):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return flash_mla_decode(q, q_rope, kv_cache.view(-1, self.page_size, 576), metadata.cache_seqlens_int32,
                                metadata.page_table, self.workspace, layer.scaling)
''',
            why="no cast: the pool reaches the kernel as stored",
        ),
    )

    INVALID = (
        Invalid(
            XPU_DECODE,
            expected=_routed(XPU_DECODE),
            status="hot",
            why="XPU decode (SGLang HEAD to 0.5.23): flash_mla_decode by position, on one line; the kernel goes "
                "first, the call's own arguments follow unchanged",
        ),
        Invalid(
            XPU_DECODE_0523,
            expected=_routed(XPU_DECODE_0523, routed_cast=ROUTED_CAST.replace("\n    ", "\n        "),
                             indent="            "),
            status="hot",
            why="SGLang 0.5.23's decode: the cast under the MLA branch, the call exploded with num_kv_splits= and a "
                "comment inside (both kept)",
        ),
        Invalid(
            XPU_DECODE_KW,
            expected=_routed(XPU_DECODE_KW),
            status="hot",
            why="every argument by keyword, the cache shaped by `.view` then `paged_view`",
        ),
        Invalid(
            XPU_DECODE_LENS_AFTER,
            expected=_routed(XPU_DECODE_LENS_AFTER),
            status="hot",
            why="the lengths come from a call after the cast (KVP103 could not read them at the cast): a routed "
                "call reads its own arguments when it runs",
        ),
        Invalid(
            XPU_DECODE_TWO_POOLS,
            expected=_routed(XPU_DECODE_TWO_POOLS, "self.cross_pool.get_key_buffer(layer.layer_id).to(q.dtype)",
                             f"_kvpatch_rt.{ROUTED_CAST_FN}(\n                self.cross_pool.get_key_buffer("
                             "layer.layer_id),\n                q.dtype,\n            )")
            .replace("self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)",
                     f"_kvpatch_rt.{ROUTED_CAST_FN}(\n                self.token_to_kv_pool.get_key_buffer("
                     "layer.layer_id),\n                q.dtype,\n            )"),
            status="hot",
            why="a cast in each arm of an if/else, one call: the call is routed once",
        ),
    )

    # -- recognise ----------------------------------------------------------
    def patched(self, call: cst.Call, ctx: UnitContext) -> Optional[Patched]:
        # kv_for_routed_kernel(pool, dtype) is KVP106's cast too: this rule's where a routed
        # paged_mla call reads it as its cache.
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == self.EMITS[0] and len(call.args) == 2):
            return None
        if not any(_routed_reader(c) for c in ctx.consumers(call)):
            return None
        return Patched(call, call.args[0].value, call.args[1].value,
                       "kvpatch's routed paged MLA decode call is in place (fused FP8 attention or gathered pages)")

    # -- decide -------------------------------------------------------------
    def decide(self, cand: CastCandidate, ctx: UnitContext) -> Optional[Decision]:
        calls = _routable_calls(cand, ctx)
        if calls is None or read_by_a_closure(cand, ctx) or refuse_unless_plain_cast(cand, ctx):
            return None  # KVP103 (or another rule) decides
        return Decision(
            HOT,
            f"full-pool cast read only by {consumer_names(cand.consumers, ctx)} (sgl-kernel's paged MLA decode, "
            f"bound by its signature): the pool goes on as stored and each call is routed through the runtime "
            f"(fused FP8 attention, or the pages of its own table cast and the kernel run on them)",
            routed_edits(cand, ctx, self.EMITS, calls),
        )


def _routed_reader(c: Consumer) -> bool:
    """The patched cast reaches a routed paged_mla call as its cache (the kernel is the
    call's first argument, so the cache sits one place later than in the kernel's call)."""
    f = c.call.func if c.kind == "call" and c.call is not None else None
    return (isinstance(f, cst.Attribute) and f.attr.value == ROUTED_CALL_FN
            and (c.arg_index == CACHE_POSITION + 1 or c.keyword == MLA_CACHE))


def _peel(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`expr` without the views around it: `x.view(...)` -> x, `paged_view(x, ps)` -> x."""
    while isinstance(expr, cst.Call) and routable_view(expr):
        if isinstance(expr.func, cst.Attribute):
            expr = expr.func.value
        elif expr.args and expr.args[0].keyword is None and not expr.args[0].star:
            expr = expr.args[0].value
        else:
            break
    return expr


def _routable_calls(cand: CastCandidate, ctx: UnitContext) -> Optional[List[cst.Call]]:
    """The distinct flash_mla_decode calls the cast reaches, when every reader is the cache
    argument of such a call that binds to the kernel's signature, through `.view`/`paged_view`
    only (no slice, no other operation, at most one name on the way); else None."""
    calls: List[cst.Call] = []
    for c in cand.consumers:
        if c.kind != "call" or c.call is None or isinstance(c.call.func, cst.Call):
            return None
        name = kernel_name(c.call)
        if name not in ROUTABLE_PAGED_KERNELS or ctx.in_nested_scope(c.call):
            return None
        bound = _bind_signature(c.call, PAGED_KERNELS[name])  # None: starred, too many positions, unknown keyword
        if bound is None or not all(p in bound for p in _REQUIRED):
            return None
        if not is_cache_arg(c.call, c.keyword, c.arg_index):
            return None  # the cast reaches another parameter (a query, say)
        if len(c.via) > 1 or any(not routable_view(v) for v in c.views):
            return None
        # The argument itself is the cast (or its one name) under views: a subscript on
        # the way (a slice of the rows) is transparent to the data flow, not to the runtime.
        arg = _peel(bound[MLA_CACHE])
        if c.via:
            if not (isinstance(arg, cst.Name) and arg.value == c.via[0]):
                return None
        elif arg is not cand.call:
            return None
        if all(x is not c.call for x in calls):
            calls.append(c.call)
    return calls or None
