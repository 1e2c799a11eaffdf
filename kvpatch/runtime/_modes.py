"""kvpatch runtime: what a patched SGLang MLA backend reads instead of a full-pool cast.

SGLang's FlashInfer MLA backend casts the whole FP8 layer pool to the query dtype every
layer, every step. This module either hands the FP8 pool straight to FlashInfer (when it
can read FP8 MLA natively) or casts only the rows the planned wrapper reads into a
persistent shadow buffer. Contract: docs/runtime.md of kvpatch.

Self-contained on purpose: `kvpatch apply` copies it into the checkout as
`_kvpatch_runtime.py`, so it imports only the standard library and torch (Triton lazily,
on CUDA) and never kvpatch.
"""

import logging
import math
import os
import re

import torch

# 15: the combine reads its columns in runs of 4, so over f16 partials (FUSED_F16_PARTIALS,
# off) it sums the splits within warps as over fp32 ones; the Gluon kernel's register cap
# (FUSED_GLUON_TUNING["maxnreg"], unset), copies 8 rows a warp ("copy_rows", 4) and the
# scores summed in every warp ("bcast_scores", off); the 64-row loader kernel's softmax
# exchange (FUSED_WGMMA_TUNING["xchg"], off);
# routed calls skip a device object per call
# 14: the 64-row kernel's split count fills the last wave of CTAs (FUSED_WGMMA_TUNING
# "splits": "fill"); auto routes 64 heads to it too; the register-prefetch loader is gone
# 13: the loader-partition 64-row kernel serves by default (FUSED_WGMMA_TUNING["ws"]); auto
# routes 128 heads and 16 heads x 8 tokens to it (FUSED_AUTO_WGMMA)
# 12: the 64-row kernel's variant with a loader warp partition (runtime part
# _fused_wgmma_ws; off: "wg_ws" in a config)
# 11: the split kernels' partials in f16 (FUSED_F16_PARTIALS; off)
# 10: the 64-row warpgroup-MMA split kernel (runtime part _fused_wgmma) for 128 heads and
# draft tokens; auto routes 16 heads x 4 tokens to it (FUSED_AUTO_WGMMA)
# 9: the Gluon split kernel serves 16-head, one-token decode by default (on Triton 3.6, SM 9.0)
# 8: a routed call's whole cast casts an e5m2 pool too (it cast e4m3 only); fused_mla refuses
# a pool that is not e4m3 (its kernels convert with e4m3's instructions)
# 7: the fused split kernel in Gluon for 16-head, one-token decode (runtime part _fused_gluon)
# 6: routed sgl-kernel paged MLA decode calls (paged_mla: XPU's flash_mla_decode)
# 5: routed FlashInfer MLA run() calls (mla_run); plan_rows keeps the plan's kv_indptr
# 4: routed kernel calls (paged_attention) and the fused FP8 attention (fused_mla)
# 3: the k and v of one shape get their own shadows (2 shared one: v overwrote k)
__kvpatch_runtime_version__ = "15"
__kvpatch_version__ = "0.1.0"

__all__ = [
    "mode",
    "plan_kv_dtype",
    "plan_rows",
    "kv_for_kernel",
    "kv_pages_for_kernel",
    "ragged_pages",
    "run_kwargs",
    "gather_cast",
    "page_cast",
    "reset",
    "poison_shadows",
    "TUNING",
    "fused_mla",
    "kv_for_routed_kernel",
    "paged_attention",
    "kv_for_mla_run",
    "mla_run",
    "paged_mla",
    "kv_rows_deferred",
    "kv_rows_at_kernel",
    "FUSED_TUNING",
    "FUSED_AUTO_ROWS",
    "FUSED_AUTO_WGMMA",
]

logger = logging.getLogger("kvpatch.runtime")

_MODES = ("auto", "fused", "gather", "native", "off")
# FlashInfer releases whose FP8 MLA plan is checked and correct, per backend.
_FA3_MIN = (0, 6, 14)
_FA2_MIN = (0, 6, 18)
_FP8 = torch.float8_e4m3fn

# Kernel launch constants; benchmarks/bench_gather.py sweeps them.
TUNING = {
    "block_rows": 16,
    "num_warps": 4,
    "programs_per_sm": 16,
}  # best of the H200 sweep

_requested = None  # KVPATCH_MODE as parsed
_mode = None  # resolved mode
_shadows = {}  # (device, shape, dtype, slot) -> persistent shadow buffer
_shadow_users = {}  # (device, shape, dtype) -> the sources that last took each slot
_warned = set()
_probe_cache = {}
_kernel = None  # jitted Triton kernels, built on first CUDA use
_page_kernel = None
_triton_failed = set()  # launch keys whose compile failed (auto falls back to torch)


def _warn_once(key, msg, *args):
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


# ---------------------------------------------------------------------------
# Probes: small so tests can monkeypatch them; cached because plan_kv_dtype runs on
# every plan, also before each CUDA-graph replay.


def _cuda_available():
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def _flashinfer_version():
    """The importable FlashInfer's version string, or None."""
    if "fi_version" not in _probe_cache:
        ver = None
        try:
            import flashinfer

            ver = getattr(flashinfer, "__version__", None)
        except Exception:
            pass
        if ver is None:
            try:
                from importlib import metadata

                for dist in ("flashinfer-python", "flashinfer"):
                    try:
                        ver = metadata.version(dist)
                        break
                    except metadata.PackageNotFoundError:
                        pass
            except Exception:
                pass
        _probe_cache["fi_version"] = ver
    return _probe_cache["fi_version"]


