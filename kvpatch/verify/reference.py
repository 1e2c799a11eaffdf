"""A torch reference of FlashInfer's BatchMLAPagedAttentionWrapper (0.6.18 API).

Same constructor, ``plan`` and ``run`` signatures, the same attributes SGLang
and the kvpatch runtime touch (``_kv_indices_buf``, ``_kv_indptr_buf``,
``_page_size``, ``_backend``, ``_cached_module.plan``, the workspace buffers),
and the same dtype checks as FlashInfer's ``plan()``/``run()``, raising the same
messages. It stands in for an SM90 fa2/fa3 device: FP8 plans are accepted (and
run natively, ``real = fp8 * scale``), but its ``_backend`` is ``"reference"``,
so the kvpatch runtime never chooses native FP8 with it.

Like FlashInfer, ``run`` takes the lengths from the last ``_cached_module.plan``
call (the host arrays SGLang's ``fast_mla_decode_plan`` passes on CUDA-graph
replay) and the page indices from ``_kv_indices_buf`` at run time.

Math: score = sm_scale * (q_nope . ckv + q_pe . kpe), V = ckv; causal: query i
of a request with qo_len queries sees kv positions j <= kv_len - qo_len + i.
Computed in float32, written in the output dtype.
"""

from __future__ import annotations

import math

import torch

_SUPPORTED_MLA_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def _check_shape_dtype_device(x, shape, dtype, device, name):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"Invalid shape of {name}: expected {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"Invalid dtype of {name}: expected {dtype}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"Invalid device of {name}: expected {device}, got {x.device}")


class _PlanFunc:
    """``module.plan(...)``; old SGLang calls ``module.plan.default(...)``."""

    def __init__(self, module):
        self._module = module

    def __call__(self, float_ws, int_ws, pin_ws, qo_indptr, kv_indptr, kv_len_arr,
                 num_heads, head_dim_o, causal, *rest):
        # FlashInfer copies this plan into the wrapper's int workspace; here it
        # stays on the module object the wrapper holds, which is equivalent.
        self._module.state = (
            [int(x) for x in qo_indptr.tolist()],
            [int(x) for x in kv_indptr.tolist()],
            [int(x) for x in kv_len_arr.tolist()],
            bool(causal),
        )
        return [0]

    @property
    def default(self):
        return self


class _RefModule:
    def __init__(self):
        self.state = None
        self.plan = _PlanFunc(self)


