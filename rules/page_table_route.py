"""KVP106 page-table-route: FA3's absorbed-MLA call, routed through the runtime.

KVP103 casts only the pages a page-table kernel reads; the kernel still reads a bf16 copy
of each (576 B read, 1,152 B written, 1,152 B read again a row). Where every reader of
the cast is a call the runtime can serve whole (`ROUTABLE_KERNELS`: FA3's
`flash_attn_with_kvcache(q=, k_cache=, v_cache=, qv=, page_table=, cache_seqlens=, ...)`,
by keyword), the cast hands the pool on as stored and each call goes through the runtime:

    kv_cache = _kvpatch_rt.kv_for_routed_kernel(pool, q.dtype)
    ...
    o = _kvpatch_rt.paged_attention(flash_attn_with_kvcache, q=..., k_cache=..., ...)

Per call, the runtime runs the fused FP8 attention (it reads the 576 FP8 bytes of each
row the call's table lists, nothing else) when the call is one it computes exactly and
KVPATCH_MODE picks it, else casts the pages of the call's own table and runs the
original kernel on them (KVP103's result, one call at a time). KVPATCH_MODE=off casts the
whole pool at the cast, as the original did.

The caches may pass only through `.view(...)`, SGLang's `paged_view` and slices on the way: the runtime finds
the pool again from the two views, and a copy would hide it. Anything else, a reader
that is not a routable call, a positional argument, a call in a nested scope: not this
rule's, and KVP103 decides as before.
"""

from __future__ import annotations

import re
from typing import List, Optional

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.analysis.match import Consumer, UnitContext, consumer_names
from kvpatch.analysis.pagedcall import CACHE_KEYWORDS, ROUTABLE_KERNELS, is_cache_arg, kernel_name, kw, routable_view
from kvpatch.rule import Decision, Invalid, Patched, Rule, Valid, refuse_unless_plain_cast
from kvpatch.sites import HOT

from ._page_table_examples import FA3_DECODE, RT
from ._routed import ROUTED_CAST_FN, read_by_a_closure, routed_edits

ROUTED_CAST = f'''        kv_cache = _kvpatch_rt.{ROUTED_CAST_FN}(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            q.dtype,
        )
'''


def _routed(src: str) -> str:
    out = src.replace("        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n",
                      ROUTED_CAST)
    return RT + re.sub(r"= flash_attn_with_kvcache\(\n( +)", r"= _kvpatch_rt.paged_attention(\n\1flash_attn_with_kvcache,\n\1",
                       out)


FA3_ONE_LINE = '''
class FlashAttentionBackend:
    def forward_decode(self, q, layer, metadata):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)  # FP8 -> bf16
        c_kv = kv_cache[:, :, :512].view(-1, self.page_size, 1, 512)
        k_pe = kv_cache[:, :, 512:].view(-1, self.page_size, 1, 64)
        return flash_attn_with_kvcache(q=q[..., 512:], k_cache=k_pe, v_cache=c_kv, qv=q[..., :512],
                                       page_table=metadata.page_table, cache_seqlens=metadata.seqlens)
'''


