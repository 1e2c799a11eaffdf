"""One loaded module (original or patched) with its backend, built without __init__."""

from __future__ import annotations

import inspect
import traceback
import types
from typing import Callable, Dict, Optional

import torch

from . import fakes
from .fakes import DECODE, EXTEND, Mode
from .targets import BACKEND_CLASS, DECODE_UPDATER, PREFILL_UPDATER, qualname_at, qualname_map
from .world import FP8, HEAD_DIM, KV_LORA, Q_DTYPE, QK_NOPE, ROPE, SM_SCALE, Batch, HarnessError, World

WRAPPER_NAME = "BatchMLAPagedAttentionWrapper"
DECODE_SITE = f"{BACKEND_CLASS}.forward_decode"
PREFILL_SITE = f"{BACKEND_CLASS}.forward_extend"


class ForwardBatch(types.SimpleNamespace):
    """Fields not set read as None (SGLang's ForwardBatch defaults most to None)."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return None


def call_bound(fn: Callable, values: Dict, extra: Optional[Dict] = None, what: str = ""):
    """Call fn with the arguments its signature names, taken from ``values``."""
    kwargs = {}
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind is p.VAR_KEYWORD:
            kwargs.update(extra or {})
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif name in values:
            kwargs[name] = values[name]
        elif p.default is p.empty:
            raise HarnessError(f"{what}: no value for its parameter {name!r}")
    return fn(**kwargs)


def _instrumented(cls, side):
    """cls with plan() and run() recording, in the instance's ``_kvverify``, the
    planned kv dtype and site and the dtype and storage run() reads."""

    def record(w):
        return w.__dict__.setdefault("_kvverify", {})

    def plan(self, *a, **k):
        rec = record(self)
        rec["plan_kv"] = k.get("kv_data_type", a[11] if len(a) > 11 else None)
        rec["plan_site"] = side.caller_site()
        return cls.plan(self, *a, **k)

    def run(self, *a, **k):
        rec = record(self)
        ckv = k.get("ckv_cache", a[2] if len(a) > 2 else None)
        if ckv is not None:
            rec["run_kv_dtype"], rec["run_kv_ptr"] = ckv.dtype, _storage_ptr(ckv)
        rec["run_site"] = side.caller_site()
        return cls.run(self, *a, **k)

    return type(cls.__name__, (cls,), {"plan": plan, "run": run, "__module__": __name__})


def _storage_ptr(t) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return None


class Side:
    """A module (original or patched), its backend and updaters, built without __init__."""

    def __init__(self, name: str, module, filename: str, source: str, world: World,
                 rel: str):
        self.name, self.module, self.filename, self.world, self.rel = (
            name, module, filename, world, rel)
        self.source, self.qmap = source, qualname_map(source)
        dev = world.device
        for cls in (BACKEND_CLASS, DECODE_UPDATER, PREFILL_UPDATER):
            if not isinstance(getattr(module, cls, None), type):
                raise HarnessError(f"{rel}: {name} module defines no class {cls}")
        wrapper_cls = getattr(module, WRAPPER_NAME, None)
        if not isinstance(wrapper_cls, type):
            raise HarnessError(f"{rel}: {name} module did not import {WRAPPER_NAME}")
        # Every wrapper the module builds, the harness's and the backend's own
        # (graph capture), names its plan site and records what run() receives.
        self.Wrapper = _instrumented(wrapper_cls, self)
        setattr(module, WRAPPER_NAME, self.Wrapper)
        self.translator = fakes.Translator(world.req_to_token, world.v2p)
        self.kv_plan = fakes.KVLocPlan()
        ws_bytes = 384 * 1024 * 1024 if dev.type == "cuda" else 1024
        self.workspace = torch.empty((ws_bytes,), dtype=torch.uint8, device=dev)
        max_bs = world.max_reqs
        b = getattr(module, BACKEND_CLASS).__new__(getattr(module, BACKEND_CLASS))
        self.backend = b
        b.__dict__.update(
            device=dev, max_context_len=world.max_ctx, token_to_kv_pool=world.pool,
            req_to_token_pool=types.SimpleNamespace(req_to_token=world.req_to_token,
                                                    size=max_bs),
            page_size=1, skip_prefill=False, enable_chunk_kv=False, fmha_backend="auto",
            workspace_buffer=self.workspace,
            kv_indptr=torch.zeros((max_bs + 1,), dtype=torch.int32, device=dev),
            qo_indptr=torch.zeros((max_bs + 1,), dtype=torch.int32, device=dev),
            q_indptr_decode=torch.arange(0, max_bs + 1, dtype=torch.int32, device=dev),
            kv_indices=torch.empty((world.slots,), dtype=torch.int32, device=dev),
            prefill_wrapper_ragged=None, mha_chunk_kv_cache=None, forward_metadata=None,
            decode_cuda_graph_metadata={}, prefill_cuda_graph_metadata={},
            data_type=Q_DTYPE, q_data_type=Q_DTYPE, kv_cache_dtype=FP8,
            _kvpatch_kv_cache_dtype=FP8, kv_index_translator=self.translator,
            # 0.5.2x: pinned host buffers of the sync-free verify / draft-extend plans
            fast_plan_qo_indptr_cpu=torch.zeros((max_bs + 1,), dtype=torch.int32),
            fast_plan_kv_indptr_cpu=torch.zeros((max_bs + 1,), dtype=torch.int32),
            fast_plan_kv_len_arr_cpu=torch.zeros((max_bs,), dtype=torch.int32),
        )
        b.decode_wrapper = self.new_wrapper()
        b.prefill_wrapper_paged = self.new_wrapper()
        b.prefill_wrapper_verify = self.new_wrapper()
        self.dec = self._updater(DECODE_UPDATER)
        self.pre = self._updater(PREFILL_UPDATER)
        b.indices_updater_decode, b.indices_updater_prefill = self.dec, self.pre

    def _updater(self, cls_name):
        b = self.backend
        cls = getattr(self.module, cls_name)
        u = cls.__new__(cls)
        u.__dict__.update(
            num_local_heads=16, kv_lora_rank=KV_LORA, qk_nope_head_dim=QK_NOPE,
            qk_rope_head_dim=ROPE, v_head_dim=KV_LORA, scaling=SM_SCALE, data_type=Q_DTYPE,
            q_data_type=Q_DTYPE, attn_backend=b, kv_indptr=b.kv_indptr, qo_indptr=b.qo_indptr,
            q_indptr=b.q_indptr_decode, kv_indices=b.kv_indices,
            req_to_token=self.world.req_to_token, page_size=1, prefill_wrapper_ragged=None,
            decode_wrapper=b.decode_wrapper, _translate_kv_loc_dense=None,
            # set by the patched __init__, which is bypassed here
            _kvpatch_kv_cache_dtype=FP8,
        )
        return u

    # -- wrappers, instrumented to name plan sites and see what run() receives --

    def new_wrapper(self, **kw):
        return self.Wrapper(self.workspace, backend="auto", **kw)

    def site_of(self, frames) -> str:
        """'file:line (Class.method)' of the innermost frame in this module's file."""
        hit = None
        for fname, lineno in frames:
            if fname == self.filename:
                hit = lineno
        if hit is None:
            return ""
        return f"{self.rel}:{hit} ({qualname_at(self.qmap, hit)})"

    def caller_site(self) -> str:
        return self.site_of((f.filename, f.lineno) for f in traceback.extract_stack())

    # -- the calls under test ---------------------------------------------------

    def heads(self, h):
        self.dec.num_local_heads = self.pre.num_local_heads = h

    def layer(self, h):
        return types.SimpleNamespace(
            layer_id=0, tp_q_head_num=h, tp_k_head_num=1, tp_v_head_num=1,
            head_dim=HEAD_DIM, qk_head_dim=HEAD_DIM, v_head_dim=KV_LORA, scaling=SM_SCALE,
            logit_cap=0.0)

    def forward_batch(self, batch: Batch, kind: str, seq_dtype=torch.int64, spec_info=None,
                      seq_lens=None, seq_lens_cpu=None):
        """SGLang's ForwardBatch for ``batch`` in forward mode ``kind``; ``seq_lens``
        (and its host copy) default to the batch's full lengths."""
        d = self.world.device
        seq = torch.tensor(batch.seq_lens if seq_lens is None else seq_lens, dtype=seq_dtype,
                           device=d)
        nq = batch.q_nope.shape[0]
        return ForwardBatch(
            forward_mode=Mode(kind), batch_size=len(batch.seq_lens),
            req_pool_indices=batch.req_pool_indices, seq_lens=seq,
            seq_lens_cpu=seq.to("cpu", copy=True) if seq_lens_cpu is None else torch.tensor(
                seq_lens_cpu, dtype=seq_dtype),
            seq_lens_sum=int(seq.sum()),
            extend_prefix_lens=torch.tensor(batch.prefix, dtype=torch.int32, device=d),
            extend_prefix_lens_cpu=list(batch.prefix),
            extend_seq_lens_cpu=batch.extend, out_cache_loc=torch.zeros(
                (nq,), dtype=torch.int64, device=d),
            positions=torch.zeros((nq,), dtype=torch.int64, device=d),
            token_to_kv_pool=self.world.pool, attn_dcp_metadata=None,
            attn_attend_prefix_cache=None, mha_return_lse=False, spec_info=spec_info,
            kv_loc_plan=self.kv_plan)

    def plan_decode(self, wrapper, batch: Batch, fb, replay_kwargs=None):
        self.heads(batch.q_nope.shape[1])
        return call_bound(self.dec.update, dict(
            req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
            seq_lens_sum=fb.seq_lens_sum, decode_wrapper=wrapper,
            init_metadata_replay=replay_kwargs is not None, spec_info=None,
            plan=self.kv_plan, kv_view=self.translator.table(fb.req_pool_indices)),
            extra=replay_kwargs, what=f"{DECODE_UPDATER}.update")

    def plan_prefill(self, wrapper, batch: Batch, fb):
        self.heads(batch.q_nope.shape[1])
        return call_bound(self.pre.update, dict(
            req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
            seq_lens_sum=fb.seq_lens_sum, prefix_lens=fb.extend_prefix_lens.to(torch.int64),
            prefill_wrapper_paged=wrapper, use_ragged=False, spec_info=None,
            attn_dcp_metadata=None, plan=self.kv_plan,
            kv_view=self.translator.table(fb.req_pool_indices)), what=f"{PREFILL_UPDATER}.update")

    def forward(self, decode: bool, wrapper, batch: Batch, fb, q_nope=None, q_pe=None):
        """forward_decode / forward_extend; ``wrapper`` None: with the metadata the
        backend's own init_forward_metadata* left."""
        h = batch.q_nope.shape[1]
        if wrapper is not None:
            self.backend.forward_metadata = types.SimpleNamespace(
                decode_wrapper=wrapper, prefill_wrapper=wrapper, use_ragged=False)
        fn = self.backend.forward_decode if decode else self.backend.forward_extend
        o = call_bound(fn, dict(
            q=batch.q_nope if q_nope is None else q_nope, k=None, v=None, layer=self.layer(h),
            forward_batch=fb, save_kv_cache=False,
            q_rope=batch.q_pe if q_pe is None else q_pe, k_rope=None),
            what=DECODE_SITE if decode else PREFILL_SITE)
        return o[0] if isinstance(o, tuple) else o

    def run_eager(self, decode: bool, batch: Batch):
        w = self.backend.decode_wrapper if decode else self.backend.prefill_wrapper_paged
        fb = self.forward_batch(batch, DECODE if decode else EXTEND)
        (self.plan_decode if decode else self.plan_prefill)(w, batch, fb)
        return self.forward(decode, w, batch, fb), w

