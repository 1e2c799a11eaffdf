"""Routed FlashInfer MLA run() calls on the CPU (KVP107's form): kv_for_mla_run hands the
pool on uncast, and mla_run casts the planned rows into the shadow before the wrapper's own
run() reads them, or hands an FP8-planned wrapper the pool with its scales. The fused path
needs CUDA (tests/gpu/test_mla_route_gpu.py); its contract is checked here on CPU tensors.

The wrapper is kvpatch's torch stand-in for FlashInfer's BatchMLAPagedAttentionWrapper
(kvpatch/verify/reference.py). The shadow is poisoned with NaN first, so a row the routed
call failed to cast reaches the output."""

import pytest

torch = pytest.importorskip("torch", reason="the runtime's routed calls need torch")

from kvpatch.runtime import load_template  # noqa: E402
from kvpatch.verify.reference import BatchMLAPagedAttentionWrapper  # noqa: E402

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@pytest.fixture
def rt(monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "auto")
    mod = load_template("_kvpatch_mla_route_cpu")
    mod.reset()
    return mod


def planned(rt, lens=(37, 70, 5), slots=512, heads=4, tq=1, causal=False, seed=0, kv_dtype=BF16):
    """A pool, a wrapper planned through plan_rows (as KVP102 routes every plan), and queries."""
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn((slots, 1, 576), generator=g) * 0.5).to(FP8)
    n = sum(lens)
    indices = torch.randperm(slots, generator=g)[:n].to(torch.int32)
    kv_indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    qo_indptr = torch.arange(len(lens) + 1, dtype=torch.int32) * tq
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    w.plan(qo_indptr, rt.plan_rows(w, kv_indptr), indices, torch.tensor(lens, dtype=torch.int32), heads, 512, 64,
           1, causal, 0.1, BF16, kv_dtype)
    q = torch.randn((len(lens) * tq, heads, 576), generator=g).to(BF16)
    return pool, w, q[..., :512], q[..., 512:]


def full_cast_out(w, pool, q_nope, q_pe):
    kv = pool.to(BF16)
    return w.run(q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:])


@pytest.mark.parametrize("how", ["positional", "keyword", "out"])
def test_routed_run_casts_the_planned_rows_and_matches_the_full_cast(rt, how):
    pool, w, q_nope, q_pe = planned(rt)
    want = full_cast_out(w, pool, q_nope, q_pe)
    kv = rt.kv_for_mla_run(pool, BF16)
    assert kv is pool  # no cast at the cast site: the routed run() decides
    rt.mla_run(w.run, q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:])  # makes the shadow, then poisoned
    rt.poison_shadows()
    if how == "positional":
        got = rt.mla_run(w.run, q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:])
    elif how == "keyword":
        got = rt.mla_run(w.run, q_nope, q_pe, ckv_cache=kv[:, :, :512], kpe_cache=kv[:, :, 512:])
    else:
        out = torch.empty_like(q_nope)
        got = rt.mla_run(w.run, q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:], out=out)
        assert got is out
    assert torch.equal(got, want)


def test_sabotage_a_stale_row_count_fails_the_comparison(rt, monkeypatch):
    """The check above can fail: a gather one row short leaves a NaN row for run() to read."""
    pool, w, q_nope, q_pe = planned(rt)
    want = full_cast_out(w, pool, q_nope, q_pe)
    rt.mla_run(w.run, q_nope, q_pe, pool[:, :, :512], pool[:, :, 512:])  # makes the shadow
    rt.poison_shadows()
    w.__dict__[rt._COUNT_ATTR].sub_(1)
    got = rt.mla_run(w.run, q_nope, q_pe, pool[:, :, :512], pool[:, :, 512:])
    assert not torch.equal(got, want) and not torch.isfinite(got).all()


def test_mode_off_casts_at_the_cast_site_and_calls_run_as_is(rt, monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "off")
    rt.reset()
    pool, w, q_nope, q_pe = planned(rt)
    kv = rt.kv_for_mla_run(pool, BF16)
    assert kv.dtype == BF16 and kv.shape == pool.shape
    got = rt.mla_run(w.run, q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:])
    assert torch.equal(got, full_cast_out(w, pool, q_nope, q_pe))


def test_a_bf16_cache_goes_to_run_untouched(rt):
    """The DCP branch hands run() its own compact bf16 buffer through the same call."""
    pool, w, q_nope, q_pe = planned(rt)
    kv = pool.to(BF16)
    seen = {}

    def run(*a, **k):
        seen["ckv"] = a[2]
        return w.run(*a, **k)

    run.__self__ = w
    rt.mla_run(run, q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:])
    assert seen["ckv"].data_ptr() == kv.data_ptr()


