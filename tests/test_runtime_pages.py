"""CPU tests of the runtime's page-table gathered cast (issue 7): what FA3/FA4, MUSA and
XPU kernels read is page_table[b, :ceil(cache_seqlens[b] / page_size)], pages of
page_size slots. Every check poisons the shadow first, compares the rows read bit for
bit with the full-pool cast, and checks every other row is still poison."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch", reason="the runtime tests need torch (pip install kvpatch[test])")

from kvpatch.runtime import load_template  # noqa: E402

_RT = load_template("_kvpatch_runtime_pages")
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@pytest.fixture
def rt(monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "gather")
    _RT.reset()
    yield _RT
    _RT.reset()


def fp8_pool(slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (slots, 1, 576), dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    raw[(raw & 0x7F) == 0] = 0x21  # no zeros: an untouched row cannot look cast
    return raw.view(FP8)


def bits(t):
    return t.contiguous().view(torch.int16)


def read_slots(tables, ps, pages_in_pool):
    """The slots the kernel reads, from the tables, on the host (the oracle)."""
    out = set()
    for pt, sl in tables:
        for b in range(pt.shape[0]):
            n = max(0, min(-(-int(sl[b]) // ps), pt.shape[1]))
            for j in range(n):
                p = int(pt[b, j])
                if 0 <= p < pages_in_pool:
                    out.update(range(p * ps, p * ps + ps))
    return sorted(out)


def check(rt, kv, tables, ps):
    first = rt.kv_pages_for_kernel(kv, BF16, ps, *tables)
    rt.poison_shadows()
    out = rt.kv_pages_for_kernel(kv, BF16, ps, *tables)
    assert out is first and out.shape == kv.shape and out.dtype == BF16
    slots = read_slots(tables, ps, kv.shape[0] // ps)
    mask = torch.zeros(kv.shape[0], dtype=torch.bool)
    mask[slots] = True
    assert torch.equal(bits(out[mask]), bits(kv.to(BF16)[mask])), "a slot the kernel reads differs"
    assert bool(torch.isnan(out[~mask].float()).all()), "a slot nobody reads was written"
    return out


@pytest.mark.parametrize("ps", [1, 16, 32, 64, 128])
def test_every_page_size_reads_exactly_the_live_pages(rt, ps):
    pages = 64
    kv = fp8_pool(pages * ps, seed=ps)
    g = torch.Generator().manual_seed(ps)
    bs, width = 4, 12
    pt = torch.randperm(pages, generator=g)[: bs * width].view(bs, width).to(torch.int32)
    pt[:, 9:] = 7  # stale junk past every request's live pages
    sl = torch.tensor([1, ps * 3, ps * 5 - 1, ps * 9], dtype=torch.int32)  # partial last pages too
    check(rt, kv, [(pt, sl)], ps)


def test_shared_and_reused_pages_and_junk_entries(rt):
    ps, pages = 16, 20
    kv = fp8_pool(pages * ps, seed=3)
    pt = torch.tensor([[3, 5, 11, -1], [3, 5, 12, 99], [19, 0, 0, 0]], dtype=torch.int64)  # shared prefix
    sl = torch.tensor([40, 48, 0], dtype=torch.int64)  # request 2 is empty
    check(rt, kv, [(pt, sl)], ps)


def test_cascade_reads_the_union_of_both_tables(rt):
    ps, pages = 1, 300
    kv = fp8_pool(pages, seed=4)
    main = (torch.arange(40, dtype=torch.int32).view(2, 20), torch.tensor([20, 7], dtype=torch.int32))
    expand = (torch.arange(200, 260, dtype=torch.int32).view(6, 10), torch.tensor([1] * 6, dtype=torch.int32))
    check(rt, kv, [main, expand], ps)


def test_a_call_that_does_not_run_passes_nones(rt):
    kv = fp8_pool(64, seed=5)
    pt, sl = torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    out = rt.kv_pages_for_kernel(kv, BF16, 1, (pt, sl), (None, None))
    assert torch.equal(bits(out[[1, 2, 3]]), bits(kv.to(BF16)[[1, 2, 3]]))


def test_a_sabotaged_page_size_misses_rows(rt):
    """The checks above can fail: casting with page_size 1 for a 16-slot page layout
    leaves all but one slot of each page as poison."""
    ps = 16
    kv = fp8_pool(8 * ps, seed=6)
    pt, sl = torch.tensor([[2, 5]], dtype=torch.int32), torch.tensor([32], dtype=torch.int32)
    rt.kv_pages_for_kernel(kv, BF16, 1, (pt, sl))
    rt.poison_shadows()
    out = rt.kv_pages_for_kernel(kv, BF16, 1, (pt, sl))
    assert bool(torch.isnan(out[2 * ps + 1: 3 * ps].float()).all())


def test_off_mode_is_exactly_to(rt, monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "off")
    rt.reset()
    kv = fp8_pool(32, seed=7)
    out = rt.kv_pages_for_kernel(kv, BF16, 1, (torch.zeros(1, 1, dtype=torch.int32),
                                               torch.ones(1, dtype=torch.int32)))
    assert torch.equal(bits(out), bits(kv.to(BF16))) and rt._shadows == {}


@pytest.mark.parametrize("bad", ["float-table", "short-seqlens", "page-size-0", "one-d-table"])
def test_unusable_tables_cast_the_whole_pool(rt, bad, caplog):
    kv = fp8_pool(32, seed=8)
    pt, sl, ps = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 1
    if bad == "float-table":
        pt = pt.float()
    elif bad == "short-seqlens":
        sl = sl[:0]
    elif bad == "page-size-0":
        ps = 0
    else:
        pt = pt.view(-1)
    with caplog.at_level(logging.WARNING, logger="kvpatch.runtime"):
        out = rt.kv_pages_for_kernel(kv, BF16, ps, (pt, sl))
    assert torch.equal(bits(out), bits(kv.to(BF16)))  # slow, never wrong
    assert "casting the whole pool" in caplog.text


def test_paged_view_of_the_pool_is_the_same_rows(rt):
    """A [pages, page_size, 1, 576] pool (the kernel's view) gives the same slots."""
    ps, pages = 16, 10
    flat = fp8_pool(pages * ps, seed=9)
    paged = flat.view(pages, ps, 1, 576)
    pt, sl = torch.tensor([[4, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    out = rt.kv_pages_for_kernel(paged, BF16, ps, (pt, sl))
    ref = flat.to(BF16).view(pages, ps, 1, 576)
    assert torch.equal(bits(out[[4, 1]]), bits(ref[[4, 1]]))


def test_no_seqlens_means_every_entry_of_the_table(rt):
    ps, pages = 16, 12
    kv = fp8_pool(pages * ps, seed=10)
    pt = torch.tensor([[3, 7, -1], [7, 11, 99]], dtype=torch.int32)
    full = torch.full((2,), 3 * ps, dtype=torch.int32)  # the oracle: every column live
    first = rt.kv_pages_for_kernel(kv, BF16, ps, (pt, None))
    rt.poison_shadows()
    out = rt.kv_pages_for_kernel(kv, BF16, ps, (pt, None))
    slots = read_slots([(pt, full)], ps, pages)
    assert out is first and torch.equal(bits(out[slots]), bits(kv.to(BF16)[slots]))


def test_lambdas_are_read_at_the_cast_and_a_missing_metadata_is_a_call_that_does_not_run(rt):
    kv = fp8_pool(64, seed=11)
    pt, sl = torch.tensor([[5, 6]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)

    class Backend:
        forward_metadata_spec_decode_expand = None  # no cascade this step

    b = Backend()
    out = rt.kv_pages_for_kernel(kv, BF16, 1, lambda: (pt, sl),
                                 lambda: (b.forward_metadata_spec_decode_expand.page_table,
                                          b.forward_metadata_spec_decode_expand.cache_seqlens_int32))
    assert torch.equal(bits(out[[5, 6]]), bits(kv.to(BF16)[[5, 6]]))


def ragged_oracle(indptr, indices, batch, ps):
    """The pages a ragged-list kernel reads (requests 0..batch-1), as one table row and its length in slots."""
    pages = [int(indices[j]) for b in range(batch) for j in range(int(indptr[b]), int(indptr[b + 1]))]
    return torch.tensor([pages], dtype=torch.int64), torch.tensor([len(pages) * ps], dtype=torch.int64)


@pytest.mark.parametrize("ps", [1, 16])
def test_ragged_page_list_reads_exactly_the_listed_pages(rt, ps):
    """aiter's paged_attention_ragged: request b reads kv_indices[kv_indptr[b]:kv_indptr[b+1]].
    Stale entries past the last request's end are not cast; pages shared between requests are."""
    pages = 50
    kv = fp8_pool(pages * ps, seed=6 + ps)
    indptr = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    indices = torch.tensor([4, 9, 2, 9, 4, 30, 41, 13, 17, 0, 0], dtype=torch.int32)  # shared 4, 9; stale tail
    first = rt.kv_pages_for_kernel(kv, BF16, ps, lambda: rt.ragged_pages(indptr, indices, ps))
    rt.poison_shadows()
    out = rt.kv_pages_for_kernel(kv, BF16, ps, lambda: rt.ragged_pages(indptr, indices, ps))
    assert out is first
    want = read_slots([ragged_oracle(indptr, indices, 3, ps)], ps, pages)
    mask = torch.zeros(kv.shape[0], dtype=torch.bool)
    mask[want] = True
    assert torch.equal(bits(out[mask]), bits(kv.to(BF16)[mask]))
    assert bool(torch.isnan(out[~mask].float()).all()), "a page past the list's end was cast"


def test_ragged_stale_indptr_tail_casts_a_superset_never_less(rt):
    """A graph-sized indptr buffer with a stale tail: the max covers every live page."""
    kv = fp8_pool(40, seed=8)
    indptr = torch.tensor([0, 2, 5, 3, 1], dtype=torch.int32)  # two requests live; tail entries stale
    indices = torch.tensor([11, 12, 13, 14, 15, 16, 17], dtype=torch.int32)
    out = rt.kv_pages_for_kernel(kv, BF16, 1, lambda: rt.ragged_pages(indptr, indices, 1))
    live = [11, 12, 13, 14, 15]
    assert torch.equal(bits(out[live]), bits(kv.to(BF16)[live]))
    assert rt.ragged_pages(None, indices, 1) == (None, None)
