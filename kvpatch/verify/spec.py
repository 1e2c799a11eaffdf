"""Speculative-decoding cases: target verify and draft extend, eager and graph.

Driven through the backend's own entry points, which every release since 2025-05
has under one of two sets of names: ``init_forward_metadata(forward_batch)``
(eager), ``init_cuda_graph_state`` then ``init_forward_metadata_out_graph(fb,
in_capture=)`` (0.5.16+) or ``init_forward_metadata_capture_cuda_graph`` /
``..._replay_cuda_graph`` (older) for the graphs. The backend then picks its own
plan call: the stock ``wrapper.plan``, ``fast_mla_prefill_plan`` bound as
``wrapper.plan`` (EAGLE/MTP verify replay) or ``fast_mla_decode_plan`` called
as a plain function (DFLASH verify replay, 0.5.19+), which is what makes these
paths worth verifying: the runtime must learn the rows from each of them.

A path the original cannot run here (a release without draft-extend graphs, one
without a DFLASH fast plan) is SKIPPED with the reason, never passed.
"""

from __future__ import annotations

import functools

import torch

from . import fakes
from .fakes import DRAFT_EXTEND, TARGET_VERIFY
from .judge import FullPoolGuard, _exc_text
from .report import SKIPPED
from .side import Side, call_bound
from .targets import BACKEND_CLASS
from .world import Batch, HarnessError, SpecShape

EAGLE, DFLASH = "eagle", "dflash"
# Where a release keeps the DFLASH sync-free verify plan (0.5.19+).
DFLASH_FAST_PLAN = "_build_fast_verify_plan_kwargs"
FAST_PLAN_CALL = "generate_attn_arg_prefill(kv_indices_buf=)"
CAPTURE_NEW, REPLAY_NEW = "init_forward_metadata_out_graph", "init_forward_metadata_out_graph"
CAPTURE_OLD = "init_forward_metadata_capture_cuda_graph"
REPLAY_OLD = "init_forward_metadata_replay_cuda_graph"
# The ForwardMode question a backend asks where it has a path of its own for the
# mode: without it, the batch would run a path built for another mode.
MODE_QUESTION = {TARGET_VERIFY: "is_target_verify", DRAFT_EXTEND: "is_draft_extend"}
NO_OWN_PATH = {
    TARGET_VERIFY: "the backend has no target-verify path (it never asks "
                   "forward_mode.is_target_verify())",
    DRAFT_EXTEND: "the backend has no draft-extend path of its own (it never asks "
                  "forward_mode.is_draft_extend*()): draft extend runs the prefill path "
                  "verified above",
}


def _plan_name(wrapper) -> str:
    """Which function plans this wrapper next: a bound fast plan or its own plan()."""
    plan = wrapper.__dict__.get("plan")
    if isinstance(plan, functools.partial):
        return getattr(plan.func, "__name__", "partial")
    return "wrapper.plan"


