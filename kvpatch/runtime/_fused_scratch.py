"""A part of the kvpatch runtime: the fused launcher's partial-result buffers and FP8 scale
tensors (issue 17), kept across calls: a captured graph holds their addresses.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts (see there); the
imports above the "joined from here" line only let this part read alone.
"""

import torch

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: scratch and scales

_fused_scratch = {}  # device -> the largest partial buffers (out, lse) made so far
# The splits' partial outputs, written once and read once by the combine: at 16 heads x
# 8 x 4k they are 12.8 MB in fp32 for 18.9 MB of FP8 rows read (gpu/breakdown_probe.py,
# GPU run 49). In f16 they are half that. They leave the latent's FP8 scale to the combine,
# so each is a convex combination of e4m3 values (|x| <= 448): in f16's range whatever the
# scale, rounded at 2^-11 relative, below the bf16 output's own 2^-9.
FUSED_PARTIAL_DTYPE = torch.float16


def _fused_scratch_for(device, rows, width):
    """Partial-result buffers for at least `rows` rows. Grown, never per shape: eager mode
    sees a new batch size on many steps. A plan keeps the buffers it was made with, so a
    graph captured with them stays valid when a later, larger plan grows the scratch."""
    bufs = _fused_scratch.get(device)
    if bufs is None or bufs[1].shape[0] < rows:
        rows = max(rows, 2 * bufs[1].shape[0] if bufs is not None else 0)
        # Never read before written: stage 2 reads only the splits stage 1 wrote.
        bufs = (
            torch.empty((rows, width), dtype=FUSED_PARTIAL_DTYPE, device=device),
            torch.empty((rows,), dtype=torch.float32, device=device),
        )
        _fused_scratch[device] = bufs
    return bufs


def _fused_scale_key(sc):
    """A scale's part of the plan key: None, its value (a number), or "tensor" (read per call)."""
    if isinstance(sc, torch.Tensor):
        return ("tensor", sc.dtype)
    return None if sc is None else float(sc)


_fused_scales = {}


def _fused_scale_tensor(sc, device):
    """None for no scale (None or 1.0), else a one-element device tensor (a float's made once)."""
    if sc is None or isinstance(sc, torch.Tensor):
        return sc
    sc = float(sc)
    if sc == 1.0:
        return None
    t = _fused_scales.get((device, sc))
    if t is None:
        t = _fused_scales[(device, sc)] = torch.full(
            (1,), sc, dtype=torch.float32, device=device
        )
    return t
