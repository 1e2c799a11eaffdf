"""KVP102 flashinfer-mla-plan-kv-dtype: tell the runtime the rows and plan the kv dtype the kernel reads.

A FlashInfer MLA `plan()` fixes the kernel's kv dtype. After KVP101 the kernel
reads either the gathered bf16 rows or the FP8 pool itself, so the plan's kv
dtype argument (positional 11, or `kv_data_type=`) becomes
`_kvpatch_rt.plan_kv_dtype(wrapper, q_dtype, kv_dtype, kv_cache_dtype, causal)`:
FP8 where the native kernel is selected, the original value otherwise. Only
that argument changes (the decode plans pass `self.data_type` as both q and kv
dtype: the attribute itself must stay). The model's KV-cache dtype is taken in
the class's `__init__` from `model_runner.kv_cache_dtype`.
Every such call also gives the kernel its rows, so its kv_indptr argument is
routed through `_kvpatch_rt.plan_rows(wrapper, kv_indptr)`: the runtime learns
how many indices the next `run()` reads from the call itself. That covers the
stock `wrapper.plan(...)` and SGLang's `fast_mla_decode_plan` and
`fast_mla_prefill_plan` (called with the wrapper first, or bound to it as
`wrapper.plan`), whose host-array plans leave the wrapper's own indptr buffer
stale. The plain functions ignore their dtypes: only the rows are routed.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst

from kvpatch.analysis.candidates import PlanCandidate
from kvpatch.rewrite.codegen import RUNTIME_ALIAS, argument_call_text, replace_arg_builder, wrap_arg_builder
from kvpatch.rewrite.initattr import keep_runner_attr
from kvpatch.analysis.match import UnitContext, attr_call, simple_expr
from kvpatch.names import KV_CACHE_DTYPE
from kvpatch.rule import Decision, Invalid, NeedRuntime, ReplaceNode, Rule, Valid
from kvpatch.sites import PLAN_PATCHED, PLAN_REWRITE, PLAN_UNSUPPORTED

from ._fi_mla_examples import BACKEND, BACKEND_ROUTED, HEADER, JIT_DECODE_PLAN, RT

KV_CACHE_ATTR = "_kvpatch_kv_cache_dtype"


class FlashInferMlaPlanKvDtype(Rule):
    ID = "KVP102"
    NAME = "flashinfer-mla-plan-kv-dtype"
    SUMMARY = "FlashInfer MLA plan(): kv dtype argument -> the runtime's choice (FP8 when native)"
    KIND = "plan"
    PRIORITY = 10
    PAIRS_WITH = ("KVP101", "KVP107")  # the gathered cast, or the routed run()
    EMITS = ("plan_kv_dtype", "plan_rows")  # the kv dtype argument; the kv_indptr argument
    CHECKED_ON = ("sglang 2e4babdb0 (2025-05-15)", "sglang 3cc3d9b95 (2025-08-21)",
                  "sglang eae59b337 (2025-11-14)", "sglang c5251a98a (2026-05-21)",
                  "sglang ea8f4e9f3 (2026-06-26)", "sglang 4ad990ba7 (2026-08-06)")

    VALID = (
        Valid(
            HEADER + JIT_DECODE_PLAN,
            why="a decode wrapper's JIT plan (16 positional arguments; SGLang b11008465 "
                "flashinfer_backend.py): not the MLA wrapper's plan(), not a plan call of this rule",
        ),
        Valid(
            HEADER + """
def replay(wrapper, qo, kvp, kvi, kvl, h, ckv, kpe, sm_scale, dt):
    fast_mla_decode_plan(wrapper, qo, kvp, kvi, kvl, h, ckv, kpe, 1, False, sm_scale, dt, dt)
""",
            why="no pool cast in this file: nothing needs the rows, so the plan stays as it is",
        ),
        Valid(
            """
class Updater:
    def call_begin_forward(self, wrapper, qo_indptr, kv_indptr, kv_indices, last_page_len):
        wrapper.plan(kv_indptr, kv_indices, last_page_len, 8, 8, 128, 1, q_data_type=self.q_data_type, kv_data_type=self.data_type)
