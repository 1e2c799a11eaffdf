"""Routed kernel calls on the CPU: kv_for_routed_kernel hands the pool on uncast, and
paged_attention casts the pages the call's own table lists into the shadow before the
original kernel runs (the fused path needs CUDA: tests/gpu/test_route_gpu.py).

The kernel here is kvpatch's torch stand-in for FA3's flash_attn_with_kvcache
(kvpatch/verify/fa3_reference.py). The shadow is poisoned with NaN first, so a page the
routed call failed to cast reaches the output."""

import pytest

torch = pytest.importorskip("torch", reason="the runtime's routed calls need torch")

from kvpatch.runtime import load_template  # noqa: E402
from kvpatch.verify.fa3_reference import flash_attn_with_kvcache as fa3  # noqa: E402

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@pytest.fixture
def rt(monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "auto")
    mod = load_template("_kvpatch_route_cpu")
    mod.reset()
    return mod


def case(ps, tq, lens=(37, 70, 5), slots=512, heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn((slots, 1, 576), generator=g) * 0.5).to(FP8)
    width = max(-(-n // ps) for n in lens)
    pt = torch.randperm(slots // ps, generator=g)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn((len(lens) * tq, heads, 576), generator=g).to(BF16)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32) * tq
    return pool, pt, sl, q, cu


def call(fn, kv, ps, pt, sl, q, cu, tq, **extra):
    """The FA3 absorbed-MLA call as SGLang makes it: caches viewed as pages, by keyword."""
    k_rope = kv[:, :, 512:].view(-1, ps, 1, 64)
    c_kv = kv[:, :, :512].view(-1, ps, 1, 512)
    return fn(q=q[..., 512:], k_cache=k_rope, v_cache=c_kv, qv=q[..., :512], page_table=pt, cache_seqlens=sl,
              cu_seqlens_q=cu, max_seqlen_q=tq, softmax_scale=0.1, causal=tq > 1, **extra)


@pytest.mark.parametrize("ps,tq", [(1, 1), (16, 1), (16, 2), (64, 4)])
def test_routed_call_casts_the_pages_its_table_lists_and_matches_the_full_cast(rt, ps, tq):
    pool, pt, sl, q, cu = case(ps, tq)
    want = call(fa3, pool.to(BF16), ps, pt, sl, q, cu, tq)
    kv = rt.kv_for_routed_kernel(pool, BF16)
    assert kv is pool  # no cast at the cast site: the routed call decides
    rt.paged_attention(fa3, **_kw(kv, ps, pt, sl, q, cu, tq))  # makes the shadow, which is then poisoned
    rt.poison_shadows()
    got = rt.paged_attention(fa3, **_kw(kv, ps, pt, sl, q, cu, tq))
    assert torch.equal(got, want)


def _kw(kv, ps, pt, sl, q, cu, tq, **extra):
    return call(lambda **kw: kw, kv, ps, pt, sl, q, cu, tq, **extra)


def test_a_call_the_fused_path_cannot_serve_still_runs_the_kernel_on_gathered_pages(rt):
    pool, pt, sl, q, cu = case(16, 2)
    want = call(fa3, pool.to(BF16), 16, pt, sl, q, cu, 2, return_softmax_lse=True)
    got = rt.paged_attention(fa3, **_kw(pool, 16, pt, sl, q, cu, 2, return_softmax_lse=True))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_caches_not_cut_from_one_pool_are_cast_whole(rt):
    pool, pt, sl, q, cu = case(16, 1)
    other = pool.clone()
    kw = _kw(pool, 16, pt, sl, q, cu, 1)
    kw["k_cache"] = other[:, :, 512:].view(-1, 16, 1, 64)
    assert rt._pool_of(kw["k_cache"], kw["v_cache"]) is None
    assert torch.equal(rt.paged_attention(fa3, **kw), call(fa3, pool.to(BF16), 16, pt, sl, q, cu, 1))


def test_an_e5m2_pool_is_cast_whole_not_handed_on_uncast(rt):
    """SGLang's fp8_e5m2 KV cache: the pool-geometry check (e4m3) declines it, and the whole
    cast must still cast it (it handed e5m2 caches to the kernel as they were)."""
    pool, pt, sl, q, cu = case(16, 1)
    pool = pool.to(BF16).to(torch.float8_e5m2)
    seen = []

    def kernel(**kw):
        seen.append((kw["k_cache"].dtype, kw["v_cache"].dtype))
        return fa3(**kw)

    got = rt.paged_attention(kernel, **_kw(pool, 16, pt, sl, q, cu, 1))
    assert seen == [(BF16, BF16)]
    assert torch.equal(got, call(fa3, pool.to(BF16), 16, pt, sl, q, cu, 1))


def test_mode_off_casts_at_the_cast_site_and_calls_the_kernel_as_is(rt, monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "off")
    rt.reset()
    pool, pt, sl, q, cu = case(1, 1)
    kv = rt.kv_for_routed_kernel(pool, BF16)
    assert kv.dtype == BF16
    assert torch.equal(rt.paged_attention(fa3, **_kw(kv, 1, pt, sl, q, cu, 1)), call(fa3, kv, 1, pt, sl, q, cu, 1))


def test_unknown_mode_is_refused(rt, monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "fastest")
    rt.reset()
    with pytest.raises(ValueError, match="fused"):
        rt.mode()


def test_fused_is_never_picked_on_the_cpu(rt, monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "fused")
    rt.reset()
    assert rt.mode() == "gather"  # no CUDA: the fused attention cannot run
    pool, pt, sl, q, cu = case(16, 1)
    assert rt._fused_shape(_kw(pool, 16, pt, sl, q, cu, 1), rt._pool_of(*_caches(pool, 16))) is None


def _caches(pool, ps):
    return pool[:, :, 512:].view(-1, ps, 1, 64), pool[:, :, :512].view(-1, ps, 1, 512)


def test_the_pool_is_recovered_from_the_two_views(rt):
    pool, *_ = case(16, 1)
    got = rt._pool_of(*_caches(pool, 16))
    assert got.data_ptr() == pool.data_ptr() and got.shape == (512, 576) and torch.equal(got.view(pool.shape).view(torch.uint8), pool.view(torch.uint8))
    k, v = _caches(pool, 16)
    assert rt._pool_of(v, k) is None  # swapped: k does not follow v in the row


def _paged_view(flat, ps):  # SGLang 0.5.23's paged_view: as_strided, dim 1 keeps the slot stride
    n, s = flat.shape[0], flat.stride(0)
    return flat.as_strided((n // ps, ps, *flat.shape[1:]), (s * ps, s, *flat.stride()[1:]))


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("how", ["view", "paged_view"])
def test_the_pool_is_recovered_at_every_page_size(rt, ps, how):
    """x.view(-1, 1, 1, d) gives the size-1 page dim the row's stride, not the slot's:
    page size 1 must still find the pool (else every call casts its caches whole)."""
    pool, *_ = case(ps, 1)
    if how == "view":
        k, v = _caches(pool, ps)
    else:
        k, v = _paged_view(pool[:, :, 512:], ps), _paged_view(pool[:, :, :512], ps)
    got = rt._pool_of(k, v)
    assert got is not None and got.data_ptr() == pool.data_ptr() and got.shape == (pool.shape[0], 576)


def test_a_routed_call_at_page_size_1_gathers_it_does_not_cast_whole(rt, monkeypatch):
    pool, pt, sl, q, cu = case(1, 1)
    want = call(fa3, pool.to(BF16), 1, pt, sl, q, cu, 1)

    def whole(*a, **k):
        raise AssertionError("the routed call cast its caches whole")

    monkeypatch.setattr(rt, "_cast_fp8_args", whole)
    assert torch.equal(rt.paged_attention(fa3, **_kw(pool, 1, pt, sl, q, cu, 1)), want)


def test_sabotage_a_stale_length_in_the_page_cast_fails_the_comparison(rt, monkeypatch):
    """The check above would see a routed call that casts one page too few."""
    pool, pt, sl, q, cu = case(16, 1, lens=(37, 70, 33))
    want = call(fa3, pool.to(BF16), 16, pt, sl, q, cu, 1)
    rt.paged_attention(fa3, **_kw(pool, 16, pt, sl, q, cu, 1))  # makes the shadow
    rt.poison_shadows()
    real = rt.page_cast
    monkeypatch.setitem(rt.paged_attention.__globals__, "page_cast",
                        lambda src, dst, table, lens, ps: real(src, dst, table, lens - 16, ps))
    got = rt.paged_attention(fa3, **_kw(pool, 16, pt, sl, q, cu, 1))
    assert not torch.equal(got, want) and not torch.isfinite(got).all()  # a poisoned page was read


class _OnCuda:
    """A pool stand-in that reports a CUDA device (the contract check reads only that)."""

    is_cuda = True

    def __init__(self, pool):
        self.device, self.shape = torch.device("cuda", 0), pool.shape


def test_the_fused_contract_takes_sglangs_own_call(rt, monkeypatch):
    """SGLang 0.5.23's absorbed-MLA decode call passes k_descale=None, v_descale=None,
    cu_seqlens_k_new, ver, num_splits, softcap=0.0 and return_softmax_lse=False: none of
    these changes what the kernel computes, so the call is the fused path's (an argument
    name it does not know, or a descale that is set, keeps the call on the kernel)."""
    monkeypatch.setattr(rt, "_cuda_available", lambda: True)
    pool, pt, sl, q, cu = case(16, 1)
    sglang = dict(k_descale=None, v_descale=None, cu_seqlens_k_new=cu, ver=3, num_splits=0, softcap=0.0,
                  return_softmax_lse=False)
    fake = _OnCuda(rt._pool_of(*_caches(pool, 16)))
    assert rt._fused_shape(_kw(pool, 16, pt, sl, q, cu, 1, **sglang), fake) == (q.shape[1], 1, pt.shape[0])
    for extra in ({"k_descale": torch.ones(1)}, {"softcap": 30.0}, {"return_softmax_lse": True},
                  {"window_size": (128, 0)}, {"new_option": 1}):
        assert rt._fused_shape(_kw(pool, 16, pt, sl, q, cu, 1, **dict(sglang, **extra)), fake) is None, extra
