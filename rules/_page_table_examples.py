"""Example sources for KVP103's VALID/INVALID examples (rules/page_table_pool_cast.py):
hand-written, shaped like the SGLang backends the rule rewrites (not SGLang code)."""

from kvpatch.rewrite.codegen import IMPORT_LINE

RT = IMPORT_LINE + "\n\n"  # what apply adds at the top of a file with no imports

FA3_DECODE = '''
class FlashAttentionBackend:
    def forward_decode(self, q, k, v, layer, forward_batch, q_rope=None):
        metadata = self.forward_metadata
        use_cascade_attn = forward_batch.spec_info is not None
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        k_rope = kv_cache[:, :, layer.v_head_dim :]
        c_kv = kv_cache[:, :, : layer.v_head_dim]
        k_rope_cache = k_rope.view(-1, self.page_size, layer.tp_k_head_num, 64)
        c_kv_cache = c_kv.view(-1, self.page_size, layer.tp_v_head_num, layer.v_head_dim)
        result = flash_attn_with_kvcache(
            q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q,
            page_table=metadata.page_table, cache_seqlens=metadata.cache_seqlens_int32,
        )
        if use_cascade_attn:
            o_expand = flash_attn_with_kvcache(
                q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q,
                page_table=self.forward_metadata_spec_decode_expand.page_table,
                cache_seqlens=self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
            )
        return result
'''
CP_EXTEND = '''
class FlashAttentionBackend:
    def forward_extend(self, q, layer, metadata):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        k_rope_cache = kv_cache[:, :, 512:].view(-1, self.page_size, 1, 64)
        c_kv_cache = kv_cache[:, :, :512].view(-1, self.page_size, 1, 512)

        def attn(q_chunk, cache_seqlens_cp):
            return flash_attn_with_kvcache(q=q_chunk, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q_chunk,
                                           page_table=metadata.page_table, cache_seqlens=cache_seqlens_cp)

        if self.cp_active:
            return self.cp_strategy.run_attention(q, attn)
        return flash_attn_with_kvcache(q=q, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q,
                                       page_table=metadata.page_table, cache_seqlens=metadata.cache_seqlens_int32)
'''
FA3_PATCHED_CAST = '''        kv_cache = _kvpatch_rt.kv_pages_for_kernel(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            q.dtype,
            self.page_size,
            lambda: (metadata.page_table, metadata.cache_seqlens_int32),
            lambda: (
                self.forward_metadata_spec_decode_expand.page_table,
                self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
            ),
        )
'''
XPU_DECODE = """
class XPUAttentionBackend:
    def forward_decode(self, q, q_rope, layer, metadata):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return flash_mla_decode(q, q_rope, kv_cache.view(-1, self.page_size, layer.head_dim),
                                metadata.cache_seqlens_int32, metadata.page_table, self.workspace, layer.scaling,
                                num_kv_splits=1)
"""
XPU_PREFILL = """
class XPUAttentionBackend:
    def forward_extend(self, q, q_rope, layer, metadata, use_local_attn):
        if use_local_attn:
            page_table = metadata.local_attn_metadata.local_block_table
            cache_seqlens = metadata.local_attn_metadata.local_seqused_k
        else:
            page_table = metadata.page_table
            cache_seqlens = metadata.cache_seqlens_int32
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(
            q.dtype
        )
        return flash_mla_prefill(q_nope=q, q_pe=q_rope, kv_c_and_k_pe_cache=kv_cache.view(-1, self.page_size, 576),
                                 cu_seqlens_q=metadata.cu_seqlens_q, seq_lens_k=cache_seqlens, max_seqlen_q=1,
                                 page_table=page_table, workspace=self.workspace, sm_scale=layer.scaling)
"""
AITER_DECODE = """
class AiterAttnBackend:
    def forward_decode(self, q, layer, forward_batch):
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if self.kv_cache_dtype == fp8_dtype:
            k_cache = k_cache.to(self.input_dtype)
            v_cache = v_cache.to(self.input_dtype)
        paged_attention_ragged(o, self.workspace_buffer, q, k_cache.view(-1, 1, layer.tp_k_head_num, 128),
                               v_cache.view(-1, 1, layer.tp_v_head_num, 128), self.scale,
                               self.forward_metadata.kv_indptr, self.forward_metadata.kv_indices, self.kv_last_page_len,
                               1, self.max_num_partitions, None, "auto", "NHD", 0.0, self.k_scale, self.v_scale)
        return o
"""
UNIFIED = """
class AiterAttnBackend:
    def forward_decode(self, q, layer, forward_batch):
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        k_cache = k_cache.to(self.input_dtype)
        unified_attention(q=q, k=k_cache.view(-1, self.page_size, 8, 128), v=v_cache, out=o,
                          seqused_k=forward_batch.seq_lens, block_table=self.forward_metadata.page_table)
        return o
"""
XPU_CAST = "self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"
XPU_CAST_WRAPPED = "self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(\n            q.dtype\n        )"


def _patched(pair: str, pool: str = "self.token_to_kv_pool.get_key_buffer(layer.layer_id)", dtype: str = "q.dtype",
             ps: str = "self.page_size", table: str = "") -> str:
    """An example's cast as apply rewrites it, with one (table, lengths) pair (or `table`)."""
    return (f"_kvpatch_rt.kv_pages_for_kernel(\n            {pool},\n            {dtype},\n            {ps},\n"
            f"            {table or f'lambda: ({pair})'},\n        )")


def _ragged(cache: str) -> str:
    """AITER_DECODE's cast of `cache`, rewritten (one level deeper: under the guard)."""
    return _patched("", cache, "self.input_dtype", "1", "lambda: _kvpatch_rt.ragged_pages(self.forward_metadata."
                    "kv_indptr, self.forward_metadata.kv_indices, 1)").replace("\n    ", "\n        ")
