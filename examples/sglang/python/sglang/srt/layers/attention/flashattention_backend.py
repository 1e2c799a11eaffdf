"""FA3-style backend (kvpatch example): absorbed MLA through a paged page_table."""

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sgl_kernel.flash_attn import flash_attn_with_kvcache


class FlashAttentionBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.page_size = model_runner.page_size
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.kv_cache_dtype_str = model_runner.kv_cache_dtype_str
        self.token_to_kv_pool = model_runner.token_to_kv_pool

    def forward_decode(self, q, k, v, layer, forward_batch, q_rope=None, k_rope=None):
        metadata = self.forward_metadata
        # The FP8 fast path only applies to regular heads: the absorbed-MLA
        # layer (head_dim 576) keeps q in bf16, so the cast below is real.
        if self.kv_cache_dtype_str != "auto" and layer.head_dim <= 256:
            q = q.to(self.kv_cache_dtype)
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        k_rope_cache = kv_cache[:, :, layer.v_head_dim :].view(
            -1, self.page_size, layer.tp_k_head_num, layer.head_dim - layer.v_head_dim
        )
        c_kv_cache = kv_cache[:, :, : layer.v_head_dim].view(
            -1, self.page_size, layer.tp_v_head_num, layer.v_head_dim
        )
        q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        return flash_attn_with_kvcache(
            q=q_rope,
            k_cache=k_rope_cache,
            v_cache=c_kv_cache,
            qv=q_nope,
            page_table=metadata.page_table,
            cache_seqlens=metadata.cache_seqlens_int32,
            softmax_scale=layer.scaling,
            causal=False,
        )
