from __future__ import annotations

"""
FlashInfer MLA attention backend (kvpatch example).

A small, hand-written file with the same shape as SGLang's
flashinfer_mla_backend.py: a backend with a paged prefill path and a decode
path that both cast the layer's FP8 KV pool to the query dtype, and two
indices updaters that plan the BatchMLAPagedAttentionWrapper.
"""

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Optional, Union

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.utils import create_flashinfer_kv_indices_triton
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.utils import is_flashinfer_available

from . import _kvpatch_runtime as _kvpatch_rt  # kvpatch: FP8 KV-cache runtime

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner import ModelRunner

if is_flashinfer_available():
    from flashinfer import BatchMLAPagedAttentionWrapper


@dataclass
class DecodeMetadata:
    decode_wrapper: BatchMLAPagedAttentionWrapper


@dataclass
class PrefillMetadata:
    prefill_wrapper: BatchMLAPagedAttentionWrapper
    use_ragged: bool


class FlashInferMLAAttnBackend(AttentionBackend):
    """FlashInfer MLA kernels over an FP8 (or bf16) compressed KV pool."""

    def __init__(self, model_runner: ModelRunner, kv_indptr_buf=None):
        super().__init__()
        self.device = model_runner.device
        self.max_context_len = model_runner.model_config.context_len
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.workspace_buffer = torch.empty(
            128 * 1024 * 1024, dtype=torch.uint8, device=model_runner.device
        )
        max_bs = model_runner.req_to_token_pool.size
        if kv_indptr_buf is None:
            self.kv_indptr = torch.zeros(
                (max_bs + 1,), dtype=torch.int32, device=model_runner.device
            )
        else:
            self.kv_indptr = kv_indptr_buf
        self.qo_indptr = torch.zeros(
            (max_bs + 1,), dtype=torch.int32, device=model_runner.device
        )
        self.q_indptr_decode = torch.arange(
            0, max_bs + 1, dtype=torch.int32, device=model_runner.device
        )
        self.prefill_wrapper_paged = BatchMLAPagedAttentionWrapper(
            self.workspace_buffer, backend="auto"
        )
        self.decode_wrapper = BatchMLAPagedAttentionWrapper(
            self.workspace_buffer, backend="auto"
        )
        self.indices_updater_prefill = FlashInferMLAIndicesUpdaterPrefill(
            model_runner, self
        )
        self.indices_updater_decode = FlashInferMLAIndicesUpdaterDecode(
            model_runner, self
        )
        self.forward_metadata: Union[PrefillMetadata, DecodeMetadata] = None
        self.decode_cuda_graph_metadata = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        if forward_batch.forward_mode.is_decode_or_idle():
            self.indices_updater_decode.update(
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                forward_batch.seq_lens_sum,
                decode_wrapper=self.decode_wrapper,
            )
            self.forward_metadata = DecodeMetadata(self.decode_wrapper)
        else:
            self.indices_updater_prefill.update(
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                forward_batch.seq_lens_sum,
                forward_batch.extend_prefix_lens,
                prefill_wrapper_paged=self.prefill_wrapper_paged,
                attn_dcp_metadata=forward_batch.attn_dcp_metadata,
            )
            self.forward_metadata = PrefillMetadata(self.prefill_wrapper_paged, False)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.cuda_graph_kv_indices = torch.zeros(
            (max_bs * self.max_context_len,), dtype=torch.int32, device=self.device
        )
        self.cuda_graph_qo_indptr = self.q_indptr_decode.clone()
        self.cuda_graph_kv_indptr = self.kv_indptr.clone()
        self.cuda_graph_kv_lens = torch.ones(
            (max_bs,), dtype=torch.int32, device=self.device
        )
        self.cuda_graph_qo_indptr_cpu = self.cuda_graph_qo_indptr.to("cpu")
        self.cuda_graph_kv_indptr_cpu = self.cuda_graph_kv_indptr.to("cpu")
        self.fast_decode_kwargs = {
            "qo_indptr_cpu": self.cuda_graph_qo_indptr_cpu,
            "kv_indptr_cpu": self.cuda_graph_kv_indptr_cpu,
            "kv_indices": self.cuda_graph_kv_indices,
        }

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ):
        decode_wrapper = BatchMLAPagedAttentionWrapper(
            self.workspace_buffer,
            use_cuda_graph=True,
            qo_indptr=self.cuda_graph_qo_indptr[: bs + 1],
            kv_indptr=self.cuda_graph_kv_indptr[: bs + 1],
            kv_indices=self.cuda_graph_kv_indices,
            kv_len_arr=self.cuda_graph_kv_lens[:bs],
            backend="auto",
        )
        seq_lens_sum = seq_lens.sum().item()
        self.indices_updater_decode.update(
            req_pool_indices, seq_lens, seq_lens_sum, decode_wrapper=decode_wrapper
        )
        self.decode_cuda_graph_metadata[bs] = decode_wrapper
        self.forward_metadata = DecodeMetadata(decode_wrapper)
        # Replays skip the stream sync of the full plan.
        decode_wrapper.plan = partial(fast_mla_decode_plan, decode_wrapper)

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        seq_lens_cpu: torch.Tensor,
    ):
        kv_len_arr_cpu = seq_lens_cpu[:bs].to(torch.int32)
        self.cuda_graph_kv_indptr_cpu[1 : bs + 1] = torch.cumsum(kv_len_arr_cpu, dim=0)
        self.fast_decode_kwargs.update(
            {
                "qo_indptr_cpu": self.cuda_graph_qo_indptr_cpu[: bs + 1],
                "kv_indptr_cpu": self.cuda_graph_kv_indptr_cpu[: bs + 1],
                "kv_len_arr_cpu": kv_len_arr_cpu,
            }
        )
        self.indices_updater_decode.update(
            req_pool_indices[:bs],
            seq_lens[:bs],
            seq_lens_sum,
            decode_wrapper=self.decode_cuda_graph_metadata[bs],
            init_metadata_replay=True,
            **self.fast_decode_kwargs,
        )
        self.forward_metadata = DecodeMetadata(self.decode_cuda_graph_metadata[bs])

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        q_rope: Optional[torch.Tensor] = None,
        k_rope: Optional[torch.Tensor] = None,
    ):
        cache_loc = forward_batch.out_cache_loc
        prefill_wrapper_paged = self.forward_metadata.prefill_wrapper

        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_mla_kv_buffer(layer, cache_loc, k, k_rope)
        if q_rope is not None:
            q = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
            q_rope = q_rope.view(
                -1, layer.tp_q_head_num, layer.head_dim - layer.v_head_dim
            )

        # mla paged prefill
        if (
            forward_batch.attn_dcp_metadata is not None
            and forward_batch.attn_dcp_metadata.dcp_kv_buffer is not None
        ):
            # Already a compact, gathered buffer: not a pool-wide cast.
            k_buf = forward_batch.attn_dcp_metadata.dcp_kv_buffer.to(q.dtype)
        else:
            k_buf = _kvpatch_rt.kv_for_mla_run(
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                q.dtype,
            )
        if q_rope is None:
            qall = q.view(-1, layer.tp_q_head_num, layer.head_dim)
            q, q_rope = qall[:, :, : layer.v_head_dim], qall[:, :, layer.v_head_dim :]
        o = q.new_empty(q.shape)
        o = _kvpatch_rt.mla_run(
            prefill_wrapper_paged.run,
            q,
            q_rope,
            k_buf[:, :, : layer.v_head_dim],
            k_buf[:, :, layer.v_head_dim :],
            out=o,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        q_rope: Optional[torch.Tensor] = None,
        k_rope: Optional[torch.Tensor] = None,
    ):
        decode_wrapper = self.forward_metadata.decode_wrapper
        cache_loc = forward_batch.out_cache_loc

        if k is not None and save_kv_cache:
            self.token_to_kv_pool.set_mla_kv_buffer(layer, cache_loc, k, k_rope)

        if q_rope is not None:
            q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
            q_rope = q_rope.view(
                -1, layer.tp_q_head_num, layer.head_dim - layer.v_head_dim
            )
        else:
            reshaped_q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
            q_nope = reshaped_q[:, :, : layer.v_head_dim]
            q_rope = reshaped_q[:, :, layer.v_head_dim :]

        # The whole layer pool is cast here, every layer, every step.
        k_buffer = _kvpatch_rt.kv_for_mla_run(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            q.dtype,  # FP8 storage -> query dtype
        )

        o = q_nope.new_empty(q_nope.shape)
        o = _kvpatch_rt.mla_run(
            decode_wrapper.run,
            q_nope,
            q_rope,
            k_buffer[:, :, : layer.v_head_dim],
            k_buffer[:, :, layer.v_head_dim :],
            out=o,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)


