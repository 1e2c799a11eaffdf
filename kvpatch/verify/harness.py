"""Run a checkout's patched FlashInfer MLA backend against its original.

For every target file: load the original and the patched module in the import
sandbox, build one random FP8 KV pool (uint8 storage viewed as float8_e4m3fn,
[slots, 1, 576]) shared by both, and for several batch shapes with scattered
slots run ``forward_decode`` (eager, and through the CUDA-graph replay path)
and the paged ``forward_extend`` (causal, with prefixes) of both. Gathered
casts must be bit-identical to the original; native FP8 must be within
NATIVE_ATOL/NATIVE_RTOL. Eager patched runs are watched by ``FullPoolGuard``
(a full-pool copy of the pool is a failure even when outputs match), and the
runtime's shadow buffers are poisoned before every measured patched run.

Version-specific knowledge is confined to the attribute tables below (the
superset of what the forward/plan paths of the SGLang versions read) and to
``REPLAY_METHODS``; calls go through ``call_bound``, which passes each method
the arguments its signature names.
"""

from __future__ import annotations

import inspect
import math
import os
import traceback
import types
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import stubs
from .reference import make_flashinfer_stub
from .report import FAILED, PASSED, SKIPPED, CaseResult, VerifyReport
from .targets import (BACKEND_CLASS, DECODE_UPDATER, PREFILL_UPDATER, Target, find_targets,
                      qualname_at, qualname_map)

FP8 = torch.float8_e4m3fn
Q_DTYPE = torch.bfloat16
KV_LORA, ROPE, QK_NOPE = 512, 64, 128
HEAD_DIM = KV_LORA + ROPE
SM_SCALE = 1.0 / math.sqrt(QK_NOPE + ROPE)
# FlashInfer's own FP8 MLA tests compare against a bf16 reference at 1e-2..2e-2.
NATIVE_ATOL = 2e-2
NATIVE_RTOL = 2e-2

DECODE_SITE = f"{BACKEND_CLASS}.forward_decode"
PREFILL_SITE = f"{BACKEND_CLASS}.forward_extend"

# Backend replay entry points, newest first (names only; arguments are bound
# by signature). Fallback: the decode updater's init_metadata_replay branch.
REPLAY_METHODS = ("_apply_cuda_graph_metadata", "init_forward_metadata_replay_cuda_graph")


class HarnessError(Exception):
    """The harness could not drive this file (not a verdict on the patch)."""


# --- shapes ------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeShape:
    bs: int
    max_len: int
    heads: int = 16


@dataclass(frozen=True)
class PrefillShape:
    prefix: Tuple[int, ...]
    extend: Tuple[int, ...]
    heads: int = 16


@dataclass
class Shapes:
    pool_slots: int
    decode: List[DecodeShape]
    prefill: List[PrefillShape]
    seed: int = 0


CPU_SHAPES = Shapes(
    4096,
    decode=[DecodeShape(1, 37, 16), DecodeShape(3, 300, 16), DecodeShape(4, 257, 16)],
    prefill=[PrefillShape((100, 0), (20, 13), 16), PrefillShape((37,), (64,), 32),
             PrefillShape((250, 5, 1), (3, 40, 1), 64), PrefillShape((64, 17), (16, 9), 128)],
)
QUICK_SHAPES = Shapes(
    4096,
    decode=[DecodeShape(1, 37, 16), DecodeShape(3, 300, 16)],
    prefill=[PrefillShape((100, 0), (20, 13), 16), PrefillShape((64,), (16,), 128)],
)
GPU_SHAPES = Shapes(
    65536,
    decode=[DecodeShape(1, 1024, 16), DecodeShape(8, 2048, 16), DecodeShape(16, 777, 128)],
    prefill=[PrefillShape((512, 0), (128, 77), 16), PrefillShape((300,), (64,), 32),
             PrefillShape((1000, 3), (31, 200), 64), PrefillShape((256, 128), (64, 64), 128)],
)
# gpu/verify_real.py: production-sized pool and batches.
BIG_SHAPES = Shapes(
    495_552,
    decode=[DecodeShape(1, 4096, 16), DecodeShape(32, 4096, 16), DecodeShape(128, 2048, 16),
            DecodeShape(32, 4096, 128)],
    prefill=[PrefillShape((1024, 1024), (256, 256), h) for h in (16, 32, 64, 128)],
)


