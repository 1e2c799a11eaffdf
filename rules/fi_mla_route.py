"""KVP107 flashinfer-mla-route: FlashInfer MLA run() on a full-pool cast, routed through the runtime.

KVP101 casts only the planned rows; the kernel still reads a bf16 copy of each (576 B
read, 1,152 B written, 1,152 B read again a row). Where every reader of the cast is a
wrapper's `run()` that takes both caches from it (ckv and kpe, by position or keyword,
through slices and views), the cast hands the pool on as stored and each run() goes
through the runtime:

    k_buffer = _kvpatch_rt.kv_for_mla_run(pool, q.dtype)
    ...
    o = _kvpatch_rt.mla_run(decode_wrapper.run, q_nope, q_rope, k_buffer[...], k_buffer[...], out=o)

Per call, the runtime runs the fused FP8 attention where it computes exactly what the
planned wrapper would (a decode plan: one query a request, no causal mask, page size 1)
and KVPATCH_MODE picks it; hands the FP8 pool to a wrapper planned for FP8 (native);
else casts the planned rows into the shadow and calls run() on them (KVP101's result).
KVPATCH_MODE=off casts the whole pool at the cast, as the original did. The rows and the
indptr come from the plan calls, which KVP102 routes through the runtime: a file with a
plan call KVP102 cannot route keeps its cast.

Anything else (another reader of the cast, a run() that takes only one cache from it, a
starred argument, a call in a nested scope): not this rule's, and KVP101 decides as before.
"""

from __future__ import annotations

from typing import List, Optional

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.analysis.classify import other_values
from kvpatch.analysis.match import UnitContext, consumer_names, is_mla_run
from kvpatch.analysis.pagedcall import routable_view, walk
from kvpatch.analysis.stable import nested_scopes
from kvpatch.rewrite.codegen import RUNTIME_ALIAS, cast_builder, route_call_builder
from kvpatch.rule import Decision, Invalid, NeedRuntime, Patched, ReplaceNode, Rule, Valid, refuse_unless_plain_cast
from kvpatch.sites import HOT

from ._fi_mla_examples import BACKEND, BACKEND_ROUTED, HEADER, RT

MLA_CACHE_KEYWORDS = ("ckv_cache", "kpe_cache")  # run()'s caches, positions 2 and 3

# SGLang 0.5.23's decode shape: the output preallocated, return_lse under DCP.
DECODE_0523 = HEADER + '''
class FlashInferMLAAttnBackend:
    def forward_decode(self, q, k, v, layer, forward_batch, q_rope=None):
        decode_wrapper = self.forward_metadata.decode_wrapper
        q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)

        o = q_nope.new_empty(q_nope.shape)
        # for decode and dcp_world_size > 1, lse should be returned
        o = decode_wrapper.run(
            q_nope,
            q_rope,
            k_buffer[:, :, : layer.v_head_dim],
            k_buffer[:, :, layer.v_head_dim :],
            out=o,
            return_lse=self.dcp_enabled,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
'''
DECODE_0523_ROUTED = HEADER + RT + DECODE_0523[len(HEADER):].replace(
    "        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n",
    "        k_buffer = _kvpatch_rt.kv_for_mla_run(\n"
    "            self.token_to_kv_pool.get_key_buffer(layer.layer_id),\n"
    "            q.dtype,\n"
    "        )\n").replace(
    "        o = decode_wrapper.run(\n",
    "        o = _kvpatch_rt.mla_run(\n            decode_wrapper.run,\n")

# The paged prefill: the DCP branch's compact buffer or the pool cast reach one run().
PREFILL_DCP = HEADER + '''
class FlashInferMLAAttnBackend:
    def forward_extend(self, q, q_rope, layer, forward_batch):
        prefill_wrapper_paged = self.forward_metadata.prefill_wrapper
        if forward_batch.attn_dcp_metadata is not None:
            k_buf = forward_batch.attn_dcp_metadata.dcp_kv_buffer.to(q.dtype)
        else:
            k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        o = q.new_empty(q.shape)
        o = prefill_wrapper_paged.run(q, q_rope, k_buf[:, :, :512], k_buf[:, :, 512:], out=o)
        return o
'''