class FlashInferMLAIndicesUpdaterDecode:
    def __init__(self, model_runner: ModelRunner, attn_backend: AttentionBackend):
        self.num_local_heads = model_runner.model_config.num_attention_heads
        self.kv_lora_rank = model_runner.model_config.kv_lora_rank
        self.qk_rope_head_dim = model_runner.model_config.qk_rope_head_dim
        self.scaling = model_runner.model_config.scaling
        self.data_type = model_runner.dtype
        self._kvpatch_kv_cache_dtype = getattr(model_runner, "kv_cache_dtype", None)
        self.attn_backend = attn_backend
        self.kv_indptr = attn_backend.kv_indptr
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.q_indptr = attn_backend.q_indptr_decode

    def update(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        decode_wrapper: BatchMLAPagedAttentionWrapper,
        init_metadata_replay: bool = False,
        **fast_decode_kwargs,
    ):
        self.call_begin_forward(
            decode_wrapper,
            req_pool_indices,
            seq_lens,
            seq_lens_sum,
            self.q_indptr,
            self.kv_indptr,
            init_metadata_replay,
            **fast_decode_kwargs,
        )

    def call_begin_forward(
        self,
        wrapper: BatchMLAPagedAttentionWrapper,
        req_pool_indices: torch.Tensor,
        paged_kernel_lens: torch.Tensor,
        paged_kernel_lens_sum: int,
        q_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        init_metadata_replay: bool = False,
        **fast_decode_kwargs,
    ):
        bs = len(req_pool_indices)
        q_indptr = q_indptr[: bs + 1]
        kv_lens = paged_kernel_lens.to(torch.int32)
        sm_scale = self.scaling
        kv_indptr[1 : bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = (
            torch.empty(paged_kernel_lens_sum, dtype=torch.int32, device=kv_indptr.device)
            if not init_metadata_replay
            else fast_decode_kwargs["kv_indices"]
        )
        create_flashinfer_kv_indices_triton[(bs,)](
            self.req_to_token,
            req_pool_indices,
            paged_kernel_lens,
            kv_indptr,
            None,
            kv_indices,
            self.req_to_token.shape[1],
        )
        if not init_metadata_replay:
            wrapper.plan(
                q_indptr,
                _kvpatch_rt.plan_rows(wrapper, kv_indptr),
                kv_indices,
                kv_lens,
                self.num_local_heads,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
                1,
                False,
                sm_scale,
                self.data_type,
                _kvpatch_rt.plan_kv_dtype(
                    wrapper,
                    self.data_type,
                    self.data_type,
                    self._kvpatch_kv_cache_dtype,
                    False,
                ),
            )
        else:
            wrapper.plan(
                fast_decode_kwargs["qo_indptr_cpu"],
                _kvpatch_rt.plan_rows(wrapper, fast_decode_kwargs["kv_indptr_cpu"]),
                kv_indices,
                fast_decode_kwargs["kv_len_arr_cpu"],
                self.num_local_heads,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
                1,
                False,
                sm_scale,
                self.data_type,
                _kvpatch_rt.plan_kv_dtype(
                    wrapper,
                    self.data_type,
                    self.data_type,
                    self._kvpatch_kv_cache_dtype,
                    False,
                ),
            )


class FlashInferMLAIndicesUpdaterPrefill:
    def __init__(self, model_runner: ModelRunner, attn_backend: AttentionBackend):
        self.num_local_heads = model_runner.model_config.num_attention_heads
        self.kv_lora_rank = model_runner.model_config.kv_lora_rank
        self.qk_rope_head_dim = model_runner.model_config.qk_rope_head_dim
        self.scaling = model_runner.model_config.scaling
        self.data_type = model_runner.dtype
        self.q_data_type = model_runner.dtype
        self._kvpatch_kv_cache_dtype = getattr(model_runner, "kv_cache_dtype", None)
        self.attn_backend = attn_backend
        self.kv_indptr = attn_backend.kv_indptr
        self.qo_indptr = attn_backend.qo_indptr
        self.req_to_token = model_runner.req_to_token_pool.req_to_token

    def update(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        prefix_lens: torch.Tensor,
        prefill_wrapper_paged: BatchMLAPagedAttentionWrapper,
        attn_dcp_metadata=None,
    ):
        self.call_begin_forward(
            prefill_wrapper_paged,
            req_pool_indices,
            seq_lens,
            seq_lens_sum,
            seq_lens,
            prefix_lens,
            self.kv_indptr,
            self.qo_indptr,
            attn_dcp_metadata=attn_dcp_metadata,
        )

    def call_begin_forward(
        self,
        wrapper_paged: BatchMLAPagedAttentionWrapper,
        req_pool_indices: torch.Tensor,
        paged_kernel_lens: torch.Tensor,
        paged_kernel_lens_sum: int,
        seq_lens: torch.Tensor,
        prefix_lens: torch.Tensor,
        kv_indptr: torch.Tensor,
        qo_indptr: torch.Tensor,
        attn_dcp_metadata=None,
    ):
        bs = len(seq_lens)
        sm_scale = self.scaling
        kv_indptr[1 : bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = torch.empty(
            paged_kernel_lens_sum, dtype=torch.int32, device=req_pool_indices.device
        )
        create_flashinfer_kv_indices_triton[(bs,)](
            self.req_to_token,
            req_pool_indices,
            paged_kernel_lens,
            kv_indptr,
            None,
            kv_indices,
            self.req_to_token.shape[1],
        )
        qo_indptr[1 : bs + 1] = torch.cumsum(seq_lens - prefix_lens, dim=0)
        qo_indptr = qo_indptr[: bs + 1]
        if attn_dcp_metadata is not None:
            kv_indptr = attn_dcp_metadata.dcp_kv_indptr
            kv_indices = attn_dcp_metadata.dcp_kv_indices
        kv_len_arr = kv_indptr[1:] - kv_indptr[:-1]
        wrapper_paged.plan(
            qo_indptr,
            _kvpatch_rt.plan_rows(wrapper_paged, kv_indptr),
            kv_indices,
            kv_len_arr,
            self.num_local_heads,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            1,
            True,
            sm_scale,
            self.q_data_type,
            _kvpatch_rt.plan_kv_dtype(
                wrapper_paged,
                self.q_data_type,
                self.data_type,
                self._kvpatch_kv_cache_dtype,
                True,
            ),
        )


def fast_mla_decode_plan(
    self,
    qo_indptr_cpu: torch.Tensor,
    kv_indptr_cpu: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len_arr_cpu: torch.Tensor,
    num_heads: int,
    head_dim_ckv: int,
    head_dim_kpe: int,
    page_size: int,
    causal: bool,
    sm_scale: float,
    q_data_type: torch.dtype,
    kv_data_type: torch.dtype,
) -> None:
    """Plan for CUDA-graph replay: skips the stream sync of the full plan.

    The dtypes are ignored: the kernel was chosen by the capture-time plan.
    """
    self._causal = causal
    self._page_size = page_size
    self._sm_scale = sm_scale
    self._cached_module.plan(
        self._float_workspace_buffer,
        self._int_workspace_buffer,
        self._pin_memory_int_workspace_buffer,
        qo_indptr_cpu,
        kv_indptr_cpu,
        kv_len_arr_cpu,
        num_heads,
        head_dim_ckv,
        causal,
    )
