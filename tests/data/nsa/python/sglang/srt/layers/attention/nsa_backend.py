"""A small NSA backend written for kvpatch's verify tests (not SGLang code).

Shaped like SGLang's nsa_backend.py of 2025-11 to 2026-01, the versions whose
forward_extend casts the whole KV pool and hands the cast to helper methods: the
prefill and decode forwards pick a kernel path by `self.nsa_*_impl`, top-k positions
become pool slots through the index transform (PAGED), or, for an FP8 store, the
prefix rows are dequantized into a ragged buffer first (RAGGED). With the FP8-compute
constant on, `_forward_flashmla_kv` quantizes the cache it got into FlashMLA's packed
656-byte rows and runs the FP8 kernel on them.
"""

from enum import IntEnum, auto

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.nsa.dequant_k_cache import dequantize_k_cache_paged
from sglang.srt.layers.attention.nsa.quant_k_cache import quantize_k_cache
from sglang.srt.layers.attention.nsa.transform_index import (
    transform_index_page_table_decode,
    transform_index_page_table_prefill,
)
from sglang.srt.layers.attention.nsa.utils import NSA_FLASHMLA_BACKEND_DECODE_COMPUTE_FP8
from sglang.srt.layers.attention.trtllm_mla_backend import _concat_mla_absorb_q_general
from sgl_kernel.flash_attn import flash_attn_with_kvcache


class TopkTransformMethod(IntEnum):
    PAGED = auto()
    RAGGED = auto()


