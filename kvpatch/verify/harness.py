"""Run a checkout's patched FlashInfer MLA backend against its original.

For every target file: load the original and the patched module in the import
sandbox, build one random FP8 KV pool (uint8 storage viewed as float8_e4m3fn,
[slots, 1, 576]) shared by both, and for several batch shapes with scattered
slots run ``forward_decode`` (eager, and through the CUDA-graph replay path),
the paged ``forward_extend`` (causal, with prefixes) and the speculative paths
of ``spec`` (target verify and draft extend, eager and graph) of both. Gathered
casts must be bit-identical to the original; native FP8 must be within
NATIVE_ATOL/NATIVE_RTOL. Eager patched runs are watched by ``FullPoolGuard``
(a full-pool copy of the pool is a failure even when outputs match), and the
runtime's shadow buffers are poisoned before every measured patched run.

Modules: world (shapes, pool, request table), side (one loaded module and its
backend), judge (full-pool cast detector, comparison), verifier (the cases of
one file), spec (its speculative-decoding cases), fakes (torch versions of the
SGLang objects the indices come from), this one (the entry point). Version-specific knowledge is confined
to the attribute tables of ``side`` (the superset of what the forward/plan
paths of the SGLang versions read), the fakes of ``stubs.REAL`` and the entry
point names of ``verifier``; calls go through ``call_bound``, which passes each
method the arguments its signature names.
"""

from __future__ import annotations

import os
import traceback
import types
from functools import partial
from typing import Optional

import torch

from kvpatch.names import MODE_AUTO, MODE_FUSED, MODE_GATHER, MODE_NATIVE, RUNTIME_MODULE, RUNTIME_VERSION_VAR, STATE_DIR, STATE_FILE

from . import fakes, stubs
from .reference import make_flashinfer_stub
from .judge import fused_counted
from .report import SKIPPED, CaseResult, VerifyReport
from .fakes import DRAFT_EXTEND, TARGET_VERIFY
from .side import DECODE_SITE, PREFILL_SITE, Side
from .spec import DFLASH, EAGLE
from .fa3 import verify_fa3_target
from .aiter import verify_aiter_target
from .sparse import verify_sparse_target
from .deadstore import verify_deletions
from .targets import AITER, DEADSTORE, FA3, SPARSE, Target, find_targets
from .verifier import FileVerifier
from .world import CPU_SHAPES, GPU_SHAPES, QUICK_SHAPES, HarnessError, Shapes, World


def _find_runtime(module):
    for v in vars(module).values():
        if isinstance(v, types.ModuleType) and hasattr(v, RUNTIME_VERSION_VAR):
            return v
    return None


def _redirect(device, *modules):
    """On the CPU path, the modules' hard-coded "cuda" factories make CPU tensors."""
    if device.type != "cuda":
        for m in modules:
            m.torch = stubs.DeviceRedirectTorch(device)


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
    known = (MODE_GATHER, MODE_NATIVE, MODE_AUTO, MODE_FUSED)
    bad = [m for m in modes if m not in known]
    if bad:
        raise ValueError(f"unknown verify mode(s) {bad}: use {', '.join(known)}")
    targets, notes = find_targets(root)
    report.notes.extend(notes)
    if not targets:
        report.add_reason(f"no patched file found (no {STATE_DIR}/{STATE_FILE} and no file imports "
                          f"{RUNTIME_MODULE})")
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
    stubs.set_dcp(shapes.dcp, shapes.dcp_rank)
    sandbox = stubs.Sandbox(flashinfer_stub=None if fi is not None else make_flashinfer_stub())
    try:
        with sandbox, torch.no_grad():
            world = None
            for t in targets:
                if t.skip:  # patched, but no driver here: its rewrites stay unverified, and say so
                    report.unverified.append(t.skip)
                    continue
                if t.problem:
                    report.errors.append(t.problem)
                    continue
                verify_deletions(t, report)  # dead casts deleted (KVP104), symbolically
                if t.family == DEADSTORE:
                    report.files.append(t.rel)
                    continue
                if world is None:
                    log(f"building a {shapes.pool_slots}-slot FP8 pool on {dev}")
                    world = World(shapes, dev)
                try:
                    if t.family in (FA3, AITER, SPARSE):
                        drive = {FA3: verify_fa3_target, AITER: verify_aiter_target,
                                 SPARSE: verify_sparse_target}[t.family]
                        drive(t, sandbox, world, modes, graph, quick, report, log, _find_runtime,
                              partial(_redirect, world.device))
                        continue
                    _verify_target(t, sandbox, world, shapes, modes, kernel, fi, graph, report, log)
                except Exception as exc:  # a harness bug must not hide the other targets
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    report.errors.append(f"{t.rel}: verify harness error {type(exc).__name__}: {exc}"
                                         f" (at {where.filename}:{where.lineno})")
    finally:
        stubs.set_dcp(1)
        if saved_mode is None:
            os.environ.pop("KVPATCH_MODE", None)
        else:
            os.environ["KVPATCH_MODE"] = saved_mode
    if not report.files and not report.errors:
        report.add_reason("no patched backend file of a family verify drives found" + (
            f" ({len(report.unverified)} patched file(s) of other backends, not verified)" if report.unverified else ""))
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
    _redirect(world.device, omod, pmod)
    try:
        orig = Side("original", omod, osrc_name, t.original, world, t.rel)
        pat = Side("patched", pmod, str(t.path), t.path.read_text(encoding="utf-8"), world, t.rel)
    except HarnessError as exc:
        report.errors.append(str(exc))
        return
    report.files.append(t.rel)
    # Before 0.5.19 the DCP planner itself turns widened ids into pool rows; from
    # then on the backend asks its translator to.
    stubs.set_dcp(world.dcp, shapes.dcp_rank, planner_translates="translate_dcp_read_ids" not in t.original)
    fakes.DCP.translated = 0
    if world.dcp > 1 and "plan_dcp_decode_metadata" not in t.original:
        report.add_reason(f"{t.rel}: DCP not exercised: this backend has no DCP decode planner")
        return
    v = FileVerifier(t, orig, pat, rt, world, kernel, report)
    log(f"{t.rel}: original from {t.original_from}, kernel {kernel}")
    with fused_counted(rt, v.fused_calls):
        _run_modes(t, v, rt, world, shapes, modes, kernel, graph, report, log)
    if MODE_FUSED in modes and world.device.type == "cuda" and kernel == "flashinfer" and not v.fused_calls[0]:
        report.unverified.append(f"{t.rel}: fused path not verified: no call took it (only run() calls routed "
                                 f"through the runtime, within the fused path's contract, do)")


