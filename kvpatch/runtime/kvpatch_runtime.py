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

__kvpatch_runtime_version__ = "3"  # 3: k and v of one shape get their own shadows
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
]

logger = logging.getLogger("kvpatch.runtime")

_MODES = ("auto", "gather", "native", "off")
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
    """'native', 'gather' or 'off', resolved once per process from KVPATCH_MODE.

    auto picks the faster path measured on an H200 (notes/gpu-runs.md): the fused
    gathered cast (decode 1x4096 on a 495,552-slot pool: 27 us vs 53 us for FlashInfer
    0.6.18's FP8 kernel). It picks native only on CUDA without Triton, where the
    gather would be the slow torch fallback.
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


# ---------------------------------------------------------------------------
# Plan / run hooks


def _native_ok(wrapper, q_dtype, kv_cache_dtype, causal):
    if mode() != "native":
        return False
    # uint8 maps to an FP4 kernel in FlashInfer; e5m2 is not supported: e4m3fn only.
    if kv_cache_dtype is not _FP8 or q_dtype is not torch.bfloat16:
        return False
    # Causal (prefill, verify) plans always gather: their consumer can also receive
    # the DCP branch's compact bf16 buffer, and FlashInfer 0.6.18's FP8 prefill
    # kernel ran at 0.4-0.8x of the unpatched bf16 path on the H200.
    if causal:
        return False
    device = getattr(wrapper, "device", None)
    if not isinstance(device, torch.device) or device.type != "cuda":
        return False
    cap = _device_capability(device)
    if cap is None or cap[0] != 9:
        return False
    version = _parse_version(_flashinfer_version())
    backend = getattr(wrapper, "_backend", None)
    if backend == "fa3":
        return _at_least(version, _FA3_MIN)
    if backend == "fa2":
        return _at_least(version, _FA2_MIN)
    return False


def plan_kv_dtype(wrapper, q_dtype, kv_dtype, kv_cache_dtype, causal):
    """The kv dtype to plan with: FP8 when the wrapper runs FP8 MLA natively, else kv_dtype.

    The choice is recorded on the wrapper so kv_for_kernel and run_kwargs follow the plan.
    """
    native = _native_ok(wrapper, q_dtype, kv_cache_dtype, bool(causal))
    choice = _FP8 if native else kv_dtype
    try:
        wrapper._kvpatch_kv_dtype = choice
    except Exception:  # an object without a __dict__ cannot be planned native
        return kv_dtype
    return choice


def _planned_fp8(wrapper):
    return getattr(wrapper, "_kvpatch_kv_dtype", None) is _FP8


def run_kwargs(wrapper):
    """FP8 run() needs both scales (and bf16 run() rejects them); SGLang stores unscaled."""
    if _planned_fp8(wrapper):
        return {"ckv_scale": 1.0, "kpe_scale": 1.0}
    return {}


def _shadow(kv_buffer, dtype):
    """The persistent shadow for kv_buffer. Two sources of one shape (an MHA layer's k and
    v, both cast before the one kernel that reads them) must not share one: the last two
    sources cast each hold their own, and a new source takes the one used least recently
    (a layer's kernel has run by the time the next layer casts)."""
    base = (kv_buffer.device, tuple(kv_buffer.shape), dtype)
    # [(source address, slot)], most recent last
    users = _shadow_users.setdefault(base, [])
    ptr = kv_buffer.data_ptr()
    mine = next((u for u in users if u[0] == ptr), None)
    if mine is None:
        mine = (ptr, len(users)) if len(users) < 2 else (ptr, users.pop(0)[1])
    else:
        users.remove(mine)
    users.append(mine)
    key = base + (mine[1],)
    buf = _shadows.get(key)
    if buf is None:
        # Contents never matter: only rows the kernel reads are read, and those are cast
        # right before every run.
        buf = torch.empty(kv_buffer.shape, dtype=dtype, device=kv_buffer.device)
        _shadows[key] = buf
    return buf


# What a routed plan call left on its wrapper: the device count of indices the
# next run() reads. One persistent tensor per wrapper, so a captured graph reads
# what the plan before each replay wrote.
_COUNT_ATTR = "_kvpatch_rows"


def _capturing():
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def _wrapper_device(wrapper, kv_indptr):
    device = getattr(wrapper, "device", None)
    if isinstance(device, torch.device):
        return device
    indices = getattr(wrapper, "_kv_indices_buf", None)
    if isinstance(indices, torch.Tensor):
        return indices.device
    return kv_indptr.device


def plan_rows(wrapper, kv_indptr):
    """Pass kv_indptr through to a plan call, noting how many indices run() reads.

    Every call that gives a FlashInfer MLA wrapper its indices (wrapper.plan,
    fast_mla_decode_plan, fast_mla_prefill_plan) routes its kv_indptr here, so the
    count comes from the call itself, not from wrapper state that some plan paths
    never refresh. A host indptr is read on the host (no sync); a device indptr is
    copied on the device (a graph that captured the copy replays it). A host value
    inside graph capture would be frozen into the graph: the wrapper is then marked
    unknown and kv_for_kernel casts the whole pool.
    """
    try:
        if not isinstance(kv_indptr, torch.Tensor) or kv_indptr.dim() != 1:
            raise TypeError("kv_indptr is not a 1-D tensor")
        count = wrapper.__dict__.get(_COUNT_ATTR)
        device = _wrapper_device(wrapper, kv_indptr)
        if count is None or count.device != device:
            if _capturing():
                raise RuntimeError("first plan of this wrapper inside graph capture")
            count = torch.zeros(1, dtype=torch.int64, device=device)
        if kv_indptr.numel() == 0:
            count.zero_()
        elif kv_indptr.device.type == "cpu":
            if _capturing():
                raise RuntimeError("host kv_indptr inside graph capture")
            count.fill_(int(kv_indptr[-1]))
        else:
            count.copy_(kv_indptr[-1:])
        wrapper.__dict__[_COUNT_ATTR] = count
    except Exception as exc:
        try:
            wrapper.__dict__[_COUNT_ATTR] = None  # unknown: whole-pool cast
        except Exception:
            pass
        _warn_once(
            ("plan_rows", type(wrapper).__name__, str(exc)),
            "kvpatch: rows of %s unknown (%s); casting the whole pool",
            type(wrapper).__name__,
            exc,
        )
    return kv_indptr


def kv_for_kernel(kv_buffer, wrapper, q_dtype, kv_indptr=None):
    """What the kernel reads in place of kv_buffer.to(q_dtype).

    The rows are wrapper._kv_indices_buf[:n] (the indices run() reads), n as the
    last routed plan call noted it (plan_rows). kv_indptr is accepted for call sites
    written by kvpatch 0.1 and not read: a backend's indptr buffer is not always
    the one the kernel was planned with.
    """
    if mode() == "off":
        return kv_buffer.to(q_dtype)
    if kv_buffer.dtype == q_dtype:
        return kv_buffer
    if kv_buffer.dtype is _FP8 and _planned_fp8(wrapper):
        return kv_buffer
    indices = getattr(wrapper, "_kv_indices_buf", None)
    count = getattr(wrapper, "__dict__", {}).get(_COUNT_ATTR)
    if not (
        isinstance(indices, torch.Tensor)
        and isinstance(count, torch.Tensor)
        and indices.device == kv_buffer.device
        and count.device == kv_buffer.device
    ):
        _warn_once(
            ("unplanned", type(wrapper).__name__),
            "kvpatch: no plan of %s was routed through kvpatch on the pool's device; "
            "casting the whole pool",
            type(wrapper).__name__,
        )
        return kv_buffer.to(q_dtype)
    if _rows(kv_buffer) is None:
        _warn_once(
            ("strides", tuple(kv_buffer.stride())),
            "kvpatch: KV buffer strides %s do not form rows; casting the whole pool",
            tuple(kv_buffer.stride()),
        )
        return kv_buffer.to(q_dtype)
    shadow = _shadow(kv_buffer, q_dtype)
    gather_cast(
        kv_buffer,
        shadow,
        indices,
        count,
        0,
        rows_per_index=int(getattr(wrapper, "_page_size", 1) or 1),
    )
    return shadow


# ---------------------------------------------------------------------------
# The gathered cast


def _rows(t):
    """t as a [slots, slot_len] view (no copy), or None when its strides do not allow it.

    A slot is what one token occupies: all dims but the last two are slot dims, so the
    MLA pool's [slots, 1, 576] and [pages, page_size, 1, 576] both give rows of 576.
    """
    if t.dim() == 0:
        return None
    lead = t.dim() - 2 if t.dim() >= 3 else 1
    try:
        return t.view(math.prod(t.shape[:lead]), math.prod(t.shape[lead:]))
    except RuntimeError:
        return None


def gather_cast(
    src,
    dst,
    indices,
    indptr,
    indptr_pos,
    indptr2=None,
    indptr2_pos=0,
    rows_per_index=1,
    *,
    backend="auto",
    config=None,
):
    """dst[r] = src[r].to(dst.dtype) for every row r read through indices[:n].

    n = min(max(indptr[indptr_pos], indptr2[indptr2_pos]), indices.numel()), read on the
    device. Index i covers slots i*rows_per_index ... +rows_per_index-1 of src viewed as
    [slots, slot_len] (see _rows); out-of-range indices are skipped. No host sync.

    backend: "auto" (Triton on CUDA when importable, else torch), "triton" (forced; also
    runs on CPU under TRITON_INTERPRET=1) or "torch". config overrides TUNING.
    Returns the path taken, "triton" or "torch".
    """
    src2, dst2 = _row_pair("gather_cast", src, dst, backend)
    rpi = int(rows_per_index)
    if rpi < 1:
        raise ValueError("gather_cast: rows_per_index must be >= 1")
    if indptr2 is None:
        indptr2, indptr2_pos = indptr, indptr_pos
    idx = indices.reshape(-1)  # a view for the 1-D buffers FlashInfer keeps
    if idx.numel() == 0 or src2.shape[0] < rpi:
        return "torch"
    cfg = dict(TUNING, **(config or {}))
    if backend != "torch" and _triton_ok(
        src2, dst2, idx, indptr, indptr2, rpi, backend
    ):
        key = (src.dtype, dst.dtype, rpi, cfg["block_rows"], cfg["num_warps"])
        if _try_triton(
            "gather",
            key,
            backend,
            lambda: _launch(
                src2, dst2, idx, indptr, indptr_pos, indptr2, indptr2_pos, rpi, cfg
            ),
        ):
            return "triton"
    elif backend == "triton":
        raise RuntimeError("gather_cast: Triton path not available for these tensors")
    _gather_cast_torch(src2, dst2, idx, indptr, indptr_pos, indptr2, indptr2_pos, rpi)
    return "torch"


def _row_pair(what, src, dst, backend):
    """src and dst as [slots, slot_len] rows, after the checks both casts share."""
    if src.shape != dst.shape or src.device != dst.device:
        raise ValueError(what + ": src and dst need the same shape and device")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(what + ": backend must be auto, triton or torch")
    src2, dst2 = _rows(src), _rows(dst)
    if src2 is None or dst2 is None:
        raise ValueError(what + ": src/dst strides do not form [slots, slot_len] rows")
    return src2, dst2


def _try_triton(what, key, backend, launch):
    """Run launch() unless this key's kernel failed before; True if it ran.

    Under backend="triton" a failure raises; under "auto" it is remembered for
    the key, warned once, and the caller takes its torch path instead.
    """
    if key in _triton_failed:
        return False
    try:
        launch()
        return True
    except Exception as exc:
        if backend == "triton":
            raise
        _triton_failed.add(key)
        _warn_once(
            ("triton", key), "kvpatch: Triton %s failed (%s); using torch", what, exc
        )
        return False


def _triton_ok(src2, dst2, idx, indptr, indptr2, rpi, backend):
    if not (src2.is_cuda or backend == "triton"):
        return False
    if src2.stride(1) != 1 or dst2.stride(1) != 1 or not idx.is_contiguous():
        return False  # the kernel assumes a contiguous inner row (vector loads)
    if idx.dtype not in (torch.int32, torch.int64):
        return False
    if any(t.dtype not in (torch.int32, torch.int64) for t in (indptr, indptr2)):
        return False
    if any(t.device != src2.device for t in (dst2, idx, indptr, indptr2)):
        return False
    if idx.numel() * rpi >= 2**31:
        return False  # the kernel's work counter is int32
    return _get_kernel() is not None


def _launch(src2, dst2, idx, indptr, pos1, indptr2, pos2, rpi, cfg):
    kernel = _get_kernel()
    n_rows, row_len = src2.shape
    main_d, tail_d = _row_split(row_len)
    br = cfg["block_rows"]
    # Persistent grid: sized on the host from the buffer length (fixed under CUDA
    # graphs); the kernel loops over however many rows the device says are valid.
    max_blocks = -(-(idx.numel() * rpi) // br)
    grid = (max(1, min(_sm_count(src2.device) * cfg["programs_per_sm"], max_blocks)),)
    kernel[grid](
        src2,
        dst2,
        idx,
        indptr,
        int(pos1),
        indptr2,
        int(pos2),
        idx.numel(),
        n_rows // rpi,
        src2.stride(0),
        dst2.stride(0),
        D=row_len,
        MAIN_D=main_d,
        TAIL_D=tail_d,
        RPI=rpi,
        BLOCK_ROWS=br,
        num_warps=cfg["num_warps"],
    )


def _gather_cast_torch(src2, dst2, idx, indptr, pos1, indptr2, pos2, rpi):
    # No .item(): valid entries are masked on the device, so this is also graph-safe.
    units = src2.shape[0] // rpi
    n = torch.maximum(indptr[pos1], indptr2[pos2]).clamp(0, idx.numel())
    pos = torch.arange(idx.numel(), device=idx.device)
    i = idx.long()
    _cast_units_torch(src2, dst2, i, (pos < n) & (i >= 0) & (i < units), rpi)


def _cast_units_torch(src2, dst2, i, valid, rpi):
    """dst unit u = src unit u cast, for every u = i[k] with valid[k] (units of rpi rows)."""
    units = src2.shape[0] // rpi
    d = src2.shape[1]
    src_u = src2[: units * rpi].view(units, rpi, d)
    dst_u = dst2[: units * rpi].view(units, rpi, d)
    # Invalid entries are redirected to the first valid row, which is written with the
    # same value; if none is valid they rewrite a row with its own old value. Either
    # way duplicates in index_copy_ agree, so the result is deterministic.
    first = i.index_select(0, torch.argmax(valid.to(torch.int32)).view(1)).clamp(
        0, units - 1
    )
    safe = torch.where(valid, i, first)
    new = src_u.index_select(0, safe).to(dst2.dtype)
    old = dst_u.index_select(0, safe)
    dst_u.index_copy_(0, safe, torch.where(valid.any(), new, old))


def _get_kernel():
    """The indices kernel, built on first use; None when Triton is not importable."""
    _build_kernels()
    return _kernel or None


def _get_page_kernel():
    _build_kernels()
    return _page_kernel or None


def _build_kernels():
    # The helper and tl are module globals: Triton resolves names a kernel calls there.
    global _kernel, _page_kernel, _cast_rows, triton, tl
    if _kernel is not None:
        return
    try:
        import triton
        import triton.language as tl
    except Exception:
        _kernel = _page_kernel = False
        return

    @triton.jit
    def _cast_rows(
        src,
        dst,
        row,
        ok,
        src_stride,
        dst_stride,
        D: tl.constexpr,
        MAIN_D: tl.constexpr,
        TAIL_D: tl.constexpr,
    ):
        cols = tl.arange(0, MAIN_D)
        s = src + row[:, None] * src_stride
        d = dst + row[:, None] * dst_stride
        m = ok[:, None]
        # Both loads are issued before the stores so they overlap in flight.
        x = tl.load(s + cols[None, :], mask=m)
        if TAIL_D > 0:
            tcols = MAIN_D + tl.arange(0, TAIL_D)
            tm = m
            if MAIN_D + TAIL_D > D:  # a column mask only when the tail is ragged
                tm = m & (tcols[None, :] < D)
            t = tl.load(s + tcols[None, :], mask=tm)
        tl.store(d + cols[None, :], x.to(dst.dtype.element_ty), mask=m)
        if TAIL_D > 0:
            tl.store(d + tcols[None, :], t.to(dst.dtype.element_ty), mask=tm)

    @triton.jit(do_not_specialize=["pos1", "pos2", "n_idx", "n_units"])
    def _gather_cast_kernel(
        src,
        dst,
        idx_ptr,
        ip1,
        pos1,
        ip2,
        pos2,
        n_idx,
        n_units,
        src_stride,
        dst_stride,
        D: tl.constexpr,
        MAIN_D: tl.constexpr,
        TAIL_D: tl.constexpr,
        RPI: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
    ):
        # Valid count from device memory: replays see whatever SGLang wrote in place.
        n = tl.maximum(tl.load(ip1 + pos1), tl.load(ip2 + pos2))
        n = tl.minimum(tl.maximum(n, 0), n_idx).to(
            tl.int32
        )  # host checks n_idx*RPI < 2**31
        total = n * RPI
        lanes = tl.arange(0, BLOCK_ROWS)
        for blk in range(
            tl.program_id(0), tl.cdiv(total, BLOCK_ROWS), tl.num_programs(0)
        ):
            w = blk * BLOCK_ROWS + lanes
            live = w < total
            unit = tl.load(idx_ptr + w // RPI, mask=live, other=-1).to(tl.int64)
            ok = live & (unit >= 0) & (unit < n_units)  # never touch rows out of range
            _cast_rows(
                src,
                dst,
                unit * RPI + w % RPI,
                ok,
                src_stride,
                dst_stride,
                D,
                MAIN_D,
                TAIL_D,
            )

    @triton.jit(do_not_specialize=["n_cols", "n_units", "pt_stride", "sl_stride"])
    def _page_cast_kernel(
        src,
        dst,
        pt_ptr,
        pt_stride,
        sl_ptr,
        sl_stride,
        n_cols,
        n_units,
        src_stride,
        dst_stride,
        D: tl.constexpr,
        MAIN_D: tl.constexpr,
        TAIL_D: tl.constexpr,
        PS: tl.constexpr,
        EVERY: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
    ):
        # Program (b, c) casts request b's live pages, page_table[b, :ceil(seqlen/PS)],
        # with C programs striding over them: work follows the live rows, not the
        # table's width. Lengths come from device memory (graph replays rewrite them).
        b = tl.program_id(0)
        if EVERY:
            n_pages = n_cols
        else:
            seqlen = tl.load(sl_ptr + b * sl_stride).to(tl.int32)
            n_pages = tl.minimum(tl.maximum(tl.cdiv(seqlen, PS), 0), n_cols)
        total = n_pages * PS
        lanes = tl.arange(0, BLOCK_ROWS)
        for blk in range(
            tl.program_id(1), tl.cdiv(total, BLOCK_ROWS), tl.num_programs(1)
        ):
            w = blk * BLOCK_ROWS + lanes
            live = w < total
            page = tl.load(
                pt_ptr + b.to(tl.int64) * pt_stride + w // PS, mask=live, other=-1
            ).to(tl.int64)
            ok = live & (page >= 0) & (page < n_units)  # never touch rows out of range
            _cast_rows(
                src,
                dst,
                page * PS + w % PS,
                ok,
                src_stride,
                dst_stride,
                D,
                MAIN_D,
                TAIL_D,
            )

    _kernel, _page_kernel = _gather_cast_kernel, _page_cast_kernel


def _row_split(row_len):
    main_d = 1 << (row_len.bit_length() - 1)  # 576 -> 512 + a 64-wide tail
    rest = row_len - main_d
    return main_d, (1 << (rest - 1).bit_length() if rest else 0)


# ---------------------------------------------------------------------------
# Page tables: FA3/FA4, MUSA and XPU kernels read pages, not an indices list


def _table_ok(kv_buffer, table):
    if not (isinstance(table, tuple) and len(table) == 2):
        return False
    pt, sl = table
    if not (
        isinstance(pt, torch.Tensor)
        and pt.dim() == 2
        and pt.device == kv_buffer.device
        and not pt.is_floating_point()
    ):
        return False
    return sl is None or (
        isinstance(sl, torch.Tensor)
        and sl.dim() == 1
        and sl.numel() >= pt.shape[0]
        and sl.device == kv_buffer.device
        and not sl.is_floating_point()
    )


def _resolve(table):
    """A (page_table, cache_seqlens) pair, or a lambda giving one (read at the cast: a
    call whose metadata is missing this step, say None.page_table, does not run)."""
    if callable(table):
        try:
            return table()
        except (AttributeError, TypeError, KeyError, IndexError):
            return (None, None)
    return table


def kv_pages_for_kernel(kv_buffer, q_dtype, page_size, *tables):
    """What a page-table kernel reads in place of kv_buffer.to(q_dtype).

    tables: one (page_table, cache_seqlens) pair, or a lambda giving it, per kernel call
    that reads the result (the cascade call and local-attention metadata add pairs); a
    pair of Nones is a call that does not run this step, and cache_seqlens None means
    every entry of the table (a call whose lengths are not known at the cast). Every page
    page_table[b, :ceil(cache_seqlens[b] / page_size)] of every pair is cast into the
    persistent shadow at the same slots; the rest of the shadow is never read by those
    calls. Counts are read on the device.
    """
    if mode() == "off":
        return kv_buffer.to(q_dtype)
    if kv_buffer.dtype == q_dtype:
        return kv_buffer
    tables = [_resolve(t) for t in tables]
    live = [
        t for t in tables if not (isinstance(t, tuple) and len(t) == 2 and t[0] is None)
    ]
    ps = int(page_size) if isinstance(page_size, int) and page_size >= 1 else None
    if (
        ps is None
        or not all(_table_ok(kv_buffer, t) for t in live)
        or _rows(kv_buffer) is None
    ):
        _warn_once(
            ("pages", type(page_size).__name__, len(tables)),
            "kvpatch: page tables or page size not usable (page_size=%r); casting the whole pool",
            page_size,
        )
        return kv_buffer.to(q_dtype)
    shadow = _shadow(kv_buffer, q_dtype)
    for pt, sl in live:
        page_cast(kv_buffer, shadow, pt, sl, ps)
    return shadow


def ragged_pages(kv_indptr, kv_indices, page_size):
    """A ragged page list as one (page_table, cache_seqlens) pair for kv_pages_for_kernel.

    A kernel handed (kv_indptr, kv_indices) reads, for request b, the pages
    kv_indices[kv_indptr[b]:kv_indptr[b + 1]]; their union lies within
    kv_indices[:max(kv_indptr)]: one table row of that many pages (page_size slots each).
    The count is read on the device (no host sync, static shapes); where the indptr
    buffer holds stale entries past the batch, the max covers them too (a superset).
    """
    if kv_indptr is None or kv_indices is None:
        return (None, None)
    count = kv_indptr.reshape(-1).amax(0, keepdim=True)
    return kv_indices.reshape(1, -1), count * int(page_size)


def page_cast(src, dst, page_table, seqlens, page_size, *, backend="auto", config=None):
    """dst[r] = src[r].to(dst.dtype) for every slot r of every page the table reads.

    Request b reads pages page_table[b, :ceil(seqlens[b] / page_size)] (every entry of
    row b when seqlens is None); page p holds slots
    p*page_size ... +page_size-1 of src viewed as [slots, slot_len] (see _rows). Pages out
    of range are skipped; a page shared by two requests is cast once per reader, with the
    same bytes. No host sync. Returns the path taken, "triton" or "torch".
    """
    src2, dst2 = _row_pair("page_cast", src, dst, backend)
    ps = int(page_size)
    if page_table.numel() == 0 or src2.shape[0] < ps:
        return "torch"
    cfg = dict(TUNING, **(config or {}))
    usable = (
        (src2.is_cuda or backend == "triton")
        and src2.stride(1) == 1
        and dst2.stride(1) == 1
        and page_table.stride(1) == 1
        and page_table.shape[1] * ps < 2**31
        and page_table.dtype in (torch.int32, torch.int64)
        and (seqlens is None or seqlens.dtype in (torch.int32, torch.int64))
    )
    if backend != "torch" and usable and _get_page_kernel() is not None:
        key = ("pages", src.dtype, dst.dtype, ps, cfg["block_rows"], cfg["num_warps"])
        launch = lambda: _launch_pages(
            src2, dst2, page_table, seqlens, ps, cfg
        )  # noqa: E731
        if _try_triton("page cast", key, backend, launch):
            return "triton"
    elif backend == "triton":
        raise RuntimeError("page_cast: Triton path not available for these tensors")
    units = src2.shape[0] // ps
    rows, cols = page_table.shape
    i = page_table.long().reshape(-1)
    valid = (i >= 0) & (i < units)
    if seqlens is not None:
        n_pages = ((seqlens[:rows].long() + ps - 1) // ps).clamp(0, cols)
        j = torch.arange(cols, device=page_table.device)
        valid &= (j[None, :] < n_pages[:, None]).reshape(-1)
    _cast_units_torch(src2, dst2, i, valid, ps)
    return "torch"


def _launch_pages(src2, dst2, pt, sl, ps, cfg):
    kernel = _get_page_kernel()
    n_rows, row_len = src2.shape
    main_d, tail_d = _row_split(row_len)
    br = cfg["block_rows"]
    rows, cols = pt.shape
    # Static grid (fixed under CUDA graphs): per request, enough programs to fill the
    # chip, never more than its widest possible page run needs.
    per_req = max(
        1,
        min(
            -(-_sm_count(src2.device) * cfg["programs_per_sm"] // max(rows, 1)),
            -(-(cols * ps) // br),
        ),
    )
    every = sl is None  # no lengths: every entry of each row is read
    kernel[(rows, per_req)](
        src2,
        dst2,
        pt,
        pt.stride(0),
        pt if every else sl,
        0 if every else sl.stride(0),
        cols,
        n_rows // ps,
        src2.stride(0),
        dst2.stride(0),
        D=row_len,
        MAIN_D=main_d,
        TAIL_D=tail_d,
        PS=ps,
        EVERY=every,
        BLOCK_ROWS=br,
        num_warps=cfg["num_warps"],
    )


# ---------------------------------------------------------------------------
# Test hooks


def reset():
    """Drop the cached mode, probes, warnings and shadow buffers."""
    global _requested, _mode
    _requested = _mode = None
    _shadows.clear()
    _shadow_users.clear()
    _warned.clear()
    _probe_cache.clear()
    _triton_failed.clear()


def poison_shadows(value=float("nan")):
    """Fill every shadow buffer, so a row a gather missed cannot pass for a cast one."""
    for buf in _shadows.values():
        buf.fill_(value)