""",
            why="a non-MLA FlashInfer decode plan (7 positional arguments, no MLA keywords)",
        ),
        Valid(
            HEADER + """
class FlashInferMLAIndicesUpdaterDecode:
    def __init__(self, model_runner, attn_backend):
        self.data_type = model_runner.kv_cache_dtype
        self.q_data_type = model_runner.dtype

    def call_begin_forward(self, wrapper, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale):
        wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale, self.q_data_type, self.data_type)


class FlashInferMLAAttnBackend:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return self.forward_metadata.decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])
""",
            why="before the May 2025 cast: no pool cast to rewrite, so the plans stay as they are",
        ),
    )

    INVALID = (
        Invalid(
            HEADER + """
class FlashInferMLAIndicesUpdaterDecode:
    def __init__(self, model_runner, attn_backend):
        self.data_type = model_runner.dtype
        self.attn_backend = attn_backend

    def call_begin_forward(self, wrapper, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale):
        wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, 128, 512, 64, 1, False, sm_scale, self.data_type, self.data_type)
""" + BACKEND,
            expected=HEADER + RT + """
class FlashInferMLAIndicesUpdaterDecode:
    def __init__(self, model_runner, attn_backend):
        self.data_type = model_runner.dtype
        self._kvpatch_kv_cache_dtype = getattr(model_runner, "kv_cache_dtype", None)
        self.attn_backend = attn_backend

    def call_begin_forward(self, wrapper, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale):
        wrapper.plan(q_indptr, _kvpatch_rt.plan_rows(wrapper, kv_indptr), kv_indices, kv_lens, 128, 512, 64, 1, False, sm_scale, self.data_type, _kvpatch_rt.plan_kv_dtype(wrapper, self.data_type, self.data_type, self._kvpatch_kv_cache_dtype, False))
