"""Verify aiter's MHA extend (KVP103 through ``mha_batch_prefill_func``), on the reference.

No ROCm GPU is lent, so aiter's kernel cannot run here: both sides (the checkout's
original file and its patched one) run their own ``AiterAttnBackend.forward_extend`` on
one random FP8 MHA pool (k and v halves of one storage, ``[slots, kv_heads, dim]``), with
``aiter_reference.mha_batch_prefill_func`` standing in for the kernel, on the CPU or on a
CUDA GPU. The metadata the backend reads is built as SGLang's ``init_forward_metadata``
leaves it: ``qo_indptr``, and a ragged ``kv_indptr``/``kv_indices`` list of scattered
slots with prefixes shared between requests, and stale entries past the batch in both
buffers (the backend slices ``kv_indptr[:bs + 1]``). Cases: prefill with and without
prefixes, one request and several, a sliding window, attention sinks, and a separate SWA page
list (``forward_metadata.swa_page_table``) that a backend of 2026-01 reads under a window. Outputs must be
bit-identical; the patched run must make no full-pool copy; the runtime's shadow rows
are poisoned (NaN) before each patched run, so a listed row left uncast shows.
"""

from __future__ import annotations

import os
import types

import torch

from .aiter_reference import KERNEL_NAME
from .fa3 import FA3Side, FA3Verifier, Layer, Meta, load_target
from .fakes import EXTEND, Mode
from .report import CaseResult
from .side import ForwardBatch, call_bound
from .world import FP8, Q_DTYPE, HarnessError

SLOTS, HEADS, KV_HEADS, DIM = 4096, 8, 2, 64
# (prefix lens, extend lens) per case; a window (None: full) and sinks per case.
CASES = (([0], [37]), ([100, 0, 7], [20, 13, 1]), ([250, 5], [3, 40]))
VARIANTS = (("", None, False, False), ("window=16", 16, False, False), ("sinks", None, True, False),
            ("swa-table", 16, False, True))  # SGLang 2026-01 reads a separate SWA page list under a window
STALE_BATCH = 3  # requests' worth of stale indptr entries past the batch


class MHAPool:
    """SGLang's MHA token pool as the aiter backend reads it: k and v, one storage."""

    def __init__(self, gen, device):
        vals = torch.randn((2, SLOTS, KV_HEADS, DIM), generator=gen, device=device)
        self.store = vals.to(FP8).view(torch.uint8)
        self.k, self.v = self.store[0].view(FP8), self.store[1].view(FP8)
        self.device = device

    def get_kv_buffer(self, layer_id):
        return self.k, self.v

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v

    def set_kv_buffer(self, *args, **kwargs):
        raise HarnessError("the aiter verify cases pass k=None: nothing is written to the pool")

    def pool_ptr(self) -> int:
        return self.store.untyped_storage().data_ptr()


class Case:
    def __init__(self, gen, dev, prefix, extend, window=None, sinks=False, swa=False):
        self.lens = [p + e for p, e in zip(prefix, extend)]
        self.qlens, self.window = list(extend), window
        perm = (torch.randperm(SLOTS - 1, generator=gen, device=dev) + 1).tolist()
        rows, used = [], 0
        for b, n in enumerate(self.lens):
            share = min(prefix[b], prefix[0], 4) if b else 0  # prefix slots shared with request 0
            own = perm[used: used + n - share]
            used += n - share
            rows.append(rows[0][:share] + own if share else own)
        stale = [perm[used + i] for i in range(8 * STALE_BATCH)]  # never read: past the batch
        indptr = torch.tensor([0] + self.lens, device=dev).cumsum(0)
        tail = indptr[-1] + torch.arange(1, STALE_BATCH + 1, device=dev) * 8
        self.kv_indptr = torch.cat([indptr, tail]).to(torch.int32)
        self.kv_indices = torch.tensor(sum(rows, []) + stale, device=dev, dtype=torch.int32)
        self.qo_indptr = torch.tensor([0] + self.qlens, device=dev).cumsum(0).to(torch.int32)
        nq = sum(self.qlens)
        self.q = torch.randn((nq, HEADS, DIM), generator=gen, device=dev).to(Q_DTYPE)
        self.sinks = torch.randn((HEADS,), generator=gen, device=dev) if sinks else None
        # The SWA list: the same lengths on other slots (a backend that reads it reads only it).
        self.swa = (torch.randperm(SLOTS - 1, generator=gen, device=dev)[: self.kv_indices.numel()] + 1).to(
            torch.int32) if swa else None

    def label(self):
        return f"kv_lens={self.lens} q_lens={self.qlens}"

    def meta(self):
        return Meta(kv_indptr=self.kv_indptr, kv_indices=self.kv_indices, qo_indptr=self.qo_indptr,
                    max_q_len=max(self.qlens), max_kv_len=max(self.lens), swa_page_table=self.swa)