def test_an_fp8_planned_wrapper_gets_the_pool_and_its_scales(rt):
    pool, w, q_nope, q_pe = planned(rt, kv_dtype=FP8)
    w._kvpatch_kv_dtype = FP8  # what plan_kv_dtype records when it plans native FP8
    got = rt.mla_run(w.run, q_nope, q_pe, pool[:, :, :512], pool[:, :, 512:])
    want = w.run(q_nope, q_pe, pool[:, :, :512], pool[:, :, 512:], ckv_scale=1.0, kpe_scale=1.0)
    assert torch.equal(got, want)


def test_caches_not_cut_from_one_pool_are_cast_whole(rt):
    pool, w, q_nope, q_pe = planned(rt)
    other = pool.clone()
    want = w.run(q_nope, q_pe, pool.to(BF16)[:, :, :512], other.to(BF16)[:, :, 512:])
    got = rt.mla_run(w.run, q_nope, q_pe, pool[:, :, :512], other[:, :, 512:])
    assert torch.equal(got, want)


def test_fused_is_never_picked_on_the_cpu(rt, monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "fused")
    rt.reset()
    pool, w, q_nope, q_pe = planned(rt)
    called = []
    monkeypatch.setattr(rt, "fused_mla", lambda *a, **k: called.append(1))
    got = rt.mla_run(w.run, q_nope, q_pe, pool[:, :, :512], pool[:, :, 512:])
    assert not called and torch.equal(got, full_cast_out(w, pool, q_nope, q_pe))
    assert w.__dict__[rt._INDPTR_ATTR] is None  # no device copy kept off CUDA


def contract(rt, w, q_nope, q_pe, **kw):
    named = {"q_nope": q_nope, "q_pe": q_pe}
    return rt._mla_contract(w, named, (q_nope, q_pe, None, None), kw, q_nope.device)


def test_the_fused_contract_takes_a_decode_plan_and_refuses_the_rest(rt):
    pool, w, q_nope, q_pe = planned(rt)
    indptr = torch.tensor([0, 37, 107, 112, 0], dtype=torch.int32)  # a buffer larger than the plan
    w.__dict__[rt._INDPTR_ATTR] = (indptr, 3)  # what plan_rows keeps on CUDA
    got = contract(rt, w, q_nope, q_pe)
    assert got is not None and got[0] is indptr and got[1] is w._kv_indices_buf and got[2] == 0.1
    assert contract(rt, w, q_nope, q_pe, out=torch.empty_like(q_nope)) is not None
    assert contract(rt, w, q_nope, q_pe, return_lse=False, lse=None) is not None
    # What the fused path does not compute as run() would: each keeps run().
    assert contract(rt, w, q_nope, q_pe, return_lse=True) is None  # DCP needs the lse
    assert contract(rt, w, q_nope, q_pe, out=torch.empty_like(q_pe)) is None
    assert contract(rt, w, q_nope, q_pe, profiler_buffer=torch.empty(4)) is None
    assert contract(rt, w, q_nope, q_pe, ckv_scale=0.5) is None
    assert contract(rt, w, q_nope, q_pe, something_new=1) is None
    assert contract(rt, w, q_nope[:2], q_pe[:2]) is None  # rows != requests: not one query each
    assert contract(rt, w, q_nope.float(), q_pe.float()) is None
    for attr, value in (("_causal", True), ("_page_size", 16), ("_sm_scale", None)):
        saved = getattr(w, attr)
        setattr(w, attr, value)
        assert contract(rt, w, q_nope, q_pe) is None, attr
        setattr(w, attr, saved)
    w.__dict__[rt._INDPTR_ATTR] = None  # a plan not routed through plan_rows
    assert contract(rt, w, q_nope, q_pe) is None


def test_a_failed_plan_forgets_the_indptr(rt):
    pool, w, q_nope, q_pe = planned(rt)
    w.__dict__[rt._INDPTR_ATTR] = (torch.zeros(4, dtype=torch.int32), 3)
    rt.plan_rows(w, [0, 1])  # not a tensor: rows unknown
    assert w.__dict__[rt._COUNT_ATTR] is None and w.__dict__[rt._INDPTR_ATTR] is None


def test_the_pool_is_recovered_from_three_dimensional_caches(rt):
    """FlashInfer's caches are [pages, page_size, d]: the runtime finds the [slots, row]
    pool from the two, at any page size, and refuses caches of two pools."""
    for ps in (1, 16):
        pool = torch.zeros((4096 // ps, ps, 576), dtype=FP8)
        got = rt._pool_of(pool[:, :, 512:], pool[:, :, :512])
        assert got is not None and got.shape == (4096, 576) and got.data_ptr() == pool.data_ptr()
    other = torch.zeros((4096, 1, 576), dtype=FP8)
    assert rt._pool_of(pool[:, :, 512:], other[:, :, :512]) is None
