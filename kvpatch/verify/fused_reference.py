"""fp32 reference of MLA attention over the rows a kernel reads (the fused FP8 path's check).

score = sm_scale * (q_nope . ckv * ckv_scale + q_pe . kpe * kpe_scale), V = ckv * ckv_scale,
softmax in fp32 over request b's rows in order; causal: query t of T sees positions
<= len - T + t. Used by tests/gpu/test_fused_gpu.py and benchmarks/bench_fused.py.
"""

import torch


def fused_reference(
    q_nope, q_pe, kv_buffer, sm_scale, rows_of, q_per_request=1, causal=False, ckv_scale=1.0, kpe_scale=1.0
):
    """fp32 reference on the same rows: rows_of(b) -> the pool slots request b reads, in order."""
    tq = int(q_per_request)
    n_tok, heads, d = q_nope.shape
    kv2 = kv_buffer.view(-1, kv_buffer.shape[-1]).float()
    out = torch.empty((n_tok, heads, d), dtype=torch.float32, device=q_nope.device)
    for b in range(n_tok // tq):
        slots = rows_of(b).long()
        k = kv2[slots]
        kn, kp = k[:, :d] * ckv_scale, k[:, d:] * kpe_scale
        qn = q_nope[b * tq : (b + 1) * tq].float()
        qp = q_pe[b * tq : (b + 1) * tq].float()
        s = (torch.einsum("thd,nd->thn", qn, kn) + torch.einsum("thd,nd->thn", qp, kp)) * sm_scale
        if causal and tq > 1:
            n = slots.numel()
            pos = torch.arange(n, device=s.device)
            lim = n - tq + torch.arange(tq, device=s.device)
            s = s.masked_fill(pos[None, None, :] > lim[:, None, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[b * tq : (b + 1) * tq] = torch.einsum("thn,nd->thd", p, kn)
    return out
