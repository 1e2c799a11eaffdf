"""A part of the kvpatch runtime: the fused launcher's partial-result buffers and FP8 scale
tensors (issue 17), kept across calls: a captured graph holds their addresses.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts (see there); the
imports above the "joined from here" line only let this part read alone.
"""

import torch

# -- joined from here --


# ---------------------------------------------------------------------------
# Fused FP8 MLA attention: scratch and scales

# (device, f16 partials) -> the largest partial buffers (out, lse) made so far
_fused_scratch = {}
# f16 partials (a config's "f16_partials" overrides): the splits' partial outputs are written
# once and read once by the combine; at 16 heads x 8 x 4k they are 12.8 MB in fp32 for 18.9 MB
# of FP8 rows read (gpu/breakdown_probe.py, GPU run 49), and half that in f16. They then leave
# the latent's FP8 scale to the combine, so each is a convex combination of e4m3 values
# (|x| <= 448), in f16's range whatever the scale, rounded at 2^-11 (the bf16 output: 2^-9).
# Off until a device has run it: the CPU interpreter and the sm_90a compiles have, no GPU.
FUSED_F16_PARTIALS = False


def _fused_scratch_for(device, rows, width, f16=False):
    """Partial-result buffers for at least `rows` rows (f16 or fp32 outputs, fp32
    log-sum-exps). Grown, never per shape: eager mode sees a new batch size on many steps.
    A plan keeps the buffers it was made with, so a graph captured with them stays valid
    when a later, larger plan grows the scratch."""
    key = (device, f16)
    bufs = _fused_scratch.get(key)
    if bufs is None or bufs[1].shape[0] < rows:
        rows = max(rows, 2 * bufs[1].shape[0] if bufs is not None else 0)
        # Never read before written: stage 2 reads only the splits stage 1 wrote.
        bufs = (
            torch.empty(
                (rows, width),
                dtype=torch.float16 if f16 else torch.float32,
                device=device,
            ),
            torch.empty((rows,), dtype=torch.float32, device=device),
        )
        _fused_scratch[key] = bufs
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