class BatchMLAPagedAttentionWrapper:
    kvpatch_reference = True

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._int_workspace_buffer = torch.empty((64,), dtype=torch.uint8, device=self.device)
        self._pin_memory_int_workspace_buffer = torch.empty((64,), dtype=torch.uint8)
        self._use_cuda_graph = use_cuda_graph
        self._qo_indptr_buf = qo_indptr
        self._kv_indptr_buf = kv_indptr
        self._kv_indices_buf = kv_indices
        self._kv_len_arr_buf = kv_len_arr
        self._backend = "reference" if backend == "auto" else backend

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
             use_profiler=False):
        if kv_data_type not in _SUPPORTED_MLA_KV_DTYPES:
            raise ValueError(
                f"MLA kv_data_type {kv_data_type} is not supported. "
                f"Supported dtypes: {list(_SUPPORTED_MLA_KV_DTYPES)}.")
        if head_dim_kpe < 0:
            raise ValueError(f"head_dim_kpe must be >= 0, got {head_dim_kpe}.")
        if kv_data_type == torch.float8_e4m3fn:
            # (FlashInfer also requires fa2/fa3 on SM90 here; the reference stands in for one.)
            if q_data_type != torch.bfloat16:
                raise ValueError(
                    "FP8 kv_data_type for MLA currently only supports "
                    f"q_data_type=torch.bfloat16, got {q_data_type}.")
            if head_dim_ckv != 512 or head_dim_kpe not in (0, 64):
                raise ValueError(
                    "FP8 kv_data_type for MLA currently only supports "
                    "head_dim_ckv=512 and head_dim_kpe in (0, 64), got "
                    f"head_dim_ckv={head_dim_ckv}, head_dim_kpe={head_dim_kpe}.")
        self._cached_module = _RefModule()
        if self._use_cuda_graph:
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=True)
            self._kv_indptr_buf.copy_(kv_indptr, non_blocking=True)
            self._kv_indices_buf[: len(kv_indices)].copy_(kv_indices, non_blocking=True)
            self._kv_len_arr_buf.copy_(kv_len_arr, non_blocking=True)
        else:
            self._qo_indptr_buf = qo_indptr.to(self.device, non_blocking=True)
            self._kv_indptr_buf = kv_indptr.to(self.device, non_blocking=True)
            self._kv_indices_buf = kv_indices.to(self.device, non_blocking=True)
            self._kv_len_arr_buf = kv_len_arr.to(self.device, non_blocking=True)
        self._causal = causal
        self._page_size = page_size
        self._sm_scale = sm_scale
        self._head_dim_ckv = head_dim_ckv
        self._q_data_type = q_data_type
        self._kv_data_type = kv_data_type
        self._use_profiler = use_profiler
        self._plan_info = self._cached_module.plan(
            self._float_workspace_buffer, self._int_workspace_buffer,
            self._pin_memory_int_workspace_buffer, qo_indptr.to("cpu"), kv_indptr.to("cpu"),
            kv_len_arr.to("cpu"), num_heads, head_dim_ckv, causal)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e=False,
            o_scale=None, *, ckv_scale=None, ckv_scale_arr=None, kpe_scale=None):
        if o_scale is not None:
            raise ValueError("o_scale is only supported with the cutlass backend for now.")
        # FlashInfer's checks, same order and text: its launcher reinterprets
        # storage by the planned dtypes, so a mismatch would be silent garbage.
        for name, t, planned, field in (("q_nope", q_nope, self._q_data_type, "q_data_type"),
                                        ("q_pe", q_pe, self._q_data_type, "q_data_type"),
                                        ("ckv_cache", ckv_cache, self._kv_data_type, "kv_data_type"),
                                        ("kpe_cache", kpe_cache, self._kv_data_type, "kv_data_type")):
            if t.dtype != planned:
                raise ValueError(f"{name}.dtype={t.dtype} does not match the planned {field}={planned}.")
        kv_is_fp8 = self._kv_data_type == torch.float8_e4m3fn
        if kv_is_fp8:
            if (ckv_scale is None) == (ckv_scale_arr is None):
                raise ValueError("Exactly one of ckv_scale or ckv_scale_arr is required when "
                                 "kv_data_type is FP8.")
            if kpe_scale is None:
                raise ValueError("kpe_scale is required when kv_data_type is FP8.")
            if ckv_scale_arr is not None:
                raise NotImplementedError("reference: ckv_scale_arr is not modelled")
            ckv_scale_f, kpe_scale_f = float(ckv_scale), float(kpe_scale)
            for name, v in (("ckv_scale", ckv_scale_f), ("kpe_scale", kpe_scale_f)):
                if not math.isfinite(v) or v <= 0.0:
                    raise ValueError(f"{name} must be a finite positive value, got {v}")
        else:
            if ckv_scale is not None or ckv_scale_arr is not None or kpe_scale is not None:
                raise ValueError("ckv_scale / ckv_scale_arr / kpe_scale are only valid when "
                                 "kv_data_type is FP8.")
            ckv_scale_f = kpe_scale_f = 1.0
        if out is None:
            out = torch.empty_like(q_nope)
        else:
            _check_shape_dtype_device(out, q_nope.shape, q_nope.dtype, q_nope.device, "out")
        if return_lse:
            if lse is None:
                lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=self.device)
            else:
                _check_shape_dtype_device(lse, q_nope.shape[:2], torch.float32,
                                          q_nope.device, "lse")
        state = self._cached_module.state
        if state is None:
            raise RuntimeError("reference MLA wrapper: run() before plan()")
        qo_indptr, kv_indptr, kv_lens, causal = state
        p = int(self._page_size)
        indices = self._kv_indices_buf
        for b in range(len(kv_lens)):
            q0, q1 = qo_indptr[b], qo_indptr[b + 1]
            qo_len, kv_l = q1 - q0, kv_lens[b]
            if qo_len == 0:
                continue
            pages = indices[kv_indptr[b]: kv_indptr[b] + (kv_l + p - 1) // p].long()
            ckv = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[:kv_l].float() * ckv_scale_f
            kpe = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:kv_l].float() * kpe_scale_f
            qn, qp = q_nope[q0:q1].float(), q_pe[q0:q1].float()     # [qo, H, d]
            s = (torch.einsum("qhd,kd->hqk", qn, ckv)
                 + torch.einsum("qhd,kd->hqk", qp, kpe)) * self._sm_scale
            if causal:
                i = torch.arange(qo_len, device=s.device).view(-1, 1)
                j = torch.arange(kv_l, device=s.device).view(1, -1)
                s = s.masked_fill(j > kv_l - qo_len + i, float("-inf"))
            m = torch.logsumexp(s, dim=-1, keepdim=True)                 # [H, qo, 1]
            o = torch.einsum("hqk,kd->qhd", torch.exp(s - m), ckv)
            out[q0:q1] = o.to(out.dtype)
            if return_lse:
                ln = m.squeeze(-1).transpose(0, 1)
                lse[q0:q1] = ln if return_lse_base_on_e else ln / math.log(2.0)
        return (out, lse) if return_lse else out


def make_flashinfer_stub():
    """The namespace served as ``flashinfer`` when real FlashInfer is not used."""
    import types
    m = types.ModuleType("flashinfer")
    m.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    return m