class NativeSparseAttnBackend(AttentionBackend):
    def get_topk_transform_method(self):
        if self.nsa_kv_cache_store_fp8 and self.nsa_prefill_impl == "flashmla_sparse":
            return TopkTransformMethod.RAGGED
        return TopkTransformMethod.PAGED

    def _split_q(self, q, q_rope, layer):
        q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        q_rope = q_rope.view(-1, layer.tp_q_head_num, layer.head_dim - layer.v_head_dim)
        return q_nope, q_rope

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                       topk_indices=None):
        metadata = self.forward_metadata
        kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if not (NSA_FLASHMLA_BACKEND_DECODE_COMPUTE_FP8 and self.nsa_kv_cache_store_fp8):
            kv_cache = kv_cache.to(q.dtype)
        q_nope, q_rope = self._split_q(q, q_rope, layer)
        method = self.get_topk_transform_method()
        if method == TopkTransformMethod.RAGGED:
            offset = metadata.topk_indices_offset.unsqueeze(1)
            topk_indices = torch.where(topk_indices != -1, topk_indices + offset, topk_indices)
        else:
            page_table_1 = transform_index_page_table_prefill(
                page_table=metadata.page_table_1,
                topk_indices=topk_indices,
                extend_lens_cpu=metadata.nsa_extend_seq_lens_list,
                page_size=1,
            )
        if self.nsa_prefill_impl == "tilelang":
            q_all = _concat_mla_absorb_q_general(q_nope, q_rope)
            return self._forward_tilelang(q_all=q_all, kv_cache=kv_cache, page_table_1=page_table_1,
                                          sm_scale=layer.scaling, v_head_dim=layer.v_head_dim)
        elif self.nsa_prefill_impl == "flashmla_sparse":
            q_all = _concat_mla_absorb_q_general(q_nope, q_rope)
            if method == TopkTransformMethod.RAGGED:
                if any(forward_batch.extend_prefix_lens_cpu):
                    kv_cache = dequantize_k_cache_paged(kv_cache, metadata.page_table_1_flattened)
                else:
                    kv_cache = torch.cat([k, k_rope], dim=-1)
                page_table_1 = topk_indices
            return self._forward_flashmla_sparse(q_all=q_all, kv_cache=kv_cache, page_table_1=page_table_1,
                                                 sm_scale=layer.scaling, v_head_dim=layer.v_head_dim)
        elif self.nsa_prefill_impl == "flashmla_kv":
            q_all = _concat_mla_absorb_q_general(q_nope, q_rope)
            return self._forward_flashmla_kv(q_all=q_all, kv_cache=kv_cache, sm_scale=layer.scaling,
                                             v_head_dim=layer.v_head_dim, layer=layer, metadata=metadata,
                                             page_table_1=page_table_1)
        elif self.nsa_prefill_impl == "fa3":
            return self._forward_fa3(q_rope=q_rope, kv_cache=kv_cache, v_head_dim=layer.v_head_dim, q_nope=q_nope,
                                     page_table=page_table_1, cache_seqlens=metadata.nsa_cache_seqlens_int32,
                                     cu_seqlens_q=metadata.nsa_cu_seqlens_q, sm_scale=layer.scaling, page_size=1)
        raise ValueError(f"unknown prefill impl {self.nsa_prefill_impl}")

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                       topk_indices=None):
        # Decode reads the store as it is (no cast): the helpers see the pool itself.
        metadata = self.forward_metadata
        kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        q_nope, q_rope = self._split_q(q, q_rope, layer)
        page_table_1 = transform_index_page_table_decode(
            page_table=metadata.page_table_1, topk_indices=topk_indices, page_size=1)
        if self.nsa_decode_impl == "flashmla_sparse":
            q_all = _concat_mla_absorb_q_general(q_nope, q_rope)
            return self._forward_flashmla_sparse(q_all=q_all, kv_cache=kv_cache, page_table_1=page_table_1,
                                                 sm_scale=layer.scaling, v_head_dim=layer.v_head_dim)
        elif self.nsa_decode_impl == "flashmla_kv":
            # With NSA_FLASHMLA_BACKEND_DECODE_COMPUTE_FP8 the helper quantizes the store it is
            # handed, whole, before the FP8 kernel (as upstream's decode does).
            q_all = _concat_mla_absorb_q_general(q_nope, q_rope)
            return self._forward_flashmla_kv(q_all=q_all, kv_cache=kv_cache, sm_scale=layer.scaling,
                                             v_head_dim=layer.v_head_dim, layer=layer, metadata=metadata,
                                             page_table_1=page_table_1)
        elif self.nsa_decode_impl == "fa3":
            return self._forward_fa3(q_rope=q_rope, kv_cache=kv_cache, v_head_dim=layer.v_head_dim, q_nope=q_nope,
                                     page_table=page_table_1, cache_seqlens=metadata.nsa_cache_seqlens_int32,
                                     cu_seqlens_q=metadata.nsa_cu_seqlens_q, sm_scale=layer.scaling, page_size=1)
        raise ValueError(f"unknown decode impl {self.nsa_decode_impl}")

    def _forward_fa3(self, q_rope, kv_cache, v_head_dim, q_nope, page_table, cache_seqlens, cu_seqlens_q,
                     sm_scale, page_size):
        rope_dim = kv_cache.shape[-1] - v_head_dim
        k_rope_cache = kv_cache[:, :, v_head_dim:].view(-1, page_size, 1, rope_dim)
        c_kv_cache = kv_cache[:, :, :v_head_dim].view(-1, page_size, 1, v_head_dim)
        return flash_attn_with_kvcache(q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q_nope,
                                       page_table=page_table, cache_seqlens=cache_seqlens,
                                       cu_seqlens_q=cu_seqlens_q, softmax_scale=sm_scale, causal=True)

    def _forward_flashmla_sparse(self, q_all, kv_cache, v_head_dim, page_table_1, sm_scale):
        from sgl_kernel.flash_mla import flash_mla_sparse_fwd

        # The kernel wants a multiple of 64 query heads: pad with zeros, trim after.
        tokens, heads, dim = q_all.shape
        padded = q_all.new_zeros((tokens, 64, dim))
        padded[:, :heads] = q_all
        indices_input = page_table_1.unsqueeze(1)
        o, _, _ = flash_mla_sparse_fwd(q=padded, kv=kv_cache, indices=indices_input, sm_scale=sm_scale,
                                       d_v=v_head_dim)
        return o[:, :heads]

    def _forward_flashmla_kv(self, q_all, kv_cache, v_head_dim, sm_scale, layer, metadata, page_table_1):
        from sgl_kernel.flash_mla import flash_mla_with_kvcache

        q_all = q_all.view(-1, 1, layer.tp_q_head_num, layer.head_dim)
        kv_cache = kv_cache.view(-1, self.real_page_size, 1, self.kv_cache_dim)
        if NSA_FLASHMLA_BACKEND_DECODE_COMPUTE_FP8 and not self.nsa_kv_cache_store_fp8:
            kv_cache = quantize_k_cache(kv_cache)
        indices = page_table_1.unsqueeze(1)
        o, _ = flash_mla_with_kvcache(q=q_all, k_cache=kv_cache, cache_seqlens=metadata.nsa_cache_seqlens_int32,
                                      head_dim_v=v_head_dim, softmax_scale=sm_scale, indices=indices,
                                      is_fp8_kvcache=NSA_FLASHMLA_BACKEND_DECODE_COMPUTE_FP8)
        return o

    def _forward_tilelang(self, q_all, kv_cache, v_head_dim, page_table_1, sm_scale):
        from sglang.srt.layers.attention.nsa.tilelang_kernel import tilelang_sparse_fwd

        return tilelang_sparse_fwd(q=q_all, kv=kv_cache, indices=page_table_1.unsqueeze(1), sm_scale=sm_scale,
                                   d_v=v_head_dim)
