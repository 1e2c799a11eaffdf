"""Verify aiter's MHA extend and decode (KVP103 through ``mha_batch_prefill_func`` and
``paged_attention_ragged``), on the reference.

No ROCm GPU is lent, so aiter's kernels cannot run here: both sides (the checkout's
original file and its patched one) run their own ``AiterAttnBackend.forward_extend`` and,
where its MHA branch calls ``paged_attention_ragged``, ``forward_decode`` on one random FP8
MHA pool (k and v halves of one storage, ``[slots, kv_heads, dim]``), with
``aiter_reference`` standing in for the kernels, on the CPU or on a CUDA GPU. The metadata
the backend reads is built as SGLang's ``init_forward_metadata`` leaves it: ``qo_indptr``,
and a ragged ``kv_indptr``/``kv_indices`` list of scattered slots with prefixes shared
between requests, and stale entries past the batch in both buffers (the extend slices
``kv_indptr[:bs + 1]``). Cases: prefill with and without
prefixes, one request and several, a sliding window, attention sinks, and a separate SWA page
list (``forward_metadata.swa_page_table``) that a backend of 2026-01 reads under a window. Decode:
one query a request, ragged lengths, prefix slots shared, ``kv_indptr`` cut to the batch (as
SGLang's decode metadata is) and stale ``kv_indices`` past it, with and without a logits soft
cap, eager and replayed on fixed metadata buffers rewritten in place (a CUDA graph's replay;
the reference reads its lists on the host, so nothing is captured). Outputs must be
bit-identical; the patched run must make no full-pool copy; the runtime's shadow rows
are poisoned (NaN) before each patched run, so a listed row left uncast shows.
"""

from __future__ import annotations

import ast
import os
import types

import torch

from .aiter_reference import DECODE_KERNEL_NAME, KERNEL_NAME
from .fa3 import FA3Side, FA3Verifier, Layer, Meta, load_target
from .fakes import DECODE, EXTEND, Mode
from .judge import FullPoolGuard, _exc_text
from .report import FAILED, SKIPPED, CaseResult
from .side import ForwardBatch, call_bound
from .targets import AITER_DECODE_KERNEL, AITER_KERNEL, FORWARDS
from kvpatch.names import RUNTIME_ALIAS
from .world import FP8, Q_DTYPE, HarnessError

SLOTS, HEADS, KV_HEADS, DIM = 4096, 8, 2, 64
# (prefix lens, extend lens) per case; a window (None: full) and sinks per case.
CASES = (([0], [37]), ([100, 0, 7], [20, 13, 1]), ([250, 5], [3, 40]))
VARIANTS = (("", None, False, False), ("window=16", 16, False, False), ("sinks", None, True, False),
            ("swa-table", 16, False, True))  # SGLang 2026-01 reads a separate SWA page list under a window
