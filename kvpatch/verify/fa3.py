"""Verify the page-table family (KVP103, and the calls KVP106 and KVP108 route): FA3/FA4
``FlashAttentionBackend``'s absorbed MLA and its ports (MUSA; XPU, whose decode calls
sgl-kernel's positional ``flash_mla_decode``).

Both sides (the checkout's original file and its patched one) run their own
``forward_decode`` and ``forward_extend`` on one random FP8 pool, with
``fa3_reference`` standing in for sgl-kernel's ``flash_attn_with_kvcache``,
``flash_mla_decode``/``flash_mla_prefill`` and ``merge_state_v2``. A routed call
(``paged_attention``, ``paged_mla``) runs gathered, and fused where the mode asks for it on
CUDA (counted through ``fused_mla``; on the CPU the fused path is reported as not run). The metadata the backend reads (``forward_metadata``:
``page_table``, ``cache_seqlens_int32``, ``cu_seqlens_q``; and the cascade call's
``forward_metadata_spec_decode_expand``) is built here as SGLang's
``init_forward_metadata`` leaves it: requests on scattered pages, prefix pages
shared between requests, stale page ids past each request's length. Cases: page sizes
1, 16 and 64; decode; decode with the cascade (speculative top-k > 1) second
table; prefill with prefixes (causal, query offset); target verify (top-k 1) and draft
extend, a few causal query tokens per request; target verify with the cascade; and
decode and target verify through a CUDA graph (captured on CUDA, replayed eagerly on the
CPU) whose page table, lengths and queries are rewritten in place before each replay.
Outputs must be bit-identical; the patched run must make no full-pool copy.
"""

from __future__ import annotations

import math
import os
import types
from functools import partial
import torch

from .fa3_reference import KERNEL_NAME
from .fakes import DECODE, DRAFT_EXTEND, EXTEND, TARGET_VERIFY, Mode
from kvpatch.names import MODE_ENV, MODE_FUSED as FUSED, MODE_GATHER as GATHER, MODE_NATIVE

from .judge import FUSED_TOLERANCE, FullPoolGuard, _exc_text, compare, fused_counted, judge_fused
from .report import FAILED, PASSED, SKIPPED, CaseResult
from .side import ForwardBatch, Side, call_bound
from .targets import qualname_map
from .verifier import FileVerifier
from .world import FP8, HEAD_DIM, KV_LORA, Q_DTYPE, ROPE, SM_SCALE, HarnessError

PAGE_SIZES = (1, 16, 64)
QUICK_PAGE_SIZES = (1, 64)
CASCADE = "cascade"
FA4, FA4_PAGE_SIZE = "fa4", 16
HEADS = 16
# (seq lens) per decode case; (prefix, extend) per prefill case; (prefix lens, tokens) per verify case.
DECODE_LENS = ([37], [300, 5, 129], [64, 64, 1])
PREFILL_LENS = (([100, 0], [20, 13]), ([250, 5, 1], [3, 40, 1]))
VERIFY_LENS = (([40, 90], 3),)
GRAPH_LENS = ([20, 9, 40], [[150, 70, 190], [3, 1, 2]])  # capture, then replays (same batch size)


