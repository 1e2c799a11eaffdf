"""aiter-shaped MHA backend for the verify tests (hand-written, not SGLang code).

As SGLang's aiter backend did from 2025-09 to 2026-02: forward_extend reads the (k, v)
pool, casts both halves to the query dtype when the pool is FP8, and hands them unviewed
(rank 3, one slot per page) to aiter's mha_batch_prefill_func with FlashInfer's ragged
page list (kv_indptr sliced to the batch, kv_indices); forward_decode's MHA branch casts
both halves the same way and hands them, viewed as pages of one slot, to aiter's
paged_attention_ragged with the decode's ragged list (kv_indptr already cut to the batch
by the metadata). KVP103 rewrites the four casts.
"""

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.quantization.fp8_kernel import fp8_dtype

try:
    from aiter import mha_batch_prefill_func, paged_attention_ragged
except ImportError:
    print("aiter is not installed")

_PARTITION_SIZE = 256  # the partition paged_attention_ragged's workspace was sized for


class AiterAttnBackend(AttentionBackend):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        self.logits_soft_cap = layer.logit_cap
        if self.use_mla:
            raise NotImplementedError("the MLA paths are not part of this fixture")

        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(
            layer.layer_id
        )

        bs0 = forward_batch.batch_size + 1

        # mha_batch_prefill_func does not take an FP8 cache here
        if self.kv_cache_dtype == fp8_dtype:
            dtype = q.dtype
            k_cache = k_cache.to(dtype)
            v_cache = v_cache.to(dtype)

        window_size = (-1, -1)
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            window_size = (layer.sliding_window_size, -1)

        o = mha_batch_prefill_func(
            q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
            k_cache,
            v_cache,
            self.qo_indptr[:bs0],
            self.forward_metadata.kv_indptr[:bs0],
            self.forward_metadata.kv_indices,
            self.forward_metadata.max_q_len,
            self.forward_metadata.max_kv_len,
            causal=True,
            logits_soft_cap=self.logits_soft_cap,
            alibi_slopes=None,
            return_lse=False,
            return_attn_probs=False,
            window_size=window_size,
            sink_ptr=sinks,
        )

        return o.view(-1, layer.tp_q_head_num * layer.head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = torch.empty_like(q, dtype=self.input_dtype)

        if self.use_mla:
            raise NotImplementedError("the MLA paths are not part of this fixture")
        else:
            self.logits_soft_cap = layer.logit_cap

            k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(
                layer.layer_id
            )

            # paged_attention_ragged does not take an FP8 cache here
            if self.kv_cache_dtype == fp8_dtype:
                dtype = q.dtype
                k_cache = k_cache.to(dtype)
                v_cache = v_cache.to(dtype)

            paged_attention_ragged(
                o.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                self.workspace_buffer,
                q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                k_cache.view(-1, 1, layer.tp_k_head_num, layer.qk_head_dim),
                v_cache.view(-1, 1, layer.tp_v_head_num, layer.v_head_dim),
                self.scale,
                self.forward_metadata.kv_indptr,
                self.forward_metadata.kv_indices,
                self.kv_last_page_len,
                1,
                self.max_num_partitions,
                None,
                "auto",
                "NHD",
                self.logits_soft_cap,
                self.k_scale,
                self.v_scale,
                None,
                _PARTITION_SIZE,
            )

        return o
