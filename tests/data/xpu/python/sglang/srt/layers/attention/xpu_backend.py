"""XPU-shaped absorbed-MLA backend for the verify tests (hand-written, not SGLang code).

As SGLang's XPU backend does it: its own class (not an FA3 subclass) whose extend is
FA3-shaped (flash_attn_with_kvcache on pages by keyword, routed by KVP106) and whose
decode hands the cast pool to sgl-kernel's flash_mla_decode positionally (routed by KVP108
through its signature: _kvpatch_rt.paged_mla). Verify serves both kernels with
kvpatch/verify/fa3_reference.py.
"""

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sgl_kernel import flash_mla_decode, merge_state_v2
from sgl_kernel.flash_attn import flash_attn_with_kvcache


class XPUAttentionBackend(AttentionBackend):
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
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        o = flash_mla_decode(
            q_nope,
            q_rope,
            kv_cache.view(-1, self.page_size, layer.head_dim),
            metadata.cache_seqlens_int32,
            metadata.page_table,
            self.workspace,
            layer.scaling,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