class _Open:
    """Attributes not set read as None (SGLang's defaults for the paths not taken)."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return None


class Meta(types.SimpleNamespace, _Open):
    pass


class Layer(types.SimpleNamespace, _Open):
    pass


class Case:
    """One batch on pages: the page table, lengths and queries both sides read."""

    def __init__(self, gen, dev, slots, ps, lens, qlens, heads=HEADS, width=None, expand=False, ver=3):
        self.ps, self.lens, self.qlens, self.ver = ps, list(lens), list(qlens), ver
        npages = [math.ceil(n / ps) for n in lens]
        pages = torch.randperm(slots // ps - 1, generator=gen, device=dev) + 1
        used = 0
        width = width or max(npages + [1]) + 2
        table = torch.randint(1, slots // ps, (len(lens), width), generator=gen, device=dev)  # stale ids
        for b, n in enumerate(npages):
            share = min(n - 1, npages[0] - 1, 2) if b else 0  # prefix pages shared with request 0
            if share > 0:
                table[b, :share] = table[0, :share]
            table[b, max(share, 0):n] = pages[used: used + n - max(share, 0)]
            used += n - max(share, 0)
        cu_q = torch.tensor([0] + self.qlens, device=dev).cumsum(0)
        cu_k = torch.tensor([0] + self.lens, device=dev).cumsum(0)
        self.meta = Meta(page_table=table.to(torch.int32), cache_seqlens_int32=torch.tensor(
            self.lens, dtype=torch.int32, device=dev), cu_seqlens_q=cu_q.to(torch.int32),
            cu_seqlens_k=cu_k.to(torch.int32), max_seq_len_q=max(self.qlens), max_seq_len_k=max(self.lens))
        nq = sum(self.qlens)
        self.q_nope = torch.randn((nq, heads, KV_LORA), generator=gen, device=dev).to(Q_DTYPE)
        self.q_pe = torch.randn((nq, heads, ROPE), generator=gen, device=dev).to(Q_DTYPE)
        self.expand = None
        if expand:  # top-k > 1: each query also reads its own draft tokens, on fresh pages
            elens = torch.randint(1, ps * 2 + 1, (nq,), generator=gen, device=dev)
            ew = 2
            et = pages[used: used + nq * ew].view(nq, ew)
            self.expand = Meta(page_table=et.to(torch.int32), cache_seqlens_int32=elens.to(torch.int32),
                               cu_seqlens_q=torch.arange(nq + 1, dtype=torch.int32, device=dev),
                               cu_seqlens_k=torch.cat([elens.new_zeros(1), elens.cumsum(0)]).to(torch.int32),
                               max_seq_len_q=1, max_seq_len_k=int(elens.max()))

    def label(self):
        return f"page_size={self.ps} kv_lens={self.lens} q_lens={self.qlens}" + (f" fa{self.ver}" if self.ver != 3 else "")

    def clone_meta(self):
        m = Meta(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(self.meta).items()})
        return m


class FA3Side:
    """One loaded module (original or patched) and its backend, built without __init__."""

    site_of = Side.site_of
    caller_site = Side.caller_site

    def __init__(self, name, module, filename, source, pool, device, rel, cls_name):
        self.name, self.module, self.filename, self.rel, self.cls_name = name, module, filename, rel, cls_name
        self.qmap = qualname_map(source)
        cls = getattr(module, cls_name, None)
        if not isinstance(cls, type):
            raise HarnessError(f"{rel}: {name} module defines no class {cls_name}")
        open_cls = type(cls.__name__, (cls, _Open), {"__module__": cls.__module__})
        self.backend = b = open_cls.__new__(open_cls)
        b.__dict__.update(
            device=device, token_to_kv_pool=pool, use_mla=True, topk=1, fa_impl_ver=3, num_splits=0,
            kv_cache_dtype=FP8, kv_cache_dtype_str="fp8_e4m3", kv_cache_is_mxfp8=False,
            has_local_attention=False, attention_chunk_size=None, is_prefill_aware_swa=False,
            use_sliding_window_kv_pool=False, attn_cp_size=1, fa_skip_kv_cache=False, dcp_size=1)

    def forward(self, kind: str, case: Case, meta=None, q_nope=None, q_pe=None):
        b = self.backend
        b.page_size, b.fa_impl_ver = case.ps, case.ver
        b.topk = 2 if case.expand is not None else 1
        b.forward_metadata = meta or case.meta
        b.forward_metadata_spec_decode_expand = case.expand
        layer = Layer(layer_id=0, tp_q_head_num=case.q_nope.shape[1], tp_k_head_num=1, tp_v_head_num=1,
                      head_dim=HEAD_DIM, qk_head_dim=HEAD_DIM, v_head_dim=KV_LORA, scaling=SM_SCALE,
                      logit_cap=0.0, sliding_window_size=None, is_cross_attention=False, use_irope=False)
        fb = ForwardBatch(forward_mode=Mode(kind), batch_size=len(case.lens),
                          spec_info=object() if (kind == DECODE and case.expand is not None) else None,
                          attn_attend_prefix_cache=None, attn_cp_metadata=None, mha_return_lse=False,
                          # before 2025-09 the FA3 backend read the pool from the batch, not from self
                          token_to_kv_pool=b.token_to_kv_pool)
        name = "forward_decode" if kind == DECODE else "forward_extend"
        if not callable(getattr(type(b), name, None)):
            raise HarnessError(f"{self.cls_name} has no {name}")
        fn = getattr(b, name)
        o = call_bound(fn, dict(q=case.q_nope if q_nope is None else q_nope, k=None, v=None, layer=layer,
                                forward_batch=fb, save_kv_cache=False,
                                q_rope=case.q_pe if q_pe is None else q_pe, k_rope=None),
                       what=f"{self.cls_name}.forward_{'decode' if kind == DECODE else 'extend'}")
        o = o[0] if isinstance(o, tuple) else o
        if not isinstance(o, torch.Tensor):  # a kernel served by a stub, not by fa3_reference
            raise HarnessError(f"{self.cls_name}.{name} returned {type(o).__name__}, not a tensor: "
                               "the kernel it calls on this path has no reference in verify")
        return o


class FA3Verifier:
    capture_forward = FileVerifier.capture_forward

    def __init__(self, rel, orig: FA3Side, pat: FA3Side, rt, world, report, gen, path: str = GATHER):
        self.rel, self.orig, self.pat, self.rt, self.world, self.report = rel, orig, pat, rt, world, report
        self.gen, self.dev = gen, world.device
        self.path = path  # GATHER (KVPATCH_MODE=gather) or FUSED (KVPATCH_MODE=fused)
        self.fused_calls = [0]  # the runtime's fused_mla, counted (fused mode)
        self.capture = self.dev.type == "cuda"  # the reference kernel reads its lengths on the device

    def case_result(self, kind, exec_, label, variant="") -> CaseResult:
        c = CaseResult(file=self.rel, qualname=f"{self.pat.cls_name}.forward_{'decode' if kind == DECODE else 'extend'}",
                       path={DECODE: "decode", EXTEND: "prefill"}.get(kind, kind), mode=self.path, exec=exec_,
                       batch=label, kernel=KERNEL_NAME, variant=variant)
        self.report.cases.append(c)
        return c

    def judge(self, c, out, ref, hits, fused_before=None):
        c.full_pool_casts = list(hits)
        fused = fused_before is not None and self.fused_calls[0] > fused_before
        c.kv_path = "cast" if hits else FUSED if fused else "gather"
        ident, c.max_abs_err, c.identical_share, _ = compare(out, ref)
        c.tolerance = "bit-identical (torch.equal)"
        problems = []
        if hits:
            problems.append("full-pool cast not removed: " + "; ".join(hits))
        if fused:
            c.tolerance = FUSED_TOLERANCE
            problem, c.message = judge_fused(out, ref)
            problems += [problem] if problem else []
        elif not ident:
            problems.append(f"output differs from the original: max_abs_err={c.max_abs_err:.4g}, "
                            f"identical={c.identical_share:.4f}"
                            + (" (NaN: a page the kernel reads was not cast)" if not torch.isfinite(out).all()
                               else ""))
        c.status, c.message = (FAILED, "; ".join(problems)) if problems else (PASSED, c.message)

    def new_case(self, ps, lens, qlens, expand=False, width=None, ver=3):
        return Case(self.gen, self.dev, self.world.slots, ps, lens, qlens, width=width, expand=expand, ver=ver)

    def eager(self, kind, case: Case, variant=""):
        c = self.case_result(kind, "eager", case.label(), variant)
        try:
            ref = self.orig.forward(kind, case).clone()
        except Exception as exc:
            c.status, c.message = SKIPPED, f"original raised {_exc_text(exc, self.orig)}: nothing to compare"
            self.report.add_reason(f"{self.rel}: the original's {c.route} does not run in the harness")
            return
        try:
            self.pat.forward(kind, case)  # warm-up: allocates the shadow
            self.rt.poison_shadows()
            guard = FullPoolGuard(self.world.pool_ptr(), self.world.store.numel(), self.pat)
            before = self.fused_calls[0]
            with guard:
                out = self.pat.forward(kind, case).clone()
        except Exception as exc:
            c.status, c.message = FAILED, f"patched run raised {_exc_text(exc, self.pat)}"
            return
        self.judge(c, out, ref, guard.hits, before)

    def graph(self, ps, kind=DECODE, tq=1):
        """Capture kind's forward once, replay it with the batch's buffers rewritten in
        place (kv lengths hold the tq query tokens of each request, as in target verify)."""
        cap_lens, replays = [n + tq - 1 for n in GRAPH_LENS[0]], [[n + tq - 1 for n in r] for r in GRAPH_LENS[1]]
        width = max(math.ceil(n / ps) for lens in [cap_lens] + replays for n in lens) + 2
        cap = self.new_case(ps, cap_lens, [tq] * len(cap_lens), width=width)
        exec_ = "graph" if self.capture else "replay"
        cases = [self.new_case(ps, lens, [tq] * len(lens), width=width) for lens in replays]
        results = [self.case_result(kind, exec_, f"{cs.label()} (capture kv_lens={cap_lens})") for cs in cases]
        try:
            self.orig.forward(kind, cap)
        except Exception as exc:
            for c in results:
                c.status, c.message = SKIPPED, f"original raised {_exc_text(exc, self.orig)}: nothing to compare"
            return
        meta = cap.clone_meta()  # the graph's fixed buffers
        q_nope, q_pe = cap.q_nope.clone(), cap.q_pe.clone()
        try:
            self.fused_at_capture = self.fused_calls[0]  # a replay runs what the capture recorded
            replay = self.capture_forward(partial(self.pat.forward, kind, cap, meta, q_nope, q_pe))
        except Exception as exc:
            for c in results:
                c.status, c.message = FAILED, f"capture raised {_exc_text(exc, self.pat)}"
            return
        for c, cs in zip(results, cases):
            try:
                ref = self.orig.forward(kind, cs).clone()
            except Exception as exc:
                c.status, c.message = SKIPPED, f"original raised {_exc_text(exc, self.orig)}"
                continue
            for k, v in vars(cs.meta).items():  # SGLang's replay: rewrite the buffers in place
                if isinstance(v, torch.Tensor):
                    getattr(meta, k).copy_(v)
            q_nope.copy_(cs.q_nope)
            q_pe.copy_(cs.q_pe)
            try:
                self.rt.poison_shadows()
                out = replay()
            except Exception as exc:
                c.status, c.message = FAILED, f"replay raised {_exc_text(exc, self.pat)}"
                continue
            self.judge(c, out, ref, [], self.fused_at_capture)
            if c.passed:
                c.message = "page table, lengths and queries rewritten in place before the replay" + (
                    f"; {c.message}" if c.kv_path == FUSED else "")

    def selfcheck_forward(self):
        """One small forward of the original, whose full-pool cast the guard must see."""
        self.orig.forward(DECODE, self.new_case(16, [33, 7], [1, 1]))

    def guard_selfcheck(self):
        guard = FullPoolGuard(self.world.pool_ptr(), self.world.store.numel(), self.orig)
        try:
            with guard:
                self.selfcheck_forward()
        except Exception:
            return
        if not guard.hits:
            self.report.errors.append(f"{self.rel}: guard self-check failed: the original's full-pool cast "
                                      "was not seen, so the no-full-cast check would prove nothing")

    def run(self, graph: bool, quick: bool = False):
        self.guard_selfcheck()
        for ps in QUICK_PAGE_SIZES if quick else PAGE_SIZES:
            for lens in DECODE_LENS[:2] if quick else DECODE_LENS:
                self.eager(DECODE, self.new_case(ps, lens, [1] * len(lens)))
            lens = DECODE_LENS[1]
            self.eager(DECODE, self.new_case(ps, lens, [1] * len(lens), expand=True), CASCADE)
            for prefix, extend in PREFILL_LENS[:1] if quick else PREFILL_LENS:
                self.eager(EXTEND, self.new_case(ps, [p + e for p, e in zip(prefix, extend)], extend))
            for prefix, tokens in VERIFY_LENS:
                lens, qlens = [p + tokens for p in prefix], [tokens] * len(prefix)
                # top-k 1 (EAGLE/MTP chains) and draft extend: one causal call over a few
                # query tokens per request, the shape the fused path serves
                self.eager(TARGET_VERIFY, self.new_case(ps, lens, qlens))
                self.eager(DRAFT_EXTEND, self.new_case(ps, lens, qlens))
                self.eager(TARGET_VERIFY, self.new_case(ps, lens, qlens, expand=True), CASCADE)
            if graph:
                self.graph(ps)
                if not quick:
                    self.graph(ps, TARGET_VERIFY, VERIFY_LENS[0][1])
        # FA4 (fa_impl_ver=4) shares the absorbed-MLA site and its cast; its branches differ
        # around the kernel call, so run them too (the same reference kernel: the rows read
        # are FA3's). A release whose original refuses FA4 here reports the case skipped.
        lens = DECODE_LENS[1]
        self.eager(DECODE, self.new_case(FA4_PAGE_SIZE, lens, [1] * len(lens), ver=4), FA4)
        prefix, extend = PREFILL_LENS[0]
        self.eager(EXTEND, self.new_case(FA4_PAGE_SIZE, [p + e for p, e in zip(prefix, extend)], extend, ver=4),
                   FA4)


def load_target(t, sandbox, report, find_runtime, redirect):
    """(original module, patched module, runtime, patched source) of one target file, loaded in
    the sandbox with the kernels redirected; None, with the error reported, when it cannot be."""
    from .stubs import module_name_for

    modname = module_name_for(t.rel)
    patched_src = t.path.read_text(encoding="utf-8")
    try:
        omod = sandbox.load(modname, t.original, f"<original {t.original_from}>")
        pmod = sandbox.load(modname, patched_src, str(t.path), runtime_path=str(t.runtime))
    except Exception as exc:
        report.errors.append(f"{t.rel}: cannot import in the verify sandbox: {type(exc).__name__}: {exc}")
        return None
    rt = find_runtime(pmod)
    if rt is None:
        report.errors.append(f"{t.rel}: the patched module holds no kvpatch runtime module")
        return None
    redirect(omod, pmod)
    return omod, pmod, rt, patched_src


def verify_fa3_target(t, sandbox, world, modes, graph, quick, report, log, find_runtime, redirect):
    """The FA3 cases of one target file (``harness._verify_target``'s counterpart)."""
    loaded = load_target(t, sandbox, report, find_runtime, redirect)
    if loaded is None:
        return
    omod, pmod, rt, patched_src = loaded
    try:
        orig = FA3Side("original", omod, f"<original {t.original_from}>", t.original, world.pool, world.device,
                       t.rel, t.cls)
        pat = FA3Side("patched", pmod, str(t.path), patched_src, world.pool, world.device, t.rel, t.cls)
    except HarnessError as exc:
        report.errors.append(str(exc))
        return
    report.files.append(t.rel)
    if MODE_NATIVE in modes:
        report.notes.append(f"{t.rel}: the page-table cast has no native FP8 mode: verified gathered")
    paths = [GATHER] + ([FUSED] if FUSED in modes else [])
    for path in paths:
        if path == FUSED:
            if world.device.type != "cuda":  # as native FP8: a GPU path, named as not run
                report.add_reason(f"fused path not run: it needs a CUDA device with Triton (device here: "
                                  f"{world.device.type})")
                continue
            if not rt._fused_build():
                report.unverified.append(f"{t.rel}: fused path not verified: Triton is not importable here")
                continue
        os.environ[MODE_ENV] = path
        rt.reset()
        log(f"{t.rel}: FA3 family ({t.cls}), {path} path, original from {t.original_from}, kernel {KERNEL_NAME}")
        gen = torch.Generator(device=world.device).manual_seed(1)
        v = FA3Verifier(t.rel, orig, pat, rt, world, report, gen, path)
        try:
            with fused_counted(rt, v.fused_calls):
                v.run(graph, quick)
        finally:
            rt.reset()
        if path == FUSED and not v.fused_calls[0]:  # its cases ran gathered, and say so (kv_path)
            report.unverified.append(f"{t.rel}: fused path not verified: no call took it (only calls routed "
                                     f"through the runtime, within the fused path's contract, do)")
