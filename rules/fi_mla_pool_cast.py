"""KVP101 flashinfer-mla-pool-cast: page-gathered cast for FlashInfer MLA.

`buf = pool.get_key_buffer(layer_id).to(q.dtype)` feeding a
`BatchMLAPagedAttentionWrapper.run()` casts every slot of the layer's pool,
though the kernel reads only the planned `kv_indices`. The cast becomes
`_kvpatch_rt.kv_for_kernel(pool, wrapper, q.dtype)`, which casts just
those rows (or hands the FP8 pool straight to a wrapper planned for FP8),
and the `run()` gets `**_kvpatch_rt.run_kwargs(wrapper)`, the FP8 scales
FlashInfer needs exactly when it was planned for FP8. How many rows the
kernel reads comes from the plan calls, which KVP102 routes through the
runtime: a file with a plan call KVP102 cannot route keeps its cast.
"""

from __future__ import annotations

from typing import List, Optional

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.analysis.classify import other_values
from kvpatch.rewrite.codegen import RUNTIME_ALIAS, cast_builder, star_kwargs_builder
from kvpatch.analysis.match import UnitContext, consumer_names, is_mla_run
from kvpatch.analysis.stable import differs_at
from kvpatch.rule import Decision, Invalid, NeedRuntime, Patched, ReplaceNode, Rule, Valid, emitted_call, refuse_unless_plain_cast
from kvpatch.sites import HOT, UNSUPPORTED

from ._fi_mla_examples import HEADER, RT


