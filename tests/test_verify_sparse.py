"""KVP105's rewrite against torch references of the sparse kernels (kvpatch/verify/
sparse_reference.py), on the CPU: the rule's own NSA example, original and patched, run
every path (flashmla_sparse with and without the inline dequantize, flashmla_kv with and
without quantize_k_cache on the way, fa3, and the FP8-compute path that casts nothing) on
an FP8 pool, with every row of the deferred buffer poisoned (NaN) before each call: the
outputs must be bit-identical. Sabotage: a rewrite that hands a kernel's wrapper a narrower
index, and a runtime whose wrapper casts nothing, must both be caught."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvpatch.runtime import load_template  # noqa: E402
from kvpatch.rules import _helper_examples as EX  # noqa: E402
from kvpatch.verify import sparse_reference as ref  # noqa: E402

if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

SLOTS, D, DV, TOPK, T, H = 256, 576, 512, 16, 6, 4


def _fa3(q, k_cache, v_cache, page_table):
    """flash_attn_with_kvcache over every page of each row of page_table (page size from
    k_cache), -1 skipped: the rows KVP105 assumes (no cache_seqlens in the example)."""
    ps = k_cache.shape[1]
    k2, v2 = k_cache.reshape(-1, k_cache.shape[-1]), v_cache.reshape(-1, v_cache.shape[-1])
    out = []
    for t in range(q.shape[0]):
        pages = page_table[t].long()
        slots = (pages[:, None] * ps + torch.arange(ps, device=pages.device)[None, :]).reshape(-1)
        slots = torch.where(pages[:, None].expand(-1, ps).reshape(-1) >= 0, slots, torch.full_like(slots, -1))
        kr, valid = ref._rows(k2, slots)
        vr, _ = ref._rows(v2, slots)
        s = (q[t].float() @ kr.T).masked_fill(~valid[None, :], float("-inf"))
        out.append(torch.softmax(s, -1) @ vr)
    return torch.stack(out)


class _Meta:
    pass


def _module(text, rt):
    g = {"flash_mla_sparse_fwd": ref.flash_mla_sparse_fwd, "flash_mla_with_kvcache": ref.flash_mla_with_kvcache,
         "flash_attn_with_kvcache": _fa3, "quantize_k_cache": lambda x: x * 2,
         "dequantize_k_cache_paged": lambda kv, idx: kv.reshape(-1, kv.shape[-1]).index_select(0, idx.long())[:, None],
         "NSA_COMPUTE_FP8": False}
    if rt is not None:
        g["_kvpatch_rt"] = rt
    text = text.replace("from . import _kvpatch_runtime as _kvpatch_rt", "")
    exec(compile(text, "nsa_backend.py", "exec"), g)
    return g


def _run(g, rt, impl, prefix, fp8, store_fp8, pool, q, topk, flat):
    g["NSA_COMPUTE_FP8"] = fp8
    be = g["NativeSparseAttnBackend"]()
    be.nsa_prefill_impl, be.nsa_kv_cache_store_fp8 = impl, store_fp8
    be.real_page_size, be.kv_cache_dim = 64, D
    be.forward_metadata = _Meta()
    be.forward_metadata.page_table_1_flattened = flat
    fb = _Meta()
    fb.extend_prefix_lens_cpu = [prefix]
    fb.token_to_kv_pool = _Meta()
    fb.token_to_kv_pool.get_key_buffer = lambda layer_id: pool
    layer = _Meta()
    layer.layer_id = 0
    if rt is not None:
        rt.poison_shadows()
    qq = q if impl != "flashmla_kv" else q[:, None]
    if impl == "fa3":
        qq = q[:, :, DV:]
    return be.forward_extend(qq, None, None, layer, fb, topk_indices=topk)


PATHS = [("flashmla_sparse", 0, False, False), ("flashmla_sparse", 3, False, False),
         ("flashmla_kv", 0, False, False), ("flashmla_kv", 0, True, False), ("fa3", 0, False, False),
         ("flashmla_sparse", 0, True, True)]


def _inputs(seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(SLOTS, 1, D, generator=gen) * 2).to(torch.float8_e4m3fn)
    q = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    topk = torch.randint(0, SLOTS, (T, TOPK), generator=gen, dtype=torch.int32)
    topk[:, -3:] = -1  # invalid entries: skipped by the kernels, never read
    flat = torch.randint(0, SLOTS, (40,), generator=gen, dtype=torch.int32)
    return tuple(x.to(device) for x in (pool, q, topk, flat))


def failures(patched_text, rt, seeds=(0, 1), device="cpu"):
    """The (seed, path) cases where the patched module's output differs from the original's."""
    orig, new = _module(EX.NSA, None), _module(patched_text, rt)
    bad = []
    for seed in seeds:
        pool, q, topk, flat = _inputs(seed, device)
        for path in PATHS:
            a = _run(orig, None, *path, pool, q, topk, flat)
            b = _run(new, rt, *path, pool, q, topk, flat)
            a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
            if not torch.equal(a, b):
                bad.append((seed, path))
    return bad


@pytest.fixture()
def rt():
    m = load_template()
    m.reset()
    return m


def test_the_patched_example_is_bit_identical_on_every_path(rt):
    assert failures(EX.NSA_PATCHED, rt) == []
    assert rt._deferred_src, "the deferred path was not taken: the test would prove nothing"


def test_sabotage_a_narrower_index_is_caught(rt):
    broken = EX.NSA_PATCHED.replace("kv_rows_at_kernel(kv_cache, page_table_1.unsqueeze(1), 1)",
                                    "kv_rows_at_kernel(kv_cache, page_table_1[:, :2].unsqueeze(1), 1)")
    assert broken != EX.NSA_PATCHED
    bad = failures(broken, rt)
    assert ("flashmla_sparse" in {p[1][0] for p in bad}), bad


def test_sabotage_a_wrapper_that_casts_nothing_is_caught(rt, monkeypatch):
    monkeypatch.setitem(rt.__dict__, "kv_rows_at_kernel", lambda kv, indices, lead=1: kv)
    bad = failures(EX.NSA_PATCHED, rt)
    assert {p[1][0] for p in bad} >= {"flashmla_sparse", "flashmla_kv", "fa3"}, bad
    assert all(not p[1][2] or not p[1][3] for p in bad)  # the path that casts nothing cannot differ


def test_a_tensor_that_is_not_deferred_passes_through(rt):
    x = torch.randn(4, 1, 8)
    assert rt.kv_rows_at_kernel(x, torch.tensor([0, 1]), 1) is x
    rt.reset()
    monkey = rt.kv_rows_deferred(x.to(torch.float8_e4m3fn), torch.float32)
    assert rt.kv_rows_at_kernel(monkey, torch.tensor([[1, -1]]), 1) is monkey
    assert torch.equal(monkey[1], x.to(torch.float8_e4m3fn)[1].float())
