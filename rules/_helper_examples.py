"""VALID/INVALID examples of KVP105 (rules/helper_pool_cast.py), shaped like SGLang's NSA
backend (python/sglang/srt/layers/attention/nsa_backend.py, 2025-10 to 2026-01)."""

from kvpatch.rule import Invalid, Valid

NSA = '''
class NativeSparseAttnBackend:
    def forward_extend(self, q, k, v, layer, forward_batch, topk_indices=None):
        kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if not (NSA_COMPUTE_FP8 and self.nsa_kv_cache_store_fp8):
            kv_cache = kv_cache.to(q.dtype)
        page_table_1 = topk_indices
        if self.nsa_prefill_impl == "flashmla_sparse":
            if any(forward_batch.extend_prefix_lens_cpu):
                kv_cache = dequantize_k_cache_paged(kv_cache, self.forward_metadata.page_table_1_flattened)
            return self._forward_flashmla_sparse(q_all=q, kv_cache=kv_cache, page_table_1=page_table_1)
        elif self.nsa_prefill_impl == "flashmla_kv":
            return self._forward_flashmla_kv(q_all=q, kv_cache=kv_cache, page_table_1=page_table_1)
        return self._forward_fa3(q, kv_cache, 512, page_table_1, 1)

    def _forward_flashmla_sparse(self, q_all, kv_cache, page_table_1):
        indices_input = page_table_1.unsqueeze(1)
        o, _, _ = flash_mla_sparse_fwd(q=q_all, kv=kv_cache, indices=indices_input, sm_scale=1.0, d_v=512)
        return o

    def _forward_flashmla_kv(self, q_all, kv_cache, page_table_1):
        kv_cache = kv_cache.view(-1, self.real_page_size, 1, self.kv_cache_dim)
        if NSA_COMPUTE_FP8 and not self.nsa_kv_cache_store_fp8:
            kv_cache = quantize_k_cache(kv_cache)
        indices = page_table_1.unsqueeze(1)
        o, _ = flash_mla_with_kvcache(q=q_all, k_cache=kv_cache, cache_seqlens=None, head_dim_v=512, indices=indices)
        return o

    def _forward_fa3(self, q_rope, kv_cache, v_head_dim, page_table, page_size):
        k_rope_cache = kv_cache[:, :, v_head_dim:].view(-1, page_size, 1, 64)
        c_kv_cache = kv_cache[:, :, :v_head_dim].view(-1, page_size, 1, v_head_dim)
        return flash_attn_with_kvcache(q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, page_table=page_table)
'''

