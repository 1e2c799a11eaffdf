"""What a patched run is judged by: the full-pool cast detector and the comparison."""

from __future__ import annotations

import traceback
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

