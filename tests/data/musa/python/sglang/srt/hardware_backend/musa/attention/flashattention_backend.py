"""MUSA-shaped absorbed-MLA backend for the verify tests (hand-written, not SGLang code).

As SGLang's MUSA port does it: the backend subclasses FA3's FlashAttentionBackend and
overrides both forwards; FA3 comes from flash_attn_interface (MATE) through a
module-level wrapper that injects scheduler metadata; the cascade's two states are
merged with FA3's merge_state_v2_wrapper.
"""

import torch
from flash_attn_interface import flash_attn_with_kvcache as mate_flash_attn_with_kvcache
from flash_attn_interface import get_scheduler_metadata

from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend, merge_state_v2_wrapper

_CURRENT_BACKEND = None


def flash_attn_with_kvcache(q, k_cache, v_cache, qv=None, page_table=None, cache_seqlens=None,
                            cu_seqlens_q=None, softmax_scale=None, causal=False,
                            return_softmax_lse=False, scheduler_metadata=None):
    if scheduler_metadata is None and _CURRENT_BACKEND is not None:
        scheduler_metadata = get_scheduler_metadata(cache_seqlens=cache_seqlens, page_size=k_cache.shape[1])
    return mate_flash_attn_with_kvcache(
        q=q, k_cache=k_cache, v_cache=v_cache, qv=qv, page_table=page_table, cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_seqlens_q, softmax_scale=softmax_scale, causal=causal,
        return_softmax_lse=return_softmax_lse, scheduler_metadata=scheduler_metadata,
    )


class MusaFlashAttentionBackend(FlashAttentionBackend):
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
            softmax_scale=layer.scaling,
            causal=False,
            return_softmax_lse=True,
        )
        o, _ = merge_state_v2_wrapper(o, lse.T.contiguous(), o_expand, lse_expand.T.contiguous())
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