# --- the world both sides share: pool and request table ------------------------


class Pool:
    """SGLang's MLATokenToKVPool as the forward paths see it (FP8 in uint8 storage)."""

    def __init__(self, store: torch.Tensor):
        self.kv_buffer = [store]
        self.store_dtype, self.dtype = torch.uint8, FP8

    def get_key_buffer(self, layer_id):
        return self.kv_buffer[layer_id].view(self.dtype)

    def get_value_buffer(self, layer_id):
        return self.get_key_buffer(layer_id)[..., :KV_LORA]

    def get_kv_buffer(self, layer_id):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_mla_kv_buffer(self, *a, **k):  # the harness passes k=None: never called
        raise HarnessError("set_mla_kv_buffer called: the harness does not save KV")

    set_kv_buffer = set_mla_kv_buffer


@dataclass
class Batch:
    seq_lens: List[int]
    prefix: List[int]
    req_pool_indices: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    label: str

    @property
    def extend(self):
        return [s - p for s, p in zip(self.seq_lens, self.prefix)]


class World:
    def __init__(self, shapes: Shapes, device: torch.device):
        self.device = device
        self.slots = shapes.pool_slots
        self.gen = torch.Generator(device=device).manual_seed(shapes.seed)
        lens = [s.max_len for s in shapes.decode] + [p + e for s in shapes.prefill
                                                     for p, e in zip(s.prefix, s.extend)]
        self.max_ctx = max(lens + [1]) + 8
        self.max_reqs = 2 * max([s.bs for s in shapes.decode]
                                + [len(s.prefix) for s in shapes.prefill] + [1]) + 2
        vals = torch.randn((self.slots, 1, HEAD_DIM), generator=self.gen, device=device)
        # FP8 values in SGLang's uint8 storage; all finite, so any NaN in an
        # output comes from a poisoned (never gathered) shadow row.
        self.store = vals.to(FP8).view(torch.uint8)
        del vals
        self.pool = Pool(self.store)
        self.req_to_token = torch.zeros((self.max_reqs, self.max_ctx), dtype=torch.int32,
                                        device=device)

    def pool_ptr(self) -> int:
        return self.store.untyped_storage().data_ptr()

    def randint(self, lo, hi, n):
        return torch.randint(lo, hi + 1, (n,), generator=self.gen, device=self.device).tolist()

    def batch(self, seq_lens: Sequence[int], heads: int, prefix: Optional[Sequence[int]] = None,
              label: str = "") -> Batch:
        """Requests on random rows of req_to_token, tokens on scattered pool slots.

        Without ``prefix`` it is a decode batch: one query per request (its last token).
        """
        seq_lens = [int(x) for x in seq_lens]
        prefix = [s - 1 for s in seq_lens] if prefix is None else [int(x) for x in prefix]
        bs, total = len(seq_lens), sum(seq_lens)
        if total >= self.slots:
            raise HarnessError(f"batch of {total} tokens does not fit a pool of {self.slots}")
        g, d = self.gen, self.device
        slots = torch.randperm(self.slots - 1, generator=g, device=d)[:total].to(torch.int32) + 1
        rows = torch.randperm(self.max_reqs, generator=g, device=d)[:bs]
        off = 0
        for r, n in zip(rows.tolist(), seq_lens):
            self.req_to_token[r, :n] = slots[off: off + n]
            off += n
        nq = sum(s - p for s, p in zip(seq_lens, prefix))
        q_nope = torch.randn((nq, heads, KV_LORA), generator=g, device=d).to(Q_DTYPE)
        q_pe = torch.randn((nq, heads, ROPE), generator=g, device=d).to(Q_DTYPE)
        return Batch(seq_lens, prefix, rows.to(torch.int64), q_nope, q_pe, label)


# --- one loaded module (original or patched) with its backend -------------------