STALE_BATCH = 3  # requests' worth of stale indptr entries past the batch
DECODE_KERNEL = AITER_DECODE_KERNEL  # the MHA decode kernel the reference stands in for
DECODE_FN, EXTEND_FN = FORWARDS
# KV lengths per decode case (one query a request); a logits soft cap (0: none) per variant.
DECODE_LENS = ([37], [300, 5, 129], [64, 64, 1, 700])
DECODE_VARIANTS = (("", 0.0), ("softcap", 30.0))
REPLAY_LENS = ([20, 9, 40], [[150, 70, 190], [3, 1, 2]])  # the buffers' first batch, then replays (same bs)
PARTITION = 256  # SGLang's _AITER_PARTITION_SIZE_ROCM: the workspace holds SLOTS keys in such partitions


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
    def __init__(self, gen, dev, prefix, extend, window=None, sinks=False, swa=False, cap=0.0, decode=False):
        self.lens = [p + e for p, e in zip(prefix, extend)]
        self.qlens, self.window, self.cap = list(extend), window, cap
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
        # SGLang's decode metadata cuts kv_indptr to the batch; the extend's buffer runs on
        self.kv_indptr = (indptr if decode else torch.cat([indptr, tail])).to(torch.int32)
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
        # What SGLang's __init__ leaves for the MHA decode: unit k/v scales ([1] float32),
        # 1/sqrt(head_dim), the partitions of the longest context, a byte workspace.
        one = torch.ones(1, dtype=torch.float32, device=device)
        self.backend.__dict__.update(use_mla=False, kv_cache_dtype=FP8, input_dtype=Q_DTYPE, page_size=1,
                                     k_scale=one, v_scale=one.clone(), kv_cache_is_vectorized_5d=False,
                                     scale=DIM ** -0.5, max_num_partitions=-(-SLOTS // PARTITION),
                                     workspace_buffer=torch.empty(0, dtype=torch.uint8, device=device))

    def forward(self, kind: str, case: Case, meta=None, q_nope=None, q_pe=None):
        """kind's forward on case; meta and q_nope (the queries) stand for a replay's fixed buffers."""
        b = self.backend
        b.forward_metadata = meta or case.meta()
        b.qo_indptr = case.qo_indptr
        # SGLang's buffer is max_bs long; the kernel reads the batch's entries only
        b.kv_last_page_len = torch.ones(len(case.lens) + STALE_BATCH, dtype=torch.int32, device=case.q.device)
        layer = Layer(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
                      head_dim=DIM, qk_head_dim=DIM, v_head_dim=DIM, scaling=DIM ** -0.5, logit_cap=case.cap,
                      sliding_window_size=case.window, is_cross_attention=False, k_scale=None, v_scale=None)
        fb = ForwardBatch(forward_mode=Mode(kind), batch_size=len(case.lens), token_to_kv_pool=b.token_to_kv_pool,
                          extend_prefix_lens_cpu=None, spec_info=None)
        name = DECODE_FN if kind == DECODE else EXTEND_FN
        args = dict(q=case.q if q_nope is None else q_nope, k=None, v=None, layer=layer, forward_batch=fb,
                    save_kv_cache=False)
        o = call_bound(getattr(b, name), args if kind == DECODE else dict(args, sinks=case.sinks),
                       what=f"{self.cls_name}.{name}")
        if not isinstance(o, torch.Tensor):
            raise HarnessError(f"{self.cls_name}.{name} returned {type(o).__name__}, not a tensor: the "
                               "kernel it calls on this path has no reference in verify")
        return o


class AiterVerifier(FA3Verifier):
    decode = False  # the class's forward_decode calls DECODE_KERNEL: drive it too
    extend = True  # its forward_extend calls AITER_KERNEL (a backend before 2025-09 has the decode only)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture = False  # the reference reads its lists on the host: replayed, never captured

    def case_result(self, kind, exec_, label, variant="") -> CaseResult:
        dec = kind == DECODE
        c = CaseResult(file=self.rel, qualname=f"{self.pat.cls_name}.{DECODE_FN if dec else EXTEND_FN}",
                       path="decode" if dec else "prefill", mode="gather", exec=exec_, batch=label,
                       kernel=DECODE_KERNEL_NAME if dec else KERNEL_NAME, variant=variant)
        self.report.cases.append(c)
        return c

    def selfcheck_forward(self):
        if self.extend:
            self.orig.forward(EXTEND, Case(self.gen, self.dev, [3], [5]))
        else:
            self.orig.forward(DECODE, self.decode_case([5, 9]))

    def decode_case(self, lens, cap=0.0):
        return Case(self.gen, self.dev, [n - 1 for n in lens], [1] * len(lens), cap=cap, decode=True)

    def run(self, graph: bool, quick: bool = False):
        self.guard_selfcheck()
        for prefix, extend in (CASES[:2] if quick else CASES) if self.extend else ():
            for variant, window, sinks, swa in VARIANTS:
                self.eager(EXTEND, Case(self.gen, self.dev, prefix, extend, window, sinks, swa), variant)
        if not self.decode:
            return
        for lens in DECODE_LENS[:2] if quick else DECODE_LENS:
            for variant, cap in DECODE_VARIANTS:
                self.eager(DECODE, self.decode_case(lens, cap), variant)
        if graph:
            self.replay()

    def replay(self):
        """Decode on fixed metadata buffers (SGLang's graph buffers: kv_indptr, a kv_indices
        buffer longer than any batch's list, the queries) rewritten in place before each run."""
        first, later = REPLAY_LENS
        cap = self.decode_case(first)
        cases = [self.decode_case(lens) for lens in later]
        results = [self.case_result(DECODE, "replay", f"{cs.label()} (first kv_lens={first})") for cs in cases]
        meta = cap.meta()
        meta.kv_indptr = cap.kv_indptr.clone()
        meta.kv_indices = torch.zeros(sum(max(ls) for ls in zip(first, *later)) + 8 * STALE_BATCH,
                                      dtype=torch.int32, device=self.dev)
        q = cap.q.clone()
        runs = [(None, cap)] + list(zip(results, cases))
        for c, cs in runs:
            try:
                ref = self.orig.forward(DECODE, cs).clone()
            except Exception as exc:
                for r in results:
                    r.status, r.message = SKIPPED, f"original raised {_exc_text(exc, self.orig)}: nothing to compare"
                return
            meta.kv_indptr.copy_(cs.kv_indptr)  # SGLang's replay: the same buffers, new contents
            meta.kv_indices.fill_(0)
            meta.kv_indices[: cs.kv_indices.numel()].copy_(cs.kv_indices)
            q.copy_(cs.q)
            guard = FullPoolGuard(self.world.pool_ptr(), self.world.store.numel(), self.pat)
            try:
                if c is not None:
                    self.rt.poison_shadows()
                with guard:
                    out = self.pat.forward(DECODE, cs, meta, q).clone()
            except Exception as exc:
                if c is None:
                    for r in results:
                        r.status, r.message = FAILED, f"first run raised {_exc_text(exc, self.pat)}"
                    return
                c.status, c.message = FAILED, f"replay raised {_exc_text(exc, self.pat)}"
                continue
            if c is not None:
                self.judge(c, out, ref, guard.hits)
                if c.passed:
                    c.message = "kv_indptr, kv_indices and queries rewritten in place before the run"


def verify_aiter_target(t, sandbox, world, modes, graph, quick, report, log, find_runtime, redirect):
    """The aiter MHA cases of one target file (``harness._verify_target``'s counterpart)."""
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
    methods = _methods(patched_src, t.cls)
    rewritten = [name for name, fn in methods.items() if _calls(fn, RUNTIME_ALIAS)]
    # The forwards verify drives: each that calls its kernel (a backend before 2025-09 has no
    # mha_batch_prefill_func extend), with (kernel, reference's name).
    driven = {fn: (kernel, ref) for fn, kernel, ref in ((EXTEND_FN, AITER_KERNEL, KERNEL_NAME),
                                                         (DECODE_FN, DECODE_KERNEL, DECODE_KERNEL_NAME))
              if fn in methods and _calls(methods[fn], kernel)}
    kernels = " and ".join(f"{fn}'s {kernel}" for fn, (kernel, _) in driven.items())
    refs = ", ".join(ref for _, ref in driven.values())
    for name in rewritten:
        if name not in driven:
            report.unverified.append(f"{t.rel}: {t.cls}.{name} is rewritten too, but verify drives only "
                                     f"{kernels} for aiter: not verified")
    report.notes.append(f"{t.rel}: aiter's {kernels} run as the torch references ({refs})"
                        f" on {world.device}: no ROCm GPU is lent, the real kernels did not run")
    os.environ["KVPATCH_MODE"] = "gather"
    rt.reset()
    log(f"{t.rel}: aiter MHA {' and '.join(fn.split('_')[1] for fn in driven)} ({t.cls}), original from "
        f"{t.original_from}, kernels {refs}")
    v = AiterVerifier(t.rel, orig, pat, rt, mha, report, gen)
    v.extend, v.decode = EXTEND_FN in driven, DECODE_FN in driven
    v.run(graph, quick)
    rt.reset()
    for fn in driven:
        ran = [c for c in report.cases if c.file == t.rel and c.qualname == f"{t.cls}.{fn}"]
        if fn in rewritten and not any(c.passed or c.failed for c in ran):
            # every case skipped (the original does not run here): its rewrite is unproven
            report.unverified.append(f"{t.rel}: {t.cls}.{fn} is rewritten, but none of its cases ran: not verified")


def _methods(source: str, cls_name: str):
    """{name: FunctionDef} of the methods of class cls_name in source."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return {fn.name: fn for fn in node.body if isinstance(fn, ast.FunctionDef)}
    return {}


def _calls(fn, name: str) -> bool:
    """fn names `name` (a call of it, or the runtime's alias, as a name or an attribute)."""
    return any((isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)
               for n in ast.walk(fn))