class FlashInferMlaPoolCast(Rule):
    ID = "KVP101"
    NAME = "flashinfer-mla-pool-cast"
    SUMMARY = "FlashInfer MLA full-pool KV cast -> page-gathered cast (or native FP8)"
    KIND = "cast"
    PRIORITY = 10
    EMITS = ("kv_for_kernel", "run_kwargs")  # the cast; the run() of an FP8 wrapper
    NEEDS_ALL = "KVP102"  # every plan call tells the runtime its rows
    CHECKED_ON = ("sglang 2e4babdb0 (2025-05-15)", "sglang 3cc3d9b95 (2025-08-21)",
                  "sglang eae59b337 (2025-11-14)", "sglang c5251a98a (2026-05-21)",
                  "sglang ea8f4e9f3 (2026-06-26)", "sglang 4ad990ba7 (2026-08-06)")

    VALID = (
        Valid(
            HEADER + """
class B:
    def forward_decode(self, q_nope, q_rope, layer, forward_batch):
        w = self.forward_metadata.decode_wrapper
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        rows = kv[forward_batch.kv_indices].to(q_nope.dtype)
        return w.run(q_nope, q_rope, rows[..., :512], rows[..., 512:])
""",
            why="already gathered before the cast",
        ),
        Valid(
            HEADER + """
class B:
    def forward_decode(self, q_nope, q_rope, layer, forward_batch):
        w = self.forward_metadata.decode_wrapper
        k = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return w.run(q_nope, q_rope, k[:, :, :512], k[:, :, 512:], ckv_scale=1.0, kpe_scale=1.0)
""",
            why="fixed upstream: the FP8 pool goes to the kernel without a cast",
        ),
        Valid(
            HEADER + """
class B:
    def forward_extend(self, q, q_rope, layer, forward_batch):
        prefill_wrapper_paged = self.forward_metadata.prefill_wrapper
        # k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        k_buf = forward_batch.attn_dcp_metadata.dcp_kv_buffer.to(q.dtype)
        return prefill_wrapper_paged.run(q, q_rope, k_buf[:, :, :512], k_buf[:, :, 512:])
""",
            why="the DCP branch casts a compact gathered buffer, and the pool cast is commented out",
        ),
        Valid(
            HEADER + """
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        q = q.to(k_buffer.dtype)
        q_rope = q_rope.to(k_buffer.dtype)
        kv = k_buffer.to(q.dtype)
        return decode_wrapper.run(q, q_rope, kv[:, :, :512], kv[:, :, 512:])
""",
            why="q was cast to the pool dtype on every path: the pool cast is a no-op",
        ),
    )

    INVALID = (
        Invalid(
            HEADER + """
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        o = decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:], out=None)
        return o
""",
            expected=HEADER + RT + """
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = _kvpatch_rt.kv_for_kernel(
            forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id),
            decode_wrapper,
            q.dtype,
        )
        o = decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:], out=None, **_kvpatch_rt.run_kwargs(decode_wrapper))
        return o
""",
            why="decode, one line, forward_batch receiver (2025)",
            preempted_by="KVP107",
        ),
        Invalid(
            HEADER + '''
class FlashInferMLAAttnBackend:
    def forward_decode(self, q, k, v, layer, forward_batch, q_rope=None):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(
            q.dtype  # fp8 -> bf16
        )
        return decode_wrapper.run(
            q,
            q_rope,
            k_buffer[:, :, : layer.v_head_dim],
            k_buffer[:, :, layer.v_head_dim :],
        )
''',
            expected=HEADER + RT + '''
class FlashInferMLAAttnBackend:
    def forward_decode(self, q, k, v, layer, forward_batch, q_rope=None):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = _kvpatch_rt.kv_for_kernel(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            decode_wrapper,
            q.dtype,  # fp8 -> bf16
        )
        return decode_wrapper.run(
            q,
            q_rope,
            k_buffer[:, :, : layer.v_head_dim],
            k_buffer[:, :, layer.v_head_dim :],
            **_kvpatch_rt.run_kwargs(decode_wrapper),
        )
''',
            status='hot',
            why='q.dtype wrapped onto its own line with a comment; exploded run() call',
            preempted_by="KVP107",
        ),
        Invalid(
            HEADER + '''
class B:
    def forward_decode(self, q_nope, q_rope, layer, forward_batch):
        wrapper = self.forward_metadata.decode_wrapper
        kv = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if kv.dtype != q_nope.dtype:
            kv = kv.to(q_nope.dtype)
        return wrapper.run(q_nope, q_rope, kv[..., :512], kv[..., 512:])
''',
            expected=HEADER + RT + '''
class B:
    def forward_decode(self, q_nope, q_rope, layer, forward_batch):
        wrapper = self.forward_metadata.decode_wrapper
        kv = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if kv.dtype != q_nope.dtype:
            kv = _kvpatch_rt.kv_for_kernel(kv, wrapper, q_nope.dtype)
        return wrapper.run(q_nope, q_rope, kv[..., :512], kv[..., 512:], **_kvpatch_rt.run_kwargs(wrapper))
''',
            status='hot',
            why='two-statement form: the buffer is bound first and cast later under a guard',
            preempted_by="KVP107",
        ),
        Invalid(
            HEADER + '''
class B:
    def forward_extend(self, q, q_rope, layer, forward_batch):
        prefill_wrapper_paged = self.forward_metadata.prefill_wrapper
        if layer.is_cross_attention:
            k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        else:
            k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return prefill_wrapper_paged.run(q, q_rope, k_buf[:, :, :512], k_buf[:, :, 512:])
''',
            expected=HEADER + RT + '''
class B:
    def forward_extend(self, q, q_rope, layer, forward_batch):
        prefill_wrapper_paged = self.forward_metadata.prefill_wrapper
        if layer.is_cross_attention:
            k_buf = _kvpatch_rt.kv_for_kernel(
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                prefill_wrapper_paged,
                q.dtype,
            )
        else:
            k_buf = _kvpatch_rt.kv_for_kernel(
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                prefill_wrapper_paged,
                q.dtype,
            )
        return prefill_wrapper_paged.run(q, q_rope, k_buf[:, :, :512], k_buf[:, :, 512:], **_kvpatch_rt.run_kwargs(prefill_wrapper_paged))
''',
            status='hot',
            why='the same cast in both arms of an if/else',
            preempted_by="KVP107",
        ),
        Invalid(
            HEADER + '''
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        w = self.forward_metadata.decode_wrapper
        return w.run(
            q,
            q_rope,
            ckv_cache=get_token_to_kv_pool().get_key_buffer(layer.layer_id).to(q.dtype)[:, :, :512],
            kpe_cache=get_token_to_kv_pool().get_key_buffer(layer.layer_id).to(q.dtype)[:, :, 512:],
        )
''',
            expected=HEADER + RT + '''
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        w = self.forward_metadata.decode_wrapper
        return w.run(
            q,
            q_rope,
            ckv_cache=_kvpatch_rt.kv_for_kernel(
                get_token_to_kv_pool().get_key_buffer(layer.layer_id),
                w,
                q.dtype,
            )[:, :, :512],
            kpe_cache=_kvpatch_rt.kv_for_kernel(
                get_token_to_kv_pool().get_key_buffer(layer.layer_id),
                w,
                q.dtype,
            )[:, :, 512:],
            **_kvpatch_rt.run_kwargs(w),
        )
''',
            status='hot',
            why='inline in the run() call, get_token_to_kv_pool() receiver, keyword ckv/kpe arguments',
        ),
        Invalid(
            HEADER + '''
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch, token_to_kv_pool):
        decode_wrapper = self.forward_metadata.decode_wrapper
        pool = token_to_kv_pool
        dtype = q.dtype
        k_buffer = pool.get_value_buffer(layer.layer_id).to(dtype)
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])
''',
            expected=HEADER + RT + '''
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch, token_to_kv_pool):
        decode_wrapper = self.forward_metadata.decode_wrapper
        pool = token_to_kv_pool
        dtype = q.dtype
        k_buffer = _kvpatch_rt.kv_for_kernel(
            pool.get_value_buffer(layer.layer_id),
            decode_wrapper,
            dtype,
        )
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:], **_kvpatch_rt.run_kwargs(decode_wrapper))
''',
            status='hot',
            why='a parameter aliased to a local, get_value_buffer, a local dtype alias',
            preempted_by="KVP107",
        ),
        Invalid(
            HEADER + '''
class B:
    def __init__(self, model_runner):
        self.kv_indptr = model_runner.kv_indptr
        self.data_type = model_runner.dtype

    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(self.data_type)
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])
''',
            expected=HEADER + RT + '''
class B:
    def __init__(self, model_runner):
        self.kv_indptr = model_runner.kv_indptr
        self.data_type = model_runner.dtype

    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = _kvpatch_rt.kv_for_kernel(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            decode_wrapper,
            self.data_type,
        )
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:], **_kvpatch_rt.run_kwargs(decode_wrapper))
''',
            status='hot',
            why="self.data_type as the dtype; the backend's self.kv_indptr is not passed: the plan calls give the rows",
            preempted_by="KVP107",
        ),
        Invalid(
            HEADER + '''
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        decode_wrapper = self.forward_metadata.decode_wrapper
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])
''',
            status='unsupported',
            why='the wrapper is bound only after the cast',
            preempted_by="KVP107",
        ),
        Invalid(
            HEADER + '''
class B:
    def plan(self, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale, dt):
        self.wrappers[self.pick()].plan(q_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale, dt, dt)

    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], self.kpe_cache)
''',
            status='unsupported',
            why="a plan call whose rows cannot be routed to the runtime (its wrapper expression would be "
                "evaluated twice): a gathered cast could miss the rows that plan gives the kernel",
        ),
        Invalid(
            HEADER + '''
class B:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        self.debug_dump(k_buffer)
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])
''',
            status='unsupported',
            why="the cast result also reaches a call that is not the wrapper's run()",
        ),
    )

    def patched(self, call: cst.Call, ctx: UnitContext) -> Optional[Patched]:
        # what decide() emits: <alias>.kv_for_kernel(pool, wrapper, dtype, ...)
        return emitted_call(call, self.EMITS[0], dtype_arg=2)

    def decide(self, cand: CastCandidate, ctx: UnitContext) -> Optional[Decision]:
        runs = [c for c in cand.consumers if is_mla_run(c)]
        if not runs or not ctx.file.module.uses_mla_wrapper:
            return None  # not a FlashInfer MLA consumer: not this rule's
        others = [c for c in cand.consumers if not is_mla_run(c)]
        if others:
            return Decision(UNSUPPORTED, f"the cast also reaches {consumer_names(others, ctx)}; only a "
                                         f"wrapper's run() is known to read just the planned rows")
        refused = refuse_unless_plain_cast(cand, ctx)
        if refused:
            return refused
        wrappers = {ctx.code(c.call.func.value) for c in runs}
        if len(wrappers) != 1:
            return Decision(UNSUPPORTED, f"the cast feeds several wrappers ({', '.join(sorted(wrappers))})")
        w_node = runs[0].call.func.value
        problem = self._wrapper_not_ready(w_node, runs, cand, ctx)
        if problem:
            return Decision(UNSUPPORTED, problem)

        w_code = ctx.code(w_node)
        edits: List = [ReplaceNode(ctx.unit.qualname, cand.call, cast_builder(cand, ctx, f"{RUNTIME_ALIAS}.{self.EMITS[0]}", [w_code])),
                       NeedRuntime()]
        kw_value = f"{RUNTIME_ALIAS}.{self.EMITS[1]}({w_code})"
        for c in runs:
            edits.append(ReplaceNode(ctx.unit.qualname, c.call,
                                     star_kwargs_builder(kw_value, f"{RUNTIME_ALIAS}.{self.EMITS[1]}")))
        # Other buffers reaching the same run() (e.g. the DCP branch) are kept as they are.
        notes = other_values(runs, cand.call, ctx)
        return Decision(
            HOT,
            f"full-pool cast; `{w_code}.run()` reads only the planned kv_indices rows: rewritten to a "
            f"page-gathered cast (native FP8 where the plan selects it)",
            edits,
            notes,
        )

    # -- checks ----------------------------------------------------------
    @staticmethod
    def _wrapper_not_ready(w_node, runs, cand: CastCandidate, ctx: UnitContext) -> str:
        """The wrapper expression must mean the same at the cast as at run()."""
        problem = differs_at(ctx, w_node, cand.call, f"`{ctx.code(w_node)}.run()`")
        return problem.replace(f"`{ctx.code(w_node)}` is bound after", f"the wrapper `{ctx.code(w_node)}` is bound after")