class SpecCases:
    """Mixed into FileVerifier (which provides world, orig, pat, rt, case, judge, ...)."""

    # -- one side -------------------------------------------------------------------

    def spec_batch(self, prefixes, shape: SpecShape, label: str) -> Batch:
        seq = [p + shape.tokens for p in prefixes]
        return self.world.batch(seq, shape.heads, prefix=prefixes, label=label)

    def spec_fb(self, side: Side, kind: str, batch: Batch, variant: str, graph: bool):
        t, n = batch.extend[0], len(batch.seq_lens)
        r2t = self.world.req_to_token
        seq_dtype = torch.int32 if graph else torch.int64
        if kind == TARGET_VERIFY:
            spec = fakes.EagleVerifyInput(r2t, t, dflash=variant == DFLASH)
            # seq_lens exclude the draft tokens; DFLASH's host copy includes them
            # (SGLang 0.5.23 _build_fast_verify_plan_kwargs relies on that).
            return side.forward_batch(batch, kind, seq_dtype, spec, seq_lens=batch.prefix,
                                      seq_lens_cpu=batch.seq_lens if variant == DFLASH
                                      else batch.prefix)
        spec = fakes.EagleDraftInput(r2t, t, n, self.world.device)
        return side.forward_batch(batch, kind, seq_dtype, spec)

    def spec_eager_run(self, side: Side, kind: str, batch: Batch, variant: str):
        fb = self.spec_fb(side, kind, batch, variant, graph=False)
        side.heads(batch.q_nope.shape[1])
        call_bound(side.backend.init_forward_metadata, dict(forward_batch=fb),
                   what=f"{BACKEND_CLASS}.init_forward_metadata")
        w = side.backend.forward_metadata.prefill_wrapper
        return side.forward(False, None, batch, fb), w, fb.spec_info

    def spec_capture(self, side: Side, kind: str, variant: str, shape: SpecShape, batch: Batch):
        """SGLang's init_cuda_graph_state + capture-time metadata; returns the
        metadata the captured forward runs with."""
        b = side.backend
        side.heads(shape.heads)
        tokens = shape.bs * shape.tokens
        call_bound(b.init_cuda_graph_state, dict(max_bs=shape.bs, max_num_tokens=tokens),
                   what=f"{BACKEND_CLASS}.init_cuda_graph_state")
        fb = self.spec_fb(side, kind, batch, variant, graph=True)
        if hasattr(b, CAPTURE_NEW):
            call_bound(getattr(b, CAPTURE_NEW), dict(forward_batch=fb, in_capture=True),
                       what=f"{BACKEND_CLASS}.{CAPTURE_NEW}")
        elif hasattr(b, CAPTURE_OLD):
            call_bound(getattr(b, CAPTURE_OLD), dict(
                bs=shape.bs, num_tokens=tokens, req_pool_indices=fb.req_pool_indices,
                seq_lens=fb.seq_lens, encoder_lens=None, forward_mode=fb.forward_mode,
                spec_info=fb.spec_info), what=f"{BACKEND_CLASS}.{CAPTURE_OLD}")
        else:
            raise HarnessError(f"{BACKEND_CLASS} has neither {CAPTURE_NEW} nor {CAPTURE_OLD}")
        if not hasattr(b.forward_metadata, "prefill_wrapper"):
            raise HarnessError(f"graph capture for {kind} left no prefill wrapper "
                               f"({type(b.forward_metadata).__name__})")
        return b.forward_metadata, fb

    def spec_replay(self, side: Side, fb) -> str:
        b = side.backend
        if hasattr(b, REPLAY_NEW):
            call_bound(getattr(b, REPLAY_NEW), dict(forward_batch=fb, in_capture=False),
                       what=f"{BACKEND_CLASS}.{REPLAY_NEW}")
            return f"{REPLAY_NEW}(in_capture=False)"
        call_bound(getattr(b, REPLAY_OLD), dict(
            bs=fb.batch_size, req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
            seq_lens_sum=fb.seq_lens_sum, encoder_lens=None, forward_mode=fb.forward_mode,
            spec_info=fb.spec_info, seq_lens_cpu=fb.seq_lens_cpu),
            what=f"{BACKEND_CLASS}.{REPLAY_OLD}")
        return REPLAY_OLD

    # -- cases ------------------------------------------------------------------------

    def spec_eager(self, kind: str, mode: str, shape: SpecShape):
        W = self.world
        prefixes = W.randint(max(1, shape.max_prefix // 2), shape.max_prefix, shape.bs - 1)
        batch = self.spec_batch(prefixes + [shape.max_prefix], shape,
                                f"bs={shape.bs} heads={shape.heads} tokens={shape.tokens}")
        c = self.case(kind, mode, "eager", batch.label, EAGLE)
        if MODE_QUESTION[kind] not in self.orig.source:
            c.status, c.message = SKIPPED, NO_OWN_PATH[kind]
            return
        try:
            ref = self.spec_eager_run(self.orig, kind, batch, EAGLE)[0].clone()
        except Exception as exc:
            c.status, c.message = SKIPPED, (f"the original does not run {kind} here: "
                                            f"{_exc_text(exc, self.orig)}")
            return
        w = None
        try:
            self.spec_eager_run(self.pat, kind, batch, EAGLE)       # warm-up: shadows
            self.rt.poison_shadows()
            guard = FullPoolGuard(W.pool_ptr(), W.store.numel(), self.pat)
            before = self.fused_calls[0]
            with guard:
                out, w, spec = self.spec_eager_run(self.pat, kind, batch, EAGLE)
                out = out.clone()
        except Exception as exc:
            self.fail_exc(c, exc, w)
            return
        self.judge(c, out, ref, w, guard.hits, mode, fused=self.fused_calls[0] > before)
        if not c.message:
            c.message = f"planned by {', '.join(spec.calls) or 'the extend path'}"

    def spec_graph(self, kind: str, variant: str, mode: str, shape: SpecShape):
        exec_ = "graph" if self.capture else "replay"
        W, mp = self.world, shape.max_prefix
        cap = self.spec_batch(W.randint(1, max(1, mp // 4), shape.bs), shape, "capture")
        replays = [("longer", W.randint(max(1, mp // 2), mp, shape.bs - 1) + [mp]),
                   ("shorter", W.randint(1, max(1, mp // 8), shape.bs))]
        cases = [self.case(kind, mode, exec_, f"bs={shape.bs} heads={shape.heads} tokens="
                           f"{shape.tokens} replay {lbl} prefix total={sum(p)} (capture "
                           f"{sum(cap.prefix)})", variant) for lbl, p in replays]
        why = self._spec_graph_unsupported(kind, variant, shape, cap)
        if why:
            for c in cases:
                c.status, c.message = SKIPPED, why
            return
        try:
            meta, fb_cap = self.spec_capture(self.pat, kind, variant, shape, cap)
            w = meta.prefill_wrapper
            q_nope, q_pe = cap.q_nope.clone(), cap.q_pe.clone()

            def fwd():
                self.pat.backend.forward_metadata = meta  # replay keeps the captured one
                return self.pat.forward(False, None, cap, fb_cap, q_nope, q_pe)
            replay = self.capture_forward(fwd)
        except Exception as exc:
            for c in cases:
                self.fail_exc(c, exc, None, what="capture-time plan/capture")
            return
        for c, (lbl, prefixes) in zip(cases, replays):
            batch = self.spec_batch(prefixes, shape, lbl)
            try:
                ref = self.spec_eager_run(self.orig, kind, batch, variant)[0].clone()
            except Exception as exc:
                c.status, c.message = SKIPPED, f"original raised {_exc_text(exc, self.orig)}"
                continue
            try:
                fb = self.spec_fb(self.pat, kind, batch, variant, graph=True)
                via = self.spec_replay(self.pat, fb)
                q_nope.copy_(batch.q_nope)
                q_pe.copy_(batch.q_pe)
                self.rt.poison_shadows()
                out = replay()
            except Exception as exc:
                self.fail_exc(c, exc, w, what="replay")
                continue
            self.judge(c, out, ref, w, [], mode, fused=self.fused_in_capture)
            calls = fb.spec_info.calls
            if variant == DFLASH and FAST_PLAN_CALL not in calls and c.passed:
                c.status = SKIPPED
                c.message = (f"DFLASH fast verify plan not taken (spec calls: {calls}): "
                             "the case ran the generic path, so DFLASH is not verified")
            elif not c.message:
                c.message = (f"replay via {via}, planned by "
                             f"{'fast_mla_decode_plan' if FAST_PLAN_CALL in calls else _plan_name(w)}")

    def _spec_graph_unsupported(self, kind, variant, shape, cap) -> str:
        """Why the release has no such graph (the original cannot capture and replay
        it), or ''."""
        if MODE_QUESTION[kind] not in self.orig.source:
            return NO_OWN_PATH[kind]
        if variant == DFLASH and not hasattr(self.orig.backend, DFLASH_FAST_PLAN):
            return (f"no DFLASH fast verify plan in this release ({BACKEND_CLASS}."
                    f"{DFLASH_FAST_PLAN} absent): DFLASH verify takes the EAGLE/MTP path")
        try:
            self.spec_capture(self.orig, kind, variant, shape, cap)
        except Exception as exc:
            return (f"the original does not capture {kind} graphs here: "
                    f"{_exc_text(exc, self.orig)}")
        return ""
