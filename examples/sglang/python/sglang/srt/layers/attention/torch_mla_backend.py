"""Reference torch MLA backend (kvpatch example): its cast is provably a no-op."""

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend


class TorchMLABackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.token_to_kv_pool = model_runner.token_to_kv_pool

    def forward_decode(self, q, k, v, layer, forward_batch):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        # This backend computes in the cache dtype: q follows the pool.
        q = q.to(kv_cache.dtype)
        kv = kv_cache.to(q.dtype)
        rows = kv[forward_batch.kv_indices]
        scores = torch.einsum("hd,nd->hn", q.float(), rows[:, 0].float())
        return torch.softmax(scores * layer.scaling, dim=-1) @ rows[:, 0, : layer.v_head_dim].float()
