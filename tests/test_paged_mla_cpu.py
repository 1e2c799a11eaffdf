"""Routed sgl-kernel paged MLA decode on the CPU (KVP108's form): kv_for_routed_kernel hands
the pool on uncast, and paged_mla casts the pages the call's own table lists into the shadow
before the original kernel runs on a view of it (the fused path needs CUDA; here its contract
is checked on CPU tensors, and its dispatch with a stand-in for fused_mla).

The kernel is kvpatch's torch stand-in for sgl-kernel's flash_mla_decode
(kvpatch/verify/fa3_reference.py). The shadow is poisoned with NaN first, so a page the
routed call failed to cast reaches the output."""

import pytest

torch = pytest.importorskip("torch", reason="the runtime's routed calls need torch")

from kvpatch.runtime import load_template  # noqa: E402
from kvpatch.verify.fa3_reference import flash_mla_decode as reference  # noqa: E402

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
SCALE = 0.1


@pytest.fixture
def rt(monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "auto")
    mod = load_template("_kvpatch_paged_mla_cpu")
    mod.reset()
    return mod


SLOTS = 1024


def case(ps, lens=(37, 70, 5), slots=SLOTS, heads=4, seed=0):
    """An FP8 pool [slots, 1, 576] (SGLang's MLA pool), a page table on scattered pages with
    stale ids past each length, the lengths and the two query halves."""
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn((slots, 1, 576), generator=g) * 0.5).to(FP8)
    width = max(-(-n // ps) for n in lens) + 2
    pt = torch.randperm(slots // ps, generator=g)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn((len(lens), heads, 576), generator=g).to(BF16)
    return pool, pt, sl, q[..., :512], q[..., 512:]


WS = torch.empty(16, dtype=torch.uint8)


def decode(fn, kv, ps, pt, sl, q_nope, q_pe, how="positional"):
    """flash_mla_decode as SGLang's XPU backend calls it (positional; 0.5.23 adds
    num_kv_splits=1 by keyword), or every argument by keyword."""
    cache = kv.view(-1, ps, 576)
    if how == "positional":
        return fn(q_nope, q_pe, cache, sl, pt, WS, SCALE)
    if how == "0.5.23":
        return fn(q_nope, q_pe, cache, sl, pt, WS, SCALE, num_kv_splits=1)
    return fn(q_nope=q_nope, q_pe=q_pe, kv_c_and_k_pe_cache=cache, seq_lens=sl, page_table=pt, workspace=WS,
              sm_scale=SCALE)


def routed(rt, kernel=reference):
    return lambda *a, **k: rt.paged_mla(kernel, *a, **k)


def read_rows(pt, sl, ps):
    """The pool slots request b reads: pages pt[b, :ceil(sl[b] / ps)], ps slots each."""
    return sorted({int(pt[b, j // ps]) * ps + j % ps for b in range(len(sl)) for j in range(int(sl[b]))})


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("how", ["positional", "0.5.23", "keyword"])
def test_routed_call_casts_the_pages_its_table_lists_and_matches_the_full_cast(rt, ps, how):
    pool, pt, sl, q_nope, q_pe = case(ps)
    want = decode(reference, pool.to(BF16), ps, pt, sl, q_nope, q_pe, how)
    kv = rt.kv_for_routed_kernel(pool, BF16)
    assert kv is pool  # no cast at the cast site: the routed call decides
    decode(routed(rt), kv, ps, pt, sl, q_nope, q_pe, how)  # makes the shadow, which is then poisoned
    rt.poison_shadows()
    got = decode(routed(rt), kv, ps, pt, sl, q_nope, q_pe, how)
    assert got.shape == (3, 4, 512) and got.dtype == BF16
    assert torch.equal(got, want)
    # The rows the kernel read are the full cast's, bit for bit; the rest stayed poisoned.
    (shadow,) = rt._shadows.values()
    rows = read_rows(pt, sl, ps)
    assert torch.equal(shadow[rows].view(torch.int16), pool.to(BF16).view(-1, 576)[rows].view(torch.int16))
    assert torch.isnan(shadow[[r for r in range(shadow.shape[0]) if r not in set(rows)][:8]]).all()


def test_the_shadow_is_made_once_and_reused_with_other_lengths(rt):
    pool, pt, sl, q_nope, q_pe = case(16)
    decode(routed(rt), pool, 16, pt, sl, q_nope, q_pe)
    first = [t.data_ptr() for t in rt._shadows.values()]
    rt.poison_shadows()
    longer = sl + 20
    got = decode(routed(rt), pool, 16, pt, longer, q_nope, q_pe)
    assert [t.data_ptr() for t in rt._shadows.values()] == first
    assert torch.equal(got, decode(reference, pool.to(BF16), 16, pt, longer, q_nope, q_pe))


def test_mode_off_casts_at_the_cast_site_and_calls_the_kernel_as_is(rt, monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "off")
    rt.reset()
    pool, pt, sl, q_nope, q_pe = case(16)
    kv = rt.kv_for_routed_kernel(pool, BF16)
    assert kv.dtype == BF16
    seen = []
    got = decode(routed(rt, lambda *a, **k: seen.append((a, k)) or "out"), kv, 16, pt, sl, q_nope, q_pe, "0.5.23")
    (args, kw), = seen
    assert got == "out" and kw == {"num_kv_splits": 1}
    assert args[0] is q_nope and args[3] is sl and args[4] is pt and args[2].data_ptr() == kv.data_ptr()


def test_a_bf16_pool_goes_to_the_kernel_untouched(rt):
    pool, pt, sl, q_nope, q_pe = case(1)
    bf = pool.to(BF16)
    cache = bf.view(-1, 1, 576)
    seen = []
    rt.paged_mla(lambda *a: seen.append(a), q_nope, q_pe, cache, sl, pt, WS, SCALE)
    assert seen[0][2] is cache and not rt._shadows


def test_fused_is_never_taken_on_the_cpu(rt, monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "fused")
    rt.reset()
    assert rt.mode() == "gather"  # no CUDA: the fused attention cannot run

    def fused(*a, **k):
        raise AssertionError("the fused path ran on the CPU")

    monkeypatch.setitem(rt.paged_mla.__globals__, "fused_mla", fused)
    pool, pt, sl, q_nope, q_pe = case(16)
    got = decode(routed(rt), pool, 16, pt, sl, q_nope, q_pe)
    assert torch.equal(got, decode(reference, pool.to(BF16), 16, pt, sl, q_nope, q_pe))
    assert not rt._pm_fused_ok(rt._pm_bind((q_nope, q_pe, pool.view(-1, 16, 576), sl, pt, WS, SCALE), {}),
                               rt._pm_pool_of(pool.view(-1, 16, 576)))


def _bound(c, ps, change=None):
    """paged_mla's bound arguments for case c (pool, table, lengths, queries), some changed."""
    pool, pt, sl, q_nope, q_pe = c
    b = dict(q_nope=q_nope, q_pe=q_pe, kv_c_and_k_pe_cache=pool.view(-1, ps, 576), seq_lens=sl, page_table=pt,
             workspace=WS, sm_scale=SCALE, num_kv_splits=1)
    b.update(change or {})
    return list(b.values())


def test_the_fused_contract_takes_sglangs_call_and_nothing_else(rt):
    """The fused path computes flash_mla_decode exactly for bf16 queries of 512 + 64, a 2-D
    int32 table and int32 lengths with one row a request, and a float scale; num_kv_splits
    only steers the kernel's scheduling. Anything else keeps the call on the kernel."""
    c = pool, pt, sl, q_nope, q_pe = case(16)
    p = rt._pm_pool_of(pool.view(-1, 16, 576))
    assert rt._pm_contract(_bound(c, 16), p)
    assert rt._pm_contract(_bound(c, 16, dict(num_kv_splits=-1)), p)
    for change in (dict(q_nope=q_nope.half(), q_pe=q_pe.half()), dict(q_pe=q_pe[..., :32]),
                   dict(q_nope=q_nope[:2]), dict(page_table=pt[:2]), dict(page_table=pt.long()),
                   dict(page_table=pt[0]), dict(seq_lens=sl[:2]), dict(seq_lens=sl.long()),
                   dict(seq_lens=sl.view(-1, 1)), dict(sm_scale=torch.tensor(SCALE)), dict(sm_scale=None),
                   dict(q_nope=q_nope.transpose(1, 2).contiguous().transpose(1, 2))):
        assert not rt._pm_contract(_bound(c, 16, change), p), list(change)


def _fake_fused(calls, shorten=0):
    """A stand-in for fused_mla that computes what it is told: the reference on the pool it
    is handed (cast), with the table, lengths and page size it is handed."""

    def fused(q_nope, q_pe, kv_buffer, out, sm_scale, *, page_table, cache_seqlens, page_size, **kw):
        calls.append(kv_buffer)
        assert kv_buffer.dtype == FP8 and kv_buffer.dim() == 2 and not kw
        cache = kv_buffer.to(BF16).view(-1, page_size, kv_buffer.shape[-1])
        out.copy_(reference(q_nope, q_pe, cache, cache_seqlens - shorten, page_table, None, sm_scale))
        return out

    return fused


@pytest.mark.parametrize("ps", [1, 64])
def test_where_the_fused_path_is_picked_it_gets_the_pool_table_lengths_and_page_size(rt, monkeypatch, ps):
    """The dispatch, with the device checks passed: fused_mla gets the FP8 pool itself (no
    cast anywhere), the call's own table and lengths and the view's page size, and its
    output is what paged_mla returns (a new [B, H, 512] tensor, as flash_mla_decode's)."""
    calls = []
    g = rt.paged_mla.__globals__
    monkeypatch.setitem(g, "fused_mla", _fake_fused(calls))
    monkeypatch.setitem(g, "_want_fused", lambda device, heads, tq: tq == 1)
    monkeypatch.setitem(g, "_pm_fused_ok", lambda b, pool: rt._pm_contract(b, pool))

    def kernel(*a, **k):
        raise AssertionError("the kernel ran: the fused path was not taken")

    pool, pt, sl, q_nope, q_pe = case(ps)
    got = decode(routed(rt, kernel), pool, ps, pt, sl, q_nope, q_pe, "0.5.23")
    assert len(calls) == 1 and calls[0].data_ptr() == pool.data_ptr() and calls[0].shape == (SLOTS, 576)
    assert got.shape == q_nope.shape and got.dtype == BF16 and got.data_ptr() != q_nope.data_ptr()
    assert torch.equal(got, decode(reference, pool.to(BF16), ps, pt, sl, q_nope, q_pe)) and not rt._shadows


def test_sabotage_fused_given_short_lengths_fails_the_comparison(rt, monkeypatch):
    g = rt.paged_mla.__globals__
    monkeypatch.setitem(g, "fused_mla", _fake_fused([], shorten=1))
    monkeypatch.setitem(g, "_want_fused", lambda device, heads, tq: True)
    monkeypatch.setitem(g, "_pm_fused_ok", lambda b, pool: True)
    pool, pt, sl, q_nope, q_pe = case(16)
    got = decode(routed(rt), pool, 16, pt, sl, q_nope, q_pe)
    assert not torch.equal(got, decode(reference, pool.to(BF16), 16, pt, sl, q_nope, q_pe))


def test_a_fused_launch_that_raises_falls_back_to_the_gather_from_then_on(rt, monkeypatch):
    tries = []

    def broken(*a, **k):
        tries.append(1)
        raise RuntimeError("no kernel image for this device")

    g = rt.paged_mla.__globals__
    monkeypatch.setitem(g, "fused_mla", broken)
    monkeypatch.setitem(g, "_pm_fused_ok", lambda b, pool: True)
    monkeypatch.setitem(g, "_want_fused", lambda device, heads, tq: (device, heads, tq) not in rt._fused_failed)
    pool, pt, sl, q_nope, q_pe = case(16)
    want = decode(reference, pool.to(BF16), 16, pt, sl, q_nope, q_pe)
    decode(routed(rt), pool, 16, pt, sl, q_nope, q_pe)
    rt.poison_shadows()
    assert torch.equal(decode(routed(rt), pool, 16, pt, sl, q_nope, q_pe), want)
    assert len(tries) == 1 and (pool.device, 4, 1) in rt._fused_failed


def test_a_cache_not_cut_from_one_pool_is_cast_whole(rt):
    """Rows spaced wider than they are (a [slots, 1, 1152] store viewed 576 wide): the pool
    cannot be recovered from the view, so the cache is cast whole, exactly as the original."""
    pool, pt, sl, q_nope, q_pe = case(16)
    wide = torch.zeros((SLOTS, 1, 1152), dtype=FP8)
    wide[:, :, :576] = pool
    cache = wide.as_strided((SLOTS // 16, 16, 576), (16 * 1152, 1152, 1))
    assert rt._pm_pool_of(cache) is None
    got = rt.paged_mla(reference, q_nope, q_pe, cache, sl, pt, WS, SCALE)
    assert torch.equal(got, decode(reference, pool.to(BF16), 16, pt, sl, q_nope, q_pe)) and not rt._shadows


@pytest.mark.parametrize("ps,how", [(1, "view"), (16, "view"), (64, "paged_view")])
def test_the_pool_is_recovered_from_the_view(rt, ps, how):
    pool, *_ = case(ps)
    if how == "view":
        cache = pool.view(-1, ps, 576)
    else:  # SGLang 0.5.23's paged_view of the [slots, 576] rows: as_strided, dim 1 keeps the slot stride
        flat = pool.view(-1, 576)
        cache = flat.as_strided((flat.shape[0] // ps, ps, 576), (576 * ps, 576, 1))
    got = rt._pm_pool_of(cache)
    assert got.data_ptr() == pool.data_ptr() and got.shape == (SLOTS, 576) and got.stride() == (576, 1)
    assert rt._pm_pool_of(cache[:, :, :512]) is None  # a slice of the rows is not the pool
    assert rt._pm_pool_of(cache.to(BF16)) is None  # nor a bf16 copy (FP8 pools only)


def test_a_call_that_does_not_bind_casts_its_fp8_tensors_whole(rt):
    pool, pt, sl, q_nope, q_pe = case(16)
    seen = []
    rt.paged_mla(lambda *a, **k: seen.append((a, k)), q_nope, q_pe, pool.view(-1, 16, 576), sl, pt, WS, SCALE,
                 new_option=True)
    (args, kw), = seen
    assert args[2].dtype == BF16 and torch.equal(args[2], pool.to(BF16).view(-1, 16, 576))
    assert args[3] is sl and args[4] is pt and args[5] is WS and kw == {"new_option": True}
    assert rt._pm_bind((q_nope,) * 9, {}) is None and rt._pm_bind((q_nope,), {"q_nope": q_nope}) is None


@pytest.mark.parametrize("ps,sabotage", [(1, "lengths"), (16, "table")])
def test_sabotage_a_broken_page_cast_fails_the_comparison(rt, monkeypatch, ps, sabotage):
    """The checks above see a routed call that casts short (seq_lens - 1: each request's last
    token) or the wrong pages (another request's table)."""
    pool, pt, sl, q_nope, q_pe = case(ps, lens=(37, 70, 33))
    want = decode(reference, pool.to(BF16), ps, pt, sl, q_nope, q_pe)
    decode(routed(rt), pool, ps, pt, sl, q_nope, q_pe)  # makes the shadow
    rt.poison_shadows()
    real = rt.page_cast
    if sabotage == "lengths":
        broken = lambda src, dst, table, lens, ps: real(src, dst, table, lens - 1, ps)  # noqa: E731
    else:
        broken = lambda src, dst, table, lens, ps: real(src, dst, table.roll(1, 0), lens, ps)  # noqa: E731
    monkeypatch.setitem(rt.paged_mla.__globals__, "page_cast", broken)
    got = decode(routed(rt), pool, ps, pt, sl, q_nope, q_pe)
    assert not torch.equal(got, want) and not torch.isfinite(got).all()  # a poisoned page was read
