"""What a patched run is judged by: the full-pool cast detector and the comparison."""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager
from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .side import Side, _storage_ptr
from .world import NATIVE_ATOL, NATIVE_RTOL


class FullPoolGuard(TorchDispatchMode):
    """Flags any op that reads the pool's storage and returns a new tensor at least
    as large as the pool: the full-pool cast the patch exists to remove (or any
    other full copy of it). Views of the pool share its storage and are fine;
    a gathered cast produces a [rows, 1, 576] tensor and is fine. A same-shaped copy
    of a view of the pool at least 1/16 of its size (the 64-wide rope part of every
    slot, cast whole by a routed call that lost the pool) is a full-pool cast too."""

    def __init__(self, pool_ptr: int, pool_numel: int, side: Side):
        super().__init__()
        self.ptr, self.numel, self.side = pool_ptr, pool_numel, side
        self.hits: List[str] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if len(self.hits) < 8:
            mine = [t for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and _storage_ptr(t) == self.ptr]
            views = [t.shape for t in mine if t.numel() * 16 >= self.numel]
            if mine:
                for o in tree_leaves(out):
                    if (isinstance(o, torch.Tensor) and (o.numel() >= self.numel or o.shape in views)
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


# The fused FP8 path reads the pool's FP8 rows itself (bf16 dots, fp32 softmax): it is
# compared with the original per output vector (one token, one head), as the runtime's
# GPU tests do; bf16 rounding puts that error near 2e-3 to 4e-3 (notes/gpu-runs.md).
FUSED_REL_TOL = 1.5e-2


# Split-kernel launches planned in this process, by kernel ("gluon", "wgmma" or "triton"),
# counted by fused_counted: a report can say which kernel its fused cases ran on.
FUSED_KERNELS = Counter()


@contextmanager
def fused_counted(rt, calls: list):
    """The runtime's fused_mla wrapped, for the block, to count its launches into calls[0]:
    a case then says which path served it (the routed call picks per call)."""
    real = getattr(rt, "fused_mla", None)
    if real is None:
        yield
        return
    # Which split kernel a plan took: the 16-row Gluon one (runtime 7+), else the 64-row one
    # (runtime 10+), else Triton's. The plan asks them in that order.
    gluon = getattr(rt, "_fused_gluon_choice", None)
    wgmma = getattr(rt, "_fused_wgmma_choice", None)

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    def chosen_gluon(*a, **k):
        picked = gluon(*a, **k)
        if picked is not None or wgmma is None:
            FUSED_KERNELS["gluon" if picked is not None else "triton"] += 1
        return picked

    def chosen_wgmma(*a, **k):
        picked = wgmma(*a, **k)
        FUSED_KERNELS["wgmma" if picked is not None else "triton"] += 1
        return picked
    rt.fused_mla = counted
    if gluon is not None:
        rt._fused_gluon_choice = chosen_gluon
    if wgmma is not None:
        rt._fused_wgmma_choice = chosen_wgmma
    try:
        yield
    finally:
        rt.fused_mla = real
        if gluon is not None:
            rt._fused_gluon_choice = gluon
        if wgmma is not None:
            rt._fused_wgmma_choice = wgmma


FUSED_TOLERANCE = f"worst output vector |out - ref| / |ref| < {FUSED_REL_TOL} (fused FP8 path)"


def judge_fused(out: torch.Tensor, ref: torch.Tensor):
    """(problem or "", message) for an output the fused path served: the FP8 rows read in
    place (bf16 dots, not the original's bf16 copy), so within FUSED_REL_TOL per vector."""
    err = vector_rel_err(out, ref)
    finite = bool(torch.isfinite(out).all())
    if finite and err < FUSED_REL_TOL:
        return "", f"fused path served; worst output vector error {err:.2e}"
    return (f"fused output off the original: worst output vector error {err:.3g} (tolerance {FUSED_REL_TOL})"
            + ("" if finite else "; NaN/inf in the output")), ""


def vector_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst output vector's |out - ref| / |ref| (last dim: one head's values)."""
    if out.shape != ref.shape:
        return float("inf")
    o, r = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    err = (o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6)
    return float(err.max()) if err.numel() else 0.0


def _exc_text(exc: BaseException, side: Side) -> str:
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
    site = side.site_of(frames)
    text = f"{type(exc).__name__}: {exc}"
    return f"{text} (raised in {site})" if site else text