NSA_PATCHED = '''from . import _kvpatch_runtime as _kvpatch_rt  # kvpatch: FP8 KV-cache runtime


class NativeSparseAttnBackend:
    def forward_extend(self, q, k, v, layer, forward_batch, topk_indices=None):
        kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if not (NSA_COMPUTE_FP8 and self.nsa_kv_cache_store_fp8):
            kv_cache = _kvpatch_rt.kv_rows_deferred(kv_cache, q.dtype)
        page_table_1 = topk_indices
        if self.nsa_prefill_impl == "flashmla_sparse":
            if any(forward_batch.extend_prefix_lens_cpu):
                kv_cache = dequantize_k_cache_paged(_kvpatch_rt.kv_rows_at_kernel(kv_cache, self.forward_metadata.page_table_1_flattened, -1), self.forward_metadata.page_table_1_flattened)
            return self._forward_flashmla_sparse(q_all=q, kv_cache=kv_cache, page_table_1=page_table_1)
        elif self.nsa_prefill_impl == "flashmla_kv":
            return self._forward_flashmla_kv(q_all=q, kv_cache=kv_cache, page_table_1=page_table_1)
        return self._forward_fa3(q, kv_cache, 512, page_table_1, 1)

    def _forward_flashmla_sparse(self, q_all, kv_cache, page_table_1):
        indices_input = page_table_1.unsqueeze(1)
        o, _, _ = flash_mla_sparse_fwd(q=q_all, kv=_kvpatch_rt.kv_rows_at_kernel(kv_cache, page_table_1.unsqueeze(1), 1), indices=indices_input, sm_scale=1.0, d_v=512)
        return o

    def _forward_flashmla_kv(self, q_all, kv_cache, page_table_1):
        kv_cache = kv_cache.view(-1, self.real_page_size, 1, self.kv_cache_dim)
        if NSA_COMPUTE_FP8 and not self.nsa_kv_cache_store_fp8:
            kv_cache = quantize_k_cache(_kvpatch_rt.kv_rows_at_kernel(kv_cache, page_table_1.unsqueeze(1), 2))
        indices = page_table_1.unsqueeze(1)
        o, _ = flash_mla_with_kvcache(q=q_all, k_cache=_kvpatch_rt.kv_rows_at_kernel(kv_cache, page_table_1.unsqueeze(1), 2), cache_seqlens=None, head_dim_v=512, indices=indices)
        return o

    def _forward_fa3(self, q_rope, kv_cache, v_head_dim, page_table, page_size):
        k_rope_cache = kv_cache[:, :, v_head_dim:].view(-1, page_size, 1, 64)
        c_kv_cache = kv_cache[:, :, :v_head_dim].view(-1, page_size, 1, v_head_dim)
        return flash_attn_with_kvcache(q=q_rope, k_cache=_kvpatch_rt.kv_rows_at_kernel(k_rope_cache, page_table, 1), v_cache=_kvpatch_rt.kv_rows_at_kernel(c_kv_cache, page_table, 1), page_table=page_table)
'''

# The subclass overrides a helper: `self._forward_flashmla_sparse` may land there.
OVERRIDDEN = NSA + '''

class NativeSparseAttnBackendV2(NativeSparseAttnBackend):
    def _forward_flashmla_sparse(self, q_all, kv_cache, page_table_1):
        return kv_cache.sum()
'''

# A pool write between the cast and the kernels: deferring the cast would show the kernel
# rows the original cast never saw.
WRITE_AFTER = NSA.replace(
    "        page_table_1 = topk_indices\n",
    "        page_table_1 = topk_indices\n"
    "        forward_batch.token_to_kv_pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, v)\n")

# The helper hands the value to something that is not a kernel with an index.
ESCAPES = NSA.replace("        indices_input = page_table_1.unsqueeze(1)\n",
                      "        indices_input = page_table_1.unsqueeze(1)\n        self.debug_dump(kv_cache)\n")

# Only gathered rows are cast before the helper: not a pool-wide cast.
GATHERED = '''
class NativeSparseAttnBackend:
    def forward_extend(self, q, k, v, layer, forward_batch, topk_indices=None):
        pool = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        rows = pool[topk_indices.flatten()].to(q.dtype)
        return self._forward_rows(q, rows)

    def _forward_rows(self, q, rows):
        return flash_mla_sparse_fwd(q=q, kv=rows, indices=None)
'''

VALID = (
    Valid(NSA_PATCHED, why="already rewritten: the deferred cast and the wrapped kernels are in place"),
    Valid(GATHERED, why="only gathered rows are cast: nothing pool-wide to defer"),
    Valid(OVERRIDDEN, why="a subclass in the file overrides a helper: not followed, so not this rule's "
                          "(KVP201 reports it hot, naming the override)"),
    Valid(ESCAPES, why="the helper hands the value to a call that is no known kernel: not this rule's "
                       "(KVP201 reports it hot, naming the call)"),
)

INVALID = (
    Invalid(NSA, expected=NSA_PATCHED,
            why="every use of the cast reaches a kernel whose rows kvpatch knows: dequantize_k_cache_paged "
                "inline, flash_mla_sparse_fwd / flash_mla_with_kvcache (through quantize_k_cache) / "
                "flash_attn_with_kvcache in followed helpers"),
    Invalid(WRITE_AFTER, expected=None, why="the pool is written after the cast: the kernel would see new rows"),
)
