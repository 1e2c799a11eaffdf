"""Example sources shared by the FlashInfer MLA rules' VALID/INVALID examples
(rules/fi_mla_pool_cast.py, KVP101; rules/fi_mla_plan_kv_dtype.py, KVP102;
rules/fi_mla_route.py, KVP107):
hand-written, shaped like SGLang's FlashInfer MLA backend (not SGLang code)."""

from kvpatch.rewrite.codegen import IMPORT_LINE

HEADER = "from flashinfer import BatchMLAPagedAttentionWrapper\n"
RT = "\n" + IMPORT_LINE + "\n"  # what apply adds after the imports
# KVP102 retargets plans only next to a cast that KVP101 or KVP107 rewrites
# (PAIRS_WITH): the site, and (below) KVP107's rewrite of it.
BACKEND = """
class FlashInferMLAAttnBackend:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])
"""
# What apply writes with every rule loaded: KVP107 routes the site.
BACKEND_ROUTED = """
class FlashInferMLAAttnBackend:
    def forward_decode(self, q, q_rope, layer, forward_batch):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = _kvpatch_rt.kv_for_mla_run(
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            q.dtype,
        )
        return _kvpatch_rt.mla_run(decode_wrapper.run, q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])
"""
# A FlashInfer decode wrapper's JIT plan (16 positional arguments, shaped like
# SGLang b11008465's flashinfer_backend.py): not an MLA wrapper's plan().
JIT_DECODE_PLAN = """
def fast_decode_plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                     page_size, window_left=-1, logits_soft_cap=None, data_type="float16"):
    self._cached_module.plan(
        self._float_workspace_buffer,
        self._int_workspace_buffer,
        self._pin_memory_int_workspace_buffer,
        indptr.to("cpu"),
        len(last_page_len),
        num_qo_heads,
        num_kv_heads,
        page_size,
        self.is_cuda_graph_enabled,
        window_left,
        logits_soft_cap,
        head_dim,
        head_dim,
        self.empty_q_data,
        self.empty_kv_cache,
    )
"""