class Mode:
    """ForwardMode as the verified paths query it."""

    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_decode_or_idle(self):
        return self.decode

    def is_extend(self):
        return not self.decode

    def __getattr__(self, attr):
        if attr.startswith("is_"):
            return lambda *a, **k: False
        raise AttributeError(attr)


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
        self.qmap = qualname_map(source)
        dev = world.device
        for cls in (BACKEND_CLASS, DECODE_UPDATER, PREFILL_UPDATER):
            if not isinstance(getattr(module, cls, None), type):
                raise HarnessError(f"{rel}: {name} module defines no class {cls}")
        self.Wrapper = getattr(module, "BatchMLAPagedAttentionWrapper", None)
        if not isinstance(self.Wrapper, type):
            raise HarnessError(f"{rel}: {name} module did not import BatchMLAPagedAttentionWrapper")
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
            _kvpatch_kv_cache_dtype=FP8,
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
        w = self.Wrapper(self.workspace, backend="auto", **kw)
        cls, rec, side = type(w), {}, self

        def plan(*a, **k):
            rec["plan_kv"] = k.get("kv_data_type", a[11] if len(a) > 11 else None)
            rec["plan_site"] = side.caller_site()
            return cls.plan(w, *a, **k)

        def run(*a, **k):
            ckv = k.get("ckv_cache", a[2] if len(a) > 2 else None)
            if ckv is not None:
                rec["run_kv_dtype"], rec["run_kv_ptr"] = ckv.dtype, _storage_ptr(ckv)
            rec["run_site"] = side.caller_site()
            return cls.run(w, *a, **k)

        w.plan, w.run = plan, run
        w._kvverify = rec
        return w

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

    def forward_batch(self, batch: Batch, decode: bool, seq_dtype=torch.int64):
        d = self.world.device
        seq = torch.tensor(batch.seq_lens, dtype=seq_dtype, device=d)
        return ForwardBatch(
            forward_mode=Mode(decode), batch_size=len(batch.seq_lens),
            req_pool_indices=batch.req_pool_indices, seq_lens=seq,
            seq_lens_cpu=seq.cpu(), seq_lens_sum=sum(batch.seq_lens),
            extend_prefix_lens=torch.tensor(batch.prefix, dtype=torch.int32, device=d),
            extend_prefix_lens_cpu=list(batch.prefix),
            extend_seq_lens_cpu=batch.extend, out_cache_loc=torch.zeros(
                (batch.q_nope.shape[0],), dtype=torch.int64, device=d),
            token_to_kv_pool=self.world.pool, attn_dcp_metadata=None,
            attn_attend_prefix_cache=None, mha_return_lse=False, spec_info=None)

    def plan_decode(self, wrapper, batch: Batch, fb, replay_kwargs=None):
        self.heads(batch.q_nope.shape[1])
        return call_bound(self.dec.update, dict(
            req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
            seq_lens_sum=fb.seq_lens_sum, decode_wrapper=wrapper,
            init_metadata_replay=replay_kwargs is not None, spec_info=None),
            extra=replay_kwargs, what=f"{DECODE_UPDATER}.update")

    def plan_prefill(self, wrapper, batch: Batch, fb):
        self.heads(batch.q_nope.shape[1])
        return call_bound(self.pre.update, dict(
            req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
            seq_lens_sum=fb.seq_lens_sum, prefix_lens=fb.extend_prefix_lens.to(torch.int64),
            prefill_wrapper_paged=wrapper, use_ragged=False, spec_info=None,
            attn_dcp_metadata=None), what=f"{PREFILL_UPDATER}.update")

    def forward(self, decode: bool, wrapper, batch: Batch, fb, q_nope=None, q_pe=None):
        h = batch.q_nope.shape[1]
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
        fb = self.forward_batch(batch, decode)
        (self.plan_decode if decode else self.plan_prefill)(w, batch, fb)
        return self.forward(decode, w, batch, fb), w


# --- full-pool cast detector -----------------------------------------------------


class FullPoolGuard(TorchDispatchMode):
    """Flags any op that reads the pool's storage and returns a new tensor at least
    as large as the pool: the full-pool cast the patch exists to remove (or any
    other full copy of it). Views of the pool share its storage and are fine;
    a gathered cast produces a [rows, 1, 576] tensor and is fine."""

    def __init__(self, pool_ptr: int, pool_numel: int, side: Side):
        super().__init__()
        self.ptr, self.numel, self.side = pool_ptr, pool_numel, side
        self.hits: List[str] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if len(self.hits) < 8:
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(_storage_ptr(t) == self.ptr for t in ins):
                for o in tree_leaves(out):
                    if (isinstance(o, torch.Tensor) and o.numel() >= self.numel
                            and _storage_ptr(o) != self.ptr):
                        site = self.side.caller_site() or "outside the verified module"
                        self.hits.append(f"{func} made a {list(o.shape)} {o.dtype} copy of the "
                                         f"whole KV pool at {site}")
        return out


