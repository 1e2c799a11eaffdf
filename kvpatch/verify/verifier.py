"""The verifier of one target: eager decode/prefill and the decode CUDA-graph replay."""

from __future__ import annotations

import inspect
from functools import partial

import torch

from .fakes import DECODE
from .judge import FUSED_TOLERANCE, FullPoolGuard, _exc_text, compare, judge_fused
from .report import FAILED, PASSED, SKIPPED, CaseResult, VerifyReport
from .side import DECODE_SITE, PREFILL_SITE, Side, call_bound
from .spec import SpecCases
from .targets import BACKEND_CLASS, DECODE_UPDATER, Target
from .world import FP8, NATIVE_ATOL, NATIVE_RTOL, Q_DTYPE, Batch, DecodeShape, World

# Backend replay entry points, newest first (names only; arguments are bound
# by signature). Fallback: the decode updater's init_metadata_replay branch.
REPLAY_METHODS = ("_apply_cuda_graph_metadata", "init_forward_metadata_replay_cuda_graph")


class FileVerifier(SpecCases):
    def __init__(self, target: Target, orig: Side, pat: Side, rt, world: World, kernel: str,
                 report: VerifyReport):
        self.t, self.orig, self.pat, self.rt, self.world = target, orig, pat, rt, world
        self.kernel, self.report = kernel, report
        # A real capture needs CUDA and FlashInfer: the reference kernel reads its
        # lengths on the host, so a captured reference would replay stale lengths.
        self.capture = world.device.type == "cuda" and kernel == "flashinfer"
        # The runtime's fused_mla launches, counted (harness wraps it): a case served by
        # the fused path is judged against its tolerance, and says so (kv_path).
        self.fused_calls = [0]
        self.fused_in_capture = False

    def case(self, path, mode, exec_, batch_label, variant="") -> CaseResult:
        c = CaseResult(file=self.t.rel, qualname=DECODE_SITE if path == "decode" else PREFILL_SITE,
                       path=path, mode=mode, exec=exec_, batch=batch_label, kernel=self.kernel,
                       variant=variant)
        self.report.cases.append(c)
        return c

    def _kv_path(self, wrapper, guard_hits) -> str:
        rec = wrapper.__dict__.get("_kvverify", {})
        if guard_hits:
            return "cast"
        if rec.get("run_kv_dtype") == FP8:
            return "native" if rec.get("run_kv_ptr") == self.world.pool_ptr() else "fp8-copy"
        if rec.get("run_kv_dtype") == Q_DTYPE:
            return "gather"
        return "?"

    def judge(self, c: CaseResult, out, ref, wrapper, guard_hits, mode, fused=False):
        c.full_pool_casts = list(guard_hits)
        c.kv_path = "cast" if guard_hits else "fused" if fused else self._kv_path(wrapper, guard_hits)
        ident, c.max_abs_err, c.identical_share, close = compare(out, ref)
        rec = wrapper.__dict__.get("_kvverify", {})
        problems = []
        if guard_hits:
            problems.append("full-pool cast not removed: " + "; ".join(guard_hits))
        if c.kv_path == "fused":
            c.tolerance = FUSED_TOLERANCE
            problem, served = judge_fused(out, ref)
            problems += [problem] if problem else []
            c.status, c.message = (FAILED, "; ".join(problems)) if problems else (PASSED, served)
            return
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
            before = self.fused_calls[0]
            with guard:
                out, w = self.pat.run_eager(decode, batch)
                out = out.clone()
        except Exception as exc:
            self.fail_exc(c, exc, w or (self.pat.backend.decode_wrapper if decode
                                        else self.pat.backend.prefill_wrapper_paged))
            return
        self.judge(c, out, ref, w, guard.hits, mode, fused=self.fused_calls[0] > before)

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
                      forward_mode=fb.forward_mode, spec_info=None, seq_lens_cpu=fb.seq_lens_cpu,
                      plan=side.kv_plan, kv_view=side.translator.table(fb.req_pool_indices))
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
        fb = side.forward_batch(capture_batch, DECODE, seq_dtype=torch.int32)
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
            replay = self.capture_forward(
                partial(self.pat.forward, True, w, cap, fb_cap, q_nope, q_pe))
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
                fb = self.pat.forward_batch(batch, DECODE, seq_dtype=torch.int32)
                via = self._replay(self.pat, w, gb, batch, fb)
                q_nope.copy_(batch.q_nope)
                q_pe.copy_(batch.q_pe)
                self.rt.poison_shadows()
                out = replay()
            except Exception as exc:
                self.fail_exc(c, exc, w, what="replay")
                self._maybe_incompatible([c], exc, shape, cap, batch)
                continue
            self.judge(c, out, ref, w, [], mode, fused=self.fused_in_capture)
            if c.passed:
                c.message = f"replay via {via}" + (f"; {c.message}" if c.message else "")

    def capture_forward(self, fwd):
        """Capture fwd() in a CUDA graph (CUDA + FlashInfer), else run it once; returns
        a function that replays it (or runs it again) and returns a copy of its output."""
        if not self.capture:
            fwd()
            self.fused_in_capture = False  # each run decides again: judged as gathered
            return lambda: fwd().clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # SGLang warms up before capture
                fwd()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        before = self.fused_calls[0]
        with torch.cuda.graph(g):
            static_out = fwd()
        self.fused_in_capture = self.fused_calls[0] > before  # what every replay runs

        def replay():
            g.replay()
            torch.cuda.synchronize()
            return static_out.clone()
        return replay

    def _maybe_incompatible(self, cases, exc, shape, cap, batch):
        """A graph-path error the original shares (say, an old SGLang's
        fast_mla_decode_plan against a new FlashInfer) is no verdict on the patch."""
        try:
            w, gb, fb = self._graph_side(self.orig, shape, cap)
            self.orig.forward(True, w, cap, fb)
            if batch is not None:
                fb = self.orig.forward_batch(batch, DECODE, seq_dtype=torch.int32)
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

