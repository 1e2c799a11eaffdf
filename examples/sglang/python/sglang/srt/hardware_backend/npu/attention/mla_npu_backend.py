"""NPU-style MLA backend (kvpatch example): the cast escapes through a helper."""

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend


class NpuMLABackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.input_dtype = model_runner.dtype

    def _kv_for_layer(self, layer):
        # The cast result is returned to the caller: which rows the kernel
        # reads is decided elsewhere, so no rule can gather it here.
        return self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(
            self.input_dtype
        )

    def forward_decode(self, q, k, v, layer, forward_batch):
        kv = self._kv_for_layer(layer)
        return self.npu_kernel(q, kv, forward_batch.block_tables)