# --- comparison --------------------------------------------------------------------


def compare(out: torch.Tensor, ref: torch.Tensor):
    """(identical, max_abs_err, identical_share, within native tolerance)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False, float("inf"), 0.0, False
    ident = torch.equal(out, ref)
    ibits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
    share = (out.view(ibits) == ref.view(ibits)).float().mean().item()
    diff = (out.float() - ref.float()).abs()
    max_err = diff.max().item() if diff.numel() else 0.0
    close = bool(torch.isfinite(out).all()) and bool(
        (diff <= NATIVE_ATOL + NATIVE_RTOL * ref.float().abs()).all())
    return ident, max_err, share, close


def _exc_text(exc: BaseException, side: Side) -> str:
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
    site = side.site_of(frames)
    text = f"{type(exc).__name__}: {exc}"
    return f"{text} (raised in {site})" if site else text


# --- the verifier of one target ------------------------------------------------------


class FileVerifier:
    def __init__(self, target: Target, orig: Side, pat: Side, rt, world: World, kernel: str,
                 report: VerifyReport):
        self.t, self.orig, self.pat, self.rt, self.world = target, orig, pat, rt, world
        self.kernel, self.report = kernel, report
        # A real capture needs CUDA and FlashInfer: the reference kernel reads its
        # lengths on the host, so a captured reference would replay stale lengths.
        self.capture = world.device.type == "cuda" and kernel == "flashinfer"

    def case(self, path, mode, exec_, batch_label) -> CaseResult:
        c = CaseResult(file=self.t.rel, qualname=DECODE_SITE if path == "decode" else PREFILL_SITE,
                       path=path, mode=mode, exec=exec_, batch=batch_label, kernel=self.kernel)
        self.report.cases.append(c)
        return c

    def _kv_path(self, wrapper, guard_hits) -> str:
        rec = wrapper._kvverify
        if guard_hits:
            return "cast"
        if rec.get("run_kv_dtype") == FP8:
            return "native" if rec.get("run_kv_ptr") == self.world.pool_ptr() else "fp8-copy"
        if rec.get("run_kv_dtype") == Q_DTYPE:
            return "gather"
        return "?"

    def judge(self, c: CaseResult, out, ref, wrapper, guard_hits, mode):
        c.full_pool_casts = list(guard_hits)
        c.kv_path = self._kv_path(wrapper, guard_hits)
        ident, c.max_abs_err, c.identical_share, close = compare(out, ref)
        rec = wrapper._kvverify
        problems = []
        if guard_hits:
            problems.append("full-pool cast not removed: " + "; ".join(guard_hits))
        planned, passed = rec.get("plan_kv"), rec.get("run_kv_dtype")
        if planned is not None and passed is not None and planned != passed:
            problems.append(f"plan/buffer dtype mismatch: wrapper planned kv_data_type={planned}"
                            f" at {rec.get('plan_site') or '?'} but run() got a {passed} buffer"
                            f" at {rec.get('run_site') or '?'}")
        if c.kv_path == "native":
            c.tolerance = f"native fp8: |d| <= {NATIVE_ATOL} + {NATIVE_RTOL}*|ref|"
            if not close:
                problems.append(f"native FP8 output outside tolerance ({c.tolerance}): "
                                f"max_abs_err={c.max_abs_err:.4g}, identical={c.identical_share:.4f}")
        else:
            c.tolerance = "bit-identical (torch.equal)"
            if not ident:
                problems.append(f"output differs from the original: max_abs_err="
                                f"{c.max_abs_err:.4g}, identical={c.identical_share:.4f}"
                                + (" (NaN: a row the kernel reads was not gathered)"
                                   if not torch.isfinite(out).all() else ""))
        if mode == "native" and c.kv_path != "native" and not problems:
            c.message = f"native requested, runtime planned {c.kv_path} for this wrapper"
        if problems:
            c.status, c.message = FAILED, "; ".join(problems)
        else:
            c.status = PASSED

    def fail_exc(self, c: CaseResult, exc, wrapper=None, what="patched run"):
        c.status = FAILED
        msg = f"{what} raised {_exc_text(exc, self.pat)}"
        rec = getattr(wrapper, "_kvverify", {}) if wrapper is not None else {}
        if rec.get("plan_kv") is not None:
            msg += (f"; the wrapper was planned with kv_data_type={rec['plan_kv']} at "
                    f"{rec.get('plan_site') or '?'}")
        c.message = msg

    def original(self, decode, batch):
        return self.orig.run_eager(decode, batch)[0].clone()

    # -- eager --------------------------------------------------------------------

    def eager(self, decode: bool, mode: str, batch: Batch):
        path = "decode" if decode else "prefill"
        c = self.case(path, mode, "eager", batch.label)
        try:
            ref = self.original(decode, batch)
        except Exception as exc:
            c.status, c.message = SKIPPED, f"original raised {_exc_text(exc, self.orig)}: nothing to compare"
            self.report.add_reason(f"{self.t.rel}: the original file does not run in the harness")
            return
        w = None
        try:
            self.pat.run_eager(decode, batch)            # warm-up: allocates shadows
            self.rt.poison_shadows()
            guard = FullPoolGuard(self.world.pool_ptr(), self.world.store.numel(), self.pat)
            with guard:
                out, w = self.pat.run_eager(decode, batch)
                out = out.clone()
        except Exception as exc:
            self.fail_exc(c, exc, w or (self.pat.backend.decode_wrapper if decode
                                        else self.pat.backend.prefill_wrapper_paged))
            return
        self.judge(c, out, ref, w, guard.hits, mode)

    def guard_selfcheck(self, batch: Batch):
        """The guard must see the original's full-pool cast, or its silence proves nothing."""
        guard = FullPoolGuard(self.world.pool_ptr(), self.world.store.numel(), self.orig)
        try:
            with guard:
                self.orig.run_eager(True, batch)
        except Exception:
            return
        if not guard.hits:
            self.report.errors.append(
                f"{self.t.rel}: guard self-check failed: the original's full-pool cast was not "
                "seen, so the no-full-cast check would prove nothing")

    # -- decode through the CUDA-graph replay path --------------------------------------

    def _replay(self, side: Side, w, gb, batch: Batch, fb) -> str:
        """Rewrite indices and lengths in place through the module's own replay path."""
        b, bs = side.backend, len(batch.seq_lens)
        b.decode_cuda_graph_metadata[bs] = w
        values = dict(bs=bs, req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
                      seq_lens_sum=fb.seq_lens_sum, encoder_lens=None,
                      forward_mode=fb.forward_mode, spec_info=None, seq_lens_cpu=fb.seq_lens_cpu)
        for name in REPLAY_METHODS:
            fn = getattr(b, name, None)
            if fn is None:
                continue
            params = inspect.signature(fn).parameters.values()
            if any(p.default is p.empty and p.name not in values for p in params
                   if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)):
                continue
            call_bound(fn, values, what=f"{BACKEND_CLASS}.{name}")
            return f"{BACKEND_CLASS}.{name}"
        # SGLang's replay body, when no backend entry point binds.
        kv_len = fb.seq_lens_cpu[:bs].to(torch.int32)
        gb["kv_indptr_cpu"][1: bs + 1] = torch.cumsum(kv_len, dim=0)
        b.fast_decode_kwargs.update(qo_indptr_cpu=gb["qo_indptr_cpu"][: bs + 1],
                                    kv_indptr_cpu=gb["kv_indptr_cpu"][: bs + 1],
                                    kv_len_arr_cpu=kv_len)
        side.plan_decode(w, batch, fb, replay_kwargs=b.fast_decode_kwargs)
        return f"{DECODE_UPDATER}.update(init_metadata_replay=True)"

    def _graph_side(self, side: Side, shape: DecodeShape, capture_batch: Batch):
        """SGLang's init_cuda_graph_state + capture-time plan, for one batch size."""
        b, dev, bs = side.backend, self.world.device, shape.bs
        gb = dict(kv_indices=torch.zeros((bs * shape.max_len + 16,), dtype=torch.int32, device=dev),
                  qo_indptr=b.q_indptr_decode.clone(), kv_indptr=b.kv_indptr.clone(),
                  kv_lens=torch.ones((bs,), dtype=torch.int32, device=dev))
        # Host copies, distinct even on CPU (where .cpu() would alias the device
        # buffer and hide the stale wrapper indptr a real GPU replay has).
        gb["qo_indptr_cpu"] = gb["qo_indptr"].to("cpu", copy=True)
        gb["kv_indptr_cpu"] = gb["kv_indptr"].to("cpu", copy=True)
        b.__dict__.update(cuda_graph_kv_indices=gb["kv_indices"],
                          cuda_graph_qo_indptr=gb["qo_indptr"], cuda_graph_kv_indptr=gb["kv_indptr"],
                          cuda_graph_kv_lens=gb["kv_lens"],
                          cuda_graph_qo_indptr_cpu=gb["qo_indptr_cpu"],
                          cuda_graph_kv_indptr_cpu=gb["kv_indptr_cpu"],
                          fast_decode_kwargs={"qo_indptr_cpu": gb["qo_indptr_cpu"],
                                              "kv_indptr_cpu": gb["kv_indptr_cpu"],
                                              "kv_indices": gb["kv_indices"]})
        w = side.new_wrapper(use_cuda_graph=True, qo_indptr=gb["qo_indptr"][: bs + 1],
                             kv_indptr=gb["kv_indptr"][: bs + 1], kv_indices=gb["kv_indices"],
                             kv_len_arr=gb["kv_lens"][:bs])
        fb = side.forward_batch(capture_batch, True, seq_dtype=torch.int32)
        side.plan_decode(w, capture_batch, fb)
        w.plan = partial(side.module.fast_mla_decode_plan, w)
        return w, gb, fb

    def graph_decode(self, mode: str, shape: DecodeShape):
        exec_ = "graph" if self.capture else "replay"
        W = self.world
        cap = W.batch(W.randint(1, max(1, shape.max_len // 4), shape.bs), shape.heads,
                      label="capture")
        replays = [
            ("longer", W.randint(max(1, shape.max_len // 2), shape.max_len, shape.bs - 1)
             + [shape.max_len]),
            ("shorter", W.randint(1, max(1, shape.max_len // 8), shape.bs)),
        ]
        cases = [self.case("decode", mode, exec_, f"bs={shape.bs} heads={shape.heads} "
                           f"replay {lbl} total={sum(l)} (capture total={sum(cap.seq_lens)})")
                 for lbl, l in replays]
        try:
            w, gb, fb_cap = self._graph_side(self.pat, shape, cap)
            q_nope, q_pe = cap.q_nope.clone(), cap.q_pe.clone()
            fwd = partial(self.pat.forward, True, w, cap, fb_cap, q_nope, q_pe)
            if self.capture:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):  # SGLang warms up before capture
                        fwd()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    static_out = fwd()
            else:
                fwd()
        except Exception as exc:
            for c in cases:
                self.fail_exc(c, exc, None, what="capture-time plan/capture")
            self._maybe_incompatible(cases, exc, shape, cap, None)
            return
        for c, (lbl, lens) in zip(cases, replays):
            batch = W.batch(lens, shape.heads, label=lbl)
            try:
                ref = self.original(True, batch)
            except Exception as exc:
                c.status, c.message = SKIPPED, f"original raised {_exc_text(exc, self.orig)}"
                continue
            try:
                fb = self.pat.forward_batch(batch, True, seq_dtype=torch.int32)
                via = self._replay(self.pat, w, gb, batch, fb)
                q_nope.copy_(batch.q_nope)
                q_pe.copy_(batch.q_pe)
                self.rt.poison_shadows()
                if self.capture:
                    g.replay()
                    torch.cuda.synchronize()
                    out = static_out.clone()
                else:
                    out = fwd().clone()
            except Exception as exc:
                self.fail_exc(c, exc, w, what="replay")
                self._maybe_incompatible([c], exc, shape, cap, batch)
                continue
            self.judge(c, out, ref, w, [], mode)
            if not c.message:
                c.message = f"replay via {via}"

    def _maybe_incompatible(self, cases, exc, shape, cap, batch):
        """A graph-path error the original shares (say, an old SGLang's
        fast_mla_decode_plan against a new FlashInfer) is no verdict on the patch."""
        try:
            w, gb, fb = self._graph_side(self.orig, shape, cap)
            self.orig.forward(True, w, cap, fb)
            if batch is not None:
                fb = self.orig.forward_batch(batch, True, seq_dtype=torch.int32)
                self._replay(self.orig, w, gb, batch, fb)
                self.orig.forward(True, w, batch, fb)
        except Exception as oexc:
            if type(oexc) is type(exc):
                for c in cases:
                    c.status = SKIPPED
                    c.message = (f"the original fails the same way on this path "
                                 f"({_exc_text(oexc, self.orig)}): an SGLang/FlashInfer "
                                 "incompatibility, not the patch")
                self.report.add_reason(f"{self.t.rel}: the CUDA-graph path does not run with "
                                       "this FlashInfer, unpatched either")


# --- entry point --------------------------------------------------------------------


def _find_runtime(module):
    for v in vars(module).values():
        if isinstance(v, types.ModuleType) and hasattr(v, "__kvpatch_runtime_version__"):
            return v
    return None


def _pick_device(device: str, report: VerifyReport) -> Optional[torch.device]:
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        report.add_reason("device='cuda' asked for, but no CUDA device is available")
        return None
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
        if not has_cuda:
            report.add_reason("no CUDA device: ran the CPU reference path only")
    elif device == "cpu":
        report.add_reason("device='cpu': ran the CPU reference path only")
    return torch.device(device)


def _real_flashinfer():
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install
        return None, f"FlashInfer not importable ({type(exc).__name__}: {exc})"
    if not isinstance(getattr(flashinfer, "BatchMLAPagedAttentionWrapper", None), type):
        return None, "FlashInfer has no BatchMLAPagedAttentionWrapper"
    return flashinfer, ""


def run_verify_impl(root, *, modes=("gather", "native"), device="auto", graph=True, quick=False,
                    log=None, shapes: Optional[Shapes] = None) -> VerifyReport:
    from pathlib import Path
    log = log or (lambda s: None)
    root = Path(root)
    report = VerifyReport(root=str(root))
    modes = tuple(modes)
    bad = [m for m in modes if m not in ("gather", "native", "auto")]
    if bad:
        raise ValueError(f"unknown verify mode(s) {bad}: use gather, native, auto")
    targets, notes = find_targets(root)
    report.notes.extend(notes)
    if not targets:
        report.add_reason("no patched file found (no .kvpatch/state.json and no file imports "
                          "_kvpatch_runtime)")
        return report
    dev = _pick_device(device, report)
    if dev is None:
        return report
    report.device, report.gpu_ran = str(dev), dev.type == "cuda"
    fi, why = (None, "the CPU path uses the reference kernel") if dev.type != "cuda" else _real_flashinfer()
    kernel = "flashinfer" if fi is not None else "reference"
    report.kernel = kernel
    if fi is not None:
        report.notes.append(f"FlashInfer {getattr(fi, '__version__', '?')}")
    elif dev.type == "cuda":
        report.add_reason(f"{why}: ran the torch reference kernel on the GPU")
    if shapes is None:
        shapes = QUICK_SHAPES if quick else (GPU_SHAPES if dev.type == "cuda" else CPU_SHAPES)

    saved_mode = os.environ.get("KVPATCH_MODE")
    sandbox = stubs.Sandbox(flashinfer_stub=None if fi is not None else make_flashinfer_stub())
    try:
        with sandbox, torch.no_grad():
            world = None
            for t in targets:
                if t.skip:
                    report.notes.append(f"skipped {t.skip}")
                    continue
                if t.problem:
                    report.errors.append(t.problem)
                    continue
                if world is None:
                    log(f"building a {shapes.pool_slots}-slot FP8 pool on {dev}")
                    world = World(shapes, dev)
                try:
                    _verify_target(t, sandbox, world, shapes, modes, kernel, fi, graph, report, log)
                except Exception as exc:  # a harness bug must not hide the other targets
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    report.errors.append(f"{t.rel}: verify harness error {type(exc).__name__}: {exc}"
                                         f" (at {where.filename}:{where.lineno})")
    finally:
        if saved_mode is None:
            os.environ.pop("KVPATCH_MODE", None)
        else:
            os.environ["KVPATCH_MODE"] = saved_mode
    if not report.files and not report.errors:
        report.add_reason("no patched FlashInfer MLA backend file found")
    if report.cases and not any(c.passed for c in report.cases) and not report.failures:
        report.add_reason("no case could run")
    return report


def _verify_target(t: Target, sandbox, world, shapes, modes, kernel, fi, graph, report, log):
    modname = stubs.module_name_for(t.rel)
    try:
        omod = sandbox.load(modname, t.original, f"<original {t.original_from}>")
        osrc_name = f"<original {t.original_from}>"
        pmod = sandbox.load(modname, t.path.read_text(encoding="utf-8"), str(t.path),
                            runtime_path=str(t.runtime))
    except Exception as exc:
        report.errors.append(f"{t.rel}: cannot import in the verify sandbox: "
                             f"{type(exc).__name__}: {exc}")
        return
    rt = _find_runtime(pmod)
    if rt is None:
        report.errors.append(f"{t.rel}: the patched module holds no kvpatch runtime module")
        return
    if world.device.type != "cuda":
        for m in (omod, pmod):
            m.torch = stubs.DeviceRedirectTorch(world.device)
    try:
        orig = Side("original", omod, osrc_name, t.original, world, t.rel)
        pat = Side("patched", pmod, str(t.path), t.path.read_text(encoding="utf-8"), world, t.rel)
    except HarnessError as exc:
        report.errors.append(str(exc))
        return
    report.files.append(t.rel)
    v = FileVerifier(t, orig, pat, rt, world, kernel, report)
    log(f"{t.rel}: original from {t.original_from}, kernel {kernel}")
    v.guard_selfcheck(world.batch([33, 7], 16, label="selfcheck"))
    for mode in modes:
        os.environ["KVPATCH_MODE"] = mode
        rt.reset()
        skip = ""
        if mode == "native":
            if kernel != "flashinfer":
                skip = (f"native FP8 needs real FlashInfer on a CUDA device (kernel here: "
                        f"{kernel} on {world.device.type})")
            else:
                resolved = rt.mode()
                if resolved != "native":
                    skip = f"the runtime resolved KVPATCH_MODE=native to {resolved!r} here"
        n_before = len(report.cases)
        for s in shapes.decode:
            lens = world.randint(max(1, s.max_len // 2), s.max_len, s.bs - 1) + [s.max_len]
            label = f"bs={s.bs} heads={s.heads} kv_lens={_short(lens)}"
            if skip:
                _skip(report, t, "decode", mode, "eager", label, skip)
                if graph:
                    _skip(report, t, "decode", mode, "graph" if v.capture else "replay", label,
                          skip)
                continue
            log(f"  {mode} decode eager {label}")
            v.eager(True, mode, world.batch(lens, s.heads, label=label))
            if graph:
                log(f"  {mode} decode {'graph' if v.capture else 'replay'} bs={s.bs}")
                v.graph_decode(mode, s)
        for s in shapes.prefill:
            seq = [p + e for p, e in zip(s.prefix, s.extend)]
            label = f"bs={len(seq)} heads={s.heads} prefix={list(s.prefix)} extend={list(s.extend)}"
            if skip:
                _skip(report, t, "prefill", mode, "eager", label, skip)
                continue
            log(f"  {mode} prefill eager {label}")
            v.eager(False, mode, world.batch(seq, s.heads, prefix=s.prefix, label=label))
        if skip:
            report.add_reason(f"native mode not run: {skip}")
        for c in report.cases[n_before:]:
            if c.failed:
                log(f"  FAIL {c.site} [{c.label()}]: {c.message}")
    rt.reset()


def _skip(report, t, path, mode, exec_, label, why):
    report.cases.append(CaseResult(
        file=t.rel, qualname=DECODE_SITE if path == "decode" else PREFILL_SITE, path=path,
        mode=mode, exec=exec_, batch=label, status=SKIPPED, message=why))


def _short(xs, n=6):
    xs = list(xs)
    return str(xs) if len(xs) <= n else f"[{', '.join(map(str, xs[:n]))}, ... ({len(xs)})]"
