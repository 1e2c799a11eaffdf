"""`kvpatch verify`: run a patched checkout's own FlashInfer MLA backend against its original.

Importing this package does not import torch; ``run_verify`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

from .report import CaseResult, VerifyReport

__all__ = ["run_verify", "VerifyReport", "CaseResult"]


def run_verify(root: Path, *, modes: Iterable[str] = ("gather", "native"), device: str = "auto",
               graph: bool = True, quick: bool = False,
               log: Optional[Callable[[str], None]] = None, shapes=None) -> VerifyReport:
    """Verify every patched FlashInfer MLA backend file under ``root``.

    modes: subset of "gather", "native" (and "auto": whatever the runtime picks).
    device: "auto" (CUDA when present, else the CPU reference path), "cuda" or "cpu".
    graph: also run the CUDA-graph paths the release has (decode; target verify,
    EAGLE/MTP and DFLASH; draft extend) through its replay entry points (captured on
    CUDA with real FlashInfer; replayed eagerly otherwise).
    quick: fewer batch shapes. shapes: a ``harness.Shapes`` overriding the defaults.
    log: called with one progress line at a time.
    """
    try:
        from .harness import run_verify_impl  # torch is imported here, not at kvpatch import
    except ImportError as exc:
        r = VerifyReport(root=str(root))
        r.add_reason(f"cannot run verify: {exc} (it needs torch: pip install 'kvpatch[verify]')")
        return r
    return run_verify_impl(Path(root), modes=tuple(modes), device=device, graph=graph,
                           quick=quick, log=log, shapes=shapes)