class PageTableRoute(Rule):
    ID = "KVP106"
    NAME = "page-table-route"
    SUMMARY = "FA3 absorbed-MLA call on a full-pool cast -> runtime-routed call (fused FP8 attention or gathered pages)"
    KIND = "cast"
    PRIORITY = 15  # before KVP103: a site both can rewrite is routed
    EMITS = (ROUTED_CAST_FN, "paged_attention")
    CHECKED_ON = ("sglang 4ad990ba7 (2026-08-06)", "sglang 0.5.16", "sglang 0.5.23")

    VALID = (
        Valid(
            '''
class FlashAttentionBackend:
    def forward_decode(self, q, layer, metadata):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return flash_attn_with_kvcache(q=q, k_cache=kv_cache[:, :, 512:].view(-1, 1, 1, 64),
                                       v_cache=kv_cache[:, :, :512].view(-1, 1, 1, 512), qv=q,
                                       page_table=metadata.page_table, cache_seqlens=metadata.seqlens)
''',
            why="no cast: the FP8 pool reaches the kernel as stored",
        ),
    )

    INVALID = (
        Invalid(
            FA3_DECODE,
            expected=_routed(FA3_DECODE),
            status="hot",
            why="FA3 absorbed-MLA decode (main call and the spec-decode cascade call): both route through the "
                "runtime, each with its own table",
        ),
        Invalid(
            FA3_DECODE.replace("k_rope.view(-1, self.page_size, layer.tp_k_head_num, 64)",
                               "paged_view(k_rope, self.page_size)")
                      .replace("c_kv.view(-1, self.page_size, layer.tp_v_head_num, layer.v_head_dim)",
                               "paged_view(c_kv, self.page_size)"),
            expected=_routed(FA3_DECODE.replace("k_rope.view(-1, self.page_size, layer.tp_k_head_num, 64)",
                                                "paged_view(k_rope, self.page_size)")
                                       .replace("c_kv.view(-1, self.page_size, layer.tp_v_head_num, layer.v_head_dim)",
                                                "paged_view(c_kv, self.page_size)")),
            status="hot",
            why="SGLang 0.5.23 shapes the pages with `paged_view(x, page_size)`, an as_strided view of the pool",
        ),
        Invalid(
            FA3_DECODE.replace("        k_rope = kv_cache", "        metadata = self.other_metadata\n"
                                                         "        k_rope = kv_cache"),
            expected=_routed(FA3_DECODE.replace("        k_rope = kv_cache", "        metadata = self.other_metadata\n"
                                                                          "        k_rope = kv_cache")),
            status="hot",
            why="`metadata` is rebound between the cast and the call: no matter, each routed call reads its own "
                "table when it runs (KVP103 could not cast at the cast)",
        ),
        Invalid(
            FA3_ONE_LINE,
            expected=RT + FA3_ONE_LINE.replace(
                "kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)  # FP8 -> bf16",
                f"kv_cache = _kvpatch_rt.{ROUTED_CAST_FN}(\n"
                "            self.token_to_kv_pool.get_key_buffer(layer.layer_id),\n"
                "            q.dtype,\n"
                "        )  # FP8 -> bf16").replace("return flash_attn_with_kvcache(q=q[..., 512:]",
                                    "return _kvpatch_rt.paged_attention(flash_attn_with_kvcache, q=q[..., 512:]"),
            status="hot",
            why="a call on one line gets the kernel as its first argument; the cast's comment is kept",
        ),
    )

    # -- recognise ----------------------------------------------------------
    def patched(self, call: cst.Call, ctx: UnitContext) -> Optional[Patched]:
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == self.EMITS[0] and len(call.args) == 2:
            return Patched(call, call.args[0].value, call.args[1].value,
                           "kvpatch's routed kernel call is in place (fused FP8 attention or gathered pages)")
        return None

    # -- decide -------------------------------------------------------------
    def decide(self, cand: CastCandidate, ctx: UnitContext) -> Optional[Decision]:
        calls = _routable_calls(cand.consumers, ctx)
        if calls is None or read_by_a_closure(cand, ctx) or refuse_unless_plain_cast(cand, ctx):
            return None  # KVP103 (or another rule) decides
        return Decision(
            HOT,
            f"full-pool cast read only by {consumer_names(cand.consumers, ctx)} (absorbed MLA): the pool goes on "
            f"as stored and each call is routed through the runtime (fused FP8 attention, or the pages of its "
            f"own table cast and the kernel run on them)",
            routed_edits(cand, ctx, self.EMITS, calls),
        )


def _routable_calls(consumers: List[Consumer], ctx: UnitContext) -> Optional[List[cst.Call]]:
    """The distinct calls the cast reaches, when every reader is a k_cache or v_cache of a
    routable kernel call by keyword, through views only, and each call takes both caches
    from this cast; else None."""
    calls: List[cst.Call] = []
    seen = {}
    for c in consumers:
        if c.kind != "call" or c.call is None or c.keyword not in CACHE_KEYWORDS:
            return None
        name = kernel_name(c.call)
        if name not in ROUTABLE_KERNELS or kw(c.call, ROUTABLE_KERNELS[name]) is None:
            return None
        if not is_cache_arg(c.call, c.keyword, c.arg_index) or ctx.in_nested_scope(c.call):
            return None
        if any(a.keyword is None and not a.star for a in c.call.args) or isinstance(c.call.func, cst.Call):
            return None
        if any(not routable_view(v) for v in c.views):
            return None
        seen.setdefault(id(c.call), set()).add(c.keyword)
        if all(x is not c.call for x in calls):
            calls.append(c.call)
    if not calls or any(seen[id(call)] != set(CACHE_KEYWORDS) for call in calls):
        return None
    return calls