class FlashInferMlaRoute(Rule):
    ID = "KVP107"
    NAME = "flashinfer-mla-route"
    SUMMARY = "FlashInfer MLA run() on a full-pool cast -> runtime-routed run() (fused FP8 attention, native FP8 or gathered rows)"
    KIND = "cast"
    PRIORITY = 5  # before KVP101: a site both can rewrite is routed
    EMITS = ("kv_for_mla_run", "mla_run")  # the cast; the run() call
    NEEDS_ALL = "KVP102"  # every plan call tells the runtime its rows and indptr
    CHECKED_ON = ("sglang 3cc3d9b95 (2025-08-21)", "sglang 9d61205da (2025-10-22)", "sglang 83a18e687 (2026-05-23)",
                  "sglang 0203c60fd (2026-07-03)", "sglang 4ad990ba7 (2026-08-06)", "sglang 64d58454e (2026-08-07)",
                  "sglang 0.5.16", "sglang 0.5.20", "sglang 0.5.23")

    VALID = (
        Valid(
            HEADER + """
class B:
    def forward_decode(self, q_nope, q_rope, layer, forward_batch):
        w = self.forward_metadata.decode_wrapper
        k = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return w.run(q_nope, q_rope, k[:, :, :512], k[:, :, 512:], ckv_scale=1.0, kpe_scale=1.0)
""",
            why="no cast: the FP8 pool reaches the kernel as stored (fixed upstream)",
        ),
    )

    INVALID = (
        Invalid(HEADER + BACKEND, expected=HEADER + RT + BACKEND_ROUTED,
                status="hot", why="decode, one line: the cast hands the pool on, run() is routed"),
        Invalid(DECODE_0523, expected=DECODE_0523_ROUTED, status="hot",
                why="SGLang 0.5.23's decode: exploded run() with out= and return_lse= (the runtime keeps "
                    "run() where an lse is asked for)"),
        Invalid(
            PREFILL_DCP,
            expected=HEADER + RT + PREFILL_DCP[len(HEADER):].replace(
                "            k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n",
                "            k_buf = _kvpatch_rt.kv_for_mla_run(\n"
                "                self.token_to_kv_pool.get_key_buffer(layer.layer_id),\n"
                "                q.dtype,\n"
                "            )\n").replace(
                "o = prefill_wrapper_paged.run(q,", "o = _kvpatch_rt.mla_run(prefill_wrapper_paged.run, q,"),
            status="hot",
            why="the DCP branch's compact bf16 buffer reaches the same run(): the runtime passes a bf16 "
                "cache through untouched",
        ),
        Invalid(
            HEADER + '''
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        decode_wrapper = self.forward_metadata.decode_wrapper
        return decode_wrapper.run(q, q_rope, ckv_cache=k_buffer[:, :, :512], kpe_cache=k_buffer[:, :, 512:])
''',
            expected=HEADER + RT + '''
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        k_buffer = _kvpatch_rt.kv_for_mla_run(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            q.dtype,
        )
        decode_wrapper = self.forward_metadata.decode_wrapper
        return _kvpatch_rt.mla_run(decode_wrapper.run, q, q_rope, ckv_cache=k_buffer[:, :, :512], kpe_cache=k_buffer[:, :, 512:])
''',
            status="hot",
            why="the wrapper bound only after the cast (KVP101 cannot name it at the cast; a routed "
                "run() reads it where it is called), caches by keyword",
        ),
        Invalid(
            HEADER + """
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        w = self.forward_metadata.decode_wrapper
        if layer.is_cross_attention:
            kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        else:
            kv = self.token_to_kv_pool.get_value_buffer(layer.layer_id).to(q.dtype)
        return w.run(q, q_rope, kv[:, :, :512], kv[:, :, 512:])
""",
            expected=HEADER + RT + """
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        w = self.forward_metadata.decode_wrapper
        if layer.is_cross_attention:
            kv = _kvpatch_rt.kv_for_mla_run(
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                q.dtype,
            )
        else:
            kv = _kvpatch_rt.kv_for_mla_run(
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                q.dtype,
            )
        return _kvpatch_rt.mla_run(w.run, q, q_rope, kv[:, :, :512], kv[:, :, 512:])
""",
            status="hot",
            why="a cast in each arm of an if/else, one run(): the call is routed once",
        ),
        Invalid(
            HEADER + """
class B:
    def plan(self, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale, dt):
        self.wrappers[self.pick()].plan(q_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale, dt, dt)
""" + BACKEND[1:],
            status="unsupported",
            why="a plan call whose rows cannot be routed to the runtime (its wrapper expression would be "
                "evaluated twice): the runtime would not know the rows run() reads",
        ),
    )

    # -- recognise ----------------------------------------------------------
    def patched(self, call: cst.Call, ctx: UnitContext) -> Optional[Patched]:
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == self.EMITS[0] and len(call.args) == 2:
            return Patched(call, call.args[0].value, call.args[1].value,
                           "kvpatch's routed run() is in place (fused FP8 attention, native FP8 or gathered rows)")
        return None

    # -- decide -------------------------------------------------------------
    def decide(self, cand: CastCandidate, ctx: UnitContext) -> Optional[Decision]:
        if not ctx.file.module.uses_mla_wrapper:
            return None
        runs = _routable_runs(cand, ctx)
        if runs is None or refuse_unless_plain_cast(cand, ctx):
            return None  # KVP101 (or another rule) decides
        edits = [ReplaceNode(ctx.unit.qualname, cand.call,
                             cast_builder(cand, ctx, f"{RUNTIME_ALIAS}.{self.EMITS[0]}")), NeedRuntime()]
        edits += [ReplaceNode(ctx.unit.qualname, call, route_call_builder(f"{RUNTIME_ALIAS}.{self.EMITS[1]}"))
                  for call in runs]
        consumers = [c for c in cand.consumers if c.call is not None]
        return Decision(
            HOT,
            f"full-pool cast read only by {consumer_names(cand.consumers, ctx)}: the pool goes on as stored and "
            f"each run() is routed through the runtime (fused FP8 attention for a decode plan, native FP8 "
            f"where the plan selects it, else the planned rows cast and run() on them)",
            edits,
            other_values(consumers, cand.call, ctx),
        )


