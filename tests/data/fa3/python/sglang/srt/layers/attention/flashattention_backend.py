"""FA3-shaped absorbed-MLA backend for the verify tests (hand-written, not SGLang code).

forward_extend and forward_decode cast the layer's whole FP8 pool and hand the pages to
flash_attn_with_kvcache with the step's page table; under speculative top-k > 1 a second
(cascade) call reads the expand table and the two states are merged.
"""

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sgl_kernel import merge_state_v2
from sgl_kernel.flash_attn import flash_attn_with_kvcache


class FlashAttentionBackend(AttentionBackend):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        metadata = self.forward_metadata
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        k_rope_cache = kv_cache[:, :, layer.v_head_dim :].view(
            -1, self.page_size, layer.tp_k_head_num, layer.head_dim - layer.v_head_dim
        )
        c_kv_cache = kv_cache[:, :, : layer.v_head_dim].view(
            -1, self.page_size, layer.tp_v_head_num, layer.v_head_dim
        )
        q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        o = flash_attn_with_kvcache(
            q=q_rope,
            k_cache=k_rope_cache,
            v_cache=c_kv_cache,
            qv=q_nope,
            page_table=metadata.page_table,
            cache_seqlens=metadata.cache_seqlens_int32,
            cu_seqlens_q=metadata.cu_seqlens_q,
            max_seqlen_q=metadata.max_seq_len_q,
            softmax_scale=layer.scaling,
            causal=True,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        metadata = self.forward_metadata
        use_cascade_attn = forward_batch.spec_info is not None and self.topk > 1
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        k_rope_cache = kv_cache[:, :, layer.v_head_dim :].view(
            -1, self.page_size, layer.tp_k_head_num, layer.head_dim - layer.v_head_dim
        )
        c_kv_cache = kv_cache[:, :, : layer.v_head_dim].view(
            -1, self.page_size, layer.tp_v_head_num, layer.v_head_dim
        )
        q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        result = flash_attn_with_kvcache(
            q=q_rope,
            k_cache=k_rope_cache,
            v_cache=c_kv_cache,
            qv=q_nope,
            page_table=metadata.page_table,
            cache_seqlens=metadata.cache_seqlens_int32,
            cu_seqlens_q=metadata.cu_seqlens_q,
            max_seqlen_q=metadata.max_seq_len_q,
            softmax_scale=layer.scaling,
            causal=not use_cascade_attn,
            return_softmax_lse=use_cascade_attn,
        )
        if not use_cascade_attn:
            return result.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        o, lse, *rest = result
        o_expand, lse_expand, *rest = flash_attn_with_kvcache(
            q=q_rope,
            k_cache=k_rope_cache,
            v_cache=c_kv_cache,
            qv=q_nope,
            page_table=self.forward_metadata_spec_decode_expand.page_table,
            cache_seqlens=self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
            cu_seqlens_q=self.forward_metadata_spec_decode_expand.cu_seqlens_q,
            max_seqlen_q=self.forward_metadata_spec_decode_expand.max_seq_len_q,
            softmax_scale=layer.scaling,
            causal=False,
            return_softmax_lse=True,
        )
        o, _ = merge_state_v2(o, lse.T.contiguous(), o_expand, lse_expand.T.contiguous())
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