def _device_capability(device):
    """(major, minor) of a CUDA device, or None."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type != "cuda":
        return None
    key = ("cap", device.index)
    if key not in _probe_cache:
        try:
            _probe_cache[key] = tuple(torch.cuda.get_device_capability(device))
        except Exception:
            _probe_cache[key] = None
    return _probe_cache[key]


def _sm_count(device):
    device = torch.device(device)
    key = ("sms", device.type, device.index)
    if key not in _probe_cache:
        n = 4  # CPU (Triton interpreter): a small grid still exercises the persistent loop
        if device.type == "cuda":
            n = torch.cuda.get_device_properties(device).multi_processor_count
        _probe_cache[key] = n
    return _probe_cache[key]


_VERSION_RE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(.*)$")


def _parse_version(text):
    """'0.6.18.post1' -> (0, 6, 18, 1); '0.7.0rc1' -> (0, 7, 0, 0); None if unparsable.

    The last field is 1 for a final or post release and 0 for a pre/dev release, so a
    pre-release sorts below its final release.
    """
    if not isinstance(text, str):
        return None
    m = _VERSION_RE.match(text.split("+", 1)[0])  # drop a local version (+cu128)
    if not m:
        return None
    release = [int(p) for p in m.group(1).split(".")][:3]
    release += [0] * (3 - len(release))
    rest = m.group(2).lstrip(".-_").lower()
    pre = rest.startswith(("a", "b", "c", "rc", "dev", "pre"))  # alpha, beta, rc, dev
    return tuple(release) + (0 if pre else 1,)


def _at_least(version, minimum):
    return version is not None and version >= tuple(minimum) + (1,)


# ---------------------------------------------------------------------------
# Mode


def _requested_mode():
    raw = os.environ.get("KVPATCH_MODE", "auto")
    value = raw.strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError("KVPATCH_MODE=%r is not one of: %s" % (raw, ", ".join(_MODES)))
    return value


def _native_available():
    return _cuda_available() and _at_least(
        _parse_version(_flashinfer_version()), _FA3_MIN
    )


def _triton_available():
    if "triton" not in _probe_cache:
        try:
            import triton  # noqa: F401

            _probe_cache["triton"] = True
        except Exception:
            _probe_cache["triton"] = False
    return _probe_cache["triton"]


def mode():
    """'fused', 'native', 'gather' or 'off', resolved once per process from KVPATCH_MODE.

    auto picks the faster path measured on an H200 (notes/gpu-runs.md): for a FlashInfer
    plan, the gathered cast (decode 1x4096 on a 495,552-slot pool: 27 us vs 53 us for
    FlashInfer 0.6.18's FP8 kernel), native only on CUDA without Triton, where the gather
    would be the slow torch fallback; for a routed kernel call, per call shape, the fused
    FP8 attention where it was measured faster (FUSED_AUTO_ROWS, FUSED_AUTO_WGMMA), else
    the gather. fused
    routes every call the fused attention can serve to it; gather never does.
    """
    global _requested, _mode
    if _mode is None:
        requested = _requested_mode()
        resolved = requested
        if requested == "auto":
            use_native = (
                _cuda_available() and not _triton_available() and _native_available()
            )
            resolved = "native" if use_native else "gather"
        elif requested == "fused":
            resolved = (
                "fused" if _cuda_available() and _triton_available() else "gather"
            )
            if resolved == "gather":
                logger.warning(
                    "KVPATCH_MODE=fused needs CUDA and Triton; using the gathered cast"
                )
        elif requested == "native":
            resolved = "native" if _native_available() else "gather"
            if resolved == "gather":
                # Old FlashInfer accepts an FP8 MLA plan unchecked and returns garbage.
                logger.warning(
                    "KVPATCH_MODE=native needs CUDA and FlashInfer >= %s (found %s); "
                    "using the gathered cast",
                    ".".join(map(str, _FA3_MIN)),
                    _flashinfer_version(),
                )
        _requested, _mode = requested, resolved
    return _mode
# -- joined up to here --
# The head of the runtime: its docstring, imports, version, __all__, state, probes and
# mode(). kvpatch/runtime/__init__.py joins it with the parts that follow in PARTS and
# drops these lines, which let this part read alone: __all__ names what they define.
from kvpatch.runtime._dispatch import (
    kv_for_kernel,
    plan_kv_dtype,
    plan_rows,
    run_kwargs,
)
from kvpatch.runtime._gather import gather_cast
from kvpatch.runtime._pages import kv_pages_for_kernel, page_cast, ragged_pages
from kvpatch.runtime._reset import poison_shadows, reset
from kvpatch.runtime._fused import FUSED_TUNING, fused_mla
from kvpatch.runtime._route import (
    FUSED_AUTO_ROWS,
    FUSED_AUTO_WGMMA,
    kv_for_routed_kernel,
    paged_attention,
)
from kvpatch.runtime._sparse import kv_rows_at_kernel, kv_rows_deferred
from kvpatch.runtime._mla_route import kv_for_mla_run, mla_run
from kvpatch.runtime._paged_mla import paged_mla