def _routable_runs(cand: CastCandidate, ctx: UnitContext) -> Optional[List[cst.Call]]:
    """The distinct run() calls the cast reaches, when every reader is a wrapper's run()
    taking its ckv or kpe cache from it (through slices and views only), each such call
    takes both caches from this cast and has no starred argument; else None."""
    calls: List[cst.Call] = []
    seen = {}
    for c in cand.consumers:
        if not is_mla_run(c) or ctx.in_nested_scope(c.call):
            return None
        if any(a.star for a in c.call.args) or not isinstance(c.call.func, cst.Attribute):
            return None
        if any(not routable_view(v) for v in c.views):
            return None
        which = c.keyword if c.keyword is not None else MLA_CACHE_KEYWORDS[c.arg_index - 2]
        seen.setdefault(id(c.call), set()).add(which)
        if all(x is not c.call for x in calls):
            calls.append(c.call)
    if not calls or any(seen[id(call)] != set(MLA_CACHE_KEYWORDS) for call in calls):
        return None
    # The data flow follows no value into a nested function: a closure reading the cast
    # would get the FP8 pool as stored. KVP101 casts for it.
    names = {n for c in cand.consumers for n in c.via}
    if any(isinstance(n, cst.Name) and n.value in names for scope in nested_scopes(ctx) for n in walk(scope)):
        return None
    return calls
