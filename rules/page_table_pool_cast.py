"""KVP103 page-table-pool-cast: page-gathered cast for page-table kernels (FA3/FA4, MUSA).

`kv_cache = pool.get_key_buffer(layer_id).to(q.dtype)`, viewed as pages and handed to
`flash_attn_with_kvcache(k_cache=..., v_cache=..., page_table=PT, cache_seqlens=SL)`,
casts every slot of the layer's pool, though the kernel reads only the pages
`PT[b, :ceil(SL[b] / page_size)]`. The cast becomes

    _kvpatch_rt.kv_pages_for_kernel(pool, q.dtype, page_size,
                                    lambda: (PT1, SL1), lambda: (PT2, SL2), ...)

with one (page_table, cache_seqlens) pair per consuming call, taken from that call's own
arguments (the cascade call adds the spec-decode expand table), and page_size from the
`.view(-1, page_size, ...)` that shapes the cast result into the kernel's pages.
Each pair is a lambda: it is read at the cast, and a call that does not run this step
(its metadata is None) contributes nothing, while a call that runs reads the same values
at the cast as at the call (checked: no name rebound, no attribute path stored to in the
function). Everything between the cast and the kernel stays as it is.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.rewrite.codegen import RUNTIME_ALIAS, cast_builder, lambda_tuple
from kvpatch.analysis.match import Consumer, UnitContext, consumer_names
from kvpatch.analysis.pagedcall import (PAGED_KERNELS, RAGGED_KERNELS, RAGGED_LAYOUT, SLOT_RAGGED_KERNELS, PagedArgs,
                                        bind_paged, closure_tables, is_cache_arg, kernel_name, kw, walk)
from kvpatch.analysis.stable import differs_at
from kvpatch.analysis.tensorops import PAGED_KEYWORDS, VIEW_FUNCTIONS
from kvpatch.rule import Decision, Invalid, NeedRuntime, Patched, ReplaceNode, Rule, Upstream, Valid, emitted_call, refuse_unless_plain_cast
from kvpatch.sites import HOT, UNSUPPORTED

from ._page_table_examples import (AITER_DECODE, AITER_PREFILL_INVALID, CP_EXTEND, FA3_DECODE, FA3_PATCHED_CAST, RT,
                                   UNIFIED, XPU_CAST, XPU_CAST_WRAPPED, XPU_DECODE, XPU_PREFILL, _patched, _ragged)

RAGGED = "ragged"  # marks a (kv_indptr, kv_page_indices) pair among the (page_table, lengths) pairs
ABSORBED_KEYWORD = "qv"  # FA3's absorbed-MLA query half: the call reads the latent cache

def _is_minus_one(e: cst.BaseExpression) -> bool:
    return (isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.Minus)
            and isinstance(e.expression, cst.Integer) and e.expression.value == "1")


def _page_dim(view: cst.Call) -> Optional[cst.BaseExpression]:
    """The page size a view shapes the pool with: `x.view(-1, PS, ...)` or `paged_view(x, PS)`."""
    pos = [a for a in view.args if a.keyword is None]
    if isinstance(view.func, cst.Name) and view.func.value in VIEW_FUNCTIONS and len(pos) >= 2:
        return pos[1].value
    if isinstance(view.func, cst.Attribute) and len(pos) >= 2 and _is_minus_one(pos[0].value):
        return pos[1].value
    return None


def paged_call(c: Consumer) -> bool:
    """The cast reaches a page-table kernel as one of its caches (kvpatch.analysis.pagedcall)."""
    return c.kind == "call" and c.call is not None and is_cache_arg(c.call, c.keyword, c.arg_index)


class PageTablePoolCast(Rule):
    ID = "KVP103"
    NAME = "page-table-pool-cast"
    SUMMARY = "FA3/FA4/MUSA full-pool KV cast read through page_table -> page-gathered cast"
    KIND = "cast"
    PRIORITY = 20
    EMITS = ("kv_pages_for_kernel", "ragged_pages")
    CHECKED_ON = ("sglang 4ad990ba7 (2026-08-06)", "sglang ea8f4e9f3 (2026-06-26)",
                  "sglang c5251a98a (2026-05-21)", "sglang 0.5.16", "sglang 0.5.23")

    VALID = (
        Valid(
            '''
class FlashAttentionBackend:
    def forward_decode(self, q, layer, metadata):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        k_rope_cache = kv_cache[:, :, 512:].view(-1, self.page_size, 1, 64)
        c_kv_cache = kv_cache[:, :, :512].view(-1, self.page_size, 1, 512)
        return flash_attn_with_kvcache(q=q, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q,
                                       page_table=metadata.page_table, cache_seqlens=metadata.cache_seqlens_int32,
                                       k_descale=self.k_scale, v_descale=self.v_scale)
''',
            why="fixed upstream: the FP8 latent cache reaches the absorbed-MLA kernel uncast (it reads FP8 itself)",
        ),
        Valid(
            '''
class FlashAttentionBackend:
    def forward_decode(self, q, layer, metadata):
        kv_cache = dequantize_referenced_pages(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id), metadata.page_table,
            metadata.cache_seqlens_int32, self.page_size, q.dtype)
        k_rope_cache = kv_cache[:, :, 512:].view(-1, self.page_size, 1, 64)
        c_kv_cache = kv_cache[:, :, :512].view(-1, self.page_size, 1, 512)
        return flash_attn_with_kvcache(q=q, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q,
                                       page_table=metadata.page_table, cache_seqlens=metadata.cache_seqlens_int32)
''',
            why="fixed upstream (the shape of sglang PR #36087): the pool goes, with the page table, to a "
                "function that converts only the referenced pages",
        ),
    )

    INVALID = (
        Invalid(
            FA3_DECODE.replace("k_rope.view(-1, self.page_size, layer.tp_k_head_num, 64)",
                               "paged_view(k_rope, self.page_size)")
                      .replace("c_kv.view(-1, self.page_size, layer.tp_v_head_num, layer.v_head_dim)",
                               "paged_view(c_kv, self.page_size)"),
            expected=RT + FA3_DECODE.replace("k_rope.view(-1, self.page_size, layer.tp_k_head_num, 64)",
                                             "paged_view(k_rope, self.page_size)")
                                    .replace("c_kv.view(-1, self.page_size, layer.tp_v_head_num, layer.v_head_dim)",
                                             "paged_view(c_kv, self.page_size)").replace(
                "        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n",
                FA3_PATCHED_CAST),
            status="hot",
            why="SGLang 0.5.23 shapes the pages with `paged_view(x, page_size)` instead of `.view(-1, page_size, ...)`",
            preempted_by="KVP106",  # routed: each call brings its own table
        ),
        Invalid(
            FA3_DECODE,
            expected=RT + FA3_DECODE.replace(
                "        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n",
                FA3_PATCHED_CAST),
            status="hot",
            why="FA3 absorbed-MLA decode (HEAD shape): the main call and the cascade call each give a table",
            preempted_by="KVP106",  # routed: each call brings its own table
        ),
        Invalid(
            FA3_DECODE.replace("        k_rope = kv_cache", "        metadata = self.other_metadata\n"
                                                         "        k_rope = kv_cache"),
            status="unsupported",
            why="`metadata` is rebound between the cast and the kernel call: the table read at the cast "
                "would not be the kernel's",
            preempted_by="KVP106",  # routed: each call brings its own table
        ),
        Invalid(
            FA3_DECODE.replace("self.page_size, layer.tp_k_head_num, 64)", "self.page_size_k, layer.tp_k_head_num, 64)"),
            status="unsupported",
            why="the two caches are viewed with different page sizes",
            preempted_by="KVP106",  # routed: each call brings its own table
        ),
        Invalid(
            CP_EXTEND,
            expected=RT + CP_EXTEND.replace(
                "        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n",
                '''        kv_cache = _kvpatch_rt.kv_pages_for_kernel(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            q.dtype,
            self.page_size,
            lambda: (metadata.page_table, metadata.cache_seqlens_int32),
            lambda: (metadata.page_table, None),
        )
'''),
            status="hot",
            why="SGLang 0.5.23's extend: a context-parallel closure reads the caches with its own seqlens, so its "
                "table is cast whole (a superset); the direct call's table with its lengths",
        ),
        Invalid(
            CP_EXTEND.replace("page_table=metadata.page_table, cache_seqlens=cache_seqlens_cp",
                              "page_table=q_chunk.table, cache_seqlens=cache_seqlens_cp"),
            status="unsupported",
            why="the closure's page table is its own parameter's: not known at the cast",
        ),
        Invalid(
            XPU_DECODE,
            expected=RT + XPU_DECODE.replace(XPU_CAST, _patched("metadata.page_table, metadata.cache_seqlens_int32")),
            status="hot",
            why="XPU decode (SGLang HEAD to 0.5.23): sgl-kernel's flash_mla_decode takes the lengths and the table "
                "by position (q_nope, q_pe, cache, seq_lens, page_table, ...)",
            preempted_by="KVP108",  # routed: each call brings its own table
        ),
        Invalid(
            XPU_PREFILL,
            expected=RT + XPU_PREFILL.replace(XPU_CAST_WRAPPED, _patched("page_table, cache_seqlens")),
            status="hot",
            why="XPU extend (SGLang 0.5.23): flash_mla_prefill by keyword, its table and lengths local names bound "
                "before the cast (local attention, SWA or the plain metadata)",
        ),
        Invalid(
            XPU_DECODE.replace("metadata.cache_seqlens_int32, metadata.page_table,", "lens, metadata.page_table,")
                      .replace("        return", "        lens = self.lengths_of(metadata)\n        return"),
            status="unsupported",
            why="the lengths are computed by a call after the cast: running it at the cast too could do more",
            preempted_by="KVP108",  # routed: the call reads its lengths when it runs
        ),
        Invalid(
            XPU_DECODE.replace("flash_mla_decode(", "other_mla_decode("),
            status="hot",
            why="a kernel that takes the page table by position but whose signature KVP103 does not know: reported "
                "with what a rewrite needs, not rewritten",
        ),
    )

    INVALID += (
        Invalid(
            AITER_DECODE,
            expected=RT + AITER_DECODE.replace("k_cache.to(self.input_dtype)", _ragged("k_cache"))
                                      .replace("v_cache.to(self.input_dtype)", _ragged("v_cache")),
            status="hot",
            why="aiter MHA decode: paged_attention_ragged reads the pages kv_indices[kv_indptr[b]:kv_indptr[b+1]] "
                "(FlashInfer's ragged list, block_size 1); each half of the (k, v) pool is cast under a guard",
        ),
        Invalid(
            AITER_DECODE.replace('"NHD"', '"HND"'),
            status="hot",
            why="the HND layout puts the block elsewhere than the view's dim 1: not bound, reported",
        ),
        Invalid(
            AITER_DECODE.replace("self.kv_last_page_len,\n                               1,",
                                 "self.kv_last_page_len,\n                               16,"),
            status="unsupported",
            why="the kernel is told blocks of 16 slots but the cache is viewed with pages of 1",
        ),
        Invalid(
            UNIFIED,
            expected=RT + UNIFIED.replace("k_cache.to(self.input_dtype)", _patched(
                "self.forward_metadata.page_table, forward_batch.seq_lens", "k_cache", "self.input_dtype").strip()),
            status="hot",
            why="aiter's triton unified_attention: k=/v= caches, block_table= and seqused_k= by keyword",
        ),
    )

    INVALID += AITER_PREFILL_INVALID  # aiter's mha_batch_prefill_func (rules/_page_table_examples.py)

    # -- recognise ----------------------------------------------------------
    def patched(self, call: cst.Call, ctx: UnitContext) -> Optional[Patched]:
        # what decide() emits: <alias>.kv_pages_for_kernel(pool, dtype, page_size, ...)
        return emitted_call(call, self.EMITS[0], dtype_arg=1)

    def fixed_upstream(self, call: cst.Call, ctx: UnitContext) -> Optional[Upstream]:
        for c in ctx.consumers(call):
            if c.kind != "call" or c.call is None:
                continue
            if paged_call(c) and kw(c.call, ABSORBED_KEYWORD) is not None:
                return Upstream(call, consumer_names([c], ctx),
                                "no cast: the latent cache reaches the page-table kernel as stored (it reads the "
                                "KV-cache dtype itself): nothing to rewrite")
            if not paged_call(c) and any(ctx.code(a.value).endswith(PAGED_KEYWORDS) for a in c.call.args
                                         if a.value is not call):
                return Upstream(call, consumer_names([c], ctx),
                                f"no cast: the pool goes, with the page table, to `{ctx.code(c.call.func)}`, which "
                                f"converts only the referenced pages (an upstream fix): nothing to rewrite")
        return None

    # -- decide -------------------------------------------------------------
    def decide(self, cand: CastCandidate, ctx: UnitContext) -> Optional[Decision]:
        paged = [c for c in cand.consumers if paged_call(c)]
        if not paged:
            return _positional_pages(cand, ctx)  # None: not a page-table consumer, not this rule's
        others = [c for c in cand.consumers if not paged_call(c)]
        if others:
            return Decision(UNSUPPORTED, f"the cast also reaches {consumer_names(others, ctx)}; only page-table "
                                         f"kernels are known to read just the pages of their tables")
        refused = refuse_unless_plain_cast(cand, ctx)
        if refused:
            return refused
        names = {n for c in cand.consumers for n in c.via}
        closure_pairs, problem = closure_tables(ctx, names, cand)
        if problem:
            return Decision(UNSUPPORTED, problem)
        for c in paged:
            nested = ctx.in_nested_scope(c.call)
            if nested:
                return Decision(UNSUPPORTED, f"`{ctx.code(c.call.func)}` is called inside {nested}: its page table "
                                             f"and seqlens are that scope's values (context parallel, say), not "
                                             f"known at the cast")
        ps, problem = self._page_size(paged, cand, ctx)
        if problem:
            return Decision(UNSUPPORTED, problem)
        pairs, problem = self._tables(paged, cand, ctx)
        if problem:
            return Decision(UNSUPPORTED, problem)
        pairs += [p for p in closure_pairs if p not in pairs]
        edits = [ReplaceNode(ctx.unit.qualname, cand.call, self._builder(cand, ctx, ps, pairs)), NeedRuntime()]
        return Decision(
            HOT,
            f"full-pool cast; {consumer_names(paged, ctx)} read only the pages of {len(pairs)} page table(s): "
            f"rewritten to a page-gathered cast (page size `{ps}`)",
            edits,
        )

    @staticmethod
    def _page_size(paged: List[Consumer], cand: CastCandidate, ctx: UnitContext) -> Tuple[str, str]:
        sizes = {}
        for c in paged:
            node = next((n for n in map(_page_dim, c.views) if n is not None), None)
            if bind_paged(c.call).slot_rows:  # it indexes the rows of the caches as handed: pages of one slot
                if c.views:
                    return "", (f"`{ctx.code(c.views[0])}` reshapes the cache before `{ctx.code(c.call.func)}`, "
                                f"which indexes the rows of a [slots, heads, dim] cache: its rows may not be the "
                                f"pool's slots")
                node = cst.Integer("1")
            if node is None:
                return "", (f"no `.view(-1, page_size, ...)` or `paged_view(x, page_size)` between the cast and "
                            f"`{ctx.code(c.call.func)}`: the size of the pages it reads is not visible")
            sizes[ctx.code(node)] = node
            told = bind_paged(c.call).block_size
            if told is not None and ctx.code(told) != ctx.code(node):
                return "", (f"`{ctx.code(c.call.func)}` is told pages of `{ctx.code(told)}` slots but the cache is "
                            f"viewed with pages of `{ctx.code(node)}`")
        if len(sizes) != 1:
            return "", f"the caches are viewed with different page sizes ({', '.join(sorted(sizes))})"
        (code, node), = sizes.items()
        problem = differs_at(ctx, node, cand.call, "the view")
        return code, problem

    @staticmethod
    def _tables(paged: List[Consumer], cand: CastCandidate, ctx: UnitContext):
        pairs: List[Tuple[str, str]] = []
        for c in paged:
            got: PagedArgs = bind_paged(c.call)
            values = []
            for arg in (got.table, got.seqlens):
                if any(isinstance(n, cst.Call) for n in walk(arg)):
                    return [], f"`{ctx.code(arg)}` calls a function: it would run at the cast too"
                problem = differs_at(ctx, arg, cand.call, f"`{ctx.code(c.call.func)}`")
                alts = _bound_values(arg, cand, ctx) if problem else [ctx.code(arg)]
                if not alts:
                    return [], (f"{problem}: `{ctx.code(c.call.func)}` reads the pages `{ctx.code(arg)}` lists, "
                                f"which the cast cannot read; a rewrite needs the cast moved after the value is "
                                f"bound, next to the kernel")
                values.append(alts)
            for table in values[0]:
                for seqlens in values[1]:
                    pair = (table, seqlens)
                    if got.block_size is not None:  # a ragged list: (kv_indptr, kv_page_indices) -> one table
                        pair = (RAGGED, seqlens, table)
                    if pair not in pairs:
                        pairs.append(pair)
        return pairs, ""

    @staticmethod
    def _builder(cand: CastCandidate, ctx: UnitContext, ps: str, pairs: List[Tuple[str, str]]):
        def table(p, lay):
            if len(p) == 3:  # (RAGGED, kv_indptr, kv_page_indices)
                return f"lambda: {RUNTIME_ALIAS}.{PageTablePoolCast.EMITS[1]}({p[1]}, {p[2]}, {ps})"
            return lambda_tuple(p, lay)

        return cast_builder(cand, ctx, f"{RUNTIME_ALIAS}.{PageTablePoolCast.EMITS[0]}",
                            after=lambda lay: [ps] + [table(p, lay) for p in pairs], explode=True)


def _bound_values(arg: cst.BaseExpression, cand: CastCandidate, ctx: UnitContext) -> List[str]:
    """A name the kernel reads that is bound after the cast (`page_table = meta.kv_indices`, then
    `page_table = meta.swa_page_table` under a condition): the value of each of its definitions
    that reach the kernel, when every one is an assignment whose value, with no call in it,
    means the same at the cast. The runtime then casts the pages of each (a superset: the
    kernel reads one of them). [] when any is not."""
    if not isinstance(arg, cst.Name):
        return []
    out: List[str] = []
    for d in ctx.flow.defs_of(arg):
        if d.kind != "assign" or d.value is None or any(isinstance(n, cst.Call) for n in walk(d.value)):
            return []
        if differs_at(ctx, d.value, cand.call, f"`{arg.value} = {ctx.code(d.value)}`"):
            return []
        if ctx.code(d.value) not in out:
            out.append(ctx.code(d.value))
    return out


def _positional_pages(cand: CastCandidate, ctx: UnitContext) -> Optional[Decision]:
    """Why a kernel that takes a page table positionally, and whose signature is not
    among the known paged kernels (kvpatch.analysis.pagedcall.PAGED_KERNELS), keeps its cast."""
    guard = f" {cand.guard_note}." if cand.guard_note else ""
    for c in cand.consumers:
        if c.kind == "call" and c.call is not None and kernel_name(c.call) in SLOT_RAGGED_KERNELS:
            return Decision(HOT, f"full-pool cast consumed by {consumer_names([c], ctx)}, whose call does not bind "
                                 f"to the parameters every aiter version shares (a `*`/`**` argument, more than "
                                 f"eight positional arguments, or a keyword that changes its layout such as "
                                 f"`block_table=` or `kv_last_page_lens=`): a rewrite needs its k and v caches, "
                                 f"kv_indptr and kv_page_indices, and its caches' layout.{guard}")
        if c.kind == "call" and c.call is not None and kernel_name(c.call) in RAGGED_KERNELS:
            return Decision(HOT, f"full-pool cast consumed by {consumer_names([c], ctx)}, whose call does not bind "
                                 f"to its known signature (a `*`/`**` argument, a keyword it does not take, or a "
                                 f"cache layout other than `{RAGGED_LAYOUT[1]}`, whose block is not the view's "
                                 f"dim 1): a rewrite needs its kv_indptr, kv_page_indices and block size "
                                 f"found by position.{guard}")
        if c.kind != "call" or c.call is None or c.keyword is not None:
            continue
        table = next((a.value for a in c.call.args if a.keyword is None
                      and ctx.code(a.value).endswith(PAGED_KEYWORDS)), None)
        if table is None:
            continue
        return Decision(HOT, f"full-pool cast consumed by {consumer_names([c], ctx)}, which takes the paged cache "
                             f"and `{ctx.code(table)}` by position, and whose signature is not one KVP103 knows "
                             f"({', '.join(sorted(PAGED_KERNELS))}), or the call does not bind to it: a rewrite "
                             f"needs the kernel's parameter order (which argument holds each request's length) "
                             f"and that it reads only `ceil(len / page_size)` pages of each table row.{guard}")
    return None