class AiterSide(FA3Side):
    def __init__(self, name, module, filename, source, pool, device, rel, cls_name):
        super().__init__(name, module, filename, source, pool, device, rel, cls_name)
        self.backend.__dict__.update(use_mla=False, kv_cache_dtype=FP8, input_dtype=Q_DTYPE, page_size=1,
                                     k_scale=None, v_scale=None, kv_cache_is_vectorized_5d=False)

    def forward(self, kind: str, case: Case, meta=None, q_nope=None, q_pe=None):
        b = self.backend
        b.forward_metadata = case.meta()
        b.qo_indptr = case.qo_indptr
        layer = Layer(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
                      head_dim=DIM, qk_head_dim=DIM, v_head_dim=DIM, scaling=DIM ** -0.5, logit_cap=0.0,
                      sliding_window_size=case.window, is_cross_attention=False, k_scale=None, v_scale=None)
        fb = ForwardBatch(forward_mode=Mode(kind), batch_size=len(case.lens), token_to_kv_pool=b.token_to_kv_pool,
                          extend_prefix_lens_cpu=None, spec_info=None)
        o = call_bound(b.forward_extend, dict(q=case.q, k=None, v=None, layer=layer, forward_batch=fb,
                                              save_kv_cache=False, sinks=case.sinks),
                       what=f"{self.cls_name}.forward_extend")
        if not isinstance(o, torch.Tensor):
            raise HarnessError(f"{self.cls_name}.forward_extend returned {type(o).__name__}, not a tensor: the "
                               "kernel it calls on this path has no reference in verify")
        return o


class AiterVerifier(FA3Verifier):
    def case_result(self, kind, exec_, label, variant="") -> CaseResult:
        c = CaseResult(file=self.rel, qualname=f"{self.pat.cls_name}.forward_extend", path="prefill", mode="gather",
                       exec=exec_, batch=label, kernel=KERNEL_NAME, variant=variant)
        self.report.cases.append(c)
        return c

    def selfcheck_forward(self):
        self.orig.forward(EXTEND, Case(self.gen, self.dev, [3], [5]))

    def run(self, graph: bool, quick: bool = False):
        self.guard_selfcheck()
        for prefix, extend in CASES[:2] if quick else CASES:
            for variant, window, sinks, swa in VARIANTS:
                self.eager(EXTEND, Case(self.gen, self.dev, prefix, extend, window, sinks, swa), variant)


def verify_aiter_target(t, sandbox, world, modes, graph, quick, report, log, find_runtime, redirect):
    """The aiter MHA-extend cases of one target file (``harness._verify_target``'s counterpart)."""
    loaded = load_target(t, sandbox, report, find_runtime, redirect)
    if loaded is None:
        return
    omod, pmod, rt, patched_src = loaded
    gen = torch.Generator(device=world.device).manual_seed(1)
    pool = MHAPool(gen, world.device)
    mha = types.SimpleNamespace(device=world.device, store=pool.k, pool_ptr=pool.pool_ptr)  # a full copy: >= k
    try:
        orig = AiterSide("original", omod, f"<original {t.original_from}>", t.original, pool, world.device,
                         t.rel, t.cls)
        pat = AiterSide("patched", pmod, str(t.path), patched_src, pool, world.device, t.rel, t.cls)
    except HarnessError as exc:
        report.errors.append(str(exc))
        return
    report.files.append(t.rel)
    for name in _other_rewritten(patched_src, t.cls):
        report.unverified.append(f"{t.rel}: {t.cls}.{name} is rewritten too, but verify drives only "
                                 f"forward_extend's mha_batch_prefill_func for aiter: not verified")
    report.notes.append(f"{t.rel}: aiter's mha_batch_prefill_func runs as the torch reference ({KERNEL_NAME}) on "
                        f"{world.device}: no ROCm GPU is lent, the real kernel did not run")
    os.environ["KVPATCH_MODE"] = "gather"
    rt.reset()
    log(f"{t.rel}: aiter MHA extend ({t.cls}), original from {t.original_from}, kernel {KERNEL_NAME}")
    AiterVerifier(t.rel, orig, pat, rt, mha, report, gen).run(graph, quick)
    rt.reset()


def _other_rewritten(source: str, cls_name: str):
    """Methods of the class other than forward_extend that call kvpatch's runtime."""
    import ast

    from kvpatch.names import RUNTIME_ALIAS

    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name != "forward_extend" and any(
                        isinstance(n, ast.Name) and n.id == RUNTIME_ALIAS for n in ast.walk(fn)):
                    yield fn.name