def _run_modes(t, v, rt, world, shapes, modes, kernel, graph, report, log):
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
            if skip or world.dcp > 1:
                _skip(report, t, "prefill", mode, "eager", label, skip or DCP_DECODE_ONLY)
                continue
            log(f"  {mode} prefill eager {label}")
            v.eager(False, mode, world.batch(seq, s.heads, prefix=s.prefix, label=label))
        for s in shapes.spec:
            for kind in (TARGET_VERIFY, DRAFT_EXTEND):
                label = f"bs={s.bs} heads={s.heads} tokens={s.tokens}"
                variants = [EAGLE, DFLASH] if kind == TARGET_VERIFY else [EAGLE]
                if skip or world.dcp > 1:
                    why = skip or DCP_DECODE_ONLY
                    _skip(report, t, kind, mode, "eager", label, why, EAGLE)
                    for variant in variants if graph else []:
                        _skip(report, t, kind, mode, "graph" if v.capture else "replay", label,
                              why, variant)
                    continue
                log(f"  {mode} {kind} eager {label}")
                v.spec_eager(kind, mode, s)
                for variant in variants if graph else []:
                    log(f"  {mode} {kind} {variant} {'graph' if v.capture else 'replay'} {label}")
                    v.spec_graph(kind, variant, mode, s)
        if skip:
            report.add_reason(f"native mode not run: {skip}")
        for c in report.cases[n_before:]:
            if c.failed:
                log(f"  FAIL {c.site} [{c.label()}]: {c.message}")
    if world.dcp > 1:
        if fakes.DCP.translated:
            report.notes.append(f"{t.rel}: DCP rank {shapes.dcp_rank} of {world.dcp}: the decode kernels "
                                f"read this rank's shard ({fakes.DCP.translated} ids localised)")
        else:
            report.add_reason(f"{t.rel}: DCP not exercised: no decode plan went through the DCP planner")
    if world.v2p is not None:
        n = min(v.orig.translator.translated, v.pat.translator.translated)
        if n:
            report.notes.append(f"{t.rel}: unified memory: the kernels read translated pool rows "
                                f"({n} ids translated per side)")
        else:
            report.add_reason(f"{t.rel}: unified memory not exercised: the backend never reads "
                              f"through a KV index translator (before 0.5.19)")
    rt.reset()


DCP_DECODE_ONLY = ("not run under DCP: SGLang's DCP prefill reads its own gathered buffer "
                   "(attn_dcp_metadata) and speculative plans are off; verified without DCP")


def _skip(report, t, path, mode, exec_, label, why, variant=""):
    report.cases.append(CaseResult(
        file=t.rel, qualname=DECODE_SITE if path == "decode" else PREFILL_SITE, path=path,
        mode=mode, exec=exec_, batch=label, variant=variant, status=SKIPPED, message=why))


def _short(xs, n=6):
    xs = list(xs)
    return str(xs) if len(xs) <= n else f"[{', '.join(map(str, xs[:n]))}, ... ({len(xs)})]"