""" + BACKEND_ROUTED,
            status="rewrite",
            why="positional decode plan: kv_indptr (argument 1) is routed, the kv dtype (argument 11) retargeted",
        ),
        Invalid(
            HEADER + '''
class FlashInferMLAIndicesUpdaterDecode:
    def __init__(self, model_runner: ModelRunner, attn_backend):
        self.data_type = model_runner.dtype
        self.page_size = model_runner.page_size

    def call_begin_forward(self, wrapper, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale):
        wrapper.plan(
            qo_indptr=q_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_len_arr=kv_lens,
            num_heads=self.num_local_heads,
            head_dim_ckv=self.kv_lora_rank,
            head_dim_kpe=self.qk_rope_head_dim,
            page_size=self.page_size,
            causal=False,
            sm_scale=sm_scale,
            q_data_type=self.data_type,
            kv_data_type=self.data_type,
        )
''' + BACKEND,
            expected=HEADER + RT + '''
class FlashInferMLAIndicesUpdaterDecode:
    def __init__(self, model_runner: ModelRunner, attn_backend):
        self.data_type = model_runner.dtype
        self._kvpatch_kv_cache_dtype = getattr(model_runner, "kv_cache_dtype", None)
        self.page_size = model_runner.page_size

    def call_begin_forward(self, wrapper, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale):
        wrapper.plan(
            qo_indptr=q_indptr,
            kv_indptr=_kvpatch_rt.plan_rows(wrapper, kv_indptr),
            kv_indices=kv_indices,
            kv_len_arr=kv_lens,
            num_heads=self.num_local_heads,
            head_dim_ckv=self.kv_lora_rank,
            head_dim_kpe=self.qk_rope_head_dim,
            page_size=self.page_size,
            causal=False,
            sm_scale=sm_scale,
            q_data_type=self.data_type,
            kv_data_type=_kvpatch_rt.plan_kv_dtype(
                wrapper,
                self.data_type,
                self.data_type,
                self._kvpatch_kv_cache_dtype,
                False,
            ),
        )
''' + BACKEND_ROUTED,
            status='rewrite',
            why='keyword plan (v0.5.1 shape): kv_indptr= routed, kv_data_type= retargeted',
        ),
        Invalid(
            HEADER + '''
class FlashInferMLAIndicesUpdaterPrefill:
    def __init__(self, runner: "ModelRunner", attn_backend):
        self.data_type = runner.kv_cache_dtype
        self.q_data_type = runner.dtype

    def call_begin_forward(self, wrapper_paged, qo_indptr, kv_indptr, kv_indices, kv_len_arr, sm_scale):
        wrapper_paged.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_len_arr,
            self.num_local_heads,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            1,
            True,
            sm_scale,
            self.q_data_type,
            self.data_type,
        )
''' + BACKEND,
            expected=HEADER + RT + '''
class FlashInferMLAIndicesUpdaterPrefill:
    def __init__(self, runner: "ModelRunner", attn_backend):
        self.data_type = runner.kv_cache_dtype
        self.q_data_type = runner.dtype
        self._kvpatch_kv_cache_dtype = getattr(runner, "kv_cache_dtype", None)

    def call_begin_forward(self, wrapper_paged, qo_indptr, kv_indptr, kv_indices, kv_len_arr, sm_scale):
        wrapper_paged.plan(
            qo_indptr,
            _kvpatch_rt.plan_rows(wrapper_paged, kv_indptr),
            kv_indices,
            kv_len_arr,
            self.num_local_heads,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            1,
            True,
            sm_scale,
            self.q_data_type,
            _kvpatch_rt.plan_kv_dtype(
                wrapper_paged,
                self.q_data_type,
                self.data_type,
                self._kvpatch_kv_cache_dtype,
                True,
            ),
        )
''' + BACKEND_ROUTED,
            status='rewrite',
            why='prefill plan, one argument per line, an annotated runner parameter',
        ),
        Invalid(
            HEADER + '''
class Updater:
    def __init__(self, dtype):
        self.data_type = dtype

    def call_begin_forward(self, wrapper, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale):
        wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale, self.data_type, self.data_type)
''' + BACKEND,
            expected=HEADER + RT + '''
class Updater:
    def __init__(self, dtype):
        self.data_type = dtype

    def call_begin_forward(self, wrapper, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale):
        wrapper.plan(q_indptr, _kvpatch_rt.plan_rows(wrapper, kv_indptr), kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale, self.data_type, self.data_type)
''' + BACKEND_ROUTED,
            status='rewrite',
            why='no model_runner in __init__: the KV-cache dtype is not reachable, so only the rows are routed '
                '(gathered cast, no native FP8)',
        ),
        Invalid(
            HEADER + '''
class FlashInferMLAIndicesUpdaterPrefill:
    def call_begin_forward(self, wrapper_paged, fast_verify_plan_kwargs, kv_indices, sm_scale):
        fast_mla_decode_plan(
            wrapper_paged,
            fast_verify_plan_kwargs["qo_indptr_cpu"],
            fast_verify_plan_kwargs["kv_indptr_cpu"],
            kv_indices,
            fast_verify_plan_kwargs["kv_len_arr_cpu"],
            16, 512, 64, 1, True, sm_scale, self.q_data_type, self.data_type,
        )
''' + BACKEND,
            expected=HEADER + RT + '''
class FlashInferMLAIndicesUpdaterPrefill:
    def call_begin_forward(self, wrapper_paged, fast_verify_plan_kwargs, kv_indices, sm_scale):
        fast_mla_decode_plan(
            wrapper_paged,
            fast_verify_plan_kwargs["qo_indptr_cpu"],
            _kvpatch_rt.plan_rows(wrapper_paged, fast_verify_plan_kwargs["kv_indptr_cpu"]),
            kv_indices,
            fast_verify_plan_kwargs["kv_len_arr_cpu"],
            16, 512, 64, 1, True, sm_scale, self.q_data_type, self.data_type,
        )
''' + BACKEND_ROUTED,
            status='rewrite',
            why="SGLang 0.5.23's DFLASH verify replay plans with the plain function and host arrays; the wrapper's "
                "own indptr buffer is never refreshed, so the rows must come from this call",
        ),
        Invalid(
            HEADER + '''
class Updater:
    def replay(self, wrapper, qo, kvp, kvi, kvl, sm_scale):
        fast_mla_prefill_plan(wrapper, qo, kv_indptr=kvp, kv_indices=kvi, kv_len_arr_cpu=kvl, num_heads=16,
                              head_dim_ckv=512, head_dim_kpe=64, page_size=1, causal=True, sm_scale=sm_scale,
                              q_data_type=self.dt, kv_data_type=self.dt)
        wrapper.plan(qo, _kvpatch_rt.plan_rows(wrapper, kvp), kvi, kvl, 16, 512, 64, 1, True, sm_scale, self.dt, _kvpatch_rt.plan_kv_dtype(wrapper, self.dt, self.dt, self._kvpatch_kv_cache_dtype, True))
''' + BACKEND,
            expected=HEADER + RT + '''
class Updater:
    def replay(self, wrapper, qo, kvp, kvi, kvl, sm_scale):
        fast_mla_prefill_plan(wrapper, qo, kv_indptr=_kvpatch_rt.plan_rows(wrapper, kvp), kv_indices=kvi, kv_len_arr_cpu=kvl, num_heads=16,
                              head_dim_ckv=512, head_dim_kpe=64, page_size=1, causal=True, sm_scale=sm_scale,
                              q_data_type=self.dt, kv_data_type=self.dt)
        wrapper.plan(qo, _kvpatch_rt.plan_rows(wrapper, kvp), kvi, kvl, 16, 512, 64, 1, True, sm_scale, self.dt, _kvpatch_rt.plan_kv_dtype(wrapper, self.dt, self.dt, self._kvpatch_kv_cache_dtype, True))
''' + BACKEND_ROUTED,
            status='rewrite',
            why="fast_mla_prefill_plan with a keyword kv_indptr; the stock plan() next to it is already patched",
        ),
        Invalid(
            HEADER + '''
class FlashInferMLAIndicesUpdaterDecode:
    def call_begin_forward(self, wrapper, kv_indices, sm_scale, **fast_decode_kwargs):
        wrapper.plan(
            qo_indptr_cpu=fast_decode_kwargs["qo_indptr_cpu"],
            kv_indptr_cpu=fast_decode_kwargs["kv_indptr_cpu"],
            kv_indices=kv_indices,
            kv_len_arr_cpu=fast_decode_kwargs["kv_len_arr_cpu"],
            num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=1, causal=False,
            sm_scale=sm_scale, q_data_type=self.dt, kv_data_type=self.dt,
        )
''' + BACKEND,
            expected=HEADER + RT + '''
class FlashInferMLAIndicesUpdaterDecode:
    def call_begin_forward(self, wrapper, kv_indices, sm_scale, **fast_decode_kwargs):
        wrapper.plan(
            qo_indptr_cpu=fast_decode_kwargs["qo_indptr_cpu"],
            kv_indptr_cpu=_kvpatch_rt.plan_rows(wrapper, fast_decode_kwargs["kv_indptr_cpu"]),
            kv_indices=kv_indices,
            kv_len_arr_cpu=fast_decode_kwargs["kv_len_arr_cpu"],
            num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=1, causal=False,
            sm_scale=sm_scale, q_data_type=self.dt, kv_data_type=self.dt,
        )
''' + BACKEND_ROUTED,
            status='rewrite',
            why="a replay plan through `wrapper.plan = partial(fast_mla_decode_plan, wrapper)`, with its "
                "host-array keywords (SGLang 2025-08): kv_indptr_cpu= is the kv_indptr",
        ),
    )

    def decide(self, cand: PlanCandidate, ctx: UnitContext) -> Optional[Decision]:
        dtype_fn, rows_fn = self.EMITS
        indptr, wrapper = cand.arg("kv_indptr"), cand.wrapper
        if indptr is None:
            return Decision(PLAN_UNSUPPORTED, "no kv_indptr argument: the rows this plan gives the kernel "
                                              "cannot be routed to the runtime")
        if wrapper is None or not (simple_expr(wrapper) or isinstance(wrapper, cst.Name)):
            code = ctx.code(wrapper) if wrapper is not None else "?"
            return Decision(PLAN_UNSUPPORTED, f"the wrapper `{code}` is not a plain name or attribute: it "
                                              f"would be evaluated twice")
        routed = attr_call(indptr.value, {rows_fn})
        route = [ReplaceNode(ctx.unit.qualname, indptr, wrap_arg_builder(f"{RUNTIME_ALIAS}.{rows_fn}",
                                                                          [ctx.code(wrapper)])), NeedRuntime()]
        if cand.form == "function":
            fn = ctx.code(cand.call.func)
            if routed:
                return Decision(PLAN_PATCHED, f"`{fn}` routes its rows through the kvpatch runtime")
            return Decision(PLAN_REWRITE, f"`{fn}` gives the kernel its rows (its dtypes are ignored): "
                                          f"kv_indptr routed through the runtime", route)
        kv, q, causal = cand.arg("kv_data_type"), cand.arg("q_data_type"), cand.arg("causal")
        retargeted = kv is not None and attr_call(kv.value, {dtype_fn})
        if retargeted and routed:
            return Decision(PLAN_PATCHED, "rows routed and kv dtype chosen by the kvpatch runtime")
        if not ctx.file.module.uses_mla_wrapper:
            return Decision(PLAN_UNSUPPORTED, "no BatchMLAPagedAttentionWrapper in this file: not known to be an "
                                              "MLA wrapper")
        edits = [] if routed else list(route)
        if retargeted:
            return Decision(PLAN_REWRITE, "kv dtype already chosen by the runtime: kv_indptr routed through it",
                            edits)
        retarget = self._retarget(cand, ctx, kv, q, causal)
        if isinstance(retarget, str):
            # Rows alone keep the gathered cast exact; only the native FP8 path is lost.
            return Decision(PLAN_REWRITE, f"kv_indptr routed through the runtime; kv dtype left as is: {retarget} "
                                          f"(gathered cast only, no native FP8)", edits)
        return Decision(
            PLAN_REWRITE,
            f"kv_indptr routed through the runtime; kv dtype fixed to `{ctx.code(kv.value)}`: retargeted to the "
            f"runtime's choice (float8_e4m3fn where the native FP8 kernel is selected, else unchanged)",
            edits + retarget + [NeedRuntime()],
        )

    def _retarget(self, cand: PlanCandidate, ctx: UnitContext, kv, q, causal):
        """The edits that hand the kv dtype argument to the runtime, or why not."""
        if kv is None or q is None or causal is None:
            missing = [n for n, a in (("kv_data_type", kv), ("q_data_type", q), ("causal", causal)) if a is None]
            return f"no {', '.join(missing)} argument"
        for what, node in (("q dtype", q.value), ("kv dtype", kv.value), ("causal", causal.value)):
            if not (simple_expr(node) or isinstance(node, cst.Name)):
                return f"the {what} argument `{ctx.code(node)}` is not a plain name or attribute"
        insert = keep_runner_attr(ctx, KV_CACHE_ATTR, KV_CACHE_DTYPE, "the model's KV-cache dtype",
                                  (q.value, kv.value))
        if isinstance(insert, str):
            return insert
        dtype_fn = self.EMITS[0]
        args = [ctx.code(cand.receiver), ctx.code(q.value), ctx.code(kv.value),
                f"{ctx.unit.first_param}.{KV_CACHE_ATTR}", ctx.code(causal.value)]
        text = argument_call_text(f"{RUNTIME_ALIAS}.{dtype_fn}", args, kv, ctx)
        return [ReplaceNode(ctx.unit.qualname, kv, replace_arg_builder(text, f"{RUNTIME_ALIAS}.{dtype_fn}")), insert]
